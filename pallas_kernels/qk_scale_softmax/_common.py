"""What the Triton schemes of the qk_scale_softmax backward share: ``dL`` rounded as the
reference rounds it or in the accurate form, the row sums ``delta``, and the tile ranges of
a causal ``P``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels._util import dot

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


# ``accurate=True`` (the entry points' option; the differentiable op's backward), two
# changes to the reference's dL, both for what the bf16 rounding loses:
# - P arrives rounded to the input dtype; with a sharp softmax P_ii rounds to 1 and
#   ``g - delta`` cancels to rounding noise. Where a row of P sums to 1 within its rounding
#   (a softmax), it is corrected to sum to 1, each entry taking a share of the missing mass
#   proportional to P_ij^2 (the least-squares correction of relative rounding errors):
#     P'_ij = P_ij * (1 + r_i * P_ij),   r_i = (1 - sum_j P_ij) / sum_j P_ij^2,
#   and ``delta = sum_j g_ij P'_ij = sum_j g_ij P_ij + r_i * sum_j g_ij P_ij^2``: four row
#   sums, no extra loads. Rows further than MAX_MISSING from 1 (not a rounded softmax;
#   all-zero rows) keep r = 0.
# - dL = scaling * P' * (g - delta) stays fp32 until the GEMMs, which take it as two 16-bit
#   operands, hi = dtype(dL) and lo = dtype(dL - hi) (two MMAs per tile, as autodiff of a
#   jnp forward keeps dL in fp32 for its GEMMs).
MAX_MISSING = 2.0 ** -6


def row_sums(g, p, accurate: bool):
  """The row sums of a ``[rows, keys]`` tile that :func:`row_stats` needs, in fp32:
  ``(sum g P,)``, or with ``accurate`` ``(sum g P, sum g P^2, sum P, sum P^2)``."""
  g = g.astype(F32)
  p = p.astype(F32)
  gp = g * p
  if not accurate:
    return (jnp.sum(gp, axis=1),)
  return (jnp.sum(gp, axis=1), jnp.sum(gp * p, axis=1), jnp.sum(p, axis=1),
          jnp.sum(p * p, axis=1))


def zero_sums(rows: int, accurate: bool):
  """:func:`row_sums`'s zeros, to accumulate over key tiles."""
  return tuple(jnp.zeros((rows,), F32) for _ in range(4 if accurate else 1))


def add_sums(a, b):
  return tuple(x + y for x, y in zip(a, b))


def row_stats(sums):
  """``(delta, r)`` of a row from its whole-row :func:`row_sums`: ``delta = sum g P`` and
  ``r = None`` (the reference form), or the accurate form's ``delta = sum g P'`` and ``r``."""
  if len(sums) == 1:
    return sums[0], None
  s_gp, s_gp2, s_p, s_p2 = sums
  missing = 1.0 - s_p
  ok = (jnp.abs(missing) <= MAX_MISSING) & (s_p2 > 0)
  r = jnp.where(ok, missing / jnp.where(ok, s_p2, 1.0), 0.0)
  return s_gp + r * s_gp2, r


def dl_tile(g, p, delta, r, scale, dtype):
  """``dL`` of a tile (``delta``, ``r`` per row from :func:`row_stats`) as the GEMMs'
  operands, a tuple. ``r is None``: ``(dtype(dtype(P * (g - delta)) * scaling),)``, exactly
  the reference's roundings (the last one is the conversion the matmul operand needs
  anyway). Else the accurate form: ``d = scaling * P * (1 + r P) * (g - delta)`` in fp32,
  as ``(hi, lo)`` with ``hi = dtype(d)``, ``lo = dtype(d - hi)`` (``(d,)`` for fp32)."""
  p = p.astype(F32)
  if r is not None:
    p = p * (1.0 + r[:, None] * p)
  d_l = p * (g.astype(F32) - delta[:, None])
  if r is None:
    return ((round_to(d_l, dtype) * scale).astype(dtype),)
  return split(d_l * scale, dtype)


def split(x, dtype, rounded=round_to):
  """``x`` (fp32) as ``(hi, lo)`` in ``dtype``, ``hi + lo`` within ``dtype``'s rounding of
  ``x - hi``; ``(x,)`` when ``dtype`` is fp32. ``rounded(x, dtype)``: ``x`` rounded to
  ``dtype``, in fp32, in a form the compiler does not fold away (else ``lo`` becomes 0)."""
  if jnp.dtype(dtype) == jnp.dtype(F32):
    return (x,)
  hi = rounded(x, dtype)
  return hi.astype(dtype), (x - hi).astype(dtype)


def dot_parts(parts, x, *, trans_a: bool = False):
  """``sum(part @ x)`` over :func:`dl_tile`'s operands, fp32 accumulation."""
  out = dot(parts[0], x, trans_a=trans_a)
  for part in parts[1:]:
    out += dot(part, x, trans_a=trans_a)
  return out


def row_delta(g, p, accurate: bool = False):
  """``(delta, r)`` (:func:`row_stats`) of a tile of whole rows."""
  return row_stats(row_sums(g, p, accurate))


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
