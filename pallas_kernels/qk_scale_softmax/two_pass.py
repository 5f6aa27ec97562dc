"""The ``"two_pass"`` scheme of the qk_scale_softmax backward: a row kernel and a column
kernel (Pallas Triton).

**Row kernel** (grid ``(cdiv(Sq, block_q), B*H)``): a program owns ``block_q`` rows; pass 1
sums the row sums (``delta``; renormalized, also ``r``: ``_common``) over the row's key tiles,
pass 2 walks them again newest first (the likeliest still in L2), forms ``dL`` and accumulates
``dL @ K_j``; it stores ``grad_query`` and the row stats (``[B*H, Sq]`` fp32 each). A row of
one key tile fuses the passes (``g`` and ``P`` read once). Dense rows of ``Sk % 8 != 0`` keys
take 16-byte aligned tiles of every ``align``-th row (``pallas_kernels._phase``).

**Column kernel** (grid ``(cdiv(Sk, block_k), B*H)``): a program owns ``block_k`` keys,
rebuilds ``dL`` from ``g``, ``P`` and the row stats over the query tiles and accumulates
``dL^T @ Q_i``; it walks the heads in reverse, starting on those the row kernel finished
last (the likeliest still in L2).

Traffic per attention element in bf16: ``g`` and ``P`` read twice (8 B), up to three times
(12 B) when the row kernel's second pass misses L2. Causal: tiles wholly above the diagonal
are skipped, tiles that cross it load with an element-wise mask, tiles below it without.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _phase
from pallas_kernels import _triton_tiles as tiles
from pallas_kernels._util import compiler_params, dot, out_struct, pallas_call
from pallas_kernels.qk_scale_softmax import _common as cm
from pallas_kernels.qk_scale_softmax._common import F32, I32, ZERO
from pallas_kernels.qk_scale_softmax.config import PassConfig


# One program: ``block_q`` query rows of one head -> their grad_query rows and row stats.
# Refs: scale [1] fp32, g and P [B*H, Sq, Sk], K [B*H, Sk, D] -> dQ [B*H, Sq, D], then
# delta (and, renormalized, r) [B*H, Sq] fp32 each. One kernel body per loop strategy,
# chosen by ``row_pass``; the number of stat refs gives the form.


class _RowTiles:
  """A row-kernel program's rows and the tiles it loads (built at the top of the kernel)."""

  def __init__(self, scale_ref, g_ref, p_ref, k_ref, stat_refs, *, seq_q: int, seq_k: int,
               head_dim: int, block_q: int, block_k: int):
    self.qi = pl.program_id(0)  # grid axis 0 is CUDA's fastest: neighbours share a head (K in L2)
    self.bh = pl.program_id(1)
    self.g_ref, self.p_ref, self.k_ref = g_ref, p_ref, k_ref
    self.renormalize = len(stat_refs) == 2
    self.seq_q, self.seq_k = seq_q, seq_k
    self.block_q, self.block_k = block_q, block_k
    self.dtype = g_ref.dtype
    self.d_pad = tiles.padded_head_dim(head_dim)
    self.scale = scale_ref[0]
    self.q_start = self.qi * block_q
    self.rows = self.q_start + jnp.arange(block_q, dtype=I32)
    self.row_ok = self.rows < seq_q
    self.d_ok = jnp.arange(self.d_pad, dtype=I32) < head_dim

  def causal_num_k_tiles(self):
    return cm.row_num_k_tiles(self.qi, self.seq_q, self.seq_k, self.block_q, self.block_k)

  def causal_num_full_k_tiles(self):
    return cm.row_num_full_k_tiles(self.qi, self.seq_q, self.seq_k, self.block_q, self.block_k)

  def zero_acc(self):
    return jnp.zeros((self.block_q, self.d_pad), F32)

  def zero_sums(self):
    return cm.zero_sums(self.block_q, self.renormalize)

  def sums(self, j, *, diagonal: bool):
    """The row sums of key tile ``j``."""
    return cm.row_sums(*self.gp(j, diagonal=diagonal), self.renormalize)

  def gp(self, j, *, diagonal: bool):
    """``g`` and ``P`` of key tile ``j`` (zero outside the arrays); ``diagonal``: also zero
    above the causal diagonal."""
    cols = j * self.block_k + jnp.arange(self.block_k, dtype=I32)
    mask = self.row_ok[:, None] & (cols < self.seq_k)[None, :]
    if diagonal:
      mask &= cols[None, :] <= self.rows[:, None] + (self.seq_k - self.seq_q)
    idx = (self.bh, pl.ds(self.q_start, self.block_q), tiles.ds(j * self.block_k, self.block_k))
    g = pltriton.load(self.g_ref.at[idx], mask=mask, other=0.0)
    p = pltriton.load(self.p_ref.at[idx], mask=mask, other=0.0)
    return g, p

  def k(self, j):
    """``K`` rows of key tile ``j``, ``[block_k, d_pad]`` (zero-padded)."""
    cols = j * self.block_k + jnp.arange(self.block_k, dtype=I32)
    mask = (cols < self.seq_k)[:, None] & self.d_ok[None, :]
    return pltriton.load(self.k_ref.at[self.bh, tiles.ds(j * self.block_k, self.block_k),
                                       tiles.ds(ZERO, self.d_pad)], mask=mask, other=0.0)

  def dq_term(self, j, acc, stats, *, diagonal: bool):
    """``acc + dL_j @ K_j`` for key tile ``j`` (``g`` and ``P`` loaded here)."""
    g, p = self.gp(j, diagonal=diagonal)
    d_l = cm.dl_tile(g, p, stats, self.scale, self.dtype)
    return acc + dot(d_l, self.k(j))

  def store(self, dq_ref, stat_refs, acc, stats):
    pltriton.store(dq_ref.at[self.bh, pl.ds(self.q_start, self.block_q), tiles.ds(ZERO, self.d_pad)],
                   acc.astype(dq_ref.dtype), mask=self.row_ok[:, None] & self.d_ok[None, :])
    for ref, stat in zip(stat_refs, stats):
      pltriton.store(ref.at[self.bh, pl.ds(self.q_start, self.block_q)], stat,
                     mask=self.row_ok)


def _row_kernel_one_tile(scale_ref, g_ref, p_ref, k_ref, dq_ref, *stat_refs, causal: bool,
                         **dims):
  """Rows of one key tile (``Sk <= block_k``): ``g`` and ``P`` are read once; the row
  stats, dL and dQ come from that read. (A loop of one trip, or none for causal rows with
  no keys.)"""
  r = _RowTiles(scale_ref, g_ref, p_ref, k_ref, stat_refs, **dims)
  n_tiles = r.causal_num_k_tiles() if causal else 1
  acc = r.zero_acc()

  def fused(j, carry):
    g, p = r.gp(j, diagonal=causal)
    stats = cm.whole_row_stats(g, p, r.renormalize)
    d_l = cm.dl_tile(g, p, stats, r.scale, r.dtype)
    return stats, carry[1] + dot(d_l, r.k(j))

  stats, acc = tiles.fori_loop(0, n_tiles, fused, (cm.row_stats(r.zero_sums()), acc))
  r.store(dq_ref, stat_refs, acc, stats)


def _row_kernel_two_pass(scale_ref, g_ref, p_ref, k_ref, dq_ref, *stat_refs, **dims):
  """Dense rows of several key tiles: pass 1 sums the row sums, pass 2 (newest tiles first:
  they are the likeliest still in L2) forms dL and accumulates dQ."""
  r = _RowTiles(scale_ref, g_ref, p_ref, k_ref, stat_refs, **dims)
  n_tiles = pl.cdiv(r.seq_k, r.block_k)
  acc = r.zero_acc()
  sums = tiles.fori_loop(0, n_tiles, lambda j, s: cm.add_sums(s, r.sums(j, diagonal=False)),
                         r.zero_sums())
  stats = cm.row_stats(sums)
  acc = tiles.fori_loop(0, n_tiles, lambda t, acc: r.dq_term(n_tiles - 1 - t, acc, stats,
                                                             diagonal=False), acc)
  r.store(dq_ref, stat_refs, acc, stats)


def _row_kernel_causal(scale_ref, g_ref, p_ref, k_ref, dq_ref, *stat_refs, **dims):
  """The two passes on causal rows: key tiles ``[0, n_full)`` lie wholly on or below the
  diagonal and load without the element-wise mask (a mask that varies along a row stops
  Triton from vectorising the loads); only the diagonal tiles ``[n_full, n_tiles)`` get it.
  Tiles past ``n_tiles`` are skipped."""
  r = _RowTiles(scale_ref, g_ref, p_ref, k_ref, stat_refs, **dims)
  n_tiles = r.causal_num_k_tiles()
  acc = r.zero_acc()
  n_full = r.causal_num_full_k_tiles()

  def pass_sums(j, sums, diagonal=False):
    return cm.add_sums(sums, r.sums(j, diagonal=diagonal))

  sums = tiles.fori_loop(0, n_full, pass_sums, r.zero_sums())
  sums = tiles.fori_loop(n_full, n_tiles, functools.partial(pass_sums, diagonal=True), sums)
  stats = cm.row_stats(sums)

  def pass_dq(t, acc, last, diagonal=False):
    return r.dq_term(last - 1 - t, acc, stats, diagonal=diagonal)  # newest tiles first

  acc = tiles.fori_loop(0, n_tiles - n_full, functools.partial(pass_dq, last=n_tiles, diagonal=True),
                   acc)
  acc = tiles.fori_loop(0, n_full, functools.partial(pass_dq, last=n_full), acc)
  r.store(dq_ref, stat_refs, acc, stats)


def _row_kernel_phased(scale_ref, g_ref, p_ref, k_ref, dq_ref, *stat_refs, seq_q: int,
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
  d = jnp.arange(d_pad, dtype=I32)
  d_ok = d < head_dim

  row_ok = rows < seq_q
  renormalize = len(stat_refs) == 2
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

  def pass_sums(j, sums):
    _, _, g, p = load_gp(j)
    return cm.add_sums(sums, cm.row_sums(g, p, renormalize))

  def pass_dq(t, acc):
    j = n_tiles - 1 - t  # newest tiles first: they are the likeliest still in L2
    cols, valid, g, p = load_gp(j)
    # K is indexed by hand: tile 0 starts at a negative (masked) key, which a slice clamps.
    k = pltriton.load(k_ref.at[(bh * seq_k + cols)[:, None] * head_dim + d[None, :]],
                      mask=valid[:, None] & d_ok[None, :], other=0.0)
    return acc + dot(cm.dl_tile(g, p, stats, scale, dtype), k)

  stats = cm.row_stats(tiles.fori_loop(0, n_tiles, pass_sums,
                                       cm.zero_sums(block_q, renormalize)))
  acc = tiles.fori_loop(0, n_tiles, pass_dq, jnp.zeros((block_q, d_pad), F32))

  offs = (bh * seq_q + rows)[:, None] * head_dim + d[None, :]
  pltriton.store(dq_ref.at[offs], acc.astype(dq_ref.dtype),
                 mask=row_ok[:, None] & d_ok[None, :])
  for ref, stat in zip(stat_refs, stats):
    pltriton.store(ref.at[bh * seq_q + rows], stat, mask=row_ok)


# One program: ``block_k`` keys of one head -> their grad_key rows. Refs: scale [1] fp32,
# g and P [B*H, Sq, Sk], Q [B*H, Sq, D], the row stats [B*H, Sq] fp32 each -> dK [B*H, Sk, D].


class _ColTiles:
  """A column-kernel program's keys and the tiles it loads (built at the top of the kernel)."""

  def __init__(self, scale_ref, g_ref, p_ref, q_ref, stat_refs, *, seq_q: int, seq_k: int,
               head_dim: int, block_q: int, block_k: int):
    self.kj = pl.program_id(0)  # neighbours share a head: its Q and delta stay in L2
    # Heads in reverse: the row kernel's last heads are the likeliest to be still in L2.
    self.bh = pl.num_programs(1) - 1 - pl.program_id(1)
    self.g_ref, self.p_ref, self.q_ref, self.stat_refs = g_ref, p_ref, q_ref, stat_refs
    self.seq_q, self.seq_k = seq_q, seq_k
    self.block_q, self.block_k = block_q, block_k
    self.dtype = g_ref.dtype
    self.d_pad = tiles.padded_head_dim(head_dim)
    self.scale = scale_ref[0]
    self.k_start = self.kj * block_k
    self.cols = self.k_start + jnp.arange(block_k, dtype=I32)
    self.col_ok = self.cols < seq_k
    self.d_ok = jnp.arange(self.d_pad, dtype=I32) < head_dim
    self.num_q_tiles = pl.cdiv(seq_q, block_q)

  def causal_first_q_tile(self):
    return cm.col_first_q_tile(self.kj, self.seq_q, self.seq_k, self.block_q, self.block_k)

  def causal_first_full_q_tile(self):
    return cm.col_first_full_q_tile(self.kj, self.seq_q, self.seq_k, self.block_q, self.block_k)

  def zero_acc(self):
    return jnp.zeros((self.block_k, self.d_pad), F32)

  def gp(self, i, *, diagonal: bool):
    """``g`` and ``P`` of query tile ``i`` (zero outside the arrays; past the last tile all
    masked); ``diagonal``: also zero above the causal diagonal."""
    q_start = i * self.block_q
    rows = q_start + jnp.arange(self.block_q, dtype=I32)
    mask = (rows < self.seq_q)[:, None] & self.col_ok[None, :]
    if diagonal:
      mask &= self.cols[None, :] <= rows[:, None] + (self.seq_k - self.seq_q)
    idx = (self.bh, pl.ds(q_start, self.block_q), tiles.ds(self.k_start, self.block_k))
    return (pltriton.load(self.g_ref.at[idx], mask=mask, other=0.0),
            pltriton.load(self.p_ref.at[idx], mask=mask, other=0.0))

  def step(self, i, acc, g, p):
    """``acc + dL_i^T @ Q_i`` for query tile ``i`` (its ``g`` and ``P`` given)."""
    q_start = i * self.block_q
    row_ok = q_start + jnp.arange(self.block_q, dtype=I32) < self.seq_q
    stats = tuple(pltriton.load(ref.at[self.bh, pl.ds(q_start, self.block_q)], mask=row_ok,
                                other=0.0) for ref in self.stat_refs)
    q_idx = (self.bh, pl.ds(q_start, self.block_q), tiles.ds(ZERO, self.d_pad))
    q = pltriton.load(self.q_ref.at[q_idx], mask=row_ok[:, None] & self.d_ok[None, :], other=0.0)
    d_l = cm.dl_tile(g, p, stats, self.scale, self.dtype)
    return acc + dot(d_l, q, trans_a=True)

  def store(self, dk_ref, acc):
    idx = (self.bh, tiles.ds(self.k_start, self.block_k), tiles.ds(ZERO, self.d_pad))
    pltriton.store(dk_ref.at[idx], acc.astype(dk_ref.dtype),
                   mask=self.col_ok[:, None] & self.d_ok[None, :])


def _col_kernel_dense(scale_ref, g_ref, p_ref, q_ref, *refs, **dims):
  """Dense: every query tile, plain loads. ``refs``: the row stats, then dK."""
  *stat_refs, dk_ref = refs
  c = _ColTiles(scale_ref, g_ref, p_ref, q_ref, stat_refs, **dims)
  acc = c.zero_acc()
  acc = tiles.fori_loop(0, c.num_q_tiles, lambda i, acc: c.step(i, acc, *c.gp(i, diagonal=False)),
                   acc)
  c.store(dk_ref, acc)


def _col_kernel_causal(scale_ref, g_ref, p_ref, q_ref, *refs, **dims):
  """Causal: query tiles before ``lo`` hold no key of this tile and are skipped; tiles
  ``[lo, full)`` cross the diagonal and get the element-wise mask; tiles ``[full, end)``
  see every key of this tile and load unmasked (vectorised). ``refs``: the row stats, then
  dK."""
  *stat_refs, dk_ref = refs
  c = _ColTiles(scale_ref, g_ref, p_ref, q_ref, stat_refs, **dims)
  lo = c.causal_first_q_tile()
  acc = c.zero_acc()
  full = c.causal_first_full_q_tile()
  acc = tiles.fori_loop(lo, full, lambda i, acc: c.step(i, acc, *c.gp(i, diagonal=True)), acc)
  acc = tiles.fori_loop(full, c.num_q_tiles,
                   lambda i, acc: c.step(i, acc, *c.gp(i, diagonal=False)), acc)
  c.store(dk_ref, acc)


def use_phased(cfg: PassConfig, causal: bool, bh: int, seq_q: int, seq_k: int,
               head_dim: int) -> bool:
  """Whether the row pass runs :func:`_row_kernel_phased`: ``cfg.row_align`` is not 0, the
  scheme is dense, rows are not 16-byte aligned (``Sk % 8 != 0``), a row spans several
  key tiles (one-tile rows take the fused single-read path) and the flat views fit int32
  offsets."""
  return not causal and _phase.applies(cfg.row_align, seq_k, cfg.block_k, bh * seq_q * seq_k,
                                       bh * max(seq_q, seq_k) * head_dim)


def _row_kernel(cfg: PassConfig, causal: bool, **dims):
  """The row kernel's body for a config (one-tile rows, causal or two-pass)."""
  if pl.cdiv(dims["seq_k"], cfg.block_k) == 1:
    return functools.partial(_row_kernel_one_tile, causal=causal, **dims)
  return functools.partial(_row_kernel_causal if causal else _row_kernel_two_pass, **dims)


@functools.partial(jax.jit, static_argnames=("causal", "cfg", "interpret", "renormalize"))
def row_pass(scale, g, p, k, *, causal, cfg, interpret, renormalize=False):
  """``(grad_query [B*H, Sq, D], stats)`` from 3D ``[B*H, ...]`` views; ``stats`` is
  ``(delta,)``, or ``(delta, r)`` with ``renormalize`` (``[B*H, Sq]`` fp32 each,
  ``_common.row_stats``)."""
  bh, seq_q, seq_k = g.shape
  head_dim = k.shape[-1]
  n_stats = 2 if renormalize else 1
  if use_phased(cfg, causal, bh, seq_q, seq_k, head_dim):
    # align <= block_k: a phase of a whole tile or more would only load earlier rows.
    align, block_q = _phase.resolve(cfg.row_align, seq_q, cfg.block_q, cfg.block_k)
    dq, *stats = pallas_call(
        functools.partial(_row_kernel_phased, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                          block_q=block_q, block_k=cfg.block_k, align=align),
        out_shape=(out_struct((bh * seq_q * head_dim,), k.dtype, g, p, k),
                   *[out_struct((bh * seq_q,), F32, g, p, k)] * n_stats),
        grid=(_phase.num_programs(seq_q, align, block_q), bh),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="qk_scale_softmax_bwd_dq_aligned",
    )(scale, g.reshape(-1), p.reshape(-1), k.reshape(-1))
    return dq.reshape(bh, seq_q, head_dim), tuple(x.reshape(bh, seq_q) for x in stats)
  dq, *stats = pallas_call(
      _row_kernel(cfg, causal, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                  block_q=cfg.block_q, block_k=cfg.block_k),
      out_shape=(out_struct((bh, seq_q, head_dim), k.dtype, g, p, k),
                 *[out_struct((bh, seq_q), F32, g, p, k)] * n_stats),
      grid=(pl.cdiv(seq_q, cfg.block_q), bh),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="qk_scale_softmax_bwd_dq",
  )(scale, g, p, k)
  return dq, tuple(stats)


@functools.partial(jax.jit, static_argnames=("causal", "cfg", "interpret"))
def col_pass(scale, g, p, q, stats, *, causal, cfg, interpret):
  """``grad_key [B*H, Sk, D]`` from 3D ``[B*H, ...]`` views and the row pass's stats (their
  number gives the form of ``dL``)."""
  bh, seq_q, seq_k = g.shape
  head_dim = q.shape[-1]
  return pallas_call(
      functools.partial(_col_kernel_causal if causal else _col_kernel_dense, seq_q=seq_q,
                        seq_k=seq_k, head_dim=head_dim, block_q=cfg.block_q,
                        block_k=cfg.block_k),
      out_shape=out_struct((bh, seq_k, head_dim), q.dtype, g, p, q),
      grid=(pl.cdiv(seq_k, cfg.block_k), bh),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="qk_scale_softmax_bwd_dk",
  )(scale, g, p, q, *stats)
