"""The ``"mosaic_gpu"`` backend of op A's backward: Pallas Mosaic GPU kernels for Hopper.

Kernels: :mod:`pallas_kernels.attention_softmax_dropout_value.pallas_mosaic_gpu` (TMA
streams, wgmma, one producer and two consumer warpgroups). They take bf16/fp16 problems
with ``D`` of 64 or 128, ``seq_q % 64 == 0``, ``seq_k % 128 == 0`` and ``G * seq_q`` a
multiple of 128 unless ``seq_k == 128`` (:meth:`supports`); a forced ``implementation="mosaic_gpu"`` on another
shape or device raises saying why. A traced dropout rate, which the kernels cannot take
as a constant, runs the Triton kernels. Residuals: the reference backward's arguments
(P, Pd, V, keep); the kernels read P and Pd, not keep.
"""

from __future__ import annotations

from pallas_kernels import attention_softmax_dropout_value as kernels
from pallas_kernels import validation
from pallas_kernels.attention_softmax_dropout_value import pallas_mosaic_gpu as mosaic
from jax_ops import backend


class AttentionValueMosaicGpu(backend.MosaicGpuBackend):
  """The op's Mosaic GPU backend (name, devices, priority and the support checks from the
  base class; :meth:`reason` says what of a problem the kernels do not take)."""

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
    return kernels.attention_softmax_dropout_value_backward(
        grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
        attention_dropout, implementation="triton" if traced else "mosaic_gpu",
        causal=causal, interpret=interpret)


BACKEND = AttentionValueMosaicGpu()
