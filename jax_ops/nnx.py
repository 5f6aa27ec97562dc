"""Flax NNX attention layers built on the ops (the ``[flax]`` extra).

Each layer projects ``x [B, S, E]`` to heads, runs one of the ops, and projects
back to ``[B, S, E]``. Dropout keys come from the ``dropout`` stream of the
``nnx.Rngs`` given at construction; ``deterministic=True`` (at construction or
per call) turns dropout off. ``implementation`` and ``interpret`` pass through
to the op (see :mod:`jax_ops`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

try:
  from flax import nnx
except ImportError as e:
  raise ImportError("jax_ops.nnx needs flax, which the [flax] extra installs: "
                    "pip install 'attention-backward-kernels[flax]'") from e

from jax_ops.ops.attention_softmax_dropout_value.api import attention_softmax_dropout_value
from jax_ops.ops.masked_softmax_dropout.api import masked_softmax_dropout
from jax_ops.ops.qk_scale_softmax.api import qk_scale_softmax
from jax_ops._common import FLOATS
from pallas_kernels import validation


def _check_layer(embed_dim, num_heads, num_kv_heads, head_dim, dropout_rate=0.0, op_dtype=None):
  """The sizes are ints >= 1 and ``num_kv_heads`` divides ``num_heads``; ``dropout_rate`` is
  a rate in [0, 1); ``op_dtype`` (the dtype a layer hands its op) is one the ops take: a
  layer is checked when it is built, not at its first call."""
  for name, v in (("embed_dim", embed_dim), ("num_heads", num_heads),
                  ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
  validation.check_dropout_rate("dropout_rate", dropout_rate)
  if op_dtype is not None and jnp.dtype(op_dtype) not in map(jnp.dtype, FLOATS):
    raise TypeError(f"dtype: expected bfloat16, float16 or float32 (the op's dtypes), got "
                    f"{jnp.dtype(op_dtype).name}")


class _Projections(nnx.Module):
  def __init__(self, embed_dim, num_heads, num_kv_heads, head_dim, *, rngs, dtype):
    self.embed_dim = embed_dim
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    linear = lambda n: nnx.Linear(embed_dim, n * head_dim, use_bias=False, dtype=dtype, rngs=rngs)
    self.query, self.key, self.value = linear(num_heads), linear(num_kv_heads), linear(num_kv_heads)
    self.out = nnx.Linear(num_heads * head_dim, embed_dim, use_bias=False, dtype=dtype, rngs=rngs)

  def check(self, x):
    """``x`` must be ``[B, S, E]`` with the layer's embedding width, a float array (the
    projections compute in the layer's ``dtype``; float64 too, under x64)."""
    validation.check_array("x", x, ("B", "S", "E"), (None, None, self.embed_dim),
                           dtypes=(jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64))
    validation.check_positive("x", x, ("B", "S", "E"))
    return x.shape[0], x.shape[1]

  def heads(self, x, proj, n):
    b, s, _ = x.shape
    return proj(x).reshape(b, s, n, self.head_dim).transpose(0, 2, 1, 3)  # [B, n, S, D]

  def merge(self, out_bshd):
    b, s = out_bshd.shape[:2]
    return self.out(out_bshd.reshape(b, s, self.num_heads * self.head_dim))


def _check_mask(mask, b, s, num_heads, *, heads_axis):
  """Raises unless ``mask`` is a bool array that broadcasts to ``[B, 1, S, S]``
  (``heads_axis=False``) or ``[B, H, S, S]`` (``[S, S]``, ``[B, 1, 1, S]`` padding masks,
  ...); the layers pass it on as given, never broadcast."""
  if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
    raise TypeError(f"mask: expected a bool array, got {type(mask).__name__}")
  validation.check_dtype("mask", mask, (jnp.bool_,))
  full = (b, num_heads if heads_axis else 1, s, s)
  if not heads_axis and mask.ndim == 4 and mask.shape[1] != 1:
    raise ValueError(f"mask: expected [B, 1, Sq, Sk] = [{b}, 1, {s}, {s}] (one mask for all "
                     f"heads, or a shape that broadcasts to it), got {list(mask.shape)}")
  try:
    ok = jnp.broadcast_shapes(mask.shape, full) == full
  except ValueError:
    ok = False
  if not ok:
    want = f"[B, H, S, S] = [{b}, {num_heads}, {s}, {s}]" if heads_axis else \
        f"[B, 1, S, S] = [{b}, 1, {s}, {s}]"
    raise ValueError(f"mask: expected a shape that broadcasts to {want}, got {list(mask.shape)}")


def _dropout_args(layer, deterministic):
  off = layer.deterministic if deterministic is None else deterministic
  if off or layer.dropout_rate == 0.0:
    return {"dropout_rate": 0.0, "dropout_rng": None}
  return {"dropout_rate": layer.dropout_rate, "dropout_rng": layer.rngs.dropout()}


class GQASelfAttention(nnx.Module):
  """Grouped-query self-attention on :func:`jax_ops.attention_softmax_dropout_value`.

  ``x [B, S, E]`` -> ``[B, S, E]``; ``num_heads % num_kv_heads == 0``. Scores
  ``q @ k^T / sqrt(D)`` are formed in ``dtype`` (bf16 by default, as in the models
  this op comes from); the op runs softmax in fp32, dropout and the GQA value matmul.
  """

  def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               dropout_rate: float = 0.0, deterministic: bool = False,
               dtype: jax.typing.DTypeLike = jnp.bfloat16, implementation: str | None = None,
               interpret: bool = False, rngs: nnx.Rngs) -> None:
    _check_layer(embed_dim, num_heads, num_kv_heads, head_dim, dropout_rate, op_dtype=dtype)
    self.proj = _Projections(embed_dim, num_heads, num_kv_heads, head_dim, rngs=rngs, dtype=dtype)
    self.dropout_rate, self.deterministic, self.rngs = dropout_rate, deterministic, rngs
    self.implementation, self.interpret = implementation, interpret

  def __call__(self, x: jax.typing.ArrayLike, mask: jax.typing.ArrayLike | None = None, *,
               deterministic: bool | None = None) -> jax.Array:
    """``x [B, S, E]``; ``mask`` (optional) bool, broadcastable to ``[B, H, S, S]``,
    True = attend (e.g. ``jax_ops.causal_mask(S, S)``)."""
    p = self.proj
    b, s = p.check(x)
    if mask is not None:
      _check_mask(mask, b, s, p.num_heads, heads_axis=True)
    q, k = p.heads(x, p.query, p.num_heads), p.heads(x, p.key, p.num_kv_heads)
    v = p.heads(x, p.value, p.num_kv_heads)
    k = jnp.repeat(k, p.num_heads // p.num_kv_heads, axis=1)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(p.head_dim)
    if mask is not None:
      scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    out = attention_softmax_dropout_value(
        scores, v, implementation=self.implementation, interpret=self.interpret,
        **_dropout_args(self, deterministic))
    return p.merge(out)


class MaskedAttention(nnx.Module):
  """Multi-head attention on :func:`jax_ops.masked_softmax_dropout` (fp32 softmax).

  ``x [B, S, E]``, ``mask`` bool (True = attend), one for all heads: ``[B, 1, S, S]`` or any
  shape that broadcasts to it (``[B, 1, 1, S]`` padding masks, ``[S, S]``) -> ``[B, S, E]``.
  """

  def __init__(self, embed_dim: int, num_heads: int, head_dim: int, *,
               dropout_rate: float = 0.0, deterministic: bool = False,
               dtype: jax.typing.DTypeLike = jnp.float32, implementation: str | None = None,
               interpret: bool = False, rngs: nnx.Rngs) -> None:
    _check_layer(embed_dim, num_heads, num_heads, head_dim, dropout_rate)
    self.proj = _Projections(embed_dim, num_heads, num_heads, head_dim, rngs=rngs, dtype=dtype)
    self.dropout_rate, self.deterministic, self.rngs = dropout_rate, deterministic, rngs
    self.implementation, self.interpret = implementation, interpret

  def __call__(self, x: jax.typing.ArrayLike, mask: jax.typing.ArrayLike, *,
               deterministic: bool | None = None) -> jax.Array:
    p = self.proj
    b, s = p.check(x)
    # Checked here (the layer's errors), passed on as given: the op reads a broadcast mask
    # through its own shape, never materialized.
    _check_mask(mask, b, s, p.num_heads, heads_axis=False)
    q, k, v = (p.heads(x, f, p.num_heads) for f in (p.query, p.key, p.value))
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) / math.sqrt(p.head_dim)
    probs = masked_softmax_dropout(
        scores, mask, implementation=self.implementation, interpret=self.interpret,
        **_dropout_args(self, deterministic))
    return p.merge(jnp.einsum("bhqk,bhkd->bqhd", probs.astype(v.dtype), v))


class QKSoftmaxAttention(nnx.Module):
  """Multi-head attention whose weights come from :func:`jax_ops.qk_scale_softmax`.

  ``x [B, S, E]`` -> ``[B, S, E]``; ``causal=True`` masks future keys (and the
  Pallas backward then skips the tiles above the diagonal).
  """

  def __init__(self, embed_dim: int, num_heads: int, head_dim: int, *, causal: bool = False,
               dtype: jax.typing.DTypeLike = jnp.bfloat16, implementation: str | None = None,
               interpret: bool = False, rngs: nnx.Rngs) -> None:
    _check_layer(embed_dim, num_heads, num_heads, head_dim, op_dtype=dtype)
    self.proj = _Projections(embed_dim, num_heads, num_heads, head_dim, rngs=rngs, dtype=dtype)
    self.causal, self.implementation, self.interpret = causal, implementation, interpret

  def __call__(self, x: jax.typing.ArrayLike) -> jax.Array:
    p = self.proj
    p.check(x)
    q, k, v = (p.heads(x, f, p.num_heads) for f in (p.query, p.key, p.value))
    weights = qk_scale_softmax(q, k, causal=self.causal, implementation=self.implementation,
                                   interpret=self.interpret)
    return p.merge(jnp.einsum("bhqk,bhkd->bqhd", weights, v,
                              preferred_element_type=jnp.float32).astype(v.dtype))
