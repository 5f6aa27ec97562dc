"""Plain-jnp forward and backward of qk_scale_softmax: ``P = softmax((Q @ K^T) * scaling)``.

The backward is the spec: ``dL`` rounded to the input dtype twice, as the reference model
rounds it, then two GEMMs with fp32 accumulation; or, with ``renormalize=True``, the op's
form: P corrected to sum to 1 and ``dL`` rounded once. It is the yardstick of the kernels,
and in the op's form the ``"xla"`` backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ops._common import FLOATS, causal_mask, f32, mm, round_to
from pallas_kernels import validation
from pallas_kernels.qk_scale_softmax._common import RENORM_BAND


def qk_scale_softmax_backward_reference(
    grad_output: jax.typing.ArrayLike, query: jax.typing.ArrayLike, key: jax.typing.ArrayLike,
    attn_weights: jax.typing.ArrayLike,
    scaling: float | jax.typing.ArrayLike, *,
    renormalize: bool = False) -> tuple[jax.Array, jax.Array]:
  """Backward of ``softmax((Q @ K^T) * scaling)`` to Q and K.

  Args:
    grad_output: ``[B, H, Sq, Sk]`` gradient of the attention weights.
    query: ``[B, H, Sq, D]``.
    key: ``[B, H, Sk, D]``.
    attn_weights: ``[B, H, Sq, Sk]`` softmax output P (a causal P is zero above the
      diagonal, which the dense math handles).
    scaling: the logits' scale (``1/sqrt(D)`` in the usual case).
    renormalize: ``False``, the spec: ``delta = rowsum(g P)``, ``dL = dtype(dtype(P (g -
      delta)) * scaling)``. ``True``: a row of P whose sum is within ``2**-6`` of 1 is
      corrected to sum to 1, ``P' = P (1 + r P)`` with ``r = (1 - rowsum(P)) /
      rowsum(P^2)``, and ``dL = dtype(P' (g - rowsum(g P')) * scaling)`` is rounded once.
      On a sharp row (``P_ii`` rounds to 1) the spec's ``g - delta`` is rounding noise;
      this form keeps it.

  Returns:
    ``(grad_query [B, H, Sq, D], grad_key [B, H, Sk, D])`` in the inputs' dtype.
  """
  validation.check_qk_scale_softmax(grad_output, query, key, attn_weights, scaling)
  dtype = query.dtype
  g = grad_output.astype(f32)
  probs = attn_weights.astype(f32)
  scale = jnp.asarray(scaling, f32)
  # The roundings of dL are explicit ops: XLA may otherwise drop a f32 -> bf16 -> f32
  # convert pair (excess precision) and skip them.
  row_sum = lambda x: jnp.sum(x, axis=-1, keepdims=True)
  if renormalize:
    # delta = sum g P' = sum g P + r sum g P^2: the four row sums in one variadic reduce,
    # which XLA computes in one read of g and P.
    squares = probs * probs
    g_p, g_p2, total, sum_sq = (x[..., None] for x in jax.lax.reduce(
        (g * probs, g * squares, probs, squares), (f32(0),) * 4,
        lambda a, b: tuple(x + y for x, y in zip(a, b)), (probs.ndim - 1,)))
    deficit = 1.0 - total
    near = jnp.abs(deficit) <= RENORM_BAND
    r = jnp.where(near, deficit, 0.0) / jnp.where(near, sum_sq, 1.0)
    delta = g_p + r * g_p2
    d_l = (probs + r * squares) * (g - delta) * scale
  else:
    d_l = round_to(probs * (g - row_sum(g * probs)), dtype) * scale
  d_l = round_to(d_l, dtype).astype(dtype)
  grad_query = mm("bhqk,bhkd->bhqd", d_l, key)
  grad_key = mm("bhqk,bhqd->bhkd", d_l, query)
  return grad_query.astype(dtype), grad_key.astype(dtype)


def qk_scale_softmax_forward(query: jax.typing.ArrayLike, key: jax.typing.ArrayLike,
                             scaling: float | jax.typing.ArrayLike,
                             causal: bool = False) -> jax.Array:
  """``P = softmax((Q @ K^T) * scaling)`` in fp32, rounded to the input dtype.

  ``query [B, H, Sq, D]``, ``key [B, H, Sk, D]``; with ``causal`` the keys
  ``k > q + (Sk - Sq)`` get probability exactly 0.
  """
  validation.check_query_and_key(query, key, dtypes=FLOATS)
  causal = validation.check_causal(causal, query.shape[2], key.shape[2])
  validation.check_scaling("scaling", scaling)
  logits = mm("bhqd,bhkd->bhqk", query, key) * scaling
  if causal:
    logits = jnp.where(causal_mask(query.shape[2], key.shape[2]), logits, -jnp.inf)
  return jax.nn.softmax(logits, axis=-1).astype(query.dtype)
