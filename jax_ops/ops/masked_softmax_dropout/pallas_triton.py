"""The ``"triton"`` backend of masked_softmax_dropout: Pallas Triton row kernels, any CUDA GPU.

The op's forward is the fused forward kernel (masked fill, softmax and dropout in one pass,
the keep mask drawn in the kernel); it writes only the output. The op saves the scores (an
input), the attention mask and the dropout key (residual policy ``"scores"``), and the
backward (``masked_softmax_dropout_backward_from_scores``) recomputes P from the scores and
redraws the mask from the key, bit for bit the one the forward drew and
``jax_ops.dropout_keep_mask`` draws. No ``[B, H, Sq, Sk]`` P or keep mask is written, saved
or read. Launch configs: ``pallas_kernels.masked_softmax_dropout.default_config``.
"""

from __future__ import annotations

from pallas_kernels import masked_softmax_dropout as kernels
from pallas_kernels.masked_softmax_dropout import forward as forward_kernel
from pallas_kernels.masked_softmax_dropout import pallas_triton as backward_kernels
from jax_ops import backend
from jax_ops.backend import SCORES


class MaskedSoftmaxTriton(backend.TritonBackend):
  """The op's Triton backend (devices and priority from the base class)."""

  def residual_policy(self, problem):
    return SCORES

  def forward_from_scores(self, scores, mask, dropout_rng, p_dropout, *, interpret=False):
    """The op's output from the fused forward kernel. ``p_dropout``: a float (0.0: no
    dropout, ``dropout_rng`` may be ``None``) or a traced scalar."""
    return forward_kernel.masked_softmax_dropout_forward(scores, mask, p_dropout, dropout_rng,
                                                         interpret=interpret)

  def backward_from_scores(self, grad_output, scores, mask, dropout_rng, p_dropout, *,
                           causal=False, interpret=False):
    """The backward recomputing P from the scores and redrawing the keep mask."""
    del causal  # a causal attention is a mask, which the dense math handles
    return backward_kernels.masked_softmax_dropout_backward_from_scores(
        grad_output, scores, mask, dropout_rng, p_dropout, interpret=interpret)

  def backward(self, grad_output, p_attn, mask, dropout_mask, p_dropout, *, causal=False,
               interpret=False):
    """The kernel entry point, with the reference backward's arguments."""
    return kernels.masked_softmax_dropout_backward(
        grad_output, p_attn, mask, dropout_mask, p_dropout, causal=causal, interpret=interpret)


BACKEND = MaskedSoftmaxTriton()
