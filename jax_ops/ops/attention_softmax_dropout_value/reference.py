"""Plain-jnp forward and backward of ``O = transpose(dropout(softmax(S)) @ V)`` with GQA.

The backward is the spec (``grad_attn_scores``, ``grad_value_states``), computed in fp32 with
exact bf16 products and rounded to the input dtype once at the end; it is the ``"xla"``
backend and the yardstick of the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_ops._common import FLOATS, apply_dropout, check_keep, dropout_scale, f32, mm
from pallas_kernels import validation


def attention_softmax_dropout_value_backward_reference(
    grad_attn_output: jax.typing.ArrayLike, attn_weights: jax.typing.ArrayLike,
    attn_weights_dropped: jax.typing.ArrayLike, value_states: jax.typing.ArrayLike,
    dropout_mask: jax.typing.ArrayLike | None,
    attention_dropout: float | jax.typing.ArrayLike) -> tuple[jax.Array, jax.Array]:
  """Backward of ``O = transpose(dropout(P) @ V)`` with GQA.

  Args:
    grad_attn_output: ``[B, Sq, H, D]`` gradient of the attention output.
    attn_weights: ``[B, H, Sq, Skv]`` softmax output P.
    attn_weights_dropped: ``[B, H, Sq, Skv]`` Pd, the weights after dropout.
    value_states: ``[B, KVH, Skv, D]`` with ``H % KVH == 0``.
    dropout_mask: ``[B, H, Sq, Skv]`` bool, True = kept (ignored when p == 0).
    attention_dropout: dropout rate p in [0, 1) (a traced p outside it gives NaN).

  Returns:
    ``(grad_attn_scores [B, H, Sq, Skv], grad_value_states [B, KVH, Skv, D])``
    in the dtype of the inputs.
  """
  p = validation.check_attention_softmax_dropout_value(
      grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
      attention_dropout)
  b, h, sq, skv = attn_weights.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  g = h // kvh
  dtype = attn_weights.dtype
  # [B, Sq, H, D] -> [B, KVH, G, Sq, D]: query head h = k * G + g reads value head k.
  d_o = jnp.transpose(grad_attn_output.reshape(b, sq, kvh, g, d), (0, 2, 3, 1, 4))
  d_pd = mm("bkgqd,bksd->bkgqs", d_o, value_states).reshape(b, h, sq, skv)
  scale = dropout_scale(dropout_mask, attention_dropout, p)
  d_w = d_pd if scale is None else d_pd * scale
  probs = attn_weights.astype(f32)
  delta = jnp.sum(d_w * probs, axis=-1, keepdims=True)
  grad_scores = (probs * (d_w - delta)).astype(dtype)
  # The sum over the G heads of a group happens inside the fp32 accumulation.
  dropped = attn_weights_dropped.reshape(b, kvh, g, sq, skv)
  grad_value = mm("bkgqs,bkgqd->bksd", dropped, d_o).astype(dtype)
  return grad_scores, grad_value


def attention_softmax_dropout_value_forward(
    scores: jax.typing.ArrayLike, value_states: jax.typing.ArrayLike,
    keep: jax.typing.ArrayLike | None, rate: float | jax.typing.ArrayLike, *,
    with_f32_output: bool = False) -> tuple[jax.Array, ...]:
  """``(O [B, Sq, H, D], P, Pd)`` for ``O = transpose(dropout(softmax(scores)) @ V)``;
  ``with_f32_output``: ``(O, P, Pd, O before its rounding, fp32)``.

  ``scores [B, H, Sq, Skv]``, ``value_states [B, KVH, Skv, D]``; ``keep`` is a
  bool ``[B, H, Sq, Skv]`` mask or ``None`` for no dropout. The softmax runs in
  fp32 and is rounded to the input dtype; the matmul accumulates in fp32.
  """
  validation.check_scores_and_value(scores, value_states, dtypes=FLOATS)
  check_keep(keep, scores.shape, rate)
  b, h, sq, skv = scores.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  # The barrier keeps XLA from making Pd out of the unrounded fp32 softmax (on a GPU it
  # drops the round trip through the input dtype): Pd is made from P, as in every real
  # forward, and a backward that rebuilds Pd from P and keep relies on it.
  probs = lax.optimization_barrier(
      jax.nn.softmax(scores.astype(f32), axis=-1).astype(scores.dtype))
  dropped = apply_dropout(probs, keep, rate)
  grouped = dropped.reshape(b, kvh, h // kvh, sq, skv)
  out = mm("bkgqs,bksd->bqkgd", grouped, value_states)
  out = out.reshape(b, sq, h, d)
  if with_f32_output:
    return out.astype(scores.dtype), probs, dropped, out
  return out.astype(scores.dtype), probs, dropped
