"""The ``"triton"`` backend of op A's backward: Pallas Triton kernels, any CUDA GPU.

Config and heuristic: ``pallas_kernels.attention_softmax_dropout_value.default_config``
(tuned tables per device kind, a heuristic elsewhere).

Residual policy: on rows of at least ``FROM_OUTPUT_MIN_KEYS`` keys that are a multiple of
8 (16-byte aligned in bf16) and ``D <= 128`` (``"fused_output"``), the op's forward is the
fused forward kernel (``pallas_kernels.attention_softmax_dropout_value.forward``: softmax,
the keep mask drawn in the kernel, GQA P·V; measured 1.21-1.34x faster than the jnp forward
on the H200 at these outputs with one hash per element; a hash per pair of columns, the
default since, measured 11-12% faster at other outputs), it saves P, keep and its fp32
output O instead of Pd, and the backward runs the one kernel that takes
``delta = rowsum(dO * O)`` (5 B per attention element instead of 7). Shorter rows, where
delta's ``O(Sq * D)`` pass costs what the dropped Pd saves, and unaligned rows, which that
kernel loads element by element, save Pd and run the two-kernel backward. The choice and
its measurements: ``benchmarks/results/attention_softmax_dropout_value_from_delta.md``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import _dropout as kernels_dropout
from pallas_kernels import attention_softmax_dropout_value as kernels
from jax_ops import backend
from jax_ops.backend import FUSED_OUTPUT, INPUTS, OUTPUT
from pallas_kernels.attention_softmax_dropout_value import forward as forward_kernel

FROM_OUTPUT_MIN_KEYS = 512


class AttentionValueTriton(backend.TritonBackend):
  """The op's Triton backend (name, devices and priority from the base class).

  ``keep``: under ``"fused_output"``, what the forward saves of the dropout mask: ``"mask"``
  (the default: the bool mask, 1 B per attention element, which the kernel from delta
  reads) or ``"seeds"`` (the key's seeds, ``[3]`` uint32: the forward writes no mask and the
  kernel from delta draws it again, 4 B per element instead of 5; measured 2-3% slower in a
  step on the H200, with less temporary memory:
  ``benchmarks/results/runs/step_a_triton_seeds_7e4f590.md``).
  ``AttentionValueTriton("triton_seeds", keep="seeds")``, registered with
  ``jax_ops.registry.register`` under that name, runs it.
  """

  def __init__(self, name: str | None = None, keep: str = "mask"):
    if keep not in ("mask", "seeds"):
      raise ValueError(f"keep: expected 'mask' or 'seeds', got {keep!r}")
    if name is not None:
      self.name = name
    self.keep = keep

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
    policy. ``p_dropout``: a float (0.0: no dropout, ``keep`` ``None``) or a traced scalar.
    With ``keep="seeds"`` the kernel stores no mask and ``keep`` is the key's seeds."""
    seeds = self.keep == "seeds"
    out, probs, _, keep, out32 = forward_kernel.attention_softmax_dropout_value_forward(
        scores, value_states, p_dropout, dropout_rng, store_keep=not seeds,
        interpret=interpret)
    if seeds and not (isinstance(p_dropout, (int, float)) and p_dropout == 0):
      keep = kernels_dropout.seeds(dropout_rng, p_dropout)
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
    """The backward given the forward's fp32 output ``[B, Sq, H, D]`` instead of Pd
    (``dropout_mask``: the bool mask, or the key's seeds, ``[3]`` uint32, from which the
    kernel draws it)."""
    delta = kernels.delta_from_output(grad_attn_output, attn_output_f32)
    seeds = None
    if dropout_mask is not None and jnp.dtype(dropout_mask.dtype) == jnp.uint32:
      seeds = dropout_mask
      dropout_mask = jax.ShapeDtypeStruct(attn_weights.shape, jnp.bool_)   # not read
    return pallas_kernels.attention_softmax_dropout_value_backward_from_delta(
        grad_attn_output, attn_weights, value_states, dropout_mask, attention_dropout, delta,
        keep_seeds=seeds, causal=causal, interpret=interpret)


BACKEND = AttentionValueTriton()
