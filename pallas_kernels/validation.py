"""Argument checks shared by the kernels and the differentiable ops.

Every public entry point validates its arguments once, at the boundary, so a
caller sees ``grad_output: expected [B, H, Sq, Sk] = [2, 4, 7, 7], got [2, 4, 7]``
instead of an error from deep inside a compiler. The checks use chex and
re-raise its assertion as a ``ValueError`` (shape, rank) or ``TypeError``
(dtype) that names the argument.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np


def as_jax(*xs):
  """NumPy arrays and scalars as jax arrays, in the dtype jax gives them (``float64``
  becomes ``float32`` unless x64 is on), as ``jnp`` functions take them; anything else
  as it is, for the checks to name."""
  return tuple(jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x for x in xs)


def _fmt(shape) -> str:
  return "[" + ", ".join(str(s) for s in shape) + "]"


def check_array(
    name: str,
    x,
    axes: Sequence[str],
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence | None = None,
) -> None:
  """Checks that ``x`` is an array of rank ``len(axes)`` with ``shape`` and a dtype in ``dtypes``.

  ``axes`` names the dimensions (``("B", "H", "Sq", "Sk")``) for the message;
  ``None`` entries of ``shape`` accept any size.
  """
  expected = "[" + ", ".join(axes) + "]"
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name}: expected an array of shape {expected}, got {type(x).__name__}")
  try:
    chex.assert_rank(x, len(axes))
  except AssertionError:
    raise ValueError(
        f"{name}: expected rank {len(axes)} {expected}, got shape {_fmt(x.shape)}") from None
  if shape is not None:
    try:
      chex.assert_shape(x, tuple(shape))
    except AssertionError:
      want = _fmt("*" if s is None else s for s in shape)
      raise ValueError(f"{name}: expected {expected} = {want}, got {_fmt(x.shape)}") from None
  if dtypes is not None:
    check_dtype(name, x, dtypes)


def check_dtype(name: str, x, dtypes: Sequence) -> None:
  """``x.dtype`` must be one of ``dtypes``, exactly (``chex.assert_type``); raises a
  ``TypeError`` that names the argument: ``mask: expected dtype bool, got float32``."""
  allowed = tuple(dict.fromkeys(jnp.dtype(d) for d in dtypes))
  if not any(_has_dtype(x, d) for d in allowed):
    names = " or ".join(d.name for d in allowed)
    raise TypeError(f"{name}: expected dtype {names}, got {jnp.dtype(x.dtype).name}")


def _has_dtype(x, dtype) -> bool:
  try:
    # The scalar type, not the dtype: chex takes float64 (== float) for "any float".
    chex.assert_type(x, jnp.dtype(dtype).type)
  except AssertionError:
    return False
  return True


def check_positive(name: str, x, axes: Sequence[str]) -> None:
  """Every dimension must be >= 1: empty attention matrices have no softmax."""
  if any(s < 1 for s in x.shape):
    raise ValueError(f"{name}: every dimension of {_fmt(axes)} must be >= 1, got {_fmt(x.shape)}")


def check_divisible(num_heads: int, num_kv_heads: int) -> None:
  if num_kv_heads < 1 or num_heads % num_kv_heads:
    raise ValueError(
        f"value_states: its heads KVH={num_kv_heads} must divide the query heads H={num_heads}")


def concrete_float(name: str, x) -> float | None:
  """``float(x)`` if ``x`` is a Python number or a concrete scalar array, else ``None`` (traced).

  Raises ``TypeError`` naming the argument for anything that is not a real number (a
  string, ``None``, a complex number) and ``ValueError`` for a non-scalar array. Bools
  count as 0 and 1 (``rate = training and 0.1`` is a common idiom).
  """
  if x is None or isinstance(x, (str, bytes)):
    raise TypeError(f"{name}: expected a real number, got {type(x).__name__} {x!r}")
  if hasattr(x, "dtype"):
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)
            or jnp.issubdtype(x.dtype, jnp.bool_)):
      raise TypeError(f"{name}: expected a real number, got dtype {jnp.dtype(x.dtype).name}")
  elif not isinstance(x, numbers.Real):
    raise TypeError(f"{name}: expected a real number, got {type(x).__name__}")
  if np.shape(x) != ():
    raise ValueError(f"{name}: expected a scalar, got shape {_fmt(np.shape(x))}")
  if isinstance(x, jax.core.Tracer):
    return None
  return float(x)


def check_key(name: str, rng) -> None:
  """``rng`` must be one PRNG key (``vmap`` for more): a typed key (``jax.random.key``) or
  a raw ``uint32`` key of the default implementation's shape (``jax.random.PRNGKey``:
  ``[2]`` for threefry)."""
  if hasattr(rng, "dtype") and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.shape == ():
      return
  elif hasattr(rng, "dtype") and _has_dtype(rng, jnp.uint32):
    if rng.shape == jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape:
      return
  what = f"shape {list(rng.shape)} {rng.dtype}" if hasattr(rng, "dtype") else type(rng).__name__
  raise TypeError(f"{name}: expected one PRNG key (jax.random.key(seed), or a raw uint32 "
                  f"key from jax.random.PRNGKey), got {what}")


def check_dropout_rate(name: str, p) -> float | None:
  """Validates a dropout rate; returns it as a float, or ``None`` when it is traced.

  A traced rate's value is unknown until the computation runs, where raising is not
  possible: the ops and kernels turn an invalid one (outside [0, 1), NaN) into NaN
  outputs instead (``nan_unless_rate_valid``), never into mis-scaled ones.
  """
  value = concrete_float(name, p)
  if value is not None and not 0.0 <= value < 1.0:  # NaN fails the comparison too
    raise ValueError(f"{name}: expected a dropout rate in [0, 1), got {value}")
  return value


def nan_unless_rate_valid(p, value):
  """``value`` where the traced rate ``p`` is in [0, 1), else NaN: a computation given an
  invalid traced rate returns NaN rather than silently mis-scaled results."""
  return jnp.where((p >= 0.0) & (p < 1.0), value, jnp.nan)


def check_scaling(name: str, x) -> float | None:
  """A finite scale factor > 0 as a float, or ``None`` when it is traced (a traced scale
  cannot be checked). ``scaling = 0`` would make every softmax uniform and a negative one
  reverse the logits' order: neither is a softmax temperature."""
  value = concrete_float(name, x)
  if value is not None and not (math.isfinite(value) and value > 0):
    raise ValueError(f"{name}: expected a finite number > 0, got {value}")
  return value


def check_causal(causal, seq_q: int, seq_k: int, *, every_row_has_keys: bool = True) -> bool:
  """``causal`` as a bool: a Python bool (it picks the kernels' loops). With
  ``every_row_has_keys`` (a forward softmax needs it), also ``Sq <= Sk``: a causal mask
  ``k > q + (Sk - Sq)`` leaves the first ``Sq - Sk`` query rows no key otherwise (a
  backward kernel takes such rows: their ``P`` is zero, and so are their gradients)."""
  if isinstance(causal, jax.core.Tracer) or np.shape(causal) != () or not (
      isinstance(causal, (bool, int, np.bool_, np.integer))
      or jnp.issubdtype(getattr(causal, "dtype", np.float32), jnp.bool_)):
    raise TypeError(f"causal: expected a Python bool (it picks the kernels' loops), got "
                    f"{type(causal).__name__}")
  if causal and every_row_has_keys and seq_q > seq_k:
    raise ValueError(f"causal: needs Sq <= Sk (every query row attends to at least one key), "
                     f"got Sq={seq_q}, Sk={seq_k}")
  return bool(causal)


_LOW = (jnp.bfloat16, jnp.float16, jnp.float32)


def check_attention_softmax_dropout_value(grad_attn_output, attn_weights, attn_weights_dropped,
                                          value_states, dropout_mask, attention_dropout, *,
                                          dtypes=_LOW, takes_pd=True) -> float | None:
  """Checks the arguments of the attention softmax-dropout-value backward.
  ``takes_pd=False``: a backward without Pd (``attn_weights_dropped`` is not checked).

  Returns the dropout rate as a float, or ``None`` when it is traced.
  """
  _check_rows_and_value("attn_weights", attn_weights, value_states, dtypes)
  b, h, sq, skv = attn_weights.shape
  d = value_states.shape[3]
  check_array("grad_attn_output", grad_attn_output, ("B", "Sq", "H", "D"), (b, sq, h, d),
              dtypes=(attn_weights.dtype,))
  if takes_pd:
    check_array("attn_weights_dropped", attn_weights_dropped, ("B", "H", "Sq", "Skv"),
                attn_weights.shape, dtypes=(attn_weights.dtype,))
  p = check_dropout_rate("attention_dropout", attention_dropout)
  if p != 0.0:  # a rate of exactly 0 never reads the dropout mask, so it may be None
    check_array("dropout_mask", dropout_mask, ("B", "H", "Sq", "Skv"), attn_weights.shape,
                dtypes=(jnp.bool_,))
  return p


def mask_broadcasts(shape, full) -> bool:
  """Whether an attention mask of ``shape`` broadcasts to ``full`` (numpy rules: rank at
  most ``len(full)``, each dimension, aligned right, 1 or the full size)."""
  shape = tuple(shape)
  return len(shape) <= len(full) and all(
      m in (1, f) for m, f in zip(reversed(shape), reversed(tuple(full))))


def check_mask(mask, b: int, sq: int, sk: int) -> None:
  """``mask``: bool, ``[B, 1, Sq, Sk]`` or a shape that broadcasts to it (rank <= 4, each
  dimension, aligned right, 1 or that size: ``[B, 1, 1, Sk]``, ``[Sq, Sk]``, ``[Sk]``,
  ``[1, 1, Sq, Sk]``, ``[B, 1, Sq, 1]``, ...)."""
  axes = ("B", "1", "Sq", "Sk")
  full = (b, 1, sq, sk)
  if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
    raise TypeError(f"mask: expected an array of shape {_fmt(axes)} or one that broadcasts "
                    f"to it, got {type(mask).__name__}")
  if not mask_broadcasts(mask.shape, full):
    raise ValueError(f"mask: expected {_fmt(axes)} = {_fmt(full)} or a shape that broadcasts "
                     f"to it (rank <= 4, each dimension 1 or that size), got {_fmt(mask.shape)}")
  check_array("mask", mask, axes[4 - mask.ndim:], dtypes=(jnp.bool_,))


def check_scores_and_mask(scores, mask, *, dtypes=_LOW) -> None:
  """Checks the inputs of the masked softmax-dropout forward: ``scores``
  ``[B, H, Sq, Sk]`` float, ``mask`` bool that broadcasts to ``[B, 1, Sq, Sk]``
  (:func:`check_mask`)."""
  check_array("scores", scores, ("B", "H", "Sq", "Sk"), dtypes=dtypes)
  check_positive("scores", scores, ("B", "H", "Sq", "Sk"))
  b, _, sq, sk = scores.shape
  check_mask(mask, b, sq, sk)


def check_scores_and_value(scores, value_states, *, dtypes=_LOW) -> None:
  """Checks the inputs of the attention softmax-dropout-value forward: ``scores``
  ``[B, H, Sq, Skv]`` float, ``value_states`` ``[B, KVH, Skv, D]`` of its dtype, ``H``
  a multiple of ``KVH``."""
  _check_rows_and_value("scores", scores, value_states, dtypes)


def _check_rows_and_value(name, rows, value_states, dtypes) -> None:
  """``rows`` (named ``name``) ``[B, H, Sq, Skv]`` of a float dtype in ``dtypes``, and
  ``value_states`` ``[B, KVH, Skv, D]`` of its dtype with ``H`` a multiple of ``KVH``."""
  check_array(name, rows, ("B", "H", "Sq", "Skv"), dtypes=dtypes)
  check_positive(name, rows, ("B", "H", "Sq", "Skv"))
  b, h, _, skv = rows.shape
  check_array("value_states", value_states, ("B", "KVH", "Skv", "D"), (b, None, skv, None),
              dtypes=(rows.dtype,))
  check_positive("value_states", value_states, ("B", "KVH", "Skv", "D"))
  check_divisible(h, value_states.shape[1])


def check_masked_softmax_dropout(grad_output, p_attn, mask, dropout_mask, p_dropout, *,
                                 dtypes=_LOW, rows_name="p_attn") -> float | None:
  """Checks the arguments of the masked softmax-dropout backward; ``rows_name`` names the
  ``[B, H, Sq, Sk]`` rows ``p_attn`` in the errors (``"scores"`` for the backward that
  recomputes P from them)."""
  axes = ("B", "H", "Sq", "Sk")
  check_array(rows_name, p_attn, axes, dtypes=dtypes)
  check_positive(rows_name, p_attn, axes)
  check_array("grad_output", grad_output, axes, dtypes=(p_attn.dtype,))
  if grad_output.shape != p_attn.shape:
    # Blame the one that disagrees with the attention mask (B, Sq, Sk); if the mask does
    # not settle it, p_attn is taken as the reference shape.
    mask_shape = tuple(getattr(mask, "shape", ()))
    def fits(x):
      return mask_broadcasts(mask_shape, (x.shape[0], 1, x.shape[2], x.shape[3]))
    if fits(grad_output) and not fits(p_attn):
      check_array(rows_name, p_attn, axes, grad_output.shape)
    check_array("grad_output", grad_output, axes, p_attn.shape)
  b, h, sq, sk = p_attn.shape
  check_mask(mask, b, sq, sk)
  p = check_dropout_rate("p_dropout", p_dropout)
  if p != 0.0:  # a rate of exactly 0 never reads the dropout mask, so it may be None
    check_array("dropout_mask", dropout_mask, ("B", "H", "Sq", "Sk"), p_attn.shape,
                dtypes=(jnp.bool_,))
  return p


def check_query_and_key(query, key, *, dtypes=_LOW) -> None:
  """Checks the inputs of the QK-scale-softmax forward: ``query``
  ``[B, H, Sq, D]`` float, ``key`` ``[B, H, Sk, D]`` of its dtype."""
  check_array("query", query, ("B", "H", "Sq", "D"), dtypes=dtypes)
  check_positive("query", query, ("B", "H", "Sq", "D"))
  b, h, _, d = query.shape
  check_array("key", key, ("B", "H", "Sk", "D"), (b, h, None, d), dtypes=(query.dtype,))
  check_positive("key", key, ("B", "H", "Sk", "D"))


def check_qk_scale_softmax(grad_output, query, key, attn_weights, scaling, *,
                           dtypes=_LOW) -> float | None:
  """Checks the arguments of the qk_scale_softmax backward; returns the scale as a float
  (``None`` when traced)."""
  check_query_and_key(query, key, dtypes=dtypes)
  b, h, sq, d = query.shape
  sk = key.shape[2]
  check_array("attn_weights", attn_weights, ("B", "H", "Sq", "Sk"), (b, h, sq, sk),
              dtypes=(query.dtype,))
  check_array("grad_output", grad_output, ("B", "H", "Sq", "Sk"), (b, h, sq, sk),
              dtypes=(query.dtype,))
  return check_scaling("scaling", scaling)
