"""Pallas Triton kernels for the backward of ``softmax((Q @ K^T) * scaling)``.

Given the softmax output ``P`` and its incoming gradient ``g`` (both ``[B, H, Sq, Sk]``),
the gradients of ``Q`` (``[B, H, Sq, D]``) and ``K`` (``[B, H, Sk, D]``) are::

  delta_i    = sum_j g_ij * P_ij                            (fp32)
  dL_ij      = dtype(dtype(P_ij * (g_ij - delta_i)) * scaling)
  grad_query = dL @ K
  grad_key   = dL^T @ Q

All arrays share one dtype: bf16 (the target), fp16 or fp32. ``delta`` is a full-row
reduction that every ``dL`` element needs, and ``dL`` must be rounded exactly as the
reference rounds it (the one-pass algebra ``dQ = s * ((P*g) @ K - delta * (P @ K))`` misses
the accuracy bar). ``dL`` (``Sq x Sk`` per head) reaches memory only in the ``"dl_gemm"``
scheme (a buffer the size of ``P``). The kernels are:

1. ``"two_pass"`` scheme. **Row kernel** (grid ``(cdiv(Sq, block_q), B*H)``): a program
   owns ``block_q`` rows; pass 1 sums ``delta`` over the row's key tiles, pass 2 walks them
   again newest first (the likeliest still in L2), forms ``dL`` and accumulates
   ``dL @ K_j``; it stores ``grad_query`` and ``delta`` (``[B*H, Sq]`` fp32). A row of one
   key tile fuses the passes (``g`` and ``P`` read once). Rows of ``Sk % 8 != 0`` keys take
   16-byte aligned tiles of every ``align``-th row (``pallas_kernels._phase``).
   **Column kernel** (grid ``(cdiv(Sk, block_k), B*H)``): a program owns ``block_k`` keys,
   rebuilds ``dL`` from ``g``, ``P`` and ``delta`` over the query tiles and accumulates
   ``dL^T @ Q_i``.
2. ``"per_head"`` scheme (rows of <= 512 keys): one program per head walks its query tiles
   (whole rows each), forms ``delta``, ``dL`` and ``grad_query`` from one read of ``g`` and
   ``P``, and keeps ``grad_key`` (``[Sk, D]`` fp32) in registers until the end.
3. ``"dl_gemm"`` scheme: a row kernel writes ``dL`` (whole rows in registers, ``g`` and
   ``P`` read once), then one Triton launch computes ``grad_query = dL @ K`` and
   ``grad_key = dL^T @ Q`` (a program per output tile of either; ``DlConfig.gemm``, or XLA's
   batched GEMMs with ``gemm=None``; or one Mosaic GPU launch with ``DlConfig.mosaic_gemm``,
   :mod:`.gemm_mosaic_gpu`): 10 B per element in bf16. Causal calls read ``g`` and ``P``
   only up to the diagonal; with the Triton GEMMs (which skip the tiles wholly above it) the
   ``dL`` kernel writes 0 only up to their tile boundary past the diagonal and pairs a short
   and a long block of rows per program, or (``DlConfig.classes``) takes the rows in
   classes of halving lengths, about half the dense bytes (the H200 table's choice for
   causal rows of more than 128 keys); with XLA's GEMMs, which do the full work, it writes
   ``dL = 0`` over the whole upper triangle.

Traffic per attention element in bf16: ``g`` and ``P`` are 4 B per read. The floor (and
the per-head kernel) reads them once; the two-pass scheme reads them twice (8 B), up to
three times when the row kernel's second pass misses L2 (12 B); plus ``Q``, ``K``, ``dQ``,
``dK``. The grids put the tile index on the fastest launch axis so that programs running
together share one head's ``K``/``Q``/``delta`` in L2; the column kernel walks the heads in
reverse, starting on those the row kernel finished last.

Causal (``causal=True``): the caller promises ``P_ij = 0`` for ``j > i + (Sk - Sq)``. Tiles
wholly above that diagonal are skipped (no loads, no MMAs); tiles that cross it load with
an element-wise mask, tiles below it without one.

Measurements, and the variants measured and dropped:
``benchmarks/results/qk_scale_softmax_design.log``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _triton_tiles as tiles
from pallas_kernels import _mosaic, _phase, _tuning, validation
from pallas_kernels._util import (check_can_compile, compiler_params, dot,
                                  enable_load_cache_modifiers, next_power_of_2, out_struct,
                                  pallas_call)
from pallas_kernels.qk_scale_softmax.config import (MAX_DL_ELEMENTS, MAX_DL_ROW,
                                                    MAX_PER_HEAD_ROW, Config, DlConfig,
                                                    PassConfig, default_config,
                                                    default_dl_config, dl_width)
from pallas_kernels.qk_scale_softmax import gemm_mosaic_gpu

__all__ = ["qk_scale_softmax_backward", "row_pass", "col_pass", "head_pass", "dl_pass",
           "dl_gemm", "dl_gemms", "dl_matmul", "use_phased"]

_F32 = jnp.float32
_I32 = jnp.int32
_SUPPORTED = (jnp.bfloat16, jnp.float16, jnp.float32)
# Index arithmetic is int32 throughout. A static start that is a Python int would become
# int64 under x64 (jax_enable_x64) next to the int32 program ids; this one stays int32.
_ZERO = np.int32(0)






# ------------------------------------------------------------------------- dL, exactly


def _round_to(x, dtype, *, bits: bool = False):
  """``x`` (fp32) rounded to nearest-even in ``dtype``, returned as fp32.

  For bf16 the value goes through a real conversion (``cvt.rn``) and comes back by a
  bitcast and a shift: a plain ``truncf``/``extf`` pair can be folded away by the compiler
  (the kernel then keeps fp32 precision and misses the reference's roundings), a bitcast
  cannot. ``bits=True`` rounds with integer arithmetic on the fp32 bits instead (about 5
  integer ops per element more; kept to check the conversion against). Inputs are finite.
  """
  if dtype == jnp.bfloat16 and bits:
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    u = u + (jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1)))
    return jax.lax.bitcast_convert_type(u & jnp.uint32(0xFFFF0000), _F32)
  if dtype == jnp.bfloat16:
    half = jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return jax.lax.bitcast_convert_type(half.astype(jnp.uint32) << 16, _F32)
  return x.astype(dtype).astype(_F32)


def _dl_tile(g, p, delta, scale, dtype):
  """``dL = dtype(dtype(P * (g - delta)) * scaling)``, exactly the reference's roundings.

  The second rounding is the conversion the matmul operand needs anyway."""
  d_l = _round_to(p.astype(_F32) * (g.astype(_F32) - delta[:, None]), dtype)
  return (d_l * scale).astype(dtype)


def _row_delta(g, p):
  """``sum_j g_ij * P_ij`` of a ``[rows, keys]`` tile, in fp32."""
  return jnp.sum(g.astype(_F32) * p.astype(_F32), axis=1)


# ----------------------------------------------------------------------- causal ranges
# With causal=True, P_ij may be non-zero only for j <= i + (Sk - Sq). These helpers give
# the tile ranges that intersect that region; they work on Python ints and traced int32
# scalars alike (the tests check them against a brute-force enumeration).


def _row_num_k_tiles(qi, seq_q: int, seq_k: int, block_q: int, block_k: int):
  """Row tile ``qi`` only meets key tiles ``[0, n)``; ``n`` may be 0 (rows with no keys)."""
  last_row = jnp.minimum((qi + 1) * block_q, seq_q) - 1
  last_col = last_row + (seq_k - seq_q)  # the row's last possibly non-zero key
  return jnp.clip((last_col + block_k) // block_k, 0, pl.cdiv(seq_k, block_k))


def _col_first_q_tile(kj, seq_q: int, seq_k: int, block_q: int, block_k: int):
  """Key tile ``kj`` only meets query tiles ``[lo, cdiv(Sq, block_q))`` (empty if lo == end)."""
  first_row = jnp.maximum(kj * block_k - (seq_k - seq_q), 0)  # first row reaching column kj*bk
  return jnp.minimum(first_row // block_q, pl.cdiv(seq_q, block_q))


def _row_num_full_k_tiles(qi, seq_q: int, seq_k: int, block_q: int, block_k: int):
  """Key tiles ``[0, n)`` lie wholly on or below the diagonal for every row of tile ``qi``
  (they need no element-wise causal mask); ``n <= _row_num_k_tiles(...)``."""
  allowed = qi * block_q + (seq_k - seq_q) + 1  # keys the tile's first row may see
  return jnp.clip(allowed // block_k, 0, _row_num_k_tiles(qi, seq_q, seq_k, block_q, block_k))


def _col_first_full_q_tile(kj, seq_q: int, seq_k: int, block_q: int, block_k: int):
  """Query tiles ``[m, cdiv(Sq, block_q))`` see every column of key tile ``kj`` (no
  element-wise causal mask needed); ``m >= _col_first_q_tile(...)``."""
  need = kj * block_k + block_k - 1 - (seq_k - seq_q)  # first row that sees the last column
  first = -((-need) // block_q)  # ceil, also for negative values
  return jnp.clip(first, _col_first_q_tile(kj, seq_q, seq_k, block_q, block_k),
                  pl.cdiv(seq_q, block_q))


# --------------------------------------------------------------------------- row kernel
# One program: ``block_q`` query rows of one head -> their grad_query rows and delta.
# Refs: scale [1] fp32, g and P [B*H, Sq, Sk], K [B*H, Sk, D] -> dQ [B*H, Sq, D],
# delta [B*H, Sq] fp32. One kernel body per loop strategy, chosen by ``row_pass``.


class _RowTiles:
  """A row-kernel program's rows and the tiles it loads (built at the top of the kernel)."""

  def __init__(self, scale_ref, g_ref, p_ref, k_ref, *, seq_q: int, seq_k: int, head_dim: int,
               block_q: int, block_k: int):
    self.qi = pl.program_id(0)  # grid axis 0 is CUDA's fastest: neighbours share a head (K in L2)
    self.bh = pl.program_id(1)
    self.g_ref, self.p_ref, self.k_ref = g_ref, p_ref, k_ref
    self.seq_q, self.seq_k = seq_q, seq_k
    self.block_q, self.block_k = block_q, block_k
    self.dtype = g_ref.dtype
    self.d_pad = tiles.padded_head_dim(head_dim)
    self.scale = scale_ref[0]
    self.q_start = self.qi * block_q
    self.rows = self.q_start + jnp.arange(block_q, dtype=_I32)
    self.row_ok = self.rows < seq_q
    self.d_ok = jnp.arange(self.d_pad, dtype=_I32) < head_dim

  def causal_num_k_tiles(self):
    return _row_num_k_tiles(self.qi, self.seq_q, self.seq_k, self.block_q, self.block_k)

  def causal_num_full_k_tiles(self):
    return _row_num_full_k_tiles(self.qi, self.seq_q, self.seq_k, self.block_q, self.block_k)

  def zero_acc(self):
    return jnp.zeros((self.block_q, self.d_pad), _F32)

  def zero_delta(self):
    return jnp.zeros((self.block_q,), _F32)

  def gp(self, j, in_range=None, *, diagonal: bool):
    """``g`` and ``P`` of key tile ``j`` (zero outside the arrays, and where ``in_range``
    is false); ``diagonal``: also zero above the causal diagonal."""
    cols = j * self.block_k + jnp.arange(self.block_k, dtype=_I32)
    mask = self.row_ok[:, None] & (cols < self.seq_k)[None, :]
    if in_range is not None:
      mask &= in_range
    if diagonal:
      mask &= cols[None, :] <= self.rows[:, None] + (self.seq_k - self.seq_q)
    idx = (self.bh, pl.ds(self.q_start, self.block_q), pl.ds(j * self.block_k, self.block_k))
    g = pltriton.load(self.g_ref.at[idx], mask=mask, other=0.0)
    p = pltriton.load(self.p_ref.at[idx], mask=mask, other=0.0)
    return g, p

  def k(self, j):
    """``K`` rows of key tile ``j``, ``[block_k, d_pad]`` (zero-padded)."""
    cols = j * self.block_k + jnp.arange(self.block_k, dtype=_I32)
    mask = (cols < self.seq_k)[:, None] & self.d_ok[None, :]
    return pltriton.load(self.k_ref.at[self.bh, pl.ds(j * self.block_k, self.block_k),
                                       pl.ds(_ZERO, self.d_pad)], mask=mask, other=0.0)

  def dq_term(self, j, acc, delta, *, diagonal: bool):
    """``acc + dL_j @ K_j`` for key tile ``j`` (``g`` and ``P`` loaded here)."""
    g, p = self.gp(j, diagonal=diagonal)
    d_l = _dl_tile(g, p, delta, self.scale, self.dtype)
    return acc + dot(d_l, self.k(j))

  def store(self, dq_ref, delta_ref, acc, delta):
    pltriton.store(dq_ref.at[self.bh, pl.ds(self.q_start, self.block_q), pl.ds(_ZERO, self.d_pad)],
                   acc.astype(dq_ref.dtype), mask=self.row_ok[:, None] & self.d_ok[None, :])
    pltriton.store(delta_ref.at[self.bh, pl.ds(self.q_start, self.block_q)], delta,
                   mask=self.row_ok)


def _row_kernel_one_tile(scale_ref, g_ref, p_ref, k_ref, dq_ref, delta_ref, *, causal: bool,
                         **dims):
  """Rows of one key tile (``Sk <= block_k``): ``g`` and ``P`` are read once; delta, dL and
  dQ come from that read. (A loop of one trip, or none for causal rows with no keys.)"""
  r = _RowTiles(scale_ref, g_ref, p_ref, k_ref, **dims)
  n_tiles = r.causal_num_k_tiles() if causal else 1
  acc = r.zero_acc()

  def fused(j, carry):
    g, p = r.gp(j, diagonal=causal)
    delta = _row_delta(g, p)
    d_l = _dl_tile(g, p, delta, r.scale, r.dtype)
    return delta, carry[1] + dot(d_l, r.k(j))

  delta, acc = tiles.fori_loop(0, n_tiles, fused, (r.zero_delta(), acc))
  r.store(dq_ref, delta_ref, acc, delta)


def _row_kernel_two_pass(scale_ref, g_ref, p_ref, k_ref, dq_ref, delta_ref, **dims):
  """Dense rows of several key tiles: pass 1 sums delta, pass 2 (newest tiles first: they
  are the likeliest still in L2) forms dL and accumulates dQ."""
  r = _RowTiles(scale_ref, g_ref, p_ref, k_ref, **dims)
  n_tiles = pl.cdiv(r.seq_k, r.block_k)
  acc = r.zero_acc()
  delta = tiles.fori_loop(0, n_tiles, lambda j, delta: delta + _row_delta(*r.gp(j, diagonal=False)),
                     r.zero_delta())
  acc = tiles.fori_loop(0, n_tiles, lambda t, acc: r.dq_term(n_tiles - 1 - t, acc, delta,
                                                        diagonal=False), acc)
  r.store(dq_ref, delta_ref, acc, delta)


def _row_kernel_causal(scale_ref, g_ref, p_ref, k_ref, dq_ref, delta_ref, **dims):
  """The two passes on causal rows: key tiles ``[0, n_full)`` lie wholly on or below the
  diagonal and load without the element-wise mask (a mask that varies along a row stops
  Triton from vectorising the loads); only the diagonal tiles ``[n_full, n_tiles)`` get it.
  Tiles past ``n_tiles`` are skipped."""
  r = _RowTiles(scale_ref, g_ref, p_ref, k_ref, **dims)
  n_tiles = r.causal_num_k_tiles()
  acc = r.zero_acc()
  n_full = r.causal_num_full_k_tiles()

  def pass_delta(j, delta, diagonal=False):
    return delta + _row_delta(*r.gp(j, diagonal=diagonal))

  delta = tiles.fori_loop(0, n_full, pass_delta, r.zero_delta())
  delta = tiles.fori_loop(n_full, n_tiles, functools.partial(pass_delta, diagonal=True), delta)

  def pass_dq(t, acc, last, diagonal=False):
    return r.dq_term(last - 1 - t, acc, delta, diagonal=diagonal)  # newest tiles first

  acc = tiles.fori_loop(0, n_tiles - n_full, functools.partial(pass_dq, last=n_tiles, diagonal=True),
                   acc)
  acc = tiles.fori_loop(0, n_full, functools.partial(pass_dq, last=n_full), acc)
  r.store(dq_ref, delta_ref, acc, delta)


def _row_kernel_prefetch(scale_ref, g_ref, p_ref, k_ref, dq_ref, delta_ref, *, causal: bool,
                         **dims):
  """The two passes with software prefetch in registers: the next tile's ``g`` and ``P``
  are requested before this one is used (rows of odd length cannot use Triton's pipelined
  16-byte copies). Causal: the loops stop at the diagonal, every tile is masked by it.

  Start indices are traced (``qi * 0 + ...``): a constant start past the end fails the
  indexer's static bounds check even though the load is masked.
  """
  r = _RowTiles(scale_ref, g_ref, p_ref, k_ref, **dims)
  n_tiles = r.causal_num_k_tiles() if causal else pl.cdiv(r.seq_k, r.block_k)
  acc = r.zero_acc()

  def pass_delta(j, carry):
    delta, g, p = carry
    nxt = r.gp(j + 1, j + 1 < n_tiles, diagonal=causal)
    return (delta + _row_delta(g, p), *nxt)

  delta, _, _ = tiles.fori_loop(0, n_tiles, pass_delta,
                           (r.zero_delta(), *r.gp(r.qi * 0, n_tiles > 0, diagonal=causal)))

  def pass_dq(t, carry):
    acc, g, p = carry
    j = n_tiles - 1 - t  # newest tiles first
    nxt = r.gp(j - 1, j >= 1, diagonal=causal)
    d_l = _dl_tile(g, p, delta, r.scale, r.dtype)
    return (acc + dot(d_l, r.k(j)), *nxt)

  acc, _, _ = tiles.fori_loop(0, n_tiles, pass_dq,
                         (acc, *r.gp(r.qi * 0 + n_tiles - 1, n_tiles > 0, diagonal=causal)))
  r.store(dq_ref, delta_ref, acc, delta)


def _row_kernel_phased(scale_ref, g_ref, p_ref, k_ref, dq_ref, delta_ref, *, seq_q: int,
                       seq_k: int, head_dim: int, block_q: int, block_k: int, align: int):
  """The row kernel (dense) for rows of ``Sk % 8 != 0`` keys, on 16-byte aligned tiles.

  One program = one row class (``block_q`` rows ``align`` apart, see ``pallas_kernels._phase``)
  of one head. Key tile ``j`` covers keys ``[j * BK - phase, (j + 1) * BK - phase)``; every
  load is of 16-byte vectors (``_phase.tile_masks``), and the edge tiles' columns of the
  neighbouring rows are zeroed. All refs but ``scale`` are flat 1D views.
  """
  program = pl.program_id(0)
  cls, q0, rows = _phase.class_rows(program, align, block_q)
  bh = pl.program_id(1)
  dtype = g_ref.dtype
  d_pad = tiles.padded_head_dim(head_dim)
  scale = scale_ref[0]
  d = jnp.arange(d_pad, dtype=_I32)
  d_ok = d < head_dim

  row_ok = rows < seq_q
  ph = _phase.phase(bh * seq_q + cls, seq_k, align)
  base = _phase.aligned_base(bh * seq_q + q0, seq_k, ph, align)
  n_tiles = _phase.num_tiles(seq_k, block_k, ph)

  def load_gp(j):
    cols, valid, load, _ = _phase.tile_masks(j, seq_k, block_k, ph)
    offs = _phase.tile_offsets(base, seq_k, block_q, j * block_k, block_k, align)
    mask = row_ok[:, None] & load[None, :]
    g = pltriton.load(g_ref.at[offs], mask=mask, other=0.0)
    p = pltriton.load(p_ref.at[offs], mask=mask, other=0.0)
    # Columns of the neighbouring rows (edge tiles): zeroed.
    g = jnp.where(valid[None, :], g, jnp.zeros_like(g))
    p = jnp.where(valid[None, :], p, jnp.zeros_like(p))
    return cols, valid, g, p

  def pass_delta(j, delta):
    _, _, g, p = load_gp(j)
    return delta + _row_delta(g, p)

  def pass_dq(t, acc):
    j = n_tiles - 1 - t  # newest tiles first: they are the likeliest still in L2
    cols, valid, g, p = load_gp(j)
    # K is indexed by hand: tile 0 starts at a negative (masked) key, which a slice clamps.
    k = pltriton.load(k_ref.at[(bh * seq_k + cols)[:, None] * head_dim + d[None, :]],
                      mask=valid[:, None] & d_ok[None, :], other=0.0)
    return acc + dot(_dl_tile(g, p, delta, scale, dtype), k)

  delta = tiles.fori_loop(0, n_tiles, pass_delta, jnp.zeros((block_q,), _F32))
  acc = tiles.fori_loop(0, n_tiles, pass_dq, jnp.zeros((block_q, d_pad), _F32))

  offs = (bh * seq_q + rows)[:, None] * head_dim + d[None, :]
  pltriton.store(dq_ref.at[offs], acc.astype(dq_ref.dtype),
                 mask=row_ok[:, None] & d_ok[None, :])
  pltriton.store(delta_ref.at[bh * seq_q + rows], delta, mask=row_ok)


# ------------------------------------------------------------------------ column kernel
# One program: ``block_k`` keys of one head -> their grad_key rows. Refs: scale [1] fp32,
# g and P [B*H, Sq, Sk], Q [B*H, Sq, D], delta [B*H, Sq] fp32 -> dK [B*H, Sk, D].


class _ColTiles:
  """A column-kernel program's keys and the tiles it loads (built at the top of the kernel)."""

  def __init__(self, scale_ref, g_ref, p_ref, q_ref, delta_ref, *, seq_q: int, seq_k: int,
               head_dim: int, block_q: int, block_k: int):
    self.kj = pl.program_id(0)  # neighbours share a head: its Q and delta stay in L2
    # Heads in reverse: the row kernel's last heads are the likeliest to be still in L2.
    self.bh = pl.num_programs(1) - 1 - pl.program_id(1)
    self.g_ref, self.p_ref, self.q_ref, self.delta_ref = g_ref, p_ref, q_ref, delta_ref
    self.seq_q, self.seq_k = seq_q, seq_k
    self.block_q, self.block_k = block_q, block_k
    self.dtype = g_ref.dtype
    self.d_pad = tiles.padded_head_dim(head_dim)
    self.scale = scale_ref[0]
    self.k_start = self.kj * block_k
    self.cols = self.k_start + jnp.arange(block_k, dtype=_I32)
    self.col_ok = self.cols < seq_k
    self.d_ok = jnp.arange(self.d_pad, dtype=_I32) < head_dim
    self.num_q_tiles = pl.cdiv(seq_q, block_q)

  def causal_first_q_tile(self):
    return _col_first_q_tile(self.kj, self.seq_q, self.seq_k, self.block_q, self.block_k)

  def causal_first_full_q_tile(self):
    return _col_first_full_q_tile(self.kj, self.seq_q, self.seq_k, self.block_q, self.block_k)

  def zero_acc(self):
    return jnp.zeros((self.block_k, self.d_pad), _F32)

  def gp(self, i, *, diagonal: bool):
    """``g`` and ``P`` of query tile ``i`` (zero outside the arrays; past the last tile all
    masked); ``diagonal``: also zero above the causal diagonal."""
    q_start = i * self.block_q
    rows = q_start + jnp.arange(self.block_q, dtype=_I32)
    mask = (rows < self.seq_q)[:, None] & self.col_ok[None, :]
    if diagonal:
      mask &= self.cols[None, :] <= rows[:, None] + (self.seq_k - self.seq_q)
    idx = (self.bh, pl.ds(q_start, self.block_q), pl.ds(self.k_start, self.block_k))
    return (pltriton.load(self.g_ref.at[idx], mask=mask, other=0.0),
            pltriton.load(self.p_ref.at[idx], mask=mask, other=0.0))

  def step(self, i, acc, g, p):
    """``acc + dL_i^T @ Q_i`` for query tile ``i`` (its ``g`` and ``P`` given)."""
    q_start = i * self.block_q
    row_ok = q_start + jnp.arange(self.block_q, dtype=_I32) < self.seq_q
    delta = pltriton.load(self.delta_ref.at[self.bh, pl.ds(q_start, self.block_q)],
                          mask=row_ok, other=0.0)
    q_idx = (self.bh, pl.ds(q_start, self.block_q), pl.ds(_ZERO, self.d_pad))
    q = pltriton.load(self.q_ref.at[q_idx], mask=row_ok[:, None] & self.d_ok[None, :], other=0.0)
    d_l = _dl_tile(g, p, delta, self.scale, self.dtype)
    return acc + dot(d_l, q, trans_a=True)

  def store(self, dk_ref, acc):
    idx = (self.bh, pl.ds(self.k_start, self.block_k), pl.ds(_ZERO, self.d_pad))
    pltriton.store(dk_ref.at[idx], acc.astype(dk_ref.dtype),
                   mask=self.col_ok[:, None] & self.d_ok[None, :])


def _col_kernel_dense(scale_ref, g_ref, p_ref, q_ref, delta_ref, dk_ref, **dims):
  """Dense: every query tile, plain loads."""
  c = _ColTiles(scale_ref, g_ref, p_ref, q_ref, delta_ref, **dims)
  acc = c.zero_acc()
  acc = tiles.fori_loop(0, c.num_q_tiles, lambda i, acc: c.step(i, acc, *c.gp(i, diagonal=False)),
                   acc)
  c.store(dk_ref, acc)


def _col_kernel_causal(scale_ref, g_ref, p_ref, q_ref, delta_ref, dk_ref, **dims):
  """Causal: query tiles before ``lo`` hold no key of this tile and are skipped; tiles
  ``[lo, full)`` cross the diagonal and get the element-wise mask; tiles ``[full, end)``
  see every key of this tile and load unmasked (vectorised)."""
  c = _ColTiles(scale_ref, g_ref, p_ref, q_ref, delta_ref, **dims)
  lo = c.causal_first_q_tile()
  acc = c.zero_acc()
  full = c.causal_first_full_q_tile()
  acc = tiles.fori_loop(lo, full, lambda i, acc: c.step(i, acc, *c.gp(i, diagonal=True)), acc)
  acc = tiles.fori_loop(full, c.num_q_tiles,
                   lambda i, acc: c.step(i, acc, *c.gp(i, diagonal=False)), acc)
  c.store(dk_ref, acc)


def _col_kernel_prefetch(scale_ref, g_ref, p_ref, q_ref, delta_ref, dk_ref, *, causal: bool,
                         **dims):
  """The next query tile's ``g`` and ``P`` are requested before this one is used (see
  :func:`_row_kernel_prefetch`). Causal: tiles before the diagonal are skipped, every tile
  is masked by it."""
  c = _ColTiles(scale_ref, g_ref, p_ref, q_ref, delta_ref, **dims)
  lo = c.causal_first_q_tile() if causal else 0
  acc = c.zero_acc()

  def body(i, carry):
    acc, g, p = carry
    nxt = c.gp(i + 1, diagonal=causal)
    return (c.step(i, acc, g, p), *nxt)

  acc, _, _ = tiles.fori_loop(lo, c.num_q_tiles, body, (acc, *c.gp(c.kj * 0 + lo, diagonal=causal)))
  c.store(dk_ref, acc)


# -------------------------------------------------------------------------- head kernel


def _head_kernel(scale_ref, g_ref, p_ref, q_ref, k_ref, dq_ref, dk_ref, *, seq_q: int,
                 seq_k: int, head_dim: int, block_q: int, causal: bool):
  """One program: a whole head (``"per_head"`` scheme, short rows).

  Walks the head's query tiles; each holds whole rows (``Sk`` padded), so ``delta``, ``dL``
  and ``grad_query`` are done in one read of ``g`` and ``P``. ``grad_key`` accumulates in
  registers over the tiles (``[Sk, D]`` fp32: only for short rows) and is stored once.
  Causal: the loads are masked above the diagonal.
  """
  bh = pl.program_id(0)
  dtype = g_ref.dtype
  d_pad = tiles.padded_head_dim(head_dim)
  block_k = next_power_of_2(max(seq_k, 16))
  scale = scale_ref[0]
  cols = jnp.arange(block_k, dtype=_I32)
  col_ok = cols < seq_k
  d_ok = jnp.arange(d_pad, dtype=_I32) < head_dim
  offset = seq_k - seq_q
  k = pltriton.load(k_ref.at[bh, pl.ds(_ZERO, block_k), pl.ds(_ZERO, d_pad)],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)

  def body(i, acc):
    q_start = i * block_q
    rows = q_start + jnp.arange(block_q, dtype=_I32)
    row_ok = rows < seq_q
    mask = row_ok[:, None] & col_ok[None, :]
    if causal:
      mask &= cols[None, :] <= rows[:, None] + offset
    idx = (bh, pl.ds(q_start, block_q), pl.ds(_ZERO, block_k))
    g = pltriton.load(g_ref.at[idx], mask=mask, other=0.0)
    p = pltriton.load(p_ref.at[idx], mask=mask, other=0.0)
    delta = _row_delta(g, p)
    d_l = _dl_tile(g, p, delta, scale, dtype)
    qd_idx = (bh, pl.ds(q_start, block_q), pl.ds(_ZERO, d_pad))
    qd_mask = row_ok[:, None] & d_ok[None, :]
    pltriton.store(dq_ref.at[qd_idx], dot(d_l, k).astype(dq_ref.dtype), mask=qd_mask)
    q = pltriton.load(q_ref.at[qd_idx], mask=qd_mask, other=0.0)
    return acc + dot(d_l, q, trans_a=True)

  acc = tiles.fori_loop(0, pl.cdiv(seq_q, block_q), body, jnp.zeros((block_k, d_pad), _F32))
  pltriton.store(dk_ref.at[bh, pl.ds(_ZERO, block_k), pl.ds(_ZERO, d_pad)],
                 acc.astype(dk_ref.dtype), mask=col_ok[:, None] & d_ok[None, :])


# ------------------------------------------------------------------------------- passes
# Each pass takes 3D [B*H, ...] views and a static PassConfig; jitted so that a tuner can
# time one pass alone.


def use_phased(cfg: PassConfig, causal: bool, bh: int, seq_q: int, seq_k: int,
               head_dim: int) -> bool:
  """Whether the row pass runs :func:`_row_kernel_phased`: ``cfg.row_align`` is not 0, the
  scheme is dense, rows are not 16-byte aligned (``Sk % 8 != 0``), a row spans several
  key tiles (one-tile rows take the fused single-read path) and the flat views fit int32
  offsets."""
  return not causal and _phase.applies(cfg.row_align, seq_k, cfg.block_k, bh * seq_q * seq_k,
                                       bh * max(seq_q, seq_k) * head_dim)


def _row_kernel(cfg: PassConfig, causal: bool, **dims):
  """The row kernel's body for a config (one-tile rows, prefetch, causal or two-pass)."""
  if pl.cdiv(dims["seq_k"], cfg.block_k) == 1:
    return functools.partial(_row_kernel_one_tile, causal=causal, **dims)
  if cfg.prefetch:
    return functools.partial(_row_kernel_prefetch, causal=causal, **dims)
  return functools.partial(_row_kernel_causal if causal else _row_kernel_two_pass, **dims)


@functools.partial(jax.jit, static_argnames=("causal", "cfg", "interpret"))
def row_pass(scale, g, p, k, *, causal, cfg, interpret):
  """``(grad_query [B*H, Sq, D], delta [B*H, Sq] fp32)`` from 3D ``[B*H, ...]`` views."""
  bh, seq_q, seq_k = g.shape
  head_dim = k.shape[-1]
  if use_phased(cfg, causal, bh, seq_q, seq_k, head_dim):
    # align <= block_k: a phase of a whole tile or more would only load earlier rows.
    align, block_q = _phase.resolve(cfg.row_align, seq_q, cfg.block_q, cfg.block_k)
    dq, delta = pallas_call(
        functools.partial(_row_kernel_phased, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                          block_q=block_q, block_k=cfg.block_k, align=align),
        out_shape=(out_struct((bh * seq_q * head_dim,), k.dtype, g, p, k),
                   out_struct((bh * seq_q,), _F32, g, p, k)),
        grid=(_phase.num_programs(seq_q, align, block_q), bh),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="qk_scale_softmax_bwd_dq_aligned",
    )(scale, g.reshape(-1), p.reshape(-1), k.reshape(-1))
    return dq.reshape(bh, seq_q, head_dim), delta.reshape(bh, seq_q)
  return pallas_call(
      _row_kernel(cfg, causal, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                  block_q=cfg.block_q, block_k=cfg.block_k),
      out_shape=(out_struct((bh, seq_q, head_dim), k.dtype, g, p, k),
                 out_struct((bh, seq_q), _F32, g, p, k)),
      grid=(pl.cdiv(seq_q, cfg.block_q), bh),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="qk_scale_softmax_bwd_dq",
  )(scale, g, p, k)


def _col_kernel(cfg: PassConfig, causal: bool, **dims):
  """The column kernel's body for a config (prefetch, causal or dense)."""
  if cfg.prefetch:
    return functools.partial(_col_kernel_prefetch, causal=causal, **dims)
  return functools.partial(_col_kernel_causal if causal else _col_kernel_dense, **dims)


@functools.partial(jax.jit, static_argnames=("causal", "cfg", "interpret"))
def col_pass(scale, g, p, q, delta, *, causal, cfg, interpret):
  """``grad_key [B*H, Sk, D]`` from 3D ``[B*H, ...]`` views and the row pass's delta."""
  bh, seq_q, seq_k = g.shape
  head_dim = q.shape[-1]
  return pallas_call(
      _col_kernel(cfg, causal, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                  block_q=cfg.block_q, block_k=cfg.block_k),
      out_shape=out_struct((bh, seq_k, head_dim), q.dtype, g, p, q),
      grid=(pl.cdiv(seq_k, cfg.block_k), bh),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="qk_scale_softmax_bwd_dk",
  )(scale, g, p, q, delta)


@functools.partial(jax.jit, static_argnames=("causal", "cfg", "interpret"))
def head_pass(scale, g, p, q, k, *, causal, cfg, interpret):
  """``(grad_query, grad_key)`` of 3D ``[B*H, ...]`` views, one program per head."""
  bh, seq_q, seq_k = g.shape
  head_dim = q.shape[-1]
  if next_power_of_2(seq_k) > MAX_PER_HEAD_ROW:
    raise ValueError(f"the per_head scheme takes rows of at most {MAX_PER_HEAD_ROW} keys, "
                     f"got Sk={seq_k}")
  return pallas_call(
      functools.partial(_head_kernel, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                        block_q=cfg.block_q, causal=causal),
      out_shape=(out_struct((bh, seq_q, head_dim), q.dtype, g, p, q, k),
                 out_struct((bh, seq_k, head_dim), q.dtype, g, p, q, k)),
      grid=(bh,),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="qk_scale_softmax_bwd_head",
  )(scale, g, p, q, k)






def _dl_kernel(scale_ref, g_ref, p_ref, dl_ref, *, seq_q: int, seq_k: int, block_q: int,
               width: int, causal: bool, causal_tile: tuple[int, int] | None = None):
  """``dL`` of ``block_q`` whole rows (``width``: the padded row length) of one head.
  Causal: ``g`` and ``P`` above the diagonal are not read (loads stop at the first multiple
  of 8 keys past it, so that they stay 16-byte vectors), and ``dL`` there is written 0, or,
  with ``causal_tile = (R, T)``, written 0 only up to the multiple of ``T`` keys past the
  diagonal of the last row of the row's group of ``R`` rows (:func:`dl_pass`); and a program
  takes two blocks of rows, block ``p`` and block ``n - 1 - p`` of the ``n``, a short and a
  long one (measured on the H200 with the causal_tile change: 1945 -> 1926 us at (1, 4096,
  4096), still 0.64x the dense time, not 0.5x). ``dl_ref``'s rows may be longer than
  ``seq_k`` (a padded row stride): the keys past ``seq_k`` are written 0."""
  block = functools.partial(_dl_block, bh=pl.program_id(1), scale_ref=scale_ref, g_ref=g_ref,
                            p_ref=p_ref, dl_ref=dl_ref, seq_q=seq_q, seq_k=seq_k,
                            block_q=block_q, width=width, causal=causal,
                            causal_tile=causal_tile)
  block(pl.program_id(0) * block_q)
  if causal:
    # The middle block of an odd count is its own partner: written twice, the same values.
    block((pl.cdiv(seq_q, block_q) - 1 - pl.program_id(0)) * block_q)


def _dl_block(q0, *, bh, scale_ref, g_ref, p_ref, dl_ref, seq_q: int, seq_k: int,
              block_q: int, width: int, causal: bool, causal_tile, row_end: int | None = None,
              whole_blocks: bool | None = None):
  """The rows ``[q0, q0 + block_q)`` of :func:`_dl_kernel`, those below ``row_end`` (default
  ``seq_q``; ``whole_blocks``: no row past it, statically)."""
  stride = dl_ref.shape[-1]  # >= seq_k
  rows = q0 + jnp.arange(block_q, dtype=jnp.int32)
  cols = jnp.arange(width, dtype=jnp.int32)
  row_end = seq_q if row_end is None else row_end
  if whole_blocks is None:
    whole_blocks = seq_q % block_q == 0 and row_end == seq_q

  def within(length):
    if whole_blocks and width == length:
      return None
    return (rows < row_end)[:, None] & (cols < length)[None, :]

  inside = within(seq_k)
  read, store = inside, within(stride)
  if causal:
    # Keys j <= i + (Sk - Sq) of row i, and the vector of 8 keys holding the last of them.
    end = rows[:, None] + (seq_k - seq_q + 1)
    near = cols[None, :] < (end + 7) // 8 * 8
    read = near if inside is None else inside & near
    if causal_tile is not None:
      group, keys = causal_tile
      last = rows // group * group + group  # 1 + the last row of the row's group
      written = cols[None, :] < (last[:, None] + (seq_k - seq_q) + keys - 1) // keys * keys
      store = written if store is None else store & written
  tile = (bh, pl.ds(q0, block_q), pl.ds(_ZERO, width))
  g = tiles.load(g_ref.at[tile], read, cache_modifier=".cg")
  p = tiles.load(p_ref.at[tile], read, cache_modifier=".cg")
  if causal:  # the keys past the diagonal that the vectors brought in
    below = cols[None, :] < end
    g = jnp.where(below, g, jnp.zeros_like(g))
    p = jnp.where(below, p, jnp.zeros_like(p))
  dl = _dl_tile(g, p, _row_delta(g, p), scale_ref[0], dl_ref.dtype)  # 0 where not read
  tiles.store(dl_ref.at[tile], dl, store)


def dl_classes(seq_q: int, seq_k: int, stride: int, rows: int,
               causal_tile: tuple[int, int]) -> list[tuple[int, int, int, int]]:
  """The row classes of :func:`_dl_kernel_classes` (causal, ``causal_tile = (R, T)``):
  ``(lo, hi, width, block_q)`` per class, longest rows first. Row ``i`` is read up to the
  vector of 8 keys holding its diagonal and written up to the multiple of ``T`` keys past
  the diagonal of its group's last row (:func:`dl_pass`); a class holds the rows whose extent
  fits ``width`` (a power of two, halving from :func:`dl_width`, down to 64 keys, at most 8
  widths: the last class takes every shorter row too) but not half of it, ``block_q`` rows
  per program, so that every program holds ``rows * dl_width(seq_k)`` elements. Static
  (Python ints)."""
  group, keys = causal_tile
  top = dl_width(seq_k)
  i = np.arange(seq_q)
  shift = seq_k - seq_q
  read = np.clip((np.minimum(i + shift + 1, seq_k) + 7) // 8 * 8, 0, None)
  written = np.clip((i // group * group + group + shift + keys - 1) // keys * keys, 0, stride)
  extent = np.minimum(np.maximum(read, written), top)
  widths = [top]
  while widths[-1] > 64 and len(widths) < 8:
    widths.append(widths[-1] // 2)
  out, hi = [], seq_q
  for k, width in enumerate(widths):
    last = k == len(widths) - 1
    lo = 0 if last else int(np.searchsorted(extent, width // 2, side="right"))
    lo = min(lo, hi)
    if hi > lo:
      out.append((lo, hi, width, max(1, rows * top // width)))
    hi = lo
  return out


def _dl_kernel_classes(scale_ref, g_ref, p_ref, dl_ref, *, seq_q: int, seq_k: int,
                       classes, causal_tile: tuple[int, int]):
  """:func:`_dl_kernel` (causal, with ``causal_tile``) in row classes (:func:`dl_classes`):
  a program holds ``block_q`` rows of its class's ``width``, so that every warp holds keys of
  its rows; one program id range per class, longest rows first."""
  pid, bh = pl.program_id(0), pl.program_id(1)  # outside the branches (the interpreter)
  start = 0
  for lo, hi, width, block_q in classes:
    n = pl.cdiv(hi - lo, block_q)

    @pl.when((pid >= start) & (pid < start + n))
    def _(lo=lo, hi=hi, width=width, block_q=block_q, start=start):
      _dl_block((pid - start) * block_q + lo, bh=bh, scale_ref=scale_ref,
                g_ref=g_ref, p_ref=p_ref, dl_ref=dl_ref, seq_q=seq_q, seq_k=seq_k,
                block_q=block_q, width=width, causal=True, causal_tile=causal_tile,
                row_end=hi, whole_blocks=(hi - lo) % block_q == 0)

    start += n


def _dl_kernel_phased(scale_ref, g_ref, p_ref, dl_ref, *, seq_q: int, seq_k: int,
                      block_q: int, width: int, align: int, causal: bool):
  """:func:`_dl_kernel` for rows of ``Sk % 8 != 0`` keys, on 16-byte aligned tiles: one
  program = one row class (``block_q`` rows ``align`` apart, ``pallas_kernels._phase``) of
  one head, the row held from ``phase`` keys early (``width >= Sk + align - 1``), so that
  ``g`` and ``P`` load as 16-byte vectors (the neighbouring rows' columns zeroed) and ``dL``
  (unpadded, the same flat offsets) stores its inner vectors whole and at most 7 keys at
  each end with a scalar mask. All refs but ``scale`` are flat 1D views."""
  cls, q0, rows = _phase.class_rows(pl.program_id(0), align, block_q)
  bh = pl.program_id(1)
  ph = _phase.phase(bh * seq_q + cls, seq_k, align)
  base = _phase.aligned_base(bh * seq_q + q0, seq_k, ph, align)
  cols, valid, load, vector = _phase.tile_masks(_ZERO, seq_k, width, ph)
  row_ok = (rows < seq_q)[:, None]
  inside = row_ok & valid[None, :]
  if causal:
    inside = inside & (cols[None, :] <= rows[:, None] + (seq_k - seq_q))
  offs = _phase.tile_offsets(base, seq_k, block_q, _ZERO, width, align)
  mask = row_ok & load[None, :]
  g = pltriton.load(g_ref.at[offs], mask=mask, other=0.0)
  p = pltriton.load(p_ref.at[offs], mask=mask, other=0.0)
  g = jnp.where(inside, g, jnp.zeros_like(g))  # neighbouring rows' keys, keys above the diagonal
  p = jnp.where(inside, p, jnp.zeros_like(p))
  dl = _dl_tile(g, p, _row_delta(g, p), scale_ref[0], dl_ref.dtype)
  tiles.store(dl_ref.at[offs], dl, row_ok & vector[None, :])
  tiles.store(dl_ref.at[offs], dl, row_ok & (valid & jnp.logical_not(vector))[None, :])


def dl_phased(seq_k: int, cfg: DlConfig, *sizes: int) -> bool:
  """Whether :func:`dl_pass` takes :func:`_dl_kernel_phased`: ``cfg.phased``, rows not
  16-byte aligned (``Sk % 8 != 0``), no padded rows, and flat views that fit int32 offsets."""
  return cfg.phased and not cfg.pad_rows and _phase.usable(seq_k, *sizes)


def dl_stride(seq_k: int, cfg: DlConfig) -> int:
  """The row length of the ``dL`` buffer: ``seq_k`` rounded up to a multiple of 8 keys
  (16-byte rows in 16-bit dtypes, which the GEMMs read with aligned loads) with
  ``cfg.pad_rows``, else ``seq_k``."""
  return -(-seq_k // 8) * 8 if cfg.pad_rows else seq_k


@functools.partial(jax.jit, static_argnames=("causal", "cfg", "interpret", "causal_tile"))
def dl_pass(scale, g, p, *, causal=False, cfg, interpret, causal_tile=None):
  """``dL [B*H, Sq, S]`` (the input dtype, rounded as the reference rounds it) from 3D
  ``[B*H, Sq, Sk]`` views of ``g`` and ``P``: ``cfg.rows`` whole rows per program (the
  padded row in registers, :class:`DlConfig`), ``g`` and ``P`` read once. ``S`` is
  :func:`dl_stride` (``Sk``, or ``Sk`` rounded up to a multiple of 8 with
  ``cfg.pad_rows``; the extra keys hold 0). Causal: 0 above the diagonal, whatever ``g``
  and ``P`` hold there; with ``causal_tile = (R, T)`` (the plain kernel only) a row's keys
  are written (0 above the diagonal) only up to the first multiple of ``T`` keys past the
  diagonal of the last row of its group of ``R`` rows (``r // R * R + R - 1``), and left
  unwritten past it: about half the writes. GEMMs that read ``dL`` only there need no more:
  :func:`causal_tile_of` their tiles for :func:`dl_gemms` and :func:`dl_matmul`,
  ``gemm_mosaic_gpu.CAUSAL_TILE`` for the Mosaic GPU GEMMs; there ``cfg.classes`` takes the
  rows in classes of halving lengths (:func:`_dl_kernel_classes`, the same ``dL`` where it
  is written). With ``cfg.phased`` rows of ``Sk % 8 != 0`` keys take
  :func:`_dl_kernel_phased` (the same ``dL``, on 16-byte aligned tiles; :func:`dl_phased`)."""
  bh, seq_q, seq_k = g.shape
  if dl_phased(seq_k, cfg, g.size):
    align, block = _phase.resolve(_phase.ALIGN, seq_q, cfg.rows, _phase.ALIGN)
    width = dl_width(seq_k + align - 1)  # the row from up to align - 1 keys early
    dl = pallas_call(
        functools.partial(_dl_kernel_phased, seq_q=seq_q, seq_k=seq_k, block_q=block,
                          width=width, align=align, causal=causal),
        out_shape=out_struct((bh * seq_q * seq_k,), g.dtype, g, p),
        grid=(_phase.num_programs(seq_q, align, block), bh),
        compiler_params=compiler_params(cfg.num_warps, 1),
        interpret=interpret,
        name="qk_scale_softmax_bwd_dl",
    )(scale, g.reshape(-1), p.reshape(-1))
    return dl.reshape(bh, seq_q, seq_k)
  width = dl_width(seq_k)
  enable_load_cache_modifiers("the dL kernel's .cg loads")
  if causal and causal_tile is not None and cfg.classes:
    classes = dl_classes(seq_q, seq_k, dl_stride(seq_k, cfg), cfg.rows, causal_tile)
    kernel = functools.partial(_dl_kernel_classes, seq_q=seq_q, seq_k=seq_k, classes=classes,
                               causal_tile=causal_tile)
    programs = sum(pl.cdiv(hi - lo, block_q) for lo, hi, _, block_q in classes)
  else:
    kernel = functools.partial(_dl_kernel, seq_q=seq_q, seq_k=seq_k, block_q=cfg.rows,
                               width=width, causal=causal, causal_tile=causal_tile)
    # Causal: a program takes two blocks of rows, a short and a long one (_dl_kernel).
    programs = pl.cdiv(pl.cdiv(seq_q, cfg.rows), 2) if causal else pl.cdiv(seq_q, cfg.rows)
  return pallas_call(
      kernel,
      out_shape=out_struct((bh, seq_q, dl_stride(seq_k, cfg)), g.dtype, g, p),
      grid=(programs, bh),
      compiler_params=compiler_params(cfg.num_warps, 1),
      interpret=interpret,
      name="qk_scale_softmax_bwd_dl",
  )(scale, g, p)


def _and_masks(*masks):
  masks = [m for m in masks if m is not None]
  out = masks[0] if masks else None
  for m in masks[1:]:
    out = out & m
  return out


def _dl_matmul_kernel(dl_ref, x_ref, o_ref, **dims):
  """One output tile of ``dL @ K`` (``transpose=False``: ``block_q`` query rows, the loop
  over key tiles) or ``dL^T @ Q`` (``block_k`` key rows, the loop over query tiles).
  Causal: only the tiles that meet the diagonal's lower side, which must hold 0 above it
  (:func:`dl_pass` writes them so with ``causal_tile=`` :func:`causal_tile_of` the tiles;
  masking them here instead took the tiles through registers and cost the GEMMs their
  pipelining: 2336 us against 2069 dense at (1, 4096, 4096) on the H200)."""
  bh = pl.program_id(1)
  _dl_matmul_tile(pl.program_id(0), bh, bh, dl_ref, x_ref, o_ref, **dims)


def _dl_matmul_tile(i, dl_head, head, dl_ref, x_ref, o_ref, *, transpose: bool, causal: bool,
                    seq_q: int, seq_k: int, head_dim: int, block_q: int, block_k: int):
  """Output tile ``i`` of :func:`_dl_matmul_kernel`, from head ``dl_head`` of ``dL`` and
  head ``head`` of ``x`` and the output."""
  d_pad = tiles.padded_head_dim(head_dim)
  d_ok = None if d_pad == head_dim else (jnp.arange(d_pad, dtype=_I32) < head_dim)[None, :]
  out_block, red_block = (block_k, block_q) if transpose else (block_q, block_k)
  # dL's rows may be padded past seq_k (zeros): its key masks take its own row length.
  dl_k = dl_ref.shape[-1]
  out_len, red_len = (seq_k, seq_q) if transpose else (seq_q, seq_k)
  dl_out, dl_red = (dl_k, seq_q) if transpose else (seq_q, dl_k)

  def ok(start, block, length, axis):
    """Which of the tile's ``block`` indices from ``start`` lie below ``length``, as a
    column (``axis=0``) or a row (``axis=1``); ``None``: all of them in every tile."""
    if length % block == 0:
      return None
    m = start + jnp.arange(block, dtype=_I32) < length
    return m[:, None] if axis == 0 else m[None, :]

  o0 = i * out_block

  def body(j, acc):
    r0 = j * red_block
    if transpose:  # dL tile [red (queries), out (keys)]
      idx = (dl_head, pl.ds(r0, red_block), pl.ds(o0, out_block))
      a_mask = _and_masks(ok(r0, red_block, dl_red, 0), ok(o0, out_block, dl_out, 1))
    else:  # dL tile [out (queries), red (keys)]
      idx = (dl_head, pl.ds(o0, out_block), pl.ds(r0, red_block))
      a_mask = _and_masks(ok(o0, out_block, dl_out, 0), ok(r0, red_block, dl_red, 1))
    a = tiles.load(dl_ref.at[idx], a_mask)
    x = tiles.load(x_ref.at[head, pl.ds(r0, red_block), pl.ds(_ZERO, d_pad)],
              _and_masks(ok(r0, red_block, red_len, 0), d_ok))
    return acc + dot(a, x, trans_a=transpose)

  lo, hi = 0, pl.cdiv(red_len, red_block)
  if causal and transpose:
    lo = _col_first_q_tile(i, seq_q, seq_k, block_q, block_k)
  elif causal:
    hi = _row_num_k_tiles(i, seq_q, seq_k, block_q, block_k)
  acc = tiles.fori_loop(lo, hi, body, jnp.zeros((out_block, d_pad), _F32))
  tiles.store(o_ref.at[head, pl.ds(o0, out_block), pl.ds(_ZERO, d_pad)], acc.astype(o_ref.dtype),
         _and_masks(ok(o0, out_block, out_len, 0), d_ok))


@functools.partial(jax.jit, static_argnames=("transpose", "causal", "cfg", "interpret",
                                             "seq_k"))
def dl_matmul(dl, x, *, transpose: bool, causal: bool = False, cfg: PassConfig, interpret,
              seq_k: int | None = None):
  """``dL @ K`` (``transpose=False``, ``x = K [B*H, Sk, D]``: ``grad_query``) or
  ``dL^T @ Q`` (``transpose=True``, ``x = Q [B*H, Sq, D]``: ``grad_key``) from
  ``dL [B*H, Sq, S]``, as a Triton kernel: ``cfg.block_q`` x ``cfg.block_k`` tiles of
  ``dL``, fp32 accumulation, the output rounded once. ``dL``'s rows may be padded with
  zeros past ``Sk`` (``S >= Sk``; :func:`dl_pass` with ``pad_rows``): ``Sk`` is ``K``'s
  length, or ``seq_k`` with ``transpose`` (``None``: ``S``). ``causal``: ``dL`` is 0 above
  the causal diagonal (:func:`dl_pass` writes it so) and the tiles wholly above it are
  skipped."""
  bh, seq_q, stride = dl.shape
  seq_k = (seq_k or stride) if transpose else x.shape[1]
  head_dim = x.shape[-1]
  out_len, block = (seq_k, cfg.block_k) if transpose else (seq_q, cfg.block_q)
  return pallas_call(
      functools.partial(_dl_matmul_kernel, transpose=transpose, causal=causal,
                        seq_q=seq_q, seq_k=seq_k,
                        head_dim=head_dim, block_q=cfg.block_q, block_k=cfg.block_k),
      out_shape=out_struct((bh, out_len, head_dim), x.dtype, dl, x),
      grid=(pl.cdiv(out_len, block), bh),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="qk_scale_softmax_bwd_dl_dk" if transpose else "qk_scale_softmax_bwd_dl_dq",
  )(dl, x)


def _dl_gemms_kernel(dl_ref, k_ref, q_ref, dq_ref, dk_ref, *, q_tiles: int, dq_dims, dk_dims):
  """The ``grad_query`` tiles (the first ``q_tiles`` programs of the grid's first axis) and
  the ``grad_key`` tiles (the rest) of one head, in one launch."""
  i, bh = pl.program_id(0), pl.program_id(1)

  @pl.when(i < q_tiles)
  def _dq():
    _dl_matmul_tile(i, bh, bh, dl_ref, k_ref, dq_ref, transpose=False, **dq_dims)

  @pl.when(i >= q_tiles)
  def _dk():
    _dl_matmul_tile(i - q_tiles, bh, bh, dl_ref, q_ref, dk_ref, transpose=True, **dk_dims)


@functools.partial(jax.jit, static_argnames=("causal", "cfg", "interpret"))
def dl_gemms(dl, q, k, *, causal: bool = False, cfg: PassConfig, interpret):
  """``(dL @ K, dL^T @ Q)`` (``grad_query``, ``grad_key``) from ``dL [B*H, Sq, S]``, ``Q [B*H,
  Sq, D]`` and ``K [B*H, Sk, D]`` in one Triton launch: a program computes one ``[block_q,
  D]`` output tile of either (``grad_query``: ``block_q`` query rows, steps of ``block_k``
  keys; ``grad_key``: ``block_q`` keys, steps of ``block_k`` query rows; tiles capped at the
  padded lengths), fp32 accumulation, rounded once. One launch fills the GPU where the two
  GEMMs apart would each leave it part idle. ``dL``'s rows may be padded past ``Sk`` (``K``'s
  length) as in :func:`dl_matmul`; ``causal`` as there."""
  bh, seq_q, stride = dl.shape
  seq_k = k.shape[1]
  head_dim = q.shape[-1]
  # grad_key's tiles are cfg's transposed (block_q keys, block_k query rows).
  dq = cfg.capped(seq_q, seq_k)
  dk = dataclasses.replace(cfg, block_q=cfg.block_k, block_k=cfg.block_q).capped(seq_q, seq_k)
  common = dict(causal=causal, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim)
  dq_dims = dict(common, block_q=dq.block_q, block_k=dq.block_k)
  dk_dims = dict(common, block_q=dk.block_q, block_k=dk.block_k)
  q_tiles = pl.cdiv(seq_q, dq_dims["block_q"])
  grid = (q_tiles + pl.cdiv(seq_k, dk_dims["block_k"]), bh)
  like = (dl, q, k)
  return pallas_call(
      functools.partial(_dl_gemms_kernel, q_tiles=q_tiles, dq_dims=dq_dims, dk_dims=dk_dims),
      out_shape=(out_struct((bh, seq_q, head_dim), q.dtype, *like),
                 out_struct((bh, seq_k, head_dim), k.dtype, *like)),
      grid=grid,
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="qk_scale_softmax_bwd_dl_gemms",
  )(dl, k, q)


def causal_tile_of(*cfgs: PassConfig) -> tuple[int, int]:
  """:func:`dl_pass`'s ``causal_tile`` for the Triton GEMMs of ``cfgs`` (their tiles read
  ``dL`` in blocks of ``block_q`` x ``block_k`` and ``block_k`` x ``block_q``, up to the
  ones that meet the diagonal): the largest tile side, as both (tiles are powers of two)."""
  side = max(max(c.block_q, c.block_k) for c in cfgs)
  return side, side


def one_launch_takes(dtype, head_dim: int) -> bool:
  """Whether :func:`dl_gemm` runs its GEMMs as the one Triton launch: 16-bit inputs and a
  padded head dim of at most 128 (what was measured; fp32 or wider heads would need tiles
  that fit shared memory), else XLA's GEMMs."""
  return jnp.dtype(dtype).itemsize <= 2 and tiles.padded_head_dim(head_dim) <= 128


def dl_gemm(scale, g, p, q, k, *, causal=False, cfg, interpret, gemm=None):
  """The ``"dl_gemm"`` scheme on 3D views: ``dL`` from :func:`dl_pass`, then ``grad_query =
  dL @ K`` and ``grad_key = dL^T @ Q``: both in one Mosaic GPU launch with
  ``cfg.mosaic_gemm`` where it takes the problem (:func:`.gemm_mosaic_gpu.dl_gemms`), else
  both in one Triton launch (:func:`dl_gemms`, tiles
  ``cfg.gemm``; 16-bit inputs with ``D <= 128``, :func:`one_launch_takes`), or as XLA batched
  GEMMs where ``cfg.gemm`` is ``None`` or the launch does not take the problem (XLA picks
  their kernels), or with ``gemm = (dq_cfg, dk_cfg)`` (:class:`PassConfig`) as two Triton launches
  (:func:`dl_matmul`). fp32 accumulation, rounded to the input dtype once. 10 B per element
  in bf16: ``g`` and ``P`` read (4), ``dL`` written (2) and read by each GEMM (4)."""
  seq_k = k.shape[1]
  mosaic = (gemm is None and cfg.mosaic_gemm and gemm_mosaic_gpu.unsupported_reason(
      g.shape[1], seq_k, q.shape[-1], g.dtype, causal) is None)
  one_launch = gemm is None and cfg.gemm is not None and one_launch_takes(g.dtype, q.shape[-1])
  # Causal: these GEMMs read dL above the diagonal only in their tiles that cross it, so the
  # dL kernel writes (zeros) only that far past it; XLA's GEMMs read it all.
  causal_tile = (None if not causal else gemm_mosaic_gpu.CAUSAL_TILE if mosaic else
                 causal_tile_of(cfg.gemm) if one_launch else
                 causal_tile_of(*gemm) if gemm is not None else None)
  dl = dl_pass(scale, g, p, causal=causal, cfg=cfg, interpret=interpret,
               causal_tile=causal_tile)
  if mosaic:
    return gemm_mosaic_gpu.dl_gemms(dl, q, k, causal=causal, interpret=interpret)
  if one_launch:
    return dl_gemms(dl, q, k, causal=causal, cfg=cfg.gemm, interpret=interpret)
  if gemm is not None:  # Triton GEMMs: (dQ config, dK config)
    return (dl_matmul(dl, k, transpose=False, causal=causal, cfg=gemm[0], interpret=interpret),
            dl_matmul(dl, q, transpose=True, causal=causal, cfg=gemm[1], interpret=interpret,
                      seq_k=seq_k))
  # fp32: full-precision products, as the reference and the Triton dot (not TF32).
  precision = jax.lax.Precision.HIGHEST if dl.dtype == _F32 else None
  stride = dl.shape[-1]
  k_rows = k if stride == seq_k else jnp.pad(k, ((0, 0), (0, stride - seq_k), (0, 0)))
  dq = jnp.einsum("bqk,bkd->bqd", dl, k_rows, precision=precision,
                  preferred_element_type=_F32).astype(q.dtype)
  dk = jnp.einsum("bqk,bqd->bkd", dl, q, precision=precision,
                  preferred_element_type=_F32).astype(k.dtype)
  return dq, dk[:, :seq_k]


# --------------------------------------------------------------------------- entry point


@functools.partial(jax.jit, static_argnames=("causal", "config", "interpret"))
def _backward(grad_output, query, key, attn_weights, scaling, *, causal, config, interpret):
  b, h, seq_q, head_dim = query.shape
  seq_k = key.shape[2]
  bh = b * h
  # Free reshapes to [B*H, ...] views; the kernels index every dimension separately.
  g = grad_output.reshape(bh, seq_q, seq_k)
  p = attn_weights.reshape(bh, seq_q, seq_k)
  q = query.reshape(bh, seq_q, head_dim)
  k = key.reshape(bh, seq_k, head_dim)
  scale = jnp.asarray(scaling, _F32).reshape(1)
  if config.scheme == "dl_gemm":
    width = dl_width(seq_k)
    if width > MAX_DL_ROW:
      raise ValueError(f"config.scheme: 'dl_gemm' holds whole rows in registers, rows of at "
                       f"most {MAX_DL_ROW} keys; got key of shape {key.shape}")
    dl_cfg = config.dl or default_dl_config(seq_k)
    if dl_cfg.rows * width > MAX_DL_ELEMENTS:
      raise ValueError(f"config.dl.rows: {dl_cfg.rows} rows of {width} (padded) keys exceed "
                       f"the {MAX_DL_ELEMENTS} elements a dL program may hold; use rows <= "
                       f"{max(1, MAX_DL_ELEMENTS // width)}")
    grad_query, grad_key = dl_gemm(scale, g, p, q, k, causal=causal, cfg=dl_cfg,
                                   interpret=interpret)
  elif config.scheme == "per_head":
    grad_query, grad_key = head_pass(scale, g, p, q, k, causal=causal, cfg=config.col,
                                     interpret=interpret)
  else:
    grad_query, delta = row_pass(scale, g, p, k, causal=causal, cfg=config.row,
                                 interpret=interpret)
    grad_key = col_pass(scale, g, p, q, delta, causal=causal, cfg=config.col,
                        interpret=interpret)
  return grad_query.reshape(b, h, seq_q, head_dim), grad_key.reshape(b, h, seq_k, head_dim)


def qk_scale_softmax_backward(grad_output, query, key, attn_weights, scaling, *, causal=False,
                              config: Config | None = None, block_q=None, block_k=None,
                              num_warps=None, num_stages=None, interpret=False):
  """Backward of ``softmax((Q @ K^T) * scaling)`` to ``Q`` and ``K``.

  Args:
    grad_output: ``[B, H, Sq, Sk]`` gradient ``g`` of the attention weights.
    query: ``[B, H, Sq, D]``.
    key: ``[B, H, Sk, D]``.
    attn_weights: ``[B, H, Sq, Sk]`` softmax output ``P``.
    scaling: the logits' scale; a Python float or a (possibly traced) scalar.
    causal: the caller promises ``P_ij == 0`` for ``j > i + (Sk - Sq)``; tiles entirely in
      that region are skipped (never loaded, no MMAs). Results equal the dense ones.
    config: the scheme and each kernel's tiles and launch parameters (:class:`Config`).
      Default: the tuned table of the device kind that runs the call (16-bit inputs,
      D <= 128), else a heuristic (:func:`default_config`).
    block_q, block_k, num_warps, num_stages: override one field of both kernels' configs
      (tiles: powers of two >= 16 along ``Sq`` and ``Sk``). With the ``"dl_gemm"`` scheme
      only ``num_warps`` applies (to the ``dL`` kernel); the others raise.
    interpret: run the kernels in the Pallas interpreter (any backend; slow, for tests).
      Without it the kernels compile for a CUDA GPU only.

  All arrays share one dtype: bfloat16 (main target), float16 or float32. Arithmetic is fp32
  with ``dL`` rounded to the input dtype exactly as the reference; matmuls take ``dL`` and
  ``K``/``Q`` in the input dtype (tensor cores) and accumulate in fp32. ``D`` may be any size
  (padded to a power of two >= 16 and masked); ``Sq``/``Sk`` any length >= 1.

  Design (module docstring): one program per head for short rows (``"per_head"``: ``g``
  and ``P`` read once, 4 B per element in bf16); a row kernel (``delta`` and
  ``grad_query``) and a column kernel (``grad_key``), 8-12 B per element (``"two_pass"``);
  or the ``dL`` kernel and the two GEMMs, 10 B per element and a ``dL`` buffer the size of
  ``P`` (``"dl_gemm"``, the H200 table's choice for dense rows of a multiple of 8 keys in
  its classes up to 4096 keys and down to the one of 256, that is 129-4096 keys; timed at
  256, 512, 1024, 2048 and 4096).

  Returns:
    ``(grad_query [B, H, Sq, D], grad_key [B, H, Sk, D])`` in the inputs' dtype.
  """
  check_can_compile("qk_scale_softmax_backward", interpret, grad_output, query, key,
                    attn_weights)
  validation.check_problem_c(grad_output, query, key, attn_weights, scaling, dtypes=_SUPPORTED)
  causal = validation.check_causal(causal, query.shape[2], key.shape[2], every_row_has_keys=False)
  if config is not None and not isinstance(config, Config):
    raise TypeError(f"config: expected a qk_scale_softmax.Config, got {type(config).__name__}")
  if config is None:
    device_kind = _tuning.device_kind_of(grad_output, query, key, attn_weights,
                                         interpret=interpret)
    config = default_config(query.shape[2], key.shape[2], query.shape[3], query.dtype,
                            device_kind, causal=causal)
  if config.scheme == "dl_gemm":
    given = [n for n, v in (("block_q", block_q), ("block_k", block_k),
                            ("num_stages", num_stages)) if v is not None]
    if given:
      raise ValueError(f"{', '.join(given)}: the 'dl_gemm' scheme's dL kernel takes whole "
                       f"rows (set config.dl = DlConfig(rows=..., num_warps=...) instead, "
                       f"and DlConfig(gemm=PassConfig(...)) for its GEMM launch's tiles)")
    config = dataclasses.replace(config, dl=config.dl or default_dl_config(key.shape[2]))
    if config.dl.mosaic_gemm:
      _mosaic.check_hopper("qk_scale_softmax_backward (config.dl.mosaic_gemm)", interpret,
                           grad_output, query, key, attn_weights)
  config = _tuning.with_overrides(config, block_q=block_q, block_k=block_k,
                                  num_warps=num_warps, num_stages=num_stages)
  return _backward(grad_output, query, key, attn_weights, scaling, causal=causal,
                   config=config, interpret=bool(interpret))
