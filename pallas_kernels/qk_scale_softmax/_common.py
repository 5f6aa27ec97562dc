"""What the Triton schemes of the qk_scale_softmax backward share: ``dL`` rounded as the
reference rounds it, the row sums ``delta``, and the tile ranges of a causal ``P``."""

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


def dl_tile(g, p, delta, scale, dtype):
  """``dL = dtype(dtype(P * (g - delta)) * scaling)``, exactly the reference's roundings.

  The second rounding is the conversion the matmul operand needs anyway."""
  d_l = round_to(p.astype(F32) * (g.astype(F32) - delta[:, None]), dtype)
  return (d_l * scale).astype(dtype)


def row_delta(g, p):
  """``sum_j g_ij * P_ij`` of a ``[rows, keys]`` tile, in fp32."""
  return jnp.sum(g.astype(F32) * p.astype(F32), axis=1)


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
