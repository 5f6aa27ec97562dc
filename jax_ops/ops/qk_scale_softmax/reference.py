"""Plain-jnp forward and backward of qk_scale_softmax: ``P = softmax((Q @ K^T) * scaling)``.

The backward is the spec: ``dL`` rounded to the input dtype twice, as the reference model
rounds it, then two GEMMs with fp32 accumulation. It is the ``"xla"`` backend and the
yardstick of the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ops._common import FLOATS, causal_mask, f32, mm, round_to
from pallas_kernels import validation


def qk_scale_softmax_backward_reference(
    grad_output: jax.typing.ArrayLike, query: jax.typing.ArrayLike, key: jax.typing.ArrayLike,
    attn_weights: jax.typing.ArrayLike,
    scaling: float | jax.typing.ArrayLike) -> tuple[jax.Array, jax.Array]:
  """Backward of ``softmax((Q @ K^T) * scaling)`` to Q and K.

  Args:
    grad_output: ``[B, H, Sq, Sk]`` gradient of the attention weights.
    query: ``[B, H, Sq, D]``.
    key: ``[B, H, Sk, D]``.
    attn_weights: ``[B, H, Sq, Sk]`` softmax output P (a causal P is zero above the
      diagonal, which the dense math handles).
    scaling: the logits' scale (``1/sqrt(D)`` in the usual case).

  Returns:
    ``(grad_query [B, H, Sq, D], grad_key [B, H, Sk, D])`` in the inputs' dtype.
  """
  validation.check_qk_scale_softmax(grad_output, query, key, attn_weights, scaling)
  dtype = query.dtype
  g = grad_output.astype(f32)
  probs = attn_weights.astype(f32)
  # The two roundings of dL are explicit ops: XLA:GPU may otherwise drop a
  # f32 -> bf16 -> f32 convert pair (excess precision) and skip them.
  d_l = round_to(probs * (g - jnp.sum(g * probs, axis=-1, keepdims=True)), dtype)
  d_l = round_to(d_l * jnp.asarray(scaling, f32), dtype).astype(dtype)
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
