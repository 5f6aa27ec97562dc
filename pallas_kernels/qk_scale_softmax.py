"""Pallas (Triton) kernels for the backward of ``softmax((Q @ K^T) * scaling)`` (problem C).

Given the softmax output ``P`` and its incoming gradient ``g`` (both
``[B, H, Sq, Sk]``), the gradients of the logits and of ``Q``/``K`` are::

  delta_i    = sum_j g_ij * P_ij                            (fp32)
  dL_ij      = dtype(dtype(P_ij * (g_ij - delta_i)) * scaling)
  grad_query = dL @ K          [B, H, Sq, D]
  grad_key   = dL^T @ Q        [B, H, Sk, D]

This module computes them with two kernels, or one for short rows; ``dL``
(``Sq x Sk`` per head) is never written to memory:

1. **Row kernel**, grid ``(cdiv(Sq, block_q), B*H)``. A program owns
   ``block_q`` rows. Pass 1 walks the row's ``Sk`` tiles and reduces
   ``delta`` (fp32); pass 2 walks them again (last tile first, so the freshest
   tiles are re-read from L2), forms ``dL`` exactly as the reference does and
   accumulates ``dL @ K_j`` on the tensor cores. It stores ``grad_query`` and
   ``delta`` (``[B*H, Sq]`` fp32, tiny). When a row fits one tile
   (``Sk <= block_k``) the two passes are one: ``g`` and ``P`` are read once.
2. **Column kernel**, grid ``(cdiv(Sk, block_k), B*H)``. A program owns
   ``block_k`` key columns, walks the ``Sq`` tiles, rebuilds ``dL`` from
   ``g``, ``P`` and ``delta`` and accumulates ``dL^T @ Q_i``.
3. **Per-head kernel** (``Config.scheme == "per_head"``, rows of <= 256 keys), grid
   ``(B*H,)``. A program owns a whole head: it walks the query tiles (whole rows each),
   forms ``delta``, ``dL`` and ``grad_query`` from one read of ``g`` and ``P``, and keeps
   ``grad_key`` (``[Sk, D]`` fp32) in registers until the end. This is the 4 B floor; it
   replaces kernels 1 and 2 where the tuned table says so (all rows of <= 256 keys on the
   H200; see ``benchmarks/results/qk_scale_softmax.md``).

Also measured and dropped (``benchmarks/results/qk_scale_softmax_tune_schemes.log``): a
delta-only kernel followed by the column kernel adding ``dL @ K_j`` into an fp32
``grad_query`` with atomics (8 B/element of ``g``/``P``, one atomic per element). The
delta kernel streams at full speed (1.93 ms at 4096 x 4096), but the atomics run at about
150 G/s: the column kernel took 14-50 ms there, against 6.9 ms for kernels 1 + 2.
Three row-kernel variants were measured and dropped too
(``benchmarks/results/attention_l2_hints.log``): L2 eviction hints (keep pass 1's tiles
for pass 2, stream the rest) changed nothing; a wider first-pass tile (512 keys) doubled
its time; and a persistent grid of 132-396 programs, meant to shrink the L2 footprint of
pass 2's re-read, was 1.1-2.3x slower, scaling with the number of programs: the row kernel
is bound by the loads each program keeps in flight, not by L2 capacity.

Rows whose length is not a multiple of 8 (``Sk`` = 449, say) are not 16-byte aligned, so
tiles of consecutive rows load with scalar accesses. The dense row kernel then takes row
classes instead (``_row_kernel_phased``, ``pallas_kernels._phase``): every ``align``-th
row of a head shares its offset modulo ``align`` elements, and tiles started that many
keys early are aligned. (2, 449, 449): 217 -> 180 us for the row kernel. The column
kernel keeps scalar loads: its ``grad_key`` accumulator is indexed by key, and a row
class's tiles are shifted by its phase; moving ``dL`` back with a 0/1 shift matrix on the
tensor cores (exact) measured 157-205 us against 144-153 us for the scalar loads
(``benchmarks/results/attention_ragged_rows.log``).

Forming ``dL`` is a good share of the work (both kernels do it per element): its first
bf16 rounding is a conversion plus a bitcast (``_round_to``), its second the conversion
the matmul operand needs anyway; rounding with integer arithmetic on the bits instead
cost 4-8% on short and ragged rows.

Memory traffic per attention element (kernels 1 + 2): ``g`` and ``P`` are 2 B each in bf16, so
each full read is 4 B/element. The column kernel reads them once (4 B). The
row kernel reads them once (4 B) when a row is one tile (the tuned choice
for ``Sk <= 256``), else twice; its second pass re-reads a row the same program
just read (newest tile first). So DRAM traffic is 8 B/element, up to 12 B when
that re-read misses L2, plus ``Q``, ``K``, ``dQ``, ``dK``. On the H200 the
row kernel with long rows takes ~1.6x the column kernel's time (1086 vs 621-673 us
at 2048 x 2048), so its re-read mostly misses: kernels 1 + 2 reach 25-42% of the
4 B floor on rows of 449-4096 keys; with kernel 3 for rows of <= 256 keys (52-75%; 26%
on the small ragged (1, 211, 211), latency-bound with 128 programs) the
geomean is 42.5% (XLA 34%), 1.08-1.57x faster than XLA
(``benchmarks/results/qk_scale_softmax.md``).
The grids put the tile index on the fastest launch axis, so programs running
together share one head and its ``K``/``Q``/``delta`` tiles come from L2; the
column kernel walks the heads in reverse, so it starts on the heads the row
kernel finished last. The floor would be one read (4 B), but it
needs ``delta`` (a full-row reduction) before any ``dL`` exists, and ``dK``
needs whole columns of ``dL``: a single pass would have to write ``dL`` (2 B
write + 2 B read = the same 8 B) or accumulate ``dQ``/``dK`` with atomics.

Why not the algebraic shortcut ``dQ = s * ((P*g) @ K - delta * (P @ K))``,
which needs ``delta`` only at the end (one pass)? It cannot reproduce the
reference's two bf16 roundings of ``dL``, and those are as large as the
tolerance: on the benchmark's inputs even float64 math with no rounding at all
puts only 98.998% of ``grad_query`` elements of the (1, 512, 512) workload
within ``atol=1e-5, rtol=0.05`` (the spec asks for 99%), and rounding ``P*g``
to bf16 for the tensor cores gives 98.5% (``benchmarks/algebra_accuracy.py``;
``benchmarks/results/qk_scale_softmax_limits.log``). Both kernels therefore
form ``dL`` exactly as the reference does.

What bounds the two-pass kernels (same log): with their inputs in L2 they are
only 7-26% faster than from DRAM, and Nsight Compute shows them latency-bound
(25% occupancy, set by registers and shared memory together; 37-41% of issue
slots busy; 39-55% of DRAM bandwidth). Smaller tiles and fewer warps buy
occupancy but lose more than they gain, and splitting the one-program-per-head
scheme over ``D`` (so 512-key rows fit) was 1.3-1.6x slower than two passes.

Causal (``causal=True``): the caller promises ``P_ij = 0`` for
``j > i + (Sk - Sq)``. Those tiles are skipped: the row kernel stops its loops
at the last tile that meets the diagonal, the column kernel starts at the
first row tile that meets it (no loads, no MMAs for skipped tiles); inside
diagonal tiles the loads are masked by the same index condition.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import validation as _checks, _phase, _tuning
from pallas_kernels._util import compiler_params, dot, next_power_of_2, out_struct, pallas_call

__all__ = ["qk_scale_softmax_backward", "Config", "PassConfig"]

_F32 = jnp.float32
_SUPPORTED = (jnp.bfloat16, jnp.float16, jnp.float32)


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


# ----------------------------------------------------------------------- causal ranges
# With causal=True, P_ij may be non-zero only for j <= i + (Sk - Sq). These two helpers give
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


def _row_kernel(scale_ref, g_ref, p_ref, k_ref, dq_ref, delta_ref, *, seq_q: int, seq_k: int,
                head_dim: int, block_q: int, block_k: int, causal: bool,
                prefetch: bool = False):
  """One program: ``block_q`` query rows of one head -> grad_query rows and delta."""
  qi = pl.program_id(0)  # grid axis 0 is CUDA's fastest: neighbours share a head (K in L2)
  bh = pl.program_id(1)
  dtype = g_ref.dtype
  d_pad = next_power_of_2(max(head_dim, 16))
  scale = scale_ref[0]

  q_start = qi * block_q
  rows = q_start + jnp.arange(block_q)
  row_ok = rows < seq_q
  d_ok = jnp.arange(d_pad) < head_dim
  offset = seq_k - seq_q  # P_ij may be non-zero only for j <= i + offset when causal

  num_k_tiles = pl.cdiv(seq_k, block_k)
  n_tiles = _row_num_k_tiles(qi, seq_q, seq_k, block_q, block_k) if causal else num_k_tiles

  def load_gp(j, in_range=None, diagonal=causal):
    cols = j * block_k + jnp.arange(block_k)
    mask = row_ok[:, None] & (cols < seq_k)[None, :]
    if in_range is not None:
      mask &= in_range
    if diagonal:
      mask &= cols[None, :] <= rows[:, None] + offset
    idx = (bh, pl.ds(q_start, block_q), pl.ds(j * block_k, block_k))
    g = pltriton.load(g_ref.at[idx], mask=mask, other=0.0)
    p = pltriton.load(p_ref.at[idx], mask=mask, other=0.0)
    return g, p

  def load_k(j):
    cols = j * block_k + jnp.arange(block_k)
    mask = (cols < seq_k)[:, None] & d_ok[None, :]
    return pltriton.load(k_ref.at[bh, pl.ds(j * block_k, block_k), pl.ds(0, d_pad)],
                         mask=mask, other=0.0)

  def row_delta(g, p):
    return jnp.sum(g.astype(_F32) * p.astype(_F32), axis=1)

  acc = jnp.zeros((block_q, d_pad), _F32)
  if num_k_tiles == 1:
    # The whole row is one tile: read g and P once, fuse both passes.
    def fused(j, carry):
      g, p = load_gp(j)
      delta = row_delta(g, p)
      d_l = _dl_tile(g, p, delta, scale, dtype)
      return delta, carry[1] + dot(d_l, load_k(j))

    delta, acc = jax.lax.fori_loop(0, n_tiles, fused, (jnp.zeros((block_q,), _F32), acc))
  elif prefetch:
    # Software prefetch in registers: the next tile's g and P are requested before this
    # one is used (rows of odd length cannot use Triton's pipelined 16-byte copies).
    # Start indices are traced (``qi * 0 + ...``): a constant start past the end fails
    # the indexer's static bounds check even though the load is masked.
    def pass_delta_pf(j, carry):
      delta, g, p = carry
      nxt = load_gp(j + 1, j + 1 < n_tiles)
      return (delta + row_delta(g, p), *nxt)

    delta, _, _ = jax.lax.fori_loop(
        0, n_tiles, pass_delta_pf, (jnp.zeros((block_q,), _F32), *load_gp(qi * 0, n_tiles > 0)))

    def pass_dq_pf(t, carry):
      acc, g, p = carry
      j = n_tiles - 1 - t
      nxt = load_gp(j - 1, j >= 1)
      d_l = _dl_tile(g, p, delta, scale, dtype)
      return (acc + dot(d_l, load_k(j)), *nxt)

    acc, _, _ = jax.lax.fori_loop(0, n_tiles, pass_dq_pf,
                                  (acc, *load_gp(qi * 0 + n_tiles - 1, n_tiles > 0)))
  else:
    # Causal: tiles [0, n_full) lie wholly on or below the diagonal, so only the diagonal
    # tiles [n_full, n_tiles) get the element-wise causal mask (a mask that varies along a
    # row stops Triton from vectorising the loads).
    n_full = _row_num_full_k_tiles(qi, seq_q, seq_k, block_q, block_k) if causal else n_tiles

    def pass_delta(j, delta, diagonal=False):
      g, p = load_gp(j, diagonal=diagonal)
      return delta + row_delta(g, p)

    delta = jax.lax.fori_loop(0, n_full, pass_delta, jnp.zeros((block_q,), _F32))
    if causal:
      delta = jax.lax.fori_loop(n_full, n_tiles, functools.partial(pass_delta, diagonal=True),
                                delta)

    def pass_dq(t, acc, last=n_tiles, diagonal=False):
      j = last - 1 - t  # newest tiles first: they are the likeliest still in L2
      g, p = load_gp(j, diagonal=diagonal)
      d_l = _dl_tile(g, p, delta, scale, dtype)
      return acc + dot(d_l, load_k(j))

    if causal:
      acc = jax.lax.fori_loop(0, n_tiles - n_full,
                              functools.partial(pass_dq, last=n_tiles, diagonal=True), acc)
    acc = jax.lax.fori_loop(0, n_full, functools.partial(pass_dq, last=n_full), acc)

  pltriton.store(dq_ref.at[bh, pl.ds(q_start, block_q), pl.ds(0, d_pad)], acc.astype(dq_ref.dtype),
                 mask=row_ok[:, None] & d_ok[None, :])
  pltriton.store(delta_ref.at[bh, pl.ds(q_start, block_q)], delta, mask=row_ok)


def _row_kernel_phased(scale_ref, g_ref, p_ref, k_ref, dq_ref, delta_ref, *, seq_q: int,
                       seq_k: int, head_dim: int, block_q: int, block_k: int, align: int):
  """The row kernel (dense) for rows of ``Sk % 8 != 0`` keys, on 16-byte aligned tiles.

  One program = one row class (``block_q`` rows ``align`` apart, see ``pallas_kernels._phase``)
  of one head. Key tile ``j`` covers keys ``[j * BK - phase, (j + 1) * BK - phase)``; every
  load is of 16-byte vectors (``_phase.tile_masks``), and the edge tiles' columns of the
  neighbouring rows are zeroed. All refs but ``scale`` are flat 1D views.
  """
  cls, q0, rows = _phase.class_rows(pl.program_id(0), align, block_q)
  bh = pl.program_id(1)
  dtype = g_ref.dtype
  d_pad = next_power_of_2(max(head_dim, 16))
  scale = scale_ref[0]
  d = jnp.arange(d_pad, dtype=jnp.int32)
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
    return delta + jnp.sum(g.astype(_F32) * p.astype(_F32), axis=1)

  def pass_dq(t, acc):
    j = n_tiles - 1 - t  # newest tiles first: they are the likeliest still in L2
    cols, valid, g, p = load_gp(j)
    # K is indexed by hand: tile 0 starts at a negative (masked) key, which a slice clamps.
    k = pltriton.load(k_ref.at[(bh * seq_k + cols)[:, None] * head_dim + d[None, :]],
                      mask=valid[:, None] & d_ok[None, :], other=0.0)
    return acc + dot(_dl_tile(g, p, delta, scale, dtype), k)

  delta = jax.lax.fori_loop(0, n_tiles, pass_delta, jnp.zeros((block_q,), _F32))
  acc = jax.lax.fori_loop(0, n_tiles, pass_dq, jnp.zeros((block_q, d_pad), _F32))

  offs = (bh * seq_q + rows)[:, None] * head_dim + d[None, :]
  pltriton.store(dq_ref.at[offs], acc.astype(dq_ref.dtype),
                 mask=row_ok[:, None] & d_ok[None, :])
  pltriton.store(delta_ref.at[bh * seq_q + rows], delta, mask=row_ok)


# ------------------------------------------------------------------------ column kernel


def _col_kernel(scale_ref, g_ref, p_ref, q_ref, delta_ref, dk_ref, *, seq_q: int, seq_k: int,
                head_dim: int, block_q: int, block_k: int, causal: bool,
                prefetch: bool = False):
  """One program: ``block_k`` key rows of one head -> grad_key rows."""
  kj = pl.program_id(0)  # neighbours share a head: its Q and delta stay in L2
  # Heads in reverse: the row kernel's last heads are the likeliest to be still in L2.
  bh = pl.num_programs(1) - 1 - pl.program_id(1)
  dtype = g_ref.dtype
  d_pad = next_power_of_2(max(head_dim, 16))
  scale = scale_ref[0]

  k_start = kj * block_k
  cols = k_start + jnp.arange(block_k)
  col_ok = cols < seq_k
  d_ok = jnp.arange(d_pad) < head_dim
  offset = seq_k - seq_q

  num_q_tiles = pl.cdiv(seq_q, block_q)
  lo = _col_first_q_tile(kj, seq_q, seq_k, block_q, block_k) if causal else 0

  def load_gp(i, diagonal=causal):
    q_start = i * block_q
    rows = q_start + jnp.arange(block_q)
    mask = (rows < seq_q)[:, None] & col_ok[None, :]  # past the last tile: all masked
    if diagonal:
      mask &= cols[None, :] <= rows[:, None] + offset
    idx = (bh, pl.ds(q_start, block_q), pl.ds(k_start, block_k))
    return (pltriton.load(g_ref.at[idx], mask=mask, other=0.0),
            pltriton.load(p_ref.at[idx], mask=mask, other=0.0))

  def step(i, acc, g, p):
    q_start = i * block_q
    row_ok = q_start + jnp.arange(block_q) < seq_q
    delta = pltriton.load(delta_ref.at[bh, pl.ds(q_start, block_q)], mask=row_ok, other=0.0)
    q = pltriton.load(q_ref.at[bh, pl.ds(q_start, block_q), pl.ds(0, d_pad)],
                      mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    d_l = _dl_tile(g, p, delta, scale, dtype)
    return acc + dot(d_l, q, trans_a=True)

  acc = jnp.zeros((block_k, d_pad), _F32)
  if prefetch:
    # The next tile's g and P are requested before this one is used (see the row kernel).
    def body_pf(i, carry):
      acc, g, p = carry
      nxt = load_gp(i + 1)
      return (step(i, acc, g, p), *nxt)

    acc, _, _ = jax.lax.fori_loop(lo, num_q_tiles, body_pf, (acc, *load_gp(kj * 0 + lo)))
  else:
    # Causal: query tiles [lo, full) cross the diagonal and get the element-wise mask;
    # tiles [full, end) see every column of this key tile and load unmasked (vectorised).
    full = _col_first_full_q_tile(kj, seq_q, seq_k, block_q, block_k) if causal else lo
    if causal:
      acc = jax.lax.fori_loop(lo, full, lambda i, acc: step(i, acc, *load_gp(i, True)), acc)
    acc = jax.lax.fori_loop(full, num_q_tiles, lambda i, acc: step(i, acc, *load_gp(i, False)),
                            acc)
  pltriton.store(dk_ref.at[bh, pl.ds(k_start, block_k), pl.ds(0, d_pad)], acc.astype(dk_ref.dtype),
                 mask=col_ok[:, None] & d_ok[None, :])


# -------------------------------------------------------------------------- head kernel


def _head_kernel(scale_ref, g_ref, p_ref, q_ref, k_ref, dq_ref, dk_ref, *, seq_q: int,
                 seq_k: int, head_dim: int, block_q: int, causal: bool):
  """One program: a whole head (``"per_head"`` scheme, short rows).

  Walks the head's query tiles; each holds whole rows (``Sk`` padded), so ``delta``, ``dL``
  and ``grad_query`` are done in one read of ``g`` and ``P``. ``grad_key`` accumulates in
  registers over the tiles (``[Sk, D]`` fp32: only for short rows) and is stored once.
  """
  bh = pl.program_id(0)
  dtype = g_ref.dtype
  d_pad = next_power_of_2(max(head_dim, 16))
  block_k = next_power_of_2(max(seq_k, 16))
  scale = scale_ref[0]
  cols = jnp.arange(block_k)
  col_ok = cols < seq_k
  d_ok = jnp.arange(d_pad) < head_dim
  offset = seq_k - seq_q
  k = pltriton.load(k_ref.at[bh, pl.ds(0, block_k), pl.ds(0, d_pad)],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)

  def body(i, acc):
    q_start = i * block_q
    rows = q_start + jnp.arange(block_q)
    row_ok = rows < seq_q
    mask = row_ok[:, None] & col_ok[None, :]
    if causal:
      mask &= cols[None, :] <= rows[:, None] + offset
    idx = (bh, pl.ds(q_start, block_q), pl.ds(0, block_k))
    g = pltriton.load(g_ref.at[idx], mask=mask, other=0.0)
    p = pltriton.load(p_ref.at[idx], mask=mask, other=0.0)
    delta = jnp.sum(g.astype(_F32) * p.astype(_F32), axis=1)
    d_l = _dl_tile(g, p, delta, scale, dtype)
    qd_idx = (bh, pl.ds(q_start, block_q), pl.ds(0, d_pad))
    qd_mask = row_ok[:, None] & d_ok[None, :]
    pltriton.store(dq_ref.at[qd_idx], dot(d_l, k).astype(dq_ref.dtype), mask=qd_mask)
    q = pltriton.load(q_ref.at[qd_idx], mask=qd_mask, other=0.0)
    return acc + dot(d_l, q, trans_a=True)

  acc = jax.lax.fori_loop(0, pl.cdiv(seq_q, block_q), body, jnp.zeros((block_k, d_pad), _F32))
  pltriton.store(dk_ref.at[bh, pl.ds(0, block_k), pl.ds(0, d_pad)], acc.astype(dk_ref.dtype),
                 mask=col_ok[:, None] & d_ok[None, :])


# ------------------------------------------------------------------------------ wrapper


class PassConfig(NamedTuple):
  """Tiles and Triton launch parameters of one kernel (tiles: powers of two >= 16).

  ``prefetch``: load the next tile's g and P while this one is computed.
  ``row_align`` (row kernel, dense): rows of ``Sk % 8 != 0`` keys take aligned tiles of
  every ``row_align``-th row (``_row_kernel_phased``; ``prefetch`` is then unused): 8, 16,
  32 or 64; -1 = ``_phase.choose``; 0 = off (tiles of consecutive rows, scalar loads).
  """
  block_q: int
  block_k: int
  num_warps: int
  num_stages: int
  prefetch: bool = False
  row_align: int = -1


SCHEMES = ("two_pass", "per_head")


class Config(NamedTuple):
  """How the backward runs: a ``scheme`` and the configs of its kernels.

  * ``"two_pass"``: ``row`` is the delta + grad_query kernel, ``col`` the grad_key kernel.
  * ``"per_head"``: one kernel, one program per head (``col.block_q`` query rows per step,
    whole rows as one tile; ``row`` unused). Rows of at most 512 keys (the tuned table
    uses it up to 256).
  """
  row: PassConfig
  col: PassConfig
  scheme: str = "two_pass"


_KERNEL = "qk_scale_softmax"


def length_class(seq_k: int) -> str:
  """The tuning table's key for rows of ``seq_k`` keys (see ``_tuning.tile_length_class``)."""
  return _tuning.tile_length_class(seq_k)


def _heuristic(seq_q: int, seq_k: int, head_dim: int, *, row: bool) -> PassConfig:
  """Untuned tiles and launch parameters for one of the two kernels.

  Base tiles are ``block_q=64`` x ``block_k=128``, capped by the padded sequence lengths and
  kept >= 16 (the tensor-core minimum). The row kernel deviates in two ways:

  * ``Sk <= 256``: the whole row is one tile (``block_k`` = padded Sk; ``block_q=32``, or
    64 when ``Sk <= 128``), so its two passes fuse and ``g``/``P`` are read once.
  * ``Sk > 256``: ``block_q=32``, halving each program's row footprint (``32*Sk*4`` B) so
    that pass 2's re-read of the row is more likely to hit L2 (~260 programs in flight).
  """
  d_pad = next_power_of_2(max(head_dim, 16))
  pq = max(16, next_power_of_2(seq_q))
  pk = max(16, next_power_of_2(seq_k))
  block_q = min(32 if row and pk > 128 else 64, pq)
  block_k = min(256 if row and pk <= 256 else 128, pk)
  tile = block_q * block_k
  num_warps = 8 if tile >= 8192 or (d_pad >= 128 and tile >= 4096) else 4
  if row and block_k >= pk:
    num_stages = 1  # one-tile rows: the loop runs once, there is nothing to prefetch
  else:
    num_stages = 2 if d_pad >= 128 or tile >= 8192 else 3
  return PassConfig(block_q, block_k, num_warps, num_stages)


def default_config(seq_q: int, seq_k: int, head_dim: int, dtype, device_kind=None,
                   schemes=SCHEMES) -> Config:
  """The tuned config (bf16/fp16, D <= 128, on the device it was tuned on), else a heuristic.

  Tuned tiles are capped at the padded lengths; a tuned row kernel with a whole-row tile
  (``block_k == 0`` in the table) takes ``block_k`` = the padded ``Sk``. The table's
  scheme is used if it is in ``schemes`` (and ``per_head`` only for ``Sk <= 256``), else
  its ``two_pass`` entry.
  """
  tuned = _tuning.lookup(_tuning.table(_KERNEL, device_kind or ""), length_class(seq_k))
  if not tuned or jnp.dtype(dtype).itemsize > 2 or next_power_of_2(head_dim) > 128:
    return Config(_heuristic(seq_q, seq_k, head_dim, row=True),
                  _heuristic(seq_q, seq_k, head_dim, row=False))
  pq = max(16, next_power_of_2(seq_q))
  pk = max(16, next_power_of_2(seq_k))

  def cap(c):
    # A whole-row tile (0) is only tuned for short rows; a long row borrowing that entry
    # (see _tuning.lookup) takes 128-key tiles instead of a tile too large for registers.
    block_k = (pk if pk <= 512 else 128) if c[1] == 0 else min(c[1], pk)
    return PassConfig(min(c[0], pq), block_k, *c[2:])

  scheme = tuned.get("scheme", "two_pass")
  if scheme == "per_head" and scheme in schemes and "head" in tuned and pk <= 256:
    head = cap(tuned["head"])
    return Config(head, head, "per_head")
  return Config(cap(tuned["row"]), cap(tuned["col"]))


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
      functools.partial(_row_kernel, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                        block_q=cfg.block_q, block_k=cfg.block_k, causal=causal,
                        prefetch=cfg.prefetch),
      out_shape=(out_struct((bh, seq_q, head_dim), k.dtype, g, p, k),
                 out_struct((bh, seq_q), _F32, g, p, k)),
      grid=(pl.cdiv(seq_q, cfg.block_q), bh),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="qk_scale_softmax_bwd_dq",
  )(scale, g, p, k)


def use_phased(cfg, causal, bh, seq_q, seq_k, head_dim) -> bool:
  """Whether the row kernel runs :func:`_row_kernel_phased`: ``cfg.row_align`` is not 0, the
  scheme is dense, rows are not 16-byte aligned (``Sk % 8 != 0``), a row spans several
  key tiles (one-tile rows take the fused single-read path) and the flat views fit int32
  offsets."""
  return not causal and _phase.applies(cfg.row_align, seq_k, cfg.block_k, bh * seq_q * seq_k,
                                       bh * max(seq_q, seq_k) * head_dim)


@functools.partial(jax.jit, static_argnames=("causal", "cfg", "interpret"))
def col_pass(scale, g, p, q, delta, *, causal, cfg, interpret):
  """``grad_key [B*H, Sk, D]`` from 3D ``[B*H, ...]`` views and the row pass's delta."""
  bh, seq_q, seq_k = g.shape
  head_dim = q.shape[-1]
  return pallas_call(
      functools.partial(_col_kernel, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                        block_q=cfg.block_q, block_k=cfg.block_k, causal=causal,
                        prefetch=cfg.prefetch),
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
  if next_power_of_2(seq_k) > 512:
    raise ValueError(f"the per_head scheme takes rows of at most 512 keys, got Sk={seq_k}")
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
  if config.scheme == "per_head":
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
  """Backward of ``softmax((Q @ K^T) * scaling)`` to ``Q`` and ``K`` (problem C).

  Args:
    grad_output: ``[B, H, Sq, Sk]`` gradient ``g`` of the attention weights.
    query: ``[B, H, Sq, D]``.
    key: ``[B, H, Sk, D]``.
    attn_weights: ``[B, H, Sq, Sk]`` softmax output ``P``.
    scaling: the logits' scale; a Python float or a (possibly traced) scalar.
    causal: the caller promises ``P_ij == 0`` for ``j > i + (Sk - Sq)``; tiles entirely in
      that region are skipped (never loaded, no MMAs). Results equal the dense ones.
    config: tiles and launch parameters of each kernel (:class:`Config`). Default: the
      table ``tuned/qk_scale_softmax.json`` measured on an H200 (16-bit inputs, D <= 128,
      on that device), else a heuristic (64 x 128 tiles; the row kernel takes 32 query rows
      for rows of more than 128 keys, and a whole row of up to 256 keys as one tile).
    block_q, block_k, num_warps, num_stages: override one field of both kernels' configs
      (tiles: powers of two >= 16 along ``Sq`` and ``Sk``).
    interpret: run the kernels in Pallas interpret mode (CPU testing).

  All arrays share one dtype: bfloat16 (main target), float16 or float32. Arithmetic is fp32
  with ``dL`` rounded to the input dtype exactly as the reference; matmuls take ``dL`` and
  ``K``/``Q`` in the input dtype (tensor cores) and accumulate in fp32. ``D`` may be any size
  (padded to a power of two >= 16 and masked); ``Sq``/``Sk`` any length >= 1.

  Design (see the module docstring): the tuned table takes one program per head for rows
  of up to 256 keys (``"per_head"``: ``g`` and ``P`` read once, 4 B per element); longer
  rows take two kernels: a row kernel computes ``delta`` and ``grad_query``; a
  column kernel recomputes ``dL`` from ``g``, ``P`` and ``delta`` and computes ``grad_key``.
  DRAM traffic there is 8 B per attention element in bf16 (``g`` and ``P`` read by each kernel,
  4 B each time), up to 12 B when ``Sk > 256`` and the row kernel's second pass over a row
  misses L2, plus ``Q``, ``K``, ``dQ``, ``dK``. ``dL`` itself is never materialised: ``dQ``
  and ``dK`` need it row-wise and column-wise, and it cannot be formed before ``delta``.

  Returns:
    ``(grad_query [B, H, Sq, D], grad_key [B, H, Sk, D])`` in the inputs' dtype.
  """
  _checks.check_problem_c(grad_output, query, key, attn_weights, scaling, dtypes=_SUPPORTED)
  causal = _checks.check_causal(causal, query.shape[2], key.shape[2], every_row_has_keys=False)
  if config is None:
    device_kind = None if interpret else jax.devices()[0].device_kind
    config = default_config(query.shape[2], key.shape[2], query.shape[3], query.dtype,
                            device_kind)
  config = _tuning.with_overrides(config, block_q=block_q, block_k=block_k,
                                  num_warps=num_warps, num_stages=num_stages)
  if config.scheme not in SCHEMES:
    raise ValueError(f"config.scheme: expected one of {SCHEMES}, got {config.scheme!r}")
  return _backward(grad_output, query, key, attn_weights, scaling, causal=causal,
                   config=config, interpret=bool(interpret))
