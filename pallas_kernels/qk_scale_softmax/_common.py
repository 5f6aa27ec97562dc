"""What the qk_scale_softmax backward kernels share: ``dL`` in either form and the row sums
it needs (the Triton schemes and the Mosaic GPU kernel), and the tile ranges of a causal
``P`` (Triton).

Two forms of ``dL`` (``renormalize``):

- ``False``, the spec: ``delta = sum_j g_ij P_ij``, ``dL = dtype(dtype(P (g - delta)) * s)``.
- ``True``: a row whose sum is within :data:`RENORM_BAND` of 1 is corrected to sum to 1,
  ``P' = P (1 + r P)`` with ``r = (1 - sum_j P_ij) / sum_j P_ij^2`` (``r = 0`` elsewhere),
  ``delta = sum_j g_ij P'_ij`` and ``dL = dtype(s P' (g - delta))``, rounded once. A rounded
  P loses ``g - delta`` on a sharp row (``P_ii`` rounds to 1); the correction keeps it.

A row's sums travel as a tuple: ``(sum gP,)`` or ``(sum gP, sum gP^2, sum P, sum P^2)``
(:func:`row_sums`); :func:`row_stats` turns them into what :func:`dl_tile` takes,
``(delta,)`` or ``(delta, r)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

F32 = jnp.float32
I32 = jnp.int32
SUPPORTED = (jnp.bfloat16, jnp.float16, jnp.float32)
# Index arithmetic is int32 throughout. A static start that is a Python int would become
# int64 under x64 (jax_enable_x64) next to the int32 program ids; this one stays int32.
ZERO = np.int32(0)


def round_to(x, dtype):
  """``x`` (fp32) rounded to nearest-even in ``dtype``, returned as fp32.

  For bf16 the value goes through a real conversion (``cvt.rn``) and comes back by a
  bitcast and a shift: a plain ``truncf``/``extf`` pair can be folded away by the compiler
  (the kernel then keeps fp32 precision and misses the reference's roundings), a bitcast
  cannot.
  """
  if dtype == jnp.bfloat16:
    half = jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return jax.lax.bitcast_convert_type(half.astype(jnp.uint32) << 16, F32)
  return x.astype(dtype).astype(F32)


# A row is renormalized where its sum is within this of 1 (bf16 rounds each element by at
# most 2**-9 relative; a row further off is not a rounded softmax row, e.g. a causal row of
# no keys, and is left as it is).
RENORM_BAND = 2.0 ** -6


def dl_tile(g, p, stats, scale, dtype, *, broadcast=None, rounding=round_to):
  """``dL`` of a ``[rows, keys]`` tile from its row stats (:func:`row_stats`), as the
  reference computes it: ``dtype(dtype(P (g - delta)) * s)`` (spec) or
  ``dtype(s P (1 + r P) (g - delta))`` (renormalized).

  The last rounding is the conversion the matmul operand needs anyway; ``rounding`` is the
  spec's first (fp32 -> dtype -> fp32). ``broadcast`` spreads a row vector over the tile
  (default ``v[:, None]``)."""
  col = broadcast or (lambda v: v[:, None])
  p = p.astype(F32)
  g = g.astype(F32)
  if len(stats) == 1:
    d_l = rounding(p * (g - col(stats[0])), dtype)
    return (d_l * scale).astype(dtype)
  delta, r = stats
  return ((p + col(r) * (p * p)) * (g - col(delta)) * scale).astype(dtype)


def row_sums(g, p, renormalize: bool):
  """The row sums of a ``[rows, keys]`` tile, in fp32: ``(sum gP,)``, and with
  ``renormalize`` also ``sum gP^2``, ``sum P`` and ``sum P^2``."""
  g = g.astype(F32)
  p = p.astype(F32)
  gp = g * p
  if not renormalize:
    return (jnp.sum(gp, axis=1),)
  return (jnp.sum(gp, axis=1), jnp.sum(gp * p, axis=1), jnp.sum(p, axis=1),
          jnp.sum(p * p, axis=1))


def zero_sums(rows: int, renormalize: bool):
  """:func:`row_sums`'s zeros, the start of a sum over key tiles."""
  return tuple(jnp.zeros((rows,), F32) for _ in range(4 if renormalize else 1))


def add_sums(a, b):
  return tuple(x + y for x, y in zip(a, b))


def row_stats(sums):
  """``(delta,)`` from the spec's sums, or ``(delta, r)`` from the renormalized form's."""
  if len(sums) == 1:
    return sums
  gp, gpp, total, squares = sums
  deficit = 1.0 - total
  near = jnp.abs(deficit) <= RENORM_BAND
  r = jnp.where(near, deficit, 0.0) / jnp.where(near, squares, 1.0)
  return gp + r * gpp, r


def whole_row_stats(g, p, renormalize: bool):
  """:func:`row_stats` of a tile that holds whole rows."""
  return row_stats(row_sums(g, p, renormalize))


# With causal=True, P_ij may be non-zero only for j <= i + (Sk - Sq). These helpers give
# the tile ranges that intersect that region; they work on Python ints and traced int32
# scalars alike.


def row_num_k_tiles(qi, seq_q: int, seq_k: int, block_q: int, block_k: int):
  """Row tile ``qi`` only meets key tiles ``[0, n)``; ``n`` may be 0 (rows with no keys)."""
  last_row = jnp.minimum((qi + 1) * block_q, seq_q) - 1
  last_col = last_row + (seq_k - seq_q)  # the row's last possibly non-zero key
  return jnp.clip((last_col + block_k) // block_k, 0, pl.cdiv(seq_k, block_k))


def col_first_q_tile(kj, seq_q: int, seq_k: int, block_q: int, block_k: int):
  """Key tile ``kj`` only meets query tiles ``[lo, cdiv(Sq, block_q))`` (empty if lo == end)."""
  first_row = jnp.maximum(kj * block_k - (seq_k - seq_q), 0)  # first row reaching column kj*bk
  return jnp.minimum(first_row // block_q, pl.cdiv(seq_q, block_q))


def row_num_full_k_tiles(qi, seq_q: int, seq_k: int, block_q: int, block_k: int):
  """Key tiles ``[0, n)`` lie wholly on or below the diagonal for every row of tile ``qi``
  (they need no element-wise causal mask); ``n <= row_num_k_tiles(...)``."""
  allowed = qi * block_q + (seq_k - seq_q) + 1  # keys the tile's first row may see
  return jnp.clip(allowed // block_k, 0, row_num_k_tiles(qi, seq_q, seq_k, block_q, block_k))


def col_first_full_q_tile(kj, seq_q: int, seq_k: int, block_q: int, block_k: int):
  """Query tiles ``[m, cdiv(Sq, block_q))`` see every column of key tile ``kj`` (no
  element-wise causal mask needed); ``m >= col_first_q_tile(...)``."""
  need = kj * block_k + block_k - 1 - (seq_k - seq_q)  # first row that sees the last column
  first = -((-need) // block_q)  # ceil, also for negative values
  return jnp.clip(first, col_first_q_tile(kj, seq_q, seq_k, block_q, block_k),
                  pl.cdiv(seq_q, block_q))
