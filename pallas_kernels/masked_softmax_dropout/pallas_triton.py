"""Masked softmax -> dropout backward: the Pallas Triton row kernel and its entry point.

Forward (for context): ``P = softmax(scores.masked_fill(~mask, -1e4))``,
``y = P * keep / (1 - p)``. Backward, all fp32 inside::

    gd = g * keep / (1 - p)        (gd = g when p == 0; keep is then not read)
    s  = rowsum(P * gd)            (over all columns: the mask is not applied)
    dS = where(mask, P * (gd - s), 0)

Design: the op is a row-wise reduction followed by an elementwise update, so one program
owns ``block_rows`` whole rows of one head and reads g, P, keep and the mask exactly once
(all four loads issued together, so a program waits for one memory round trip); the result
is written once. Triton blocks are powers of two, so a row of odd length is either padded
to the next power of two or covered by two masked power-of-two column chunks (131 = 128 + 4
lanes rather than 256); the tuned table picks per row-length class. That is the minimum
traffic: 4 + 4 (+1 keep) bytes in, 4 out per element (fp32), plus the [B, 1, Sq, Sk]
attention mask. The launch grid is (heads, batch * row blocks) with heads fastest, so the H
programs that share a mask tile run together and the mask comes from L2 after its first
read. The config comes from the tuned table for the arrays' device (``config.py``), else a
heuristic of a few thousand elements per program.

Config fields beyond the tiling (defaults: the design above) express other designs, such
as a public Triton row kernel's (one row per program, g/P/keep loaded ``.cg``, an evict-first
store, the mask loaded ``.ca`` after the row sum, several heads per program on short rows):
cache modifiers and L2 eviction policies of the streamed loads, the mask load and the
store, the mask loaded after the row sums, and ``heads_per_program`` (the grid's first axis
is then ``cdiv(H, heads_per_program)``; the mask tile is loaded once for all of them).
``benchmarks/b_variants.py`` times them. Measurements and history:
``benchmarks/results/masked_softmax_dropout_design.log``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _dropout, _tuning, _util, validation
from pallas_kernels._util import Dropout, compiler_params, out_struct, pallas_call
from pallas_kernels.masked_softmax_dropout.config import (MAX_WARP_ROWS, SEGMENT, Config,
                                                          column_chunks, default_config,
                                                          warp_rows_warps)
from pallas_kernels.masked_softmax_dropout.forward import masked_fill

_NAME = "masked_softmax_dropout_backward"


def _unpack_refs(refs, dropout: Dropout):
  """``(scale_ref, g_ref, p_ref, mask_ref, keep_ref, o_ref)``; absent refs are ``None``.

  ``scale_ref`` (traced rate only) holds ``[1 / (1 - p), p > 0]``; ``keep_ref`` is absent
  when the rate is a concrete 0.
  """
  if dropout.mode == "traced":
    return refs
  if dropout.mode == "none":
    g_ref, p_ref, mask_ref, o_ref = refs
    return None, g_ref, p_ref, mask_ref, None, o_ref
  g_ref, p_ref, mask_ref, keep_ref, o_ref = refs
  return None, g_ref, p_ref, mask_ref, keep_ref, o_ref


# The default configs of the kernels that draw the mask hash once per pair of columns
# (Config.pair_hash): off, timed on the H200 (the backward from the scores,
# benchmarks/results/runs/b_forward_b44b81d.log): 540 vs 497 us at B=8 H=16 S=1024, 904 vs
# 939 us at (4, 4, 4096), equal at (32, 8, 256) and (16, 8, 2048); S=1024 then ran the
# heuristic launch, which the table's 1024 entry has since replaced.
PAIR_HASH = False


def _hashed_keep(seeds_ref, bh, rows, c0, width, seq_k, pairs):
  """The keep mask of the tile of ``width`` columns from ``c0`` drawn from the key
  (``pallas_kernels._dropout``): ``seeds_ref`` holds ``[k0, k1, threshold]`` (uint32).
  ``pairs``: one hash per pair of columns (:attr:`Config.pair_hash`; the tiles are column
  chunks of a power-of-two width at multiples of it, so even ones start at even columns)."""
  u32 = jnp.uint32
  u = _dropout.tile_bits16(seeds_ref[0], seeds_ref[1], bh.astype(u32),
                           rows.astype(u32)[:, None], jnp.asarray(c0).astype(u32), width,
                           seq_k, pairs=pairs)
  return u >= seeds_ref[2]


def _draw(config, bh, rows, c0, width, seq_k):
  """``_dropped_grad``'s ``hashed`` argument (:func:`_hashed_keep`'s) for a tile."""
  return (bh, rows, c0, width, seq_k, config.pair_hash)


def _load_keep(keep_ref, scale_ref, tile, valid, dropout: Dropout, stream: dict):
  """The tile's keep mask as read (``None`` when the rate is a concrete 0); ``stream``: the
  load's cache modifier and eviction policy."""
  if dropout.mode == "none":
    return None
  if dropout.mode == "traced":
    # A traced rate: when it is 0 the predicated-off load never touches memory.
    return pltriton.load(keep_ref.at[tile], mask=valid & (scale_ref[1] > 0), other=True,
                         **stream)
  return pltriton.load(keep_ref.at[tile], mask=valid, other=False, **stream)


def _dropped_grad(g, keep, keep_ref, scale_ref, dropout: Dropout, hashed=None,
                  drawn: bool = False):
  """``gd = g * keep / (1 - p)`` for one tile (``g`` when the rate is a concrete 0), fp32.
  ``keep``: the tile's mask, as read or (``drawn``) as drawn from the key; ``hashed``:
  ``_hashed_keep``'s arguments (:func:`_draw`) when ``keep_ref`` holds the key's seeds and
  the mask is drawn here instead."""
  g = g.astype(jnp.float32)
  if dropout.mode == "none":
    return g
  if hashed is not None:
    keep, drawn = _hashed_keep(keep_ref, *hashed), True
  if dropout.mode == "traced":
    # Drawn from the key: 0 * scale, NaN everywhere for an invalid rate (a read mask's
    # loads are predicated off at rate 0 instead).
    return jnp.where(keep, g * scale_ref[0], _fill(dropout, scale_ref) if drawn else 0.0)
  return jnp.where(keep, g * dropout.scale, 0.0)


def _fill(dropout: Dropout, scale_ref):
  """The value of masked elements: 0; with a traced rate, 0 * (1 / (1 - p)): NaN for an
  invalid rate, so that then every element is NaN, as in the reference."""
  return 0.0 if dropout.mode != "traced" else 0.0 * scale_ref[0]


def _load_mask(mask_ref, b, r0, c0, block_rows, width, valid, config):
  return pltriton.load(mask_ref.at[b, pl.ds(r0, block_rows), pl.ds(c0, width)], mask=valid,
                       other=False, cache_modifier=config.mask_cache,
                       eviction_policy=config.mask_eviction)


def _program_heads(h, b, num_heads, heads_per_program):
  """``[(b * H + head, in_range)]`` for the heads of program ``h`` of the grid's first axis;
  ``in_range`` is ``None`` where every head exists (H a multiple of the heads per program),
  else ``head < H``."""
  if heads_per_program == 1:
    return [(b * num_heads + h, None)]
  heads = [h * heads_per_program + j for j in range(heads_per_program)]
  ragged = num_heads % heads_per_program != 0
  return [(b * num_heads + head, head < num_heads if ragged else None) for head in heads]


def _grid(batch, num_heads, seq_q, config: Config):
  """The launch grid: ``(head groups, batch * row blocks)`` in the default order (with
  ``blocks_per_program`` row blocks per program), else one axis in :attr:`Config.row_group`
  order (:func:`_program_tile` decodes it)."""
  n_heads = pl.cdiv(num_heads, config.heads_per_program)
  n_blocks = pl.cdiv(seq_q, config.block_rows)
  if config.row_group == 0:
    return (n_heads, batch * pl.cdiv(n_blocks, config.blocks_per_program))
  group = min(config.row_group, n_blocks)
  return (batch * n_heads * pl.cdiv(n_blocks, group) * group,)


def _program_tile(num_heads, seq_q, config: Config):
  """``(head group, batch entry, first row)`` of this program. Where the row blocks do not
  divide evenly (a row group, or ``blocks_per_program``), the last programs get rows >=
  ``seq_q``: every access of theirs is masked off."""
  n_blocks = pl.cdiv(seq_q, config.block_rows)
  if config.row_group == 0:
    per_head = pl.cdiv(n_blocks, config.blocks_per_program)
    t = pl.program_id(1)
    first = (t % per_head) * config.blocks_per_program
    return pl.program_id(0), t // per_head, first * config.block_rows
  n_heads = pl.cdiv(num_heads, config.heads_per_program)
  group = min(config.row_group, n_blocks)
  n_groups = pl.cdiv(n_blocks, group)
  p = pl.program_id(0)
  in_group, p = p % group, p // group
  h, p = p % n_heads, p // n_heads
  block = (p % n_groups) * group + in_group
  return h, p // n_groups, block * config.block_rows


class _Block:
  """One row block of a program (``block_rows`` rows of its heads): its loads, and the
  update that reduces and writes it."""

  def __init__(self, refs, h, b, heads, *, seq_q, seq_k, config: Config, dropout: Dropout,
               hashed: bool, from_scores: bool = False):
    (self.scale_ref, self.g_ref, self.p_ref, self.mask_ref, self.keep_ref,
     self.o_ref) = refs
    self.h, self.b, self.heads = h, b, heads
    self.seq_q, self.seq_k, self.config, self.dropout = seq_q, seq_k, config, dropout
    self.hashed = hashed
    # ``p_ref`` holds the scores, from which the update recomputes P.
    self.from_scores = from_scores

  def _chunks(self, r0, live=None):
    """``(c0, width, rows, cols, valid)`` per column chunk of the block at row ``r0``;
    ``live``: a scalar predicate that masks every access off when false."""
    block_rows = self.config.block_rows
    rows = r0 + jnp.arange(block_rows)
    for c0, width in column_chunks(self.seq_k, self.config.split):
      # A traced start: a constant one past the row's end fails the indexer's static bounds
      # check even though the masked access is fine.
      c0 = self.h * 0 + c0
      cols = c0 + jnp.arange(width)
      valid = (rows[:, None] < self.seq_q) & (cols[None, :] < self.seq_k)
      if live is not None:
        valid = valid & live
      yield c0, width, rows, cols, valid

  def _head_valid(self, valid, in_range):
    return valid if in_range is None else valid & in_range

  def load_tile(self, bh, head_valid, r0, c0, width, stream):
    """``(g, P, keep)`` of one head's tile as read (``keep`` ``None`` when not read)."""
    tile = (bh, pl.ds(r0, self.config.block_rows), pl.ds(c0, width))
    g = pltriton.load(self.g_ref.at[tile], mask=head_valid, other=0.0, **stream)
    probs = pltriton.load(self.p_ref.at[tile], mask=head_valid, other=0.0, **stream)
    keep = None if self.hashed else _load_keep(self.keep_ref, self.scale_ref, tile,
                                               head_valid, self.dropout, stream)
    return g, probs, keep

  def load(self, r0, live=None):
    """The block's loads as read, per chunk ``(mask tile or None, [(g, P, keep)] per
    head)``; the mask tile is ``None`` when it is loaded after the row sums."""
    c = self.config
    stream = dict(cache_modifier=c.stream_cache, eviction_policy=c.stream_eviction)
    out = []
    for c0, width, _, _, valid in self._chunks(r0, live):
      per_head = [self.load_tile(bh, self._head_valid(valid, in_range), r0, c0, width,
                                 stream)
                  for bh, in_range in self.heads]
      # By default the attention mask is loaded with the others (not after the row sum),
      # so a program waits for one round trip to memory, not two; P from the scores needs it
      # first.
      after = c.mask_after_sum and not self.from_scores
      attend = None if after else _load_mask(self.mask_ref, self.b, r0, c0, c.block_rows,
                                             width, valid, c)
      out.append((attend, per_head))
    return out

  def _softmax(self, chunks, loaded):
    """P of the loaded block from its scores, per chunk and head (fp32, rounded to the
    output dtype first): the forward kernel's ``masked_softmax`` over the whole row."""
    filled = [[masked_fill(s, attend, self._head_valid(valid, in_range))
               for (_, in_range), (_, s, _) in zip(self.heads, per_head)]
              for (_, _, _, _, valid), (attend, per_head) in zip(chunks, loaded)]
    heads = range(len(self.heads))
    top = [functools.reduce(jnp.maximum, [jnp.max(f[i], axis=1, keepdims=True)
                                          for f in filled]) for i in heads]
    exps = [[jnp.exp(f[i] - top[i]) for i in heads] for f in filled]
    total = [sum(jnp.sum(e[i], axis=1, keepdims=True) for e in exps) for i in heads]
    dtype = self.o_ref.dtype
    return [[(e[i] / total[i]).astype(dtype).astype(jnp.float32) for i in heads]
            for e in exps]

  def update(self, r0, loaded):
    """Reduces the row sums of the loaded block and writes its gradient."""
    c = self.config
    chunks = list(self._chunks(r0))
    sums = [jnp.zeros((c.block_rows, 1), jnp.float32) for _ in self.heads]
    dropped = []
    if self.from_scores:
      probs_of = self._softmax(chunks, loaded)
    else:
      probs_of = [[probs for _, probs, _ in per_head] for _, per_head in loaded]
    for (c0, width, rows, _, _), (_, per_head), chunk_probs in zip(chunks, loaded, probs_of):
      gds = []
      for (bh, _), (g, _, keep), probs in zip(self.heads, per_head, chunk_probs):
        draw = _draw(self.config, bh, rows, c0, width, self.seq_k) if self.hashed else None
        gds.append((probs.astype(jnp.float32),
                    _dropped_grad(g, keep, self.keep_ref, self.scale_ref, self.dropout, draw)))
      sums = [s + jnp.sum(probs * gd, axis=1, keepdims=True)
              for s, (probs, gd) in zip(sums, gds)]
      dropped.append(gds)
    fill = self.fill()
    for (c0, width, _, _, valid), (attend, _), gds in zip(chunks, loaded, dropped):
      if attend is None:
        attend = _load_mask(self.mask_ref, self.b, r0, c0, c.block_rows, width, valid, c)
      self.store(r0, c0, width, valid, attend, sums, gds, fill)

  def fill(self):
    """The value of masked elements (:func:`_fill`)."""
    return _fill(self.dropout, self.scale_ref)

  def store(self, r0, c0, width, valid, attend, sums, gds, fill):
    """Writes ``dS = where(mask, P * (gd - s), fill)`` of one chunk, per head."""
    rows = self.config.block_rows
    for s, (bh, in_range), (probs, gd) in zip(sums, self.heads, gds):
      out = jnp.where(attend, probs * (gd - s), fill)
      pltriton.store(self.o_ref.at[bh, pl.ds(r0, rows), pl.ds(c0, width)],
                     out.astype(self.o_ref.dtype), mask=self._head_valid(valid, in_range),
                     eviction_policy=self.config.store_eviction)


def _loop(n: int, body, init):
  """``fori_loop(0, n, body, init)`` with an int32 index, under x64 too (the kernel's other
  indices are int32)."""
  return jax.lax.fori_loop(jnp.int32(0), jnp.int32(n), body, init)


def _two_pass(block: _Block, r0):
  """The rows of ``block`` at ``r0`` in column chunks of ``config.chunk``, twice: the first
  pass reduces the row sums, the second reads the chunks again (from the caches: the
  program read them a moment ago) and writes the gradient. Few registers per program, so
  many programs share an SM and keep memory busy."""
  c, width = block.config, block.config.chunk
  n_chunks = pl.cdiv(block.seq_k, width)
  rows = r0 + jnp.arange(c.block_rows)

  def chunk(j, stream):
    c0 = j * width
    cols = c0 + jnp.arange(width)
    valid = (rows[:, None] < block.seq_q) & (cols[None, :] < block.seq_k)
    per_head = []
    for bh, in_range in block.heads:
      g, probs, keep = block.load_tile(bh, block._head_valid(valid, in_range), r0, c0, width,
                                       stream)
      draw = _draw(block.config, bh, rows, c0, width, block.seq_k) if block.hashed else None
      per_head.append((probs.astype(jnp.float32),
                       _dropped_grad(g, keep, block.keep_ref, block.scale_ref, block.dropout,
                                     draw)))
    return c0, valid, per_head

  first = dict(cache_modifier=c.stream_cache, eviction_policy=c.stream_eviction)
  again = dict(cache_modifier=None, eviction_policy="evict_first")  # the last read

  def accumulate(j, accs):
    _, _, per_head = chunk(j, first)
    return tuple(a + probs * gd for a, (probs, gd) in zip(accs, per_head))

  zeros = tuple(jnp.zeros((c.block_rows, width), jnp.float32) for _ in block.heads)
  accs = _loop(n_chunks, accumulate, zeros)
  sums = [jnp.sum(a, axis=1, keepdims=True) for a in accs]
  fill = block.fill()

  def write(j, carry):
    c0, valid, per_head = chunk(j, again)
    attend = _load_mask(block.mask_ref, block.b, r0, c0, c.block_rows, width, valid, c)
    block.store(r0, c0, width, valid, attend, sums, per_head, fill)
    return carry

  _loop(n_chunks, write, 0)


def _kernel(*refs, num_heads, seq_q, seq_k, config: Config, dropout: Dropout,
            hashed: bool = False, from_scores: bool = False):
  """One program: ``blocks_per_program`` blocks of ``block_rows`` rows of
  ``heads_per_program`` heads of one batch entry (:func:`_program_tile`); every row whole,
  in power-of-two column chunks, every byte read once. The mask tile is loaded once and
  serves all the program's heads. With several blocks, the next block's loads are issued
  before this block's row sums, so the loads of one overlap the update of the other."""
  h, b, r0 = _program_tile(num_heads, seq_q, config)
  block = _Block(_unpack_refs(refs, dropout), h, b,
                 _program_heads(h, b, num_heads, config.heads_per_program), seq_q=seq_q,
                 seq_k=seq_k, config=config, dropout=dropout, hashed=hashed,
                 from_scores=from_scores)
  if config.chunk:
    _two_pass(block, r0)
    return
  n = config.blocks_per_program
  if n == 1:
    block.update(r0, block.load(r0))
    return
  step = config.block_rows
  if not config.prefetch:
    def plain(i, carry):
      block.update(r0 + i * step, block.load(r0 + i * step))
      return carry

    _loop(n, plain, 0)
    return

  def body(i, loaded):
    nxt = block.load(r0 + (i + 1) * step, live=i + 1 < n)
    block.update(r0 + i * step, loaded)
    return nxt

  _loop(n, body, block.load(r0))


# A warp_rows program's slots in the partial-sums buffer (one per warp).
_SUM_SLOTS = MAX_WARP_ROWS


def _warp_rows_kernel(*refs, num_heads, seq_q, seq_k, warps, config: Config,
                      dropout: Dropout, hashed: bool, interpret: bool):
  """One row of one head on ``warps`` warps (:attr:`Config.warp_rows`). The row is a
  ``[warps, 128]`` tile of flat offsets (warp ``w`` owns columns ``128 w .. 128 w + 127``),
  so each warp reduces its segment with shuffles. Each warp writes its partial sum to slot
  ``w`` of the row's ``[32]`` slots in ``sums_ref``; after a barrier every warp reads the
  row's slots back as a ``[warps, 128]`` tile (slots ``>= warps`` masked off) and sums them
  in the same order, so all hold the same row sum. Every load and store is a ``[warps, 128]``
  tile contiguous along the columns: the tiles share one register layout and nothing goes
  through shared memory."""
  *refs, sums_ref = refs
  scale_ref, g_ref, p_ref, mask_ref, keep_ref, o_ref = _unpack_refs(refs, dropout)
  h, t = pl.program_id(0), pl.program_id(1)
  b, r = t // seq_q, t % seq_q
  bh = b * num_heads + h
  warp = jnp.arange(warps, dtype=jnp.int32)[:, None]
  lane = jnp.arange(SEGMENT, dtype=jnp.int32)[None, :]
  cols = warp * SEGMENT + lane
  valid = cols < seq_k
  base, mask_base = (bh * seq_q + r) * seq_k, (b * seq_q + r) * seq_k
  if seq_k % SEGMENT == 0:
    base, mask_base = pl.multiple_of(base, SEGMENT), pl.multiple_of(mask_base, SEGMENT)
  stream = dict(cache_modifier=config.stream_cache, eviction_policy=config.stream_eviction)
  at = base + cols
  g = pltriton.load(g_ref.at[at], mask=valid, other=0.0, **stream)
  probs = pltriton.load(p_ref.at[at], mask=valid, other=0.0, **stream).astype(jnp.float32)
  mask_at = mask_base + cols

  def load_mask():
    return pltriton.load(mask_ref.at[mask_at], mask=valid, other=False,
                         cache_modifier=config.mask_cache, eviction_policy=config.mask_eviction)

  attend = None if config.mask_after_sum else load_mask()
  if dropout.mode == "none":
    keep = None
  elif hashed:
    u32 = jnp.uint32
    keep = _dropout.bits16(keep_ref[0], keep_ref[1], bh.astype(u32), r.astype(u32),
                           cols.astype(u32), seq_k) >= keep_ref[2]
  else:
    keep = _load_keep(keep_ref, scale_ref, at, valid, dropout, stream)
  gd = _dropped_grad(g, keep, keep_ref, scale_ref, dropout, drawn=hashed)
  total = jnp.sum(probs * gd, axis=1, keepdims=True)             # [warps, 1]: per warp
  if warps > 1:
    row_slots = (bh * seq_q + r) * _SUM_SLOTS
    # Every lane of warp w writes the warp's sum to slot w (the same value to one address:
    # no mask, so no two lanes' masked-off stores can meet in the interpreter's scatter).
    pltriton.store(sums_ref.at[row_slots + warp + lane * 0],
                   jnp.broadcast_to(total, cols.shape))
    slots = row_slots + lane + warp * 0
    if not interpret:  # the interpreter runs a program's body in order
      pltriton.debug_barrier()
    parts = pltriton.load(sums_ref.at[slots], mask=lane < warps, other=0.0,
                          cache_modifier=".cg")
    total = jnp.sum(parts, axis=1, keepdims=True)
  if attend is None:
    attend = load_mask()
  fill = _fill(dropout, scale_ref)
  out = jnp.where(attend, probs * (gd - total), fill)
  pltriton.store(o_ref.at[at], out.astype(o_ref.dtype), mask=valid,
                 eviction_policy=config.store_eviction)


def _warp_rows_call(args, shape, dtype, *, config, dropout, hashed, interpret):
  """:func:`_call`'s launch for a ``warp_rows`` config: ``args`` as there (3D views),
  flattened; one program per row, heads fastest."""
  b, h, seq_q, seq_k = shape
  warps = warp_rows_warps(seq_k)
  flat = [a if a.ndim <= 1 else a.reshape(-1) for a in args]
  if hashed:   # the key's seeds stay as they are
    flat[-1] = args[-1]
  rows = b * h * seq_q
  out, _ = pallas_call(
      functools.partial(_warp_rows_kernel, num_heads=h, seq_q=seq_q, seq_k=seq_k,
                        warps=warps, config=config, dropout=dropout, hashed=hashed,
                        interpret=interpret),
      out_shape=(out_struct((rows * seq_k,), dtype, *args),
                 out_struct((rows * _SUM_SLOTS,), jnp.float32, *args)),
      grid=(h, b * seq_q),
      compiler_params=compiler_params(warps, 1),
      interpret=interpret,
      name=_NAME,
  )(*flat)
  return out.reshape(b, h, seq_q, seq_k)


def warp_rows_take(config: Config, shape, *, from_scores: bool = False) -> bool:
  """Whether ``config`` runs the :attr:`Config.warp_rows` kernel on ``[B, H, Sq, Sk]`` arrays
  (else the row kernel at the same warps); raises if its warps are not the rows'."""
  if not config.warp_rows:
    return False
  seq_k = shape[-1]
  warps = warp_rows_warps(seq_k)
  if warps > MAX_WARP_ROWS:
    raise ValueError(f"config.warp_rows: rows of {seq_k} keys need {warps} warps, more than "
                     f"{MAX_WARP_ROWS}; use warp_rows=False")
  if config.num_warps != warps:
    raise ValueError(f"config.num_warps={config.num_warps}: a warp_rows config for rows of "
                     f"{seq_k} keys runs {warps} warps (one per {SEGMENT} columns)")
  return not from_scores and math.prod(shape) < 2**31


@functools.partial(jax.jit, static_argnames=("dropout", "config", "num_stages", "interpret",
                                             "hashed", "from_scores"))
def _call(grad_output, p_attn, mask, dropout_mask, p_dropout, *, dropout: Dropout,
          config: Config, num_stages: int, interpret: bool, hashed: bool = False,
          from_scores: bool = False):
  """``hashed``: ``dropout_mask`` is the key's ``[k0, k1, threshold]`` (uint32), not a mask;
  ``from_scores``: ``p_attn`` holds the scores, from which the kernel recomputes P."""
  b, h, seq_q, seq_k = p_attn.shape
  config = dataclasses.replace(config, heads_per_program=min(config.heads_per_program, h))
  if config.uses_cache_modifiers:
    _util.enable_load_cache_modifiers("config.stream_cache / config.mask_cache",
                                      "use None")
  kernel = functools.partial(_kernel, num_heads=h, seq_q=seq_q, seq_k=seq_k, config=config,
                             dropout=dropout, hashed=hashed, from_scores=from_scores)
  args = [grad_output.reshape(b * h, seq_q, seq_k), p_attn.reshape(b * h, seq_q, seq_k),
          mask.reshape(b, seq_q, seq_k)]
  if dropout.mode == "traced":
    p = jnp.asarray(p_dropout, jnp.float32)
    # An invalid traced rate (outside [0, 1), NaN) gives NaN gradients, not wrong ones.
    inv = validation.nan_unless_rate_valid(p, 1.0 / (1.0 - p))
    args.insert(0, jnp.stack([inv, (p > 0).astype(jnp.float32)]))
  if dropout.mode != "none":
    args.append(dropout_mask if hashed else dropout_mask.reshape(b * h, seq_q, seq_k))
  if warp_rows_take(config, p_attn.shape, from_scores=from_scores):
    return _warp_rows_call(args, p_attn.shape, p_attn.dtype, config=config, dropout=dropout,
                           hashed=hashed, interpret=interpret)
  config = dataclasses.replace(config, warp_rows=False)
  out = pallas_call(
      kernel,
      out_shape=out_struct((b * h, seq_q, seq_k), p_attn.dtype, *args),
      grid=_grid(b, h, seq_q, config),
      compiler_params=compiler_params(config.num_warps, num_stages),
      interpret=interpret,
      name=_NAME,
  )(*args)
  return out.reshape(b, h, seq_q, seq_k)


def masked_softmax_dropout_backward(grad_output, p_attn, mask, dropout_mask, p_dropout, *,
                                    config: Config | None = None,
                                    num_stages: int | None = None,
                                    causal: bool = False, interpret: bool = False):
  """Gradient of the scores through masked softmax and dropout.

  Args:
    grad_output: ``[B, H, Sq, Sk]`` float (fp32 in the usual case), gradient of the
      dropout output.
    p_attn: ``[B, H, Sq, Sk]``, same dtype, the softmax output P.
    mask: ``[B, 1, Sq, Sk]`` bool, True = attend; broadcast over the heads.
    dropout_mask: ``[B, H, Sq, Sk]`` bool, True = kept. Never read when the rate is 0 (it
      may then be ``None`` if the rate is a Python number).
    p_dropout: dropout rate in [0, 1): a Python float, or a traced scalar (one outside
      [0, 1) gives NaN gradients, since nothing can raise at run time).
    config: launch configuration; default: tuned for the device that holds the arrays,
      else a heuristic.
    num_stages: Triton pipelining depth; default: the config's (1: the default configs
      have no loop).
    causal: accepted for a uniform interface across the kernels, and ignored: a causal
      attention is a mask (and a P that is zero above the diagonal), which the dense math
      handles as any other.
    interpret: run the kernel in the Pallas interpreter (any backend).

  Returns:
    ``grad_scores [B, H, Sq, Sk]`` in the dtype of ``p_attn``.
  """
  del causal  # see above: the dense math covers it
  _util.check_can_compile(_NAME, interpret, grad_output, p_attn, mask, dropout_mask)
  p = validation.check_problem_b(grad_output, p_attn, mask, dropout_mask, p_dropout)
  if config is None:
    device_kind = _tuning.device_kind_of(p_attn, grad_output, interpret=interpret)
    config = default_config(p_attn.shape[2], p_attn.shape[3], device_kind)
  elif not isinstance(config, Config):
    raise TypeError(f"config: expected a masked_softmax_dropout.Config, got {config!r}")
  if num_stages is None:
    num_stages = config.num_stages
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"num_stages must be >= 1 (an int), got {num_stages!r}")
  return _call(grad_output, p_attn, mask, dropout_mask, p_dropout, dropout=Dropout.of(p),
               config=config, num_stages=num_stages, interpret=interpret)


def masked_softmax_dropout_backward_from_key(grad_output, p_attn, mask, dropout_rng, p_dropout,
                                             *, config: Config | None = None,
                                             interpret: bool = False):
  """:func:`masked_softmax_dropout_backward` with the keep mask drawn in the kernel from the
  key, ``jax_ops.dropout_keep_mask(dropout_rng, p_dropout, shape)`` bit for bit, instead
  of read (1 B per element less; the forward need not store it). ``p_dropout`` is the rate
  as given (a Python float or a traced scalar); the kernel scales by the rate the mask draws
  (``pallas_kernels._dropout.effective_rate``). The op's Triton backend made with the
  ``"key"`` residual policy of ``jax_ops.ops.masked_softmax_dropout`` uses it.
  """
  return _from_key(grad_output, p_attn, mask, dropout_rng, p_dropout, config=config,
                   interpret=interpret, from_scores=False)


def masked_softmax_dropout_backward_from_scores(grad_output, scores, mask, dropout_rng,
                                                p_dropout, *, config: Config | None = None,
                                                interpret: bool = False):
  """:func:`masked_softmax_dropout_backward_from_key` given the scores instead of P: the
  kernel recomputes ``P = softmax(scores.masked_fill(~mask, -1e4))`` (in fp32, rounded to
  the scores' dtype) from the row it holds, so the forward need store neither P nor the
  keep mask (``masked_softmax_dropout_forward(..., store_probs=False, store_keep=False)``)
  and a training step keeps no ``[B, H, Sq, Sk]`` residual but its input. The same bytes
  as reading P. P agrees with the forward kernel's to rounding (the row sums may be reduced
  in another order). ``scores [B, H, Sq, Sk]``; the other arguments as there; the config
  must not be two-pass (``chunk``). The op's Triton backend runs it (its default residual
  policy, ``"scores"``: measured in a training step on the H200,
  ``benchmarks/results/step.md``).
  """
  validation.check_scores_and_mask(scores, mask)   # errors that name the scores
  if config is not None and isinstance(config, Config) and config.chunk:
    raise ValueError(f"config.chunk={config.chunk}: the backward from the scores needs each "
                     "row whole (use chunk=0)")
  return _from_key(grad_output, scores, mask, dropout_rng, p_dropout, config=config,
                   interpret=interpret, from_scores=True)


def _from_key(grad_output, p_attn, mask, dropout_rng, p_dropout, *, config, interpret,
              from_scores):
  _util.check_can_compile(_NAME, interpret, grad_output, p_attn, mask)
  # The mask is not an argument: its shape stands in for the check.
  p = validation.check_problem_b(grad_output, p_attn, mask,
                                 jax.ShapeDtypeStruct(p_attn.shape, jnp.bool_), p_dropout)
  if config is None:
    device_kind = _tuning.device_kind_of(p_attn, grad_output, interpret=interpret)
    config = default_config(p_attn.shape[2], p_attn.shape[3], device_kind)
    if from_scores and config.chunk:
      config = dataclasses.replace(config, chunk=0)
    if PAIR_HASH:
      config = dataclasses.replace(config, pair_hash=True)
  elif not isinstance(config, Config):
    raise TypeError(f"config: expected a masked_softmax_dropout.Config, got {config!r}")
  if p == 0.0:
    return _call(grad_output, p_attn, mask, None, 0.0, dropout=Dropout.of(0.0), config=config,
                 num_stages=config.num_stages, interpret=interpret, from_scores=from_scores)
  if dropout_rng is None:
    raise ValueError("dropout_rng: a p_dropout that may be > 0 needs a PRNG key")
  given = p if p is not None else jnp.asarray(p_dropout, jnp.float32)
  rate = _dropout.effective_rate(given)
  if p is None:  # a traced rate: an invalid one gives NaN (the scale), as the keep-mask path
    rate = validation.nan_unless_rate_valid(given, rate)
  dropout = Dropout.of(rate if p is not None else None)
  return _call(grad_output, p_attn, mask, _dropout.seeds(dropout_rng, given), rate,
               dropout=dropout, config=config, num_stages=config.num_stages,
               interpret=interpret, hashed=True, from_scores=from_scores)
