"""The dropout mask's hash, shared by the jnp reference (``jax_ops.dropout_keep_mask``) and
the kernels that draw the mask themselves: the same uint32 arithmetic, bit for bit.

For element ``(n, r, c)`` of an array ``[..., rows, cols]`` (``n`` the row-major index over
the leading dimensions), with ``(k0, k1) = jax.random.bits(rng, (2,), uint32)``::

  K    = mix32(mix32(n * GOLDEN + k1) ^ k0)                 (once per leading index)
  h    = mix32((r * ceil(cols / 2) + c // 2) ^ K)
  u    = (h >> (16 * (c % 2))) & 0xFFFF
  keep = u >= round(rate * 2**16)          (the threshold at most 2**16 - 1)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import validation

RATE_BITS = 16                     # the rate is rounded to a multiple of 2**-16
RATE_STEPS = 1 << RATE_BITS
GOLDEN = np.uint32(0x9E3779B9)


def mix32(x):
  """A 32-bit integer mixer (lowbias32: two multiply-xorshift rounds), full avalanche.
  ``x``: uint32 (array or kernel value)."""
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x7FEB352D)
  x = x ^ (x >> np.uint32(15))
  x = x * np.uint32(0x846CA68B)
  return x ^ (x >> np.uint32(16))


def slice_key(k0, k1, n):
  """``K``, the key of the ``[rows, cols]`` slice of leading index ``n``: a scalar in a
  kernel program that owns one slice, so that each pair of elements costs one mixer."""
  return mix32(mix32(n * GOLDEN + k1) ^ k0)


def keyed_pair_hash32(key, r, pair, cols: int):
  """The hash ``h`` of the element pairs ``(r, pair)`` of the slice of key ``key``
  (:func:`slice_key`): columns ``2 * pair`` and ``2 * pair + 1``, whose 16 bits ``u`` are
  its low and high halves (uint32 values that broadcast together)."""
  pairs = np.uint32((cols + 1) // 2)
  return mix32((r * pairs + pair) ^ key)


def pair_hash32(k0, k1, n, r, pair, cols: int):
  """:func:`keyed_pair_hash32` of the slice of leading index ``n``."""
  return keyed_pair_hash32(slice_key(k0, k1, n), r, pair, cols)


def keyed_bits16(key, r, c, cols: int):
  """The 16 bits ``u`` of elements ``(r, c)`` of the slice of key ``key`` (uint32 values
  that broadcast together)."""
  h = keyed_pair_hash32(key, r, c >> np.uint32(1), cols)
  return (h >> ((c & np.uint32(1)) * np.uint32(16))) & np.uint32(0xFFFF)


def bits16(k0, k1, n, r, c, cols: int):
  """The 16 bits ``u`` of elements ``(n, r, c)`` (uint32 values that broadcast together)."""
  return keyed_bits16(slice_key(k0, k1, n), r, c, cols)


def tile_bits16(k0, k1, n, r, c0, width: int, cols: int, *, pairs: bool):
  """:func:`bits16` of the ``width`` columns ``c0, ..., c0 + width - 1`` of rows ``r``
  (uint32 ``[R, 1]``): ``[R, width]`` uint32. ``c0``: a uint32 scalar, traced or not.

  ``pairs``: one hash per pair of columns, its two 16-bit halves interleaved (in a Triton
  kernel a join and a reshape) instead of one hash per element; the same bits. It needs an
  even ``c0`` (checked when ``c0`` is concrete; a kernel whose tiles start at multiples of
  their even width has one) and applies to even widths only: an odd ``width`` hashes per
  element."""
  if pairs and width % 2 == 0:
    if isinstance(c0, (int, np.integer)) and int(c0) % 2:
      raise ValueError(f"c0: a tile hashed by pairs of columns starts at an even column, "
                       f"got {int(c0)}")
    pair = (c0 >> np.uint32(1)) + jnp.arange(width // 2, dtype=jnp.uint32)[None, :]
    h = pair_hash32(k0, k1, n, r, pair, cols)
    halves = jnp.stack([h & np.uint32(0xFFFF), h >> np.uint32(16)], axis=-1)
    return halves.reshape(h.shape[0], width)
  return bits16(k0, k1, n, r, c0 + jnp.arange(width, dtype=jnp.uint32)[None, :], cols)


def rate_threshold(rate):
  """The threshold ``round(rate * 2**16)`` (at most ``2**16 - 1``), of the rate in fp32
  (rounded half to even) whether it is a Python number or traced, so that an eager call
  and a jitted one draw the same mask: a Python int for a Python float, else a uint32 array
  (0 for a NaN rate)."""
  if isinstance(rate, (int, float)):
    return min(int(np.round(np.float32(rate) * np.float32(RATE_STEPS))), RATE_STEPS - 1)
  rate = jnp.asarray(rate, jnp.float32)
  t = jnp.clip(jnp.round(rate * RATE_STEPS), 0, RATE_STEPS - 1)
  return jnp.where(jnp.isnan(t), 0, t).astype(jnp.uint32)


def effective_rate(rate):
  """The rate the mask draws: ``rate`` rounded to a multiple of ``2**-16``. A Python float
  gives a Python float; a NaN stays NaN."""
  if isinstance(rate, (int, float)):
    return rate_threshold(rate) / RATE_STEPS
  rate = jnp.asarray(rate, jnp.float32)
  return jnp.where(jnp.isnan(rate), rate,
                   rate_threshold(rate).astype(jnp.float32) / RATE_STEPS)


def key_words(rng, name="dropout_rng"):
  """``(k0, k1)``: the two uint32 words of a PRNG key that the hash takes; ``TypeError``
  naming ``name`` unless ``rng`` is one key."""
  validation.check_key(name, rng)
  return jax.random.bits(rng, (2,), jnp.uint32)


def seeds(rng, rate):
  """``[k0, k1, threshold]`` (uint32): what a kernel that draws the mask reads."""
  k0, k1 = key_words(rng)
  return jnp.stack([k0, k1, jnp.asarray(rate_threshold(rate), jnp.uint32)])


def kernel_args(dropout_rate, dropout_rng):
  """``(dropout, seeds, scale)`` for a forward kernel that draws the mask: whether a mask is
  drawn (a rate that may be > 0), the key's ``[k0, k1, threshold]`` (:func:`seeds`) and
  ``[1 / (1 - p)]`` in fp32 of the rate drawn (NaN for an invalid traced rate). Checks the
  rate (``ValueError`` naming ``dropout_rate``) and that a key comes with a rate > 0."""
  p_static = validation.check_dropout_rate("dropout_rate", dropout_rate)
  if p_static == 0.0:
    return False, jnp.zeros((3,), jnp.uint32), jnp.ones((1,), jnp.float32)
  if dropout_rng is None:
    raise ValueError("dropout_rng: a dropout_rate that may be > 0 needs a PRNG key")
  rate = jnp.asarray(dropout_rate, jnp.float32)
  p = effective_rate(rate)
  scale = validation.nan_unless_rate_valid(rate, 1.0 / (1.0 - p)).reshape(1)
  return True, seeds(dropout_rng, rate), scale
