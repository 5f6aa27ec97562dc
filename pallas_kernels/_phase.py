"""Aligned tiles of rows whose length is not a multiple of 8 elements.

In a row-major ``[N, S, L]`` array with ``L % 8 != 0`` consecutive rows start at different
offsets modulo 8 elements (their "phase"), so a tile of consecutive rows is not 16-byte
aligned (bf16) and Triton lowers its loads to scalar loads it cannot pipeline. Rows
``align`` apart (8, 16, 32 or 64) share a phase modulo ``align``: a kernel that takes such a
"row class" per tile and starts its column tiles ``phase`` columns early (tile ``j`` covers
columns ``[j * BK - phase, (j + 1) * BK - phase)``) loads and stores 16-byte vectors.

A row's first and last tiles reach outside ``[0, L)``: into earlier rows (never before the
array) and into the next row or, for the last row, the rest of the 16-byte granule holding
its last element, never past it (:func:`tile_masks`). Kernels zero those columns or never
store them, and store edge tiles as whole vectors plus a scalar-masked rest (at most 7
elements at each end). Offsets are int32 into flat 1D views, so arrays hold fewer than
``2**31`` elements (:func:`usable`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

ALIGN = 8  # elements per 16-byte vector in bf16 / fp16


def usable(row_len: int, *sizes: int) -> bool:
  """Whether the phase-aligned path applies: rows not a multiple of ``ALIGN`` elements and
  every flat array (``sizes``, in elements) indexable with int32 offsets."""
  return row_len % ALIGN != 0 and all(s < 2**31 for s in sizes)


def applies(row_align: int, row_len: int, block: int, *sizes: int) -> bool:
  """Whether a pass configured with ``row_align`` takes row-class tiles: not switched off
  (0), its rows span more than one ``block``-wide column tile (a one-tile row keeps its
  single-read path) and :func:`usable`."""
  return row_align != 0 and -(-row_len // block) > 1 and usable(row_len, *sizes)


ROW_ALIGNS = (64, 32, 16, ALIGN)  # elements: 128-, 64-, 32- and 16-byte aligned rows in bf16


def choose(rows: int, block_rows: int, min_use: float = 0.85,
           max_align: int = ROW_ALIGNS[0]) -> tuple[int, int]:
  """``(align, block)``: row classes of every ``align``-th of ``rows`` rows, in tiles of
  ``block`` rows.

  Rows ``align`` elements apart start at the same offset modulo ``align`` elements, so
  with larger classes the tiles start on 32-, 64- or 128-byte boundaries (whole DRAM
  sectors, which stream faster). The largest ``align`` whose classes
  still fill at least ``min_use`` of their tiles wins (else the best-filled); ``block`` is
  ``block_rows`` capped at the class size (and >= 16, the tensor-core minimum). ``align``
  is at most ``max_align`` (a kernel that peels only the first column tile needs
  ``phase < block``).
  """
  best = None
  for align in (a for a in ROW_ALIGNS if a <= max(max_align, ALIGN)):
    per = -(-rows // align)
    block = _block(rows, align, block_rows)
    use = per / (-(-per // block) * block)
    if use >= min_use:
      return align, block
    if best is None or use >= best[0]:  # ties: the smaller align, fewer empty programs
      best = (use, align, block)
  return best[1], best[2]


def resolve(row_align: int, rows: int, block_rows: int, max_align: int) -> tuple[int, int]:
  """``(align, block)`` of a pass whose config asks for ``row_align`` (-1: :func:`choose`;
  8, 16, 32 or 64: that, capped at ``max_align``)."""
  if row_align == -1:
    return choose(rows, block_rows, max_align=max_align)
  if row_align not in ROW_ALIGNS:
    raise ValueError(f"row_align: expected -1 or one of {ROW_ALIGNS}, got {row_align}")
  align = min(row_align, max(max_align, ALIGN))
  return align, _block(rows, align, block_rows)


def _i32(n: int):
  """A static int as an int32 operand: index arithmetic stays int32, also under x64 (where
  a Python int next to a traced int32 would be an int64 and ``lax`` refuses the mix)."""
  return np.int32(n)


def _block(rows: int, align: int, block_rows: int) -> int:
  """``block_rows`` capped at the padded class size (``rows / align``), and >= 16."""
  per = -(-rows // align)
  return min(block_rows, max(16, 1 << max(per - 1, 0).bit_length()))


def num_programs(rows: int, align: int, block: int) -> int:
  """Grid size along the rows: ``align`` classes, each in tiles of ``block`` rows."""
  return align * -(-(-(-rows // align)) // block)


def class_rows(program, align: int, block: int):
  """``(class, first row, [block] rows)`` of grid program ``program`` (see
  :func:`num_programs`: programs of one tile index run the ``align`` classes together)."""
  cls = lax.rem(program, _i32(align))
  first = cls + _i32(align * block) * lax.div(program, _i32(align))
  return cls, first, first + _i32(align) * jnp.arange(block, dtype=jnp.int32)


def phase(first_row, row_len: int, align: int = ALIGN):
  """``(first_row * row_len) % align`` for a traced int32 row index, without overflow."""
  return lax.rem(lax.rem(first_row, _i32(align)) * _i32(row_len % align), _i32(align))


def aligned_base(first_row, row_len: int, ph, align: int = ALIGN):
  """Flat offset of column ``-ph`` of row ``first_row``: a multiple of ``align``."""
  return pl.multiple_of(first_row * row_len - ph, align)


def tile_offsets(base, row_len: int, rows: int, col0, cols: int, align: int = ALIGN):
  """``[rows, cols]`` flat offsets of a tile: rows ``align`` apart from ``base``, columns
  ``col0 + [0, cols)`` (tile column ``t`` is the row's column ``col0 + t - phase``; the
  tile is 16-byte aligned if ``col0`` is a multiple of ``ALIGN``)."""
  r = jnp.arange(rows, dtype=jnp.int32)[:, None] * (align * row_len)
  c = (col0 + jnp.arange(cols, dtype=jnp.int32))[None, :]
  return base + r + c


def num_tiles(row_len: int, block: int, ph):
  """Column tiles covering a row shifted by ``ph``: ``cdiv(row_len + ph, block)``."""
  return lax.div(_i32(row_len) + ph + _i32(block) - _i32(1), _i32(block))


def _round_down(x):
  return lax.div(x, _i32(ALIGN)) * _i32(ALIGN)  # x >= 0 here; a known multiple of 8


def tile_masks(j, row_len: int, block: int, ph):
  """Column masks of tile ``j`` of a row shifted by ``ph`` (``[block]`` vectors).

  Returns ``(cols, valid, load, vector)``: ``cols = j * block - ph + [0, block)`` are the
  row's columns in the tile; ``valid = 0 <= cols < row_len``; ``load``: the columns up to
  the end of the 16-byte vector holding the row's last element (vector-granular, so loads
  stay 16-byte; tile 0's columns before the row are earlier rows' elements);
  ``vector``: the columns of the 16-byte vectors wholly inside the row (a vectorised
  store writes these; a scalar store the rest of ``valid``).
  """
  t = jnp.arange(block, dtype=jnp.int32)
  col0 = j * block
  cols = col0 - ph + t
  valid = (cols >= 0) & (cols < row_len)
  lo = jnp.maximum(ph - col0, 0)  # the row is [ph - col0, row_len + ph - col0) in the tile
  hi = jnp.maximum(row_len + ph - col0, 0)
  load = t < _round_down(hi + ALIGN - 1)
  vector = (t >= _round_down(lo + ALIGN - 1)) & (t < _round_down(hi))
  return cols, valid, load, vector
