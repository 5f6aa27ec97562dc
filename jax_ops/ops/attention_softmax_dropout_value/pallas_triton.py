"""The ``"triton"`` backend of the op's backward: Pallas Triton kernels, any CUDA GPU.

Config: ``pallas_kernels.attention_softmax_dropout_value.default_config`` (tuned tables per
device kind, a heuristic elsewhere).

Residual policy: :func:`pallas_kernels.attention_softmax_dropout_value.dispatch.triton_residuals`
(on rows of at least 512 aligned keys the fused forward kernel saves P, keep and its fp32
output O instead of Pd, and the backward is the one kernel that takes
``delta = rowsum(dO * O)``; elsewhere Pd is saved and the two-kernel backward runs).
"""

from __future__ import annotations

from pallas_kernels import attention_softmax_dropout_value as kernels
from jax_ops import backend
from pallas_kernels.attention_softmax_dropout_value import dispatch
from pallas_kernels.attention_softmax_dropout_value import forward as forward_kernel


class AttentionValueTriton(backend.TritonBackend):
  """The op's Triton backend (name, devices and priority from the base class)."""

  def residual_policy(self, problem):
    b, h, sq, skv = problem.shape("scores")
    _, kvh, _, d = problem.shape("value_states")
    return dispatch.triton_residuals(b, h, kvh, sq, skv, d)

  def forward_with_output(self, scores, value_states, dropout_rng, p_dropout, *,
                          interpret=False):
    """``(O, P, keep, O_f32)`` from the fused forward kernel (softmax, the keep mask drawn
    in the kernel and stored for the backward, GQA P·V; no Pd): the ``"fused_output"``
    policy. ``p_dropout``: a float (0.0: no dropout, ``keep`` ``None``) or a traced scalar."""
    out, probs, _, keep, out32 = forward_kernel.attention_softmax_dropout_value_forward(
        scores, value_states, p_dropout, dropout_rng, interpret=interpret)
    return out, probs, keep, out32

  def forward_output(self, scores, value_states, dropout_rng, p_dropout, *, interpret=False):
    """``O`` alone from the fused forward kernel (no P, Pd, keep or fp32 O written): the
    op's value where no gradient is taken, under the policies with a fused forward."""
    return forward_kernel.attention_softmax_dropout_value_forward(
        scores, value_states, p_dropout, dropout_rng, store_probs=False, store_keep=False,
        store_f32=False, interpret=interpret)[0]

  def backward(self, grad_attn_output, attn_weights, attn_weights_dropped, value_states,
               dropout_mask, attention_dropout, *, causal=False, interpret=False):
    return kernels.pallas_triton.attention_softmax_dropout_value_backward(
        grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
        attention_dropout, causal=causal, interpret=interpret)

  def backward_from_output(self, grad_attn_output, attn_weights, value_states, dropout_mask,
                           attention_dropout, attn_output_f32, *, causal=False,
                           interpret=False):
    """The backward given the forward's fp32 output ``[B, Sq, H, D]`` instead of Pd."""
    delta = kernels.delta_from_output(grad_attn_output, attn_output_f32)
    return kernels.attention_softmax_dropout_value_backward_from_delta(
        grad_attn_output, attn_weights, value_states, dropout_mask, attention_dropout, delta,
        causal=causal, interpret=interpret)


BACKEND = AttentionValueTriton()
