"""Tests of the row-class helpers of the phase-aligned kernels (``pallas_kernels._phase``)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _phase


@pytest.mark.parametrize("row_len, block", [(45, 16), (449, 64), (293, 128), (773, 64), (9, 16)])
def test_tile_masks_cover_each_row_element_once(row_len, block):
  """Over the column tiles of a row shifted by any phase: ``valid`` covers ``[0, L)``
  exactly once; ``vector`` and ``load`` are 8-column granular; stores (vector plus the
  scalar rest) write only valid columns; loads stay inside the 8-column granules
  from the row's first to its last element (the first tile may start in the previous row)."""
  for ph in range(64):
    seen = np.zeros(row_len, int)
    for j in range(int(_phase.num_tiles(row_len, block, ph))):
      cols, valid, load, vector = (np.asarray(x) for x in
                                   _phase.tile_masks(jnp.int32(j), row_len, block, jnp.int32(ph)))
      np.testing.assert_array_equal(cols, j * block - ph + np.arange(block))
      np.testing.assert_array_equal(valid, (cols >= 0) & (cols < row_len))
      seen[cols[valid]] += 1
      assert not np.any(vector & ~valid)
      assert not np.any(valid & ~load)
      for m in (vector, load):  # granular: constant over each aligned group of 8 columns
        assert np.all(m.reshape(-1, _phase.ALIGN) == m.reshape(-1, _phase.ALIGN)[:, :1])
      end = -(-(row_len + ph) // _phase.ALIGN) * _phase.ALIGN  # granule end of the row
      assert np.all(j * block + np.arange(block)[load] < end)
    np.testing.assert_array_equal(seen, 1)


def test_phase_no_overflow():
  rows = np.array([0, 1, 7, 8, 12345, 2**31 // 449 - 1], np.int64)
  for align, row_len in itertools.product(_phase.ROW_ALIGNS, (449, 293, 130, 1)):
    got = np.asarray(_phase.phase(jnp.asarray(rows, jnp.int32), row_len, align))
    np.testing.assert_array_equal(got, (rows * row_len) % align)


def test_choose():
  for rows, block in itertools.product((1, 37, 211, 449, 2110, 3730, 6910, 55280), (16, 32, 64)):
    for max_align in (8, 16, 64):
      align, b = _phase.choose(rows, block, max_align=max_align)
      assert align in _phase.ROW_ALIGNS and align <= max(max_align, _phase.ALIGN)
      assert 16 <= b <= max(block, 16) and b & (b - 1) == 0
  assert _phase.choose(3730, 64) == (64, 64)  # a kv group of 10 heads x 373 rows
  assert _phase.choose(449, 32) == (32, 16)


def test_usable():
  assert _phase.usable(449, 10**6) and not _phase.usable(512, 10**6)
  assert not _phase.usable(449, 2**31)


@pytest.mark.parametrize("align", _phase.ROW_ALIGNS)
def test_class_tiles_copy(align):
  """benchmarks/ragged_stream.py's copies: consecutive-row tiles copy everything; class
  tiles copy exactly the elements of the 16-byte vectors wholly inside their row (the rest
  is what the kernels' scalar stores add)."""
  from benchmarks.ragged_stream import copy_fn
  n, row_len = 70, 45
  x = jnp.asarray(np.random.default_rng(0).standard_normal((n, row_len)), jnp.float32)
  rows = copy_fn("rows", n, row_len, 16, 16, 4, 2, interpret=True)(x)
  np.testing.assert_array_equal(np.asarray(rows), 2 * np.asarray(x))
  out = np.asarray(copy_fn("classes", n, row_len, 16, 32, 4, 2, align=align,
                           interpret=True)(x))
  flat = np.arange(n * row_len)
  row = flat // row_len
  vec = flat // _phase.ALIGN
  inside = (vec * _phase.ALIGN >= row * row_len) & (
      vec * _phase.ALIGN + _phase.ALIGN <= (row + 1) * row_len)
  assert inside.mean() > 0.6
  np.testing.assert_array_equal(out[inside], 2 * np.asarray(x).reshape(-1)[inside])
