"""The ``"mosaic_gpu"`` backend of the op's backward: Pallas Mosaic GPU kernels for Hopper.

Kernels: :mod:`pallas_kernels.attention_softmax_dropout_value.pallas_mosaic_gpu` (TMA
streams, wgmma, one producer and two consumer warpgroups); the shapes they take:
:func:`pallas_kernels.attention_softmax_dropout_value.dispatch.mosaic_gpu_reason`. A forced
``implementation="mosaic_gpu"`` on another shape or device raises saying why.

Residuals (:func:`pallas_kernels.attention_softmax_dropout_value.dispatch.mosaic_gpu_residuals`):
on rows of more than 128 keys (``"fused_output"``) the fused Triton forward kernel that
normalizes last (:func:`pallas_kernels.attention_softmax_dropout_value.forward.attention_softmax_dropout_value_forward_unnormalized`:
one pass over the keys, one exponential per element) writes O, the unnormalized ``E``
(fp16), its scales (per row and 64 keys) and
the fp32 output, no Pd and no mask; the op saves the key's seeds, and the backward takes
``delta = rowsum(dO * O)``, draws keep again in the dS-dV kernel and rebuilds P and Pd from
E (4 B per attention element). The op's value without a gradient comes from the same
kernel, writing O alone. On rows of 128 keys (``"fused_inputs"``, whose one-key-block
kernel reads Pd) the same forward kernel writes P and Pd. Past the fused kernel's int32
offsets the jnp forward runs (``"inputs"``). A traced dropout rate, which the kernels cannot
take as a constant, runs the Triton backend's forward and kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import attention_softmax_dropout_value as kernels
from pallas_kernels import _dropout as kernels_dropout
from pallas_kernels import validation
from pallas_kernels.attention_softmax_dropout_value import dispatch
from pallas_kernels.attention_softmax_dropout_value import forward as forward_kernel
from pallas_kernels.attention_softmax_dropout_value import pallas_mosaic_gpu as mosaic
from jax_ops import backend
from jax_ops.ops.attention_softmax_dropout_value import pallas_triton as triton


class AttentionValueMosaicGpu(backend.MosaicGpuBackend):
  """The op's Mosaic GPU backend (devices, priority and the support checks from the base
  class; :meth:`reason` says what of a problem the kernels do not take)."""

  def residual_policy(self, problem):
    b, h, sq, skv = problem.shape("scores")
    _, kvh, _, d = problem.shape("value_states")
    return dispatch.mosaic_gpu_residuals(b, h, kvh, sq, skv, d)

  def forward_with_dropped(self, scores, value_states, dropout_rng, p_dropout, *,
                           interpret=False):
    """``(O, P, Pd)`` from the fused forward kernel, the keep mask drawn in the kernel and
    not stored: the ``"fused_inputs"`` policy. ``p_dropout``: a float (0.0: no dropout,
    ``dropout_rng`` may be ``None``; ``Pd`` is then ``P``)."""
    out, probs, dropped, _, _ = forward_kernel.attention_softmax_dropout_value_forward(
        scores, value_states, p_dropout, dropout_rng, store_dropped=True, store_keep=False,
        store_f32=False, interpret=interpret)
    return out, probs, dropped

  def forward_output(self, scores, value_states, dropout_rng, p_dropout, *, interpret=False):
    """``O`` alone, as :meth:`forward_with_output` makes it (the unnormalized kernel, nothing
    else written; rows of 128 keys and a traced rate: the Triton backend's, as the fused
    forward of their policies)."""
    if (validation.concrete_float("p_dropout", p_dropout) is None
        or not mosaic.takes_output(scores.shape[-1])):
      return triton.BACKEND.forward_output(scores, value_states, dropout_rng, p_dropout,
                                           interpret=interpret)
    return forward_kernel.attention_softmax_dropout_value_forward_unnormalized(
        scores, value_states, p_dropout, dropout_rng, store_exp=False, store_f32=False,
        interpret=interpret)[0]

  def forward_with_output(self, scores, value_states, dropout_rng, p_dropout, *,
                          interpret=False):
    """``(O, E, (seeds, row_scale), O_f32)`` from the fused forward kernel that leaves the
    softmax unnormalized (``forward_kernel.attention_softmax_dropout_value_forward_unnormalized``:
    ``P = E * row_scale``), no Pd: the ``"fused_output"`` policy. A concrete rate: ``seeds``
    is the key's (``[k0, k1, threshold, 0]`` uint32, ``mosaic.keep_seeds_of``; the kernel
    writes no mask), ``None`` for a rate of 0; a traced one: the Triton backend's
    ``(O, P, keep, O_f32)`` (a bool mask, for its kernel)."""
    if validation.concrete_float("p_dropout", p_dropout) is None:
      return triton.BACKEND.forward_with_output(scores, value_states, dropout_rng, p_dropout,
                                                interpret=interpret)
    out, exp, row_scale, out32 = forward_kernel.attention_softmax_dropout_value_forward_unnormalized(
        scores, value_states, p_dropout, dropout_rng, interpret=interpret)
    seeds = None if p_dropout == 0 else mosaic.keep_seeds_of(
        dropout_rng, kernels_dropout.effective_rate(p_dropout))
    return out, exp, (seeds, row_scale), out32

  def backward_from_output(self, grad_attn_output, attn_weights, value_states, dropout_mask,
                           attention_dropout, attn_output_f32, *, causal=False,
                           interpret=False):
    """The Mosaic GPU dS-dV kernel from delta, given :meth:`forward_with_output`'s E and
    ``dropout_mask = (seeds, row_scale)`` (the key's seeds, from which the kernel draws the
    mask again, or ``None`` for a rate of 0; P is ``E * row_scale``); a traced rate: the
    Triton backend's kernel from delta."""
    args = (grad_attn_output, attn_weights, value_states, dropout_mask, attention_dropout,
            attn_output_f32)
    if validation.concrete_float("attention_dropout", attention_dropout) is None:
      return triton.BACKEND.backward_from_output(*args, causal=causal, interpret=interpret)
    seeds, row_scale = dropout_mask
    return mosaic.backward_from_output(grad_attn_output, attn_weights, value_states,
                                       _unread_mask(None, attn_weights), attention_dropout,
                                       attn_output_f32, keep_seeds=seeds, row_scale=row_scale,
                                       interpret=interpret)

  def reason(self, problem):
    shapes = dict(problem.shapes)
    if "scores" not in shapes or "value_states" not in shapes:
      return "a problem without the shapes of scores and value_states"
    b, h, sq, skv = shapes["scores"]
    _, kvh, _, d = shapes["value_states"]
    return dispatch.mosaic_gpu_reason(b, h, kvh, sq, skv, d, problem.dtype, 0.1,
                                      problem.causal)

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
