"""The ``"triton"`` backend of op B: Pallas Triton row kernels, any CUDA GPU.

Config and heuristic: ``pallas_kernels.masked_softmax_dropout.default_config`` (tuned
tables per device kind, a heuristic elsewhere).

The op's forward is the fused forward kernel (``pallas_kernels.masked_softmax_dropout.forward``:
masked fill, softmax and dropout in one pass, the keep mask drawn in the kernel and not
stored), and the backward redraws the mask from the dropout key, bit for bit the one the
forward drew and ``jax_ops.dropout_keep_mask`` draws. No ``[B, H, Sq, Sk]`` keep mask is
written, saved or read. Two residual policies:

* ``"scores"`` (the default): the forward kernel writes only the output and the op saves
  the scores (an input), the attention mask and the key; the backward
  (``masked_softmax_dropout_backward_from_scores``) recomputes P from the scores. Measured
  on an H200 in a training step, the two policies one after the other in one run at
  9ca4af2 (``benchmarks/results/runs/step_b_scores_9ca4af2.md`` and
  ``step_b_key_9ca4af2.log``): 1057 us against 1291 us for ``"key"`` at B=8 H=16 S=1024,
  3968 against 4236 us at B=16 H=8 S=2048, and no temporary ``[B, H, S, S]`` buffer
  (``"key"``: 512 MB and 2048 MB).
* ``"key"``: the forward kernel also writes P, and the op saves P instead of the scores;
  the backward is ``masked_softmax_dropout_backward_from_key``.

``backward`` (the keep-reading kernel, the reference backward's arguments) stays for
callers that hold a keep mask.
"""

from __future__ import annotations

import pallas_kernels
from pallas_kernels import masked_softmax_dropout as kernels
from pallas_kernels.masked_softmax_dropout import forward as forward_kernel
from pallas_kernels.masked_softmax_dropout import pallas_triton as backward_kernels
from jax_ops import backend
from jax_ops.backend import KEY, SCORES


class MaskedSoftmaxTriton(backend.ResidualChoice, backend.TritonBackend):
  """The op's Triton backend (devices and priority from the base class).

  ``residuals``: its residual policy, ``"scores"`` (the default: P recomputed in the
  backward from the scores, so the forward writes only its output) or ``"key"`` (P saved:
  ``MaskedSoftmaxTriton("triton_key", residuals="key")`` registered with
  ``jax_ops.registry.register`` under that name runs it).
  """

  POLICIES = (SCORES, KEY)

  def residual_policy(self, problem):
    return self.residuals

  def config(self, problem):
    """The backward kernel's default config for this problem on its device."""
    _, _, sq, sk = problem.shape("scores")
    kind = self.device_kind(problem)
    return kernels.default_config(sq, sk, kind)

  def forward_from_key(self, scores, mask, dropout_rng, p_dropout, *, interpret=False):
    """``(y, P)`` of the op from the fused forward kernel, the keep mask drawn from
    ``dropout_rng`` in the kernel and not stored. ``p_dropout``: a float (0.0: no dropout,
    ``dropout_rng`` may be ``None``) or a traced scalar."""
    y, probs, _ = forward_kernel.masked_softmax_dropout_forward(
        scores, mask, p_dropout, dropout_rng, store_keep=False, interpret=interpret)
    return y, probs

  def forward_from_scores(self, scores, mask, dropout_rng, p_dropout, *, interpret=False):
    """The op's output ``y`` alone from the fused forward kernel (neither P nor the keep
    mask is written): the ``"scores"`` policy."""
    y, _, _ = forward_kernel.masked_softmax_dropout_forward(
        scores, mask, p_dropout, dropout_rng, store_keep=False, store_probs=False,
        interpret=interpret)
    return y

  def backward_from_scores(self, grad_output, scores, mask, dropout_rng, p_dropout, *,
                           causal=False, interpret=False):
    """The backward recomputing P from the scores and redrawing the keep mask."""
    del causal
    return backward_kernels.masked_softmax_dropout_backward_from_scores(
        grad_output, scores, mask, dropout_rng, p_dropout, interpret=interpret)

  def backward_from_key(self, grad_output, p_attn, mask, dropout_rng, p_dropout, *,
                        causal=False, interpret=False):
    """The backward with the keep mask redrawn from ``dropout_rng`` in the kernel."""
    del causal  # a causal attention is a mask, which the dense math handles
    return backward_kernels.masked_softmax_dropout_backward_from_key(
        grad_output, p_attn, mask, dropout_rng, p_dropout, interpret=interpret)

  def backward(self, grad_output, p_attn, mask, dropout_mask, p_dropout, *, causal=False,
               interpret=False):
    return pallas_kernels.masked_softmax_dropout_backward(
        grad_output, p_attn, mask, dropout_mask, p_dropout, causal=causal, interpret=interpret)


BACKEND = MaskedSoftmaxTriton()
