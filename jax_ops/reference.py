"""Pure-jnp references of the three attention backward computations.

Argument order and semantics follow the project spec exactly. Everything is
computed in fp32 (matmuls take the inputs' exact bf16 products and accumulate in
fp32, the natural XLA formulation) and rounded to the output dtype once at the end, except where the math says
otherwise (the two bf16 roundings of ``dL`` in problem C). These functions are
the ``"xla"`` implementation of the differentiable ops and the yardstick the
Pallas kernels are tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import validation as _checks

f32 = jnp.float32


def _matmul_operand(x):
  """Matmul operands keep their dtype (fp32 accumulate via ``preferred_element_type``)
  on accelerators; XLA:CPU has no bf16 x bf16 -> fp32 dot, so there they are upcast
  (bf16 values are exact in fp32, so the product is the same)."""
  return x.astype(f32) if jax.default_backend() == "cpu" else x


def _mm(spec, a, b):
  """einsum of two same-dtype operands: exact products, fp32 accumulation, fp32 result."""
  # fp32 operands ask for full fp32 products (no TF32); bf16 products are exact anyway.
  precision = jax.lax.Precision.HIGHEST if a.dtype == f32 else None
  return jnp.einsum(spec, _matmul_operand(a), _matmul_operand(b), preferred_element_type=f32,
                    precision=precision)


def _round_to(x, dtype):
  """``x`` rounded to ``dtype``'s precision (kept in fp32), never optimised away."""
  if jnp.dtype(dtype) == jnp.bfloat16:  # same exponent range as fp32: no subnormal change
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
  return x.astype(dtype).astype(f32)


def _dropout_scale(keep, p, p_static):
  """``keep / (1 - p)`` as fp32, or ``None`` when no dropout is applied (p == 0)."""
  if p_static == 0.0:
    return None
  scale = keep.astype(f32) * (1.0 / (1.0 - jnp.asarray(p, f32)))
  if p_static is None:  # traced rate: p == 0 must ignore the mask
    scale = jnp.where(jnp.asarray(p) > 0, scale, 1.0)
  return scale


def attention_softmax_dropout_value_backward_reference(
    grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
    attention_dropout):
  """Backward of ``O = transpose(dropout(P) @ V)`` with GQA (problem A).

  Args:
    grad_attn_output: ``[B, Sq, H, D]`` gradient of the attention output.
    attn_weights: ``[B, H, Sq, Skv]`` softmax output P.
    attn_weights_dropped: ``[B, H, Sq, Skv]`` Pd, the weights after dropout.
    value_states: ``[B, KVH, Skv, D]`` with ``H % KVH == 0``.
    dropout_mask: ``[B, H, Sq, Skv]`` bool, True = kept (ignored when p == 0).
    attention_dropout: dropout rate p in [0, 1).

  Returns:
    ``(grad_attn_scores [B, H, Sq, Skv], grad_value_states [B, KVH, Skv, D])``
    in the dtype of the inputs.
  """
  p = _checks.check_problem_a(grad_attn_output, attn_weights, attn_weights_dropped,
                              value_states, dropout_mask, attention_dropout)
  b, h, sq, skv = attn_weights.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  g = h // kvh
  dtype = attn_weights.dtype
  # [B, Sq, H, D] -> [B, KVH, G, Sq, D]: query head h = k * G + g reads value head k.
  d_o = jnp.transpose(grad_attn_output.reshape(b, sq, kvh, g, d), (0, 2, 3, 1, 4))
  d_pd = _mm("bkgqd,bksd->bkgqs", d_o, value_states).reshape(b, h, sq, skv)
  scale = _dropout_scale(dropout_mask, attention_dropout, p)
  d_w = d_pd if scale is None else d_pd * scale
  probs = attn_weights.astype(f32)
  delta = jnp.sum(d_w * probs, axis=-1, keepdims=True)
  grad_scores = (probs * (d_w - delta)).astype(dtype)
  # The sum over the G heads of a group happens inside the fp32 accumulation.
  grad_value = _mm("bkgqs,bkgqd->bksd", attn_weights_dropped.reshape(b, kvh, g, sq, skv), d_o)
  grad_value = grad_value.astype(dtype)
  return grad_scores, grad_value


def masked_softmax_dropout_backward_reference(grad_output, p_attn, mask, dropout_mask, p_dropout):
  """Backward of ``dropout(softmax(scores.masked_fill(~mask, -1e4)))`` (problem B).

  Args:
    grad_output: ``[B, H, Sq, Sk]`` gradient of the dropout output.
    p_attn: ``[B, H, Sq, Sk]`` softmax output P.
    mask: ``[B, 1, Sq, Sk]`` bool, True = attend (broadcast over heads).
    dropout_mask: ``[B, H, Sq, Sk]`` bool, True = kept; not read when p == 0.
    p_dropout: dropout rate p in [0, 1).

  Returns:
    ``grad_scores [B, H, Sq, Sk]`` in the dtype of ``p_attn``.
  """
  p = _checks.check_problem_b(grad_output, p_attn, mask, dropout_mask, p_dropout)
  g = grad_output.astype(f32)
  scale = _dropout_scale(dropout_mask, p_dropout, p)
  gd = g if scale is None else g * scale
  probs = p_attn.astype(f32)
  s = jnp.sum(probs * gd, axis=-1, keepdims=True)  # over all columns: the mask is not applied
  return jnp.where(mask, probs * (gd - s), 0.0).astype(p_attn.dtype)


def qk_scale_softmax_backward_reference(grad_output, query, key, attn_weights, scaling):
  """Backward of ``softmax((Q @ K^T) * scaling)`` to Q and K (problem C).

  Args:
    grad_output: ``[B, H, Sq, Sk]`` gradient of the attention weights.
    query: ``[B, H, Sq, D]``.
    key: ``[B, H, Sk, D]``.
    attn_weights: ``[B, H, Sq, Sk]`` softmax output P.
    scaling: the logits' scale (``1/sqrt(D)`` in the usual case).

  Returns:
    ``(grad_query [B, H, Sq, D], grad_key [B, H, Sk, D])`` in the inputs' dtype.
  """
  _checks.check_problem_c(grad_output, query, key, attn_weights, scaling)
  dtype = query.dtype
  g = grad_output.astype(f32)
  probs = attn_weights.astype(f32)
  # The two roundings of dL are explicit ops: XLA:GPU may otherwise drop a
  # f32 -> bf16 -> f32 convert pair (excess precision) and skip them.
  d_l = _round_to(probs * (g - jnp.sum(g * probs, axis=-1, keepdims=True)), dtype)
  d_l = _round_to(d_l * jnp.asarray(scaling, f32), dtype).astype(dtype)
  grad_query = _mm("bhqk,bhkd->bhqd", d_l, key)
  grad_key = _mm("bhqk,bhqd->bhkd", d_l, query)
  return grad_query.astype(dtype), grad_key.astype(dtype)


# Forward passes in plain jnp. The differentiable ops run these, and the tests
# differentiate them with jax.vjp to check the ops' custom backward passes.


def dropout_keep_mask(rng, rate, shape):
  """The dropout keep mask the ops draw: ``bernoulli(rng, 1 - rate)``, True = kept."""
  return jax.random.bernoulli(rng, 1.0 - jnp.asarray(rate, f32), shape)


def _apply_dropout(probs, keep, rate):
  """``probs * keep / (1 - rate)`` in fp32, rounded once to ``probs.dtype``."""
  if keep is None:
    return probs
  scaled = probs.astype(f32) * keep * (1.0 / (1.0 - jnp.asarray(rate, f32)))
  return scaled.astype(probs.dtype)


def attention_softmax_dropout_value_forward(scores, value_states, keep, rate, *,
                                            with_f32_output=False):
  """``(O [B, Sq, H, D], P, Pd)`` for ``O = transpose(dropout(softmax(scores)) @ V)``;
  ``with_f32_output``: ``(O, P, Pd, O before its rounding, fp32)``.

  ``scores [B, H, Sq, Skv]``, ``value_states [B, KVH, Skv, D]``; ``keep`` is a
  bool ``[B, H, Sq, Skv]`` mask or ``None`` for no dropout. The softmax runs in
  fp32 and is rounded to the input dtype; the matmul accumulates in fp32.
  """
  b, h, sq, skv = scores.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  # The barrier keeps XLA from making Pd out of the unrounded fp32 softmax (on a GPU it
  # drops the round trip through the input dtype): Pd is made from P, as in every real
  # forward, and the Pallas backward that rebuilds Pd from P and keep relies on it.
  probs = lax.optimization_barrier(
      jax.nn.softmax(scores.astype(f32), axis=-1).astype(scores.dtype))
  dropped = _apply_dropout(probs, keep, rate)
  grouped = dropped.reshape(b, kvh, h // kvh, sq, skv)
  out = _mm("bkgqs,bksd->bqkgd", grouped, value_states)
  out = out.reshape(b, sq, h, d)
  if with_f32_output:
    return out.astype(scores.dtype), probs, dropped, out
  return out.astype(scores.dtype), probs, dropped


def masked_softmax_dropout_forward(scores, mask, keep, rate):
  """``(y, P)`` for ``y = dropout(softmax(scores.masked_fill(~mask, -1e4)))``.

  ``scores [B, H, Sq, Sk]``, ``mask [B, 1, Sq, Sk]`` bool (True = attend),
  ``keep`` a bool ``[B, H, Sq, Sk]`` mask or ``None``. Computed in fp32.
  """
  filled = jnp.where(mask, scores.astype(f32), -1e4)
  probs = jax.nn.softmax(filled, axis=-1).astype(scores.dtype)
  return _apply_dropout(probs, keep, rate), probs


def causal_mask(sq, sk):
  """``[Sq, Sk]`` bool, True where key ``k <= q + (Sk - Sq)`` (bottom-right aligned)."""
  return jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)


def qk_scale_softmax_forward(query, key, scaling, causal=False):
  """``P = softmax((Q @ K^T) * scaling)`` in fp32, rounded to the input dtype.

  ``query [B, H, Sq, D]``, ``key [B, H, Sk, D]``; with ``causal`` the keys
  ``k > q + (Sk - Sq)`` get probability exactly 0.
  """
  logits = _mm("bhqd,bhkd->bhqk", query, key) * scaling
  if causal:
    logits = jnp.where(causal_mask(query.shape[2], key.shape[2]), logits, -jnp.inf)
  return jax.nn.softmax(logits, axis=-1).astype(query.dtype)
