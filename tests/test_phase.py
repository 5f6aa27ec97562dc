"""Tests of the row-class helpers of the phase-aligned kernels (``pallas_kernels._phase``)."""

from __future__ import annotations

import dataclasses
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


@pytest.fixture
def flat_accesses(monkeypatch):
  """Records the offsets every masked load / store of a flat (1D) ref lets through, as
  ``(kind, array size, offsets)``, while the kernels run in the interpreter (which would
  clamp or drop out-of-bounds accesses silently)."""
  import jax
  from jax.experimental.pallas import triton as pltriton

  log = []
  orig_load, orig_store = pltriton.load, pltriton.store

  def record(kind, ref, mask):
    indices = getattr(ref, "transforms", (None,))[0]
    if len(ref.ref.shape) != 1 if hasattr(ref, "ref") else True:
      return
    offs = indices.indices[0]
    if not hasattr(offs, "shape"):
      return
    ok = jnp.ones(offs.shape, bool) if mask is None else jnp.broadcast_to(mask, offs.shape)
    size = ref.ref.shape[0]
    jax.debug.callback(
        lambda o, m: log.append((kind, size, np.asarray(o)[np.asarray(m)])), offs, ok)

  def load(ref, mask=None, other=None, **kw):
    record("load", ref, mask)
    return orig_load(ref, mask=mask, other=other, **kw)

  def store(ref, val, mask=None, **kw):
    record("store", ref, mask)
    return orig_store(ref, val, mask=mask, **kw)

  monkeypatch.setattr(pltriton, "load", load)
  monkeypatch.setattr(pltriton, "store", store)
  jax.clear_caches()
  yield log
  jax.clear_caches()


def _check_accesses(log, outputs):
  """Loads stay inside the ALIGN-element granules of their array; stores inside it, and
  every element of each output in ``outputs`` (sizes) is written exactly once."""
  assert log, "no flat accesses recorded"
  written = {size: np.zeros(size, int) for size in outputs}
  for kind, size, offs in log:
    assert offs.size == 0 or offs.min() >= 0, kind
    end = size if kind == "store" else -(-size // _phase.ALIGN) * _phase.ALIGN
    assert offs.size == 0 or offs.max() < end, (kind, size, offs.max())
    if kind == "store":
      np.add.at(written[size], offs, 1)
  for size, count in written.items():
    assert np.all(count == 1), (size, np.unique(count, return_counts=True))


# (B, H, KVH, Sq, Skv, D, block_kv, row_align): phases above 16 (align 64, 64-key tiles),
# classes with no rows (Sq < align), an odd number of elements in all (granule at the end).
@pytest.mark.parametrize("b,h,kvh,sq,skv,d,block_kv,row_align", [
    (1, 4, 1, 37, 45, 16, 16, -1),
    (1, 8, 2, 40, 150, 32, 64, 64),
    (1, 8, 2, 40, 150, 32, 64, 32),
    (1, 3, 3, 5, 17, 16, 16, -1),
])
def test_ds_pass_phased_accesses(flat_accesses, b, h, kvh, sq, skv, d, block_kv, row_align):
  from pallas_kernels import attention_softmax_dropout_value as asdv
  from attention_softmax_dropout_value.kernel_base import make_inputs

  ds_cfg = asdv.PassConfig(16, block_kv, 4, 2, row_align=row_align)
  assert asdv.use_phased(ds_cfg, b, h, sq, skv, d, 1, 1)
  args = make_inputs(b, h, kvh, sq, skv, d, 0.1)
  asdv.attention_softmax_dropout_value_backward(
      *args, 0.1, config=asdv.Config(asdv.PassConfig(16, 16, 4, 2), ds_cfg), interpret=True)
  _check_accesses(flat_accesses, [b * h * sq * skv])


@pytest.mark.parametrize("sq,sk,d,block_k,row_align", [
    (33, 131, 64, 32, -1), (7, 70, 32, 16, 64), (200, 45, 16, 16, 8), (5, 17, 16, 16, -1)])
def test_row_kernel_phased_accesses(flat_accesses, sq, sk, d, block_k, row_align):
  from pallas_kernels import qk_scale_softmax as qks
  from qk_scale_softmax.kernel_base import make_inputs

  row = qks.PassConfig(16, block_k, 4, 2, row_align=row_align)
  assert qks.use_phased(row, False, 1, sq, sk, d)
  g, q, k, p = make_inputs(0, 1, 1, sq, sk, d)
  qks.qk_scale_softmax_backward(g, q, k, p, 0.125, interpret=True,
                                config=qks.Config(row, qks.PassConfig(16, 32, 4, 2)))
  _check_accesses(flat_accesses, [sq * d, sq])


def test_resolve_and_config_check():
  assert _phase.resolve(-1, 3730, 64, 64) == (64, 64)  # the automatic choice
  assert _phase.resolve(64, 3730, 64, 16) == (16, 64)  # capped at max_align
  assert _phase.resolve(16, 449, 32, 64) == (16, 32)
  with pytest.raises(ValueError, match="row_align"):
    _phase.resolve(12, 449, 32, 64)
  from pallas_kernels import _tuning
  from pallas_kernels import qk_scale_softmax as qks
  ok = qks.Config(qks.PassConfig(16, 32, 4, 2, row_align=64), qks.PassConfig(16, 32, 4, 2))
  assert _tuning.with_overrides(ok) == ok
  with pytest.raises(ValueError, match=r"config\.row_align"):
    dataclasses.replace(ok.row, row_align=12)
