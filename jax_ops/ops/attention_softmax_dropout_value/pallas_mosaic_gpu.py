"""The ``"mosaic_gpu"`` backend of op A's backward: Pallas Mosaic GPU kernels for Hopper.

Kernels: :mod:`pallas_kernels.attention_softmax_dropout_value.pallas_mosaic_gpu` (TMA
streams, wgmma, one producer and two consumer warpgroups). They take bf16/fp16 problems
with ``D`` of 64 or 128, ``seq_q % 64 == 0``, ``seq_k % 128 == 0`` and ``G * seq_q`` a
multiple of 128 unless ``seq_k`` is 128 or 256 (:meth:`supports`); a forced
``implementation="mosaic_gpu"`` on another shape or device raises saying why. A traced
dropout rate, which the kernels cannot take as a constant, runs the Triton kernels.
Residuals (policy ``"fused_output"``, the default on rows of more than 128 keys): P, V and
the forward's fp32 output from the fused forward kernel
(:mod:`pallas_kernels.attention_softmax_dropout_value.forward`), which writes no Pd and no
mask, and the key's seeds: the backward takes ``delta = rowsum(dO * O)``, draws keep again
in the dS-dV kernel and rebuilds Pd from P (4 B per attention element). Rows of 128 keys
(policy ``"fused_inputs"``, whose one-key-block kernel reads Pd): P, Pd and V from the same
forward kernel, which writes no keep mask: the kernels read P and Pd, not keep. A traced
rate saves, on rows of more than 128 keys, the Triton backend's residuals (P, keep and the
fp32 output, for its kernel from delta), and on rows of 128 keys the jnp forward's P, Pd, V
and keep, for the Triton kernels. Backends made with ``residuals="fused_inputs"`` (P and Pd
on every row length) or ``"inputs"`` (the jnp forward) save the others; see the class.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import attention_softmax_dropout_value as kernels
from pallas_kernels import _dropout as kernels_dropout
from pallas_kernels import validation
from pallas_kernels.attention_softmax_dropout_value import pallas_mosaic_gpu as mosaic
from jax_ops import backend
from jax_ops.ops.attention_softmax_dropout_value import pallas_triton as triton
from jax_ops.backend import FUSED_INPUTS, FUSED_OUTPUT, INPUTS
from pallas_kernels.attention_softmax_dropout_value import forward as forward_kernel
from pallas_kernels.attention_softmax_dropout_value import forward_mosaic_gpu as forward_mosaic


class AttentionValueMosaicGpu(backend.ResidualChoice, backend.MosaicGpuBackend):
  """The op's Mosaic GPU backend (devices, priority and the support checks from the base
  class; :meth:`reason` says what of a problem the kernels do not take).

  ``residuals``:

  - ``"fused_output"`` (the default) on rows of more than 128 keys: the fused forward writing
    no Pd and no mask; P, the fp32 output and the key's seeds saved; the backward takes
    delta from the output, draws keep again in the dS-dV kernel and rebuilds Pd from P
    (:func:`mosaic.backward_from_output`). With ``keep="bits"`` the forward writes the mask
    as bits instead, which the backward reads (measured slower: packing the bits in the
    Triton forward costs more than they save). Rows of 128 keys take ``"fused_inputs"``.
  - ``"fused_inputs"``: P and Pd from the fused Triton forward kernel, no keep mask written.
  - ``"inputs"``: the jnp forward (P, Pd and keep), also wherever the fused kernel's int32
    offsets do not reach.

  Measured in a training step on the H200 (``benchmarks/results/step.md``,
  ``step_a_fused_inputs.md``, ``step_a_fused_bits.md``, ``step_a_inputs.md``).
  ``AttentionValueMosaicGpu("mosaic_gpu_pd", residuals="fused_inputs")`` (or
  ``AttentionValueMosaicGpu("mosaic_gpu_fused_bits", residuals="fused_output", keep="bits")``),
  registered with ``jax_ops.registry.register`` under that name, runs one of the others.
  """

  POLICIES = (FUSED_OUTPUT, FUSED_INPUTS, INPUTS)

  def __init__(self, name=None, residuals=None, keep: str = "seeds", forward: str = "triton"):
    """``keep``: under ``"fused_output"`` (no effect under the other policies), what the
    forward saves of the mask: ``"seeds"`` (the key's two words and the threshold; the dS-dV
    kernel draws keep again) or ``"bits"`` (the forward kernel writes it as bits, 1/8 B per
    attention element). ``forward``: under ``"fused_output"`` with ``keep="seeds"``, the
    forward kernel: ``"triton"`` (:mod:`pallas_kernels.attention_softmax_dropout_value.forward`)
    or ``"mosaic_gpu"`` (:mod:`pallas_kernels.attention_softmax_dropout_value.forward_mosaic_gpu`,
    TMA and wgmma, on the shapes it takes; the Triton kernel on the others)."""
    super().__init__(name, residuals)
    if keep not in ("seeds", "bits"):
      raise ValueError(f"keep: expected 'seeds' or 'bits', got {keep!r}")
    if forward not in ("triton", "mosaic_gpu"):
      raise ValueError(f"forward: expected 'triton' or 'mosaic_gpu', got {forward!r}")
    self.keep = keep
    self.forward = forward

  def residual_policy(self, problem):
    b, h, sq, skv = problem.shape("scores")
    _, kvh, _, d = problem.shape("value_states")
    if not forward_kernel.takes(b, h, kvh, sq, skv, d):
      return INPUTS   # past the fused kernel's int32 offsets: the jnp forward
    if self.residuals == FUSED_OUTPUT:
      # Rows of one key block: that kernel computes delta from P and reads Pd.
      return FUSED_OUTPUT if skv > mosaic.WGS * mosaic.KEYS else FUSED_INPUTS
    return self.residuals

  def forward_with_dropped(self, scores, value_states, dropout_rng, p_dropout, *,
                           interpret=False):
    """``(O, P, Pd)`` from the fused forward kernel, the keep mask drawn in the kernel and
    not stored: the ``"fused_inputs"`` policy. ``p_dropout``: a float (0.0: no dropout,
    ``dropout_rng`` may be ``None``; ``Pd`` is then ``P``)."""
    out, probs, dropped, _, _ = forward_kernel.attention_softmax_dropout_value_forward(
        scores, value_states, p_dropout, dropout_rng, store_dropped=True, store_keep=False,
        store_f32=False, interpret=interpret)
    return out, probs, dropped

  def forward_output(self, *args, interpret=False):
    """``O`` alone from the fused (Triton) forward kernel: the Triton backend's."""
    return triton.BACKEND.forward_output(*args, interpret=interpret)

  def forward_with_output(self, scores, value_states, dropout_rng, p_dropout, *,
                          interpret=False):
    """``(O, P, keep, O_f32)`` from the fused forward kernel, no Pd: the ``"fused_output"``
    policy. A concrete rate: ``keep`` is the key's seeds (``[k0, k1, threshold, 0]`` uint32,
    ``mosaic.keep_seeds_of``; the kernel writes no mask) or, with ``keep="bits"``, the mask
    as bits (``forward.forward_with_keep_bits``); a traced one: the Triton backend's (a bool
    mask, for its kernel). ``None`` for a rate of 0."""
    if validation.concrete_float("p_dropout", p_dropout) is None:
      return triton.BACKEND.forward_with_output(scores, value_states, dropout_rng, p_dropout,
                                                interpret=interpret)
    if self.keep == "bits":
      return forward_kernel.forward_with_keep_bits(scores, value_states, p_dropout,
                                                   dropout_rng, interpret=interpret)
    b, h, sq, skv = scores.shape
    kvh, d = value_states.shape[1], value_states.shape[3]
    if self.forward == "mosaic_gpu" and forward_mosaic.unsupported_reason(
        b, h, kvh, sq, skv, d, scores.dtype, float(p_dropout)) is None:
      out, probs, out32 = forward_mosaic.forward_with_output(
          scores, value_states, p_dropout, dropout_rng, interpret=interpret)
    else:
      out, probs, _, _, out32 = forward_kernel.attention_softmax_dropout_value_forward(
          scores, value_states, p_dropout, dropout_rng, store_keep=False, interpret=interpret)
    seeds = None if p_dropout == 0 else mosaic.keep_seeds_of(
        dropout_rng, kernels_dropout.effective_rate(p_dropout))
    return out, probs, seeds, out32

  def backward_from_output(self, grad_attn_output, attn_weights, value_states, dropout_mask,
                           attention_dropout, attn_output_f32, *, causal=False,
                           interpret=False):
    """The Mosaic GPU dS-dV kernel from delta (``dropout_mask``: what
    :meth:`forward_with_output` saved of the mask, the key's seeds, from which the kernel
    draws it again, or its bits, or a bool mask, packed to bits here; a traced rate: the
    Triton backend's kernel from delta)."""
    args = (grad_attn_output, attn_weights, value_states, dropout_mask, attention_dropout,
            attn_output_f32)
    if validation.concrete_float("attention_dropout", attention_dropout) is None:
      return triton.BACKEND.backward_from_output(*args, causal=causal, interpret=interpret)
    # What forward_with_output saved of the mask: seeds, bits (or a bool mask).
    found = {"keep_seeds": None, "keep_bits": None}
    if dropout_mask is not None and jnp.dtype(dropout_mask.dtype) == jnp.uint32:
      found["keep_seeds"], dropout_mask = dropout_mask, None
    elif dropout_mask is not None and jnp.dtype(dropout_mask.dtype) == jnp.int32:
      found["keep_bits"], dropout_mask = dropout_mask, None
    # No dropout (a rate of 0): no mask, and none read.
    return mosaic.backward_from_output(grad_attn_output, attn_weights, value_states,
                                       _unread_mask(dropout_mask, attn_weights),
                                       attention_dropout, attn_output_f32, **found,
                                       interpret=interpret)

  def reason(self, problem):
    shapes = dict(problem.shapes)
    if "scores" not in shapes or "value_states" not in shapes:
      return "a problem without the shapes of scores and value_states"
    b, h, sq, skv = shapes["scores"]
    _, kvh, _, d = shapes["value_states"]
    return mosaic.unsupported_reason(b, h, kvh, sq, skv, d, problem.dtype, 0.1,
                                     problem.causal)

  def config(self, problem):
    """The kernels' default config for this problem."""
    b, h, sq, skv = problem.shape("scores")
    _, kvh, _, d = problem.shape("value_states")
    return mosaic.default_config(b, h, kvh, sq, skv, d)

  def backward(self, grad_attn_output, attn_weights, attn_weights_dropped, value_states,
               dropout_mask, attention_dropout, *, causal=False, interpret=False):
    traced = validation.concrete_float("attention_dropout", attention_dropout) is None
    if not traced:   # "fused_inputs" saves no keep mask: the Mosaic kernels never read it
      dropout_mask = _unread_mask(dropout_mask, attn_weights)
    return kernels.attention_softmax_dropout_value_backward(
        grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
        attention_dropout, implementation="triton" if traced else "mosaic_gpu",
        causal=causal, interpret=interpret)


def _unread_mask(dropout_mask, attn_weights):
  """The keep mask for kernels that check its shape and dtype but never read it: a
  ``ShapeDtypeStruct`` of the scores' shape where none was saved."""
  if dropout_mask is None:
    return jax.ShapeDtypeStruct(attn_weights.shape, jnp.bool_)
  return dropout_mask


BACKEND = AttentionValueMosaicGpu()
