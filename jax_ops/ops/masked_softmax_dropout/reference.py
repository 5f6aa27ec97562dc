"""Plain-jnp forward and backward of ``dropout(softmax(scores.masked_fill(~mask, -1e4)))``.

The backward is the spec, in fp32 throughout; it is the ``"xla"`` backend and the
yardstick of the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ops._common import FLOATS, apply_dropout, check_keep, dropout_scale, f32
from pallas_kernels import validation


def masked_softmax_dropout_backward_reference(
    grad_output: jax.typing.ArrayLike, p_attn: jax.typing.ArrayLike, mask: jax.typing.ArrayLike,
    dropout_mask: jax.typing.ArrayLike | None,
    p_dropout: float | jax.typing.ArrayLike) -> jax.Array:
  """Backward of ``dropout(softmax(scores.masked_fill(~mask, -1e4)))``.

  Args:
    grad_output: ``[B, H, Sq, Sk]`` gradient of the dropout output.
    p_attn: ``[B, H, Sq, Sk]`` softmax output P.
    mask: bool, True = attend: ``[B, 1, Sq, Sk]`` or a shape that broadcasts to it
      (``[B, 1, 1, Sk]``, ``[Sq, Sk]``, ...: ``pallas_kernels.validation.check_mask``).
    dropout_mask: ``[B, H, Sq, Sk]`` bool, True = kept; not read when p == 0.
    p_dropout: dropout rate p in [0, 1) (a traced p outside it gives NaN).

  Returns:
    ``grad_scores [B, H, Sq, Sk]`` in the dtype of ``p_attn``.
  """
  p = validation.check_masked_softmax_dropout(grad_output, p_attn, mask, dropout_mask, p_dropout)
  g = grad_output.astype(f32)
  scale = dropout_scale(dropout_mask, p_dropout, p)
  gd = g if scale is None else g * scale
  probs = p_attn.astype(f32)
  s = jnp.sum(probs * gd, axis=-1, keepdims=True)  # over all columns: the mask is not applied
  # A traced rate outside [0, 1) makes every element NaN, masked ones too.
  fill = 0.0 if p is not None else validation.nan_unless_rate_valid(
      jnp.asarray(p_dropout, f32), 0.0)
  return jnp.where(mask, probs * (gd - s), fill).astype(p_attn.dtype)


def masked_softmax_dropout_forward(
    scores: jax.typing.ArrayLike, mask: jax.typing.ArrayLike, keep: jax.typing.ArrayLike | None,
    rate: float | jax.typing.ArrayLike) -> tuple[jax.Array, jax.Array]:
  """``(y, P)`` for ``y = dropout(softmax(scores.masked_fill(~mask, -1e4)))``.

  ``scores [B, H, Sq, Sk]``, ``mask`` bool that broadcasts to ``[B, 1, Sq, Sk]`` (True =
  attend),
  ``keep`` a bool ``[B, H, Sq, Sk]`` mask or ``None``. Computed in fp32.
  """
  validation.check_scores_and_mask(scores, mask, dtypes=FLOATS)
  check_keep(keep, scores.shape, rate)
  filled = jnp.where(mask, scores.astype(f32), -1e4)
  probs = jax.nn.softmax(filled, axis=-1).astype(scores.dtype)
  return apply_dropout(probs, keep, rate), probs
