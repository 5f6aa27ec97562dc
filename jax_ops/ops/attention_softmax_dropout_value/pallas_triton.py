"""The ``"triton"`` backend of the op's backward: Pallas Triton kernels, any CUDA GPU.

Config: ``pallas_kernels.attention_softmax_dropout_value.default_config`` (tuned tables per
device kind, a heuristic elsewhere).

Residual policy: on rows of at least ``FROM_OUTPUT_MIN_KEYS`` keys that are a multiple of 8
(16-byte aligned in bf16) and ``D <= 128`` (``"fused_output"``), the forward is the fused
forward kernel (``pallas_kernels.attention_softmax_dropout_value.forward``: softmax, the keep
mask drawn in the kernel, GQA P·V), which saves P, keep and its fp32 output O instead of Pd;
the backward is the one kernel that takes ``delta = rowsum(dO * O)`` (5 B per attention
element instead of 7). Shorter rows, where delta's ``O(Sq * D)`` pass costs what the
dropped Pd saves, and unaligned rows, which that kernel loads element by element, save Pd
(the jnp forward) and run the two-kernel backward.
"""

from __future__ import annotations

from pallas_kernels import attention_softmax_dropout_value as kernels
from jax_ops import backend
from jax_ops.backend import FUSED_OUTPUT, INPUTS, OUTPUT
from pallas_kernels.attention_softmax_dropout_value import forward as forward_kernel

FROM_OUTPUT_MIN_KEYS = 512


class AttentionValueTriton(backend.TritonBackend):
  """The op's Triton backend (name, devices and priority from the base class)."""

  def residual_policy(self, problem):
    b, h, sq, skv = problem.shape("scores")
    d = problem.shape("value_states")[3]
    if (skv >= FROM_OUTPUT_MIN_KEYS and skv % 8 == 0 and d <= 128
        and b * sq * h * d < 2**31):  # the from-delta kernel's int32 offsets into dO
      # The fused forward kernel indexes the scores with int32 offsets too; larger ones
      # keep the jnp forward.
      kvh = problem.shape("value_states")[1]
      return FUSED_OUTPUT if forward_kernel.takes(b, h, kvh, sq, skv, d) else OUTPUT
    return INPUTS

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

  def config(self, problem):
    """The kernels' default config for this problem on its device."""
    b, h, sq, skv = problem.shape("scores")
    _, kvh, _, d = problem.shape("value_states")
    kind = self.device_kind(problem)
    return kernels.default_config(b, h, kvh, sq, skv, d, problem.dtype, kind)

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
