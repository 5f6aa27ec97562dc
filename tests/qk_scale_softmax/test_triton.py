"""The qk_scale_softmax kernel tests on the Pallas Triton backend: the base suite
(``kernel_base``), plus the Triton kernels' own loop strategies, configs, tuned table and
lowering (interpret mode off a GPU)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (INTERPRET, ON_GPU, assert_configs_fit, softmax_probs,
                      triton_calls_in_gpu_lowering)
from pallas_kernels import _tuning
from pallas_kernels import qk_scale_softmax as qks
from pallas_kernels.qk_scale_softmax import config as qks_config
from pallas_kernels.qk_scale_softmax import _common, pallas_triton
from pallas_kernels.qk_scale_softmax import dl_gemm as dlg
from pallas_kernels.qk_scale_softmax.pallas_triton import qk_scale_softmax_backward

from .kernel_base import *  # noqa: F401,F403
from .kernel_base import assert_renormalized, make_inputs, reference, run_and_check
from .kernel_base import assert_close as assert_close_to_ref


@pytest.fixture
def backward():
  return qk_scale_softmax_backward


def assert_config_fits(config, rows, cols):
  """``conftest.assert_configs_fit`` for a :class:`qks.Config` (dataclasses, not tuples)."""
  assert isinstance(config, qks.Config) and config.scheme in qks.SCHEMES, config
  assert_configs_fit([dataclasses.astuple(config.row), dataclasses.astuple(config.col)],
                     rows, cols)


# ------------------------------------------------------------- loop strategies (kernels)


def untuned(sq, sk, d, causal=False):
  """The heuristic config (no device table), whose tiles ``block_q``/``block_k`` override:
  a device's table may pick the ``dl_gemm`` scheme, which takes whole rows instead."""
  return qks_config.default_config(sq, sk, d, jnp.bfloat16, None, causal=causal)


# Small explicit tiles force several tiles in both loops (the row kernel's two passes).
@pytest.mark.parametrize("sq, sk, d, blocks", [
    (131, 33, 40, dict(block_q=32, block_k=16)),
    (33, 131, 64, dict(block_q=16, block_k=32)),
])
def test_dense_tiles(sq, sk, d, blocks):
  args = make_inputs(0, 1, 2, sq, sk, d)
  run_and_check(qk_scale_softmax_backward, args, 1.0 / np.sqrt(d), config=untuned(sq, sk, d),
                **blocks)


@pytest.mark.parametrize("sq, sk, d, blocks", [
    (33, 131, 64, dict(block_q=16, block_k=32)),   # Sq < Sk: every row has keys
    (131, 33, 64, dict(block_q=32, block_k=16)),   # Sq > Sk: leading rows have none
])
def test_causal_tiles(sq, sk, d, blocks):
  args = make_inputs(1, 1, 2, sq, sk, d, causal=True)
  run_and_check(qk_scale_softmax_backward, args, 1.0 / np.sqrt(d), causal=True,
                config=untuned(sq, sk, d, causal=True), **blocks)


# (Sq, Sk, D, block_k): rows of Sk % 8 != 0 keys spanning several key tiles.
PHASED_CASES = [(33, 131, 64, 32), (131, 33, 40, 16), (7, 70, 128, 16), (200, 45, 64, 16)]


_ALIGNS = (-1, 8, 32, 64)


# Each case at two of the alignments, each alignment on two cases.
@pytest.mark.parametrize("sq, sk, d, block_k, row_align", [
    (*case, _ALIGNS[(i + j) % 4]) for i, case in enumerate(PHASED_CASES) for j in (0, 1)])
def test_row_kernel_phased(sq, sk, d, block_k, row_align):
  """The row kernel on aligned tiles of every ``row_align``-th row (``_row_kernel_phased``):
  against the reference, and against tiles of consecutive rows (``row_align=0``; the
  tiles group the keys differently, so sums may round differently)."""
  args = make_inputs(8, 2, 1, sq, sk, d)
  row = qks.PassConfig(16, block_k, 4, 2, row_align=row_align)
  col = qks.PassConfig(16, 32, 4, 2)
  plain = dataclasses.replace(row, row_align=0)
  assert qks.use_phased(row, False, 2, sq, sk, d)
  assert not qks.use_phased(plain, False, 2, sq, sk, d)
  assert not qks.use_phased(row, True, 2, sq, sk, d)  # causal keeps the plain row kernel
  outs = run_and_check(qk_scale_softmax_backward, args, 0.125, config=qks.Config(row, col))
  base = qk_scale_softmax_backward(*args, 0.125, interpret=INTERPRET,
                                   config=qks.Config(plain, col))
  for out, ref in zip(outs, base):
    o, r = (np.asarray(x, np.float32) for x in (out, ref))
    assert np.mean(np.abs(o - r) <= 1e-5 + 1e-2 * np.abs(r)) >= 0.999


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk, d, block_q", [(33, 131, 64, 16), (131, 33, 40, 32),
                                                (7, 70, 128, 16), (70, 256, 64, 32)])
def test_per_head(causal, sq, sk, d, block_q):
  """The one-program-per-head scheme: several query tiles, ragged rows, causal, D padding."""
  args = make_inputs(7, 1, 2, sq, sk, d, causal=causal)
  cfg = qks.PassConfig(block_q, 32, 4, 2)
  run_and_check(qk_scale_softmax_backward, args, 0.125, causal=causal,
                config=qks.Config(cfg, cfg, "per_head"))


DL_GEMM = qks.Config(qks.PassConfig(16, 16, 4, 2), qks.PassConfig(16, 16, 4, 2), "dl_gemm")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk, d, dl", [
    (1, 1, 64, None), (7, 7, 40, qks.DlConfig(2, 4)), (131, 131, 128, qks.DlConfig(4, 8)),
    (33, 293, 64, qks.DlConfig(1, 4)), (293, 131, 64, qks.DlConfig(8, 2)),
    (64, 64, 64, qks.DlConfig(4, 4))])
def test_dl_gemm(causal, sq, sk, d, dl):
  """The dL kernel + GEMM scheme: ragged rows (programs past the last row), D padding,
  several rows per program, causal with Sq != Sk (rows with no keys), and aligned rows
  (no masked loads when dense)."""
  args = make_inputs(12, 1, 2, sq, sk, d, causal=causal)
  run_and_check(qk_scale_softmax_backward, args, 0.125, causal=causal,
                config=dataclasses.replace(DL_GEMM, dl=dl))


def test_dl_pass_rounds_as_reference():
  """dL is the reference's dL bit for bit (its two roundings), and 0 above a causal
  diagonal whatever g and P hold there."""
  sq, sk = 33, 65
  g, _, _, p = make_inputs(13, 1, 2, sq, sk, 16, causal=True)
  g3, p3 = g.reshape(2, sq, sk), p.reshape(2, sq, sk)
  scale = jnp.full((1,), 0.125, jnp.float32)
  delta = jnp.sum(g3.astype(jnp.float32) * p3.astype(jnp.float32), -1, keepdims=True)
  want = ((p3.astype(jnp.float32) * (g3.astype(jnp.float32) - delta)).astype(g.dtype)
          .astype(jnp.float32) * 0.125).astype(g.dtype)
  cfg = qks.DlConfig(4, 4)
  got = dlg.dl_pass(scale, g3, p3, cfg=cfg, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  upper = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
  # A causal tile of 128 keys: every key of these rows is written.
  dirty = dlg.dl_pass(scale, jnp.where(upper, jnp.nan, g3).astype(g.dtype),
                      jnp.where(upper, jnp.inf, p3).astype(p.dtype), causal=True,
                      cfg=cfg, causal_tile=(128, 128), interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(dirty, np.float32), np.asarray(want, np.float32))



@pytest.mark.parametrize("bh, sq, sk, rows", [
    (3, 37, 211, 2), (2, 21, 9, 4), (1, 70, 65, 8), (2, 33, 70, 1), (2, 19, 64, 2)])
def test_dl_pass_phased_equals_the_plain_kernel(bh, sq, sk, rows):
  """``DlConfig.phased`` (row classes on 16-byte aligned tiles, ragged dense rows) writes the
  plain dL kernel's dL bit for bit: every row phase, classes of fewer rows than a program
  holds; aligned rows (Sk % 8 == 0) and causal calls keep the plain kernel."""
  ks = jax.random.split(jax.random.key(18), 2)
  g = jax.random.normal(ks[0], (bh, sq, sk), jnp.float32).astype(jnp.bfloat16)
  p = softmax_probs(ks[1], (bh, sq, sk), jnp.bfloat16)
  scale = jnp.full((1,), 0.125, jnp.float32)
  plain = dlg.dl_pass(scale, g, p, cfg=qks.DlConfig(rows, 4), interpret=INTERPRET)
  cfg = qks.DlConfig(rows, 4, phased=True)
  assert dlg.dl_phased(sk, cfg, False, g.size) == (sk % 8 != 0)
  assert not dlg.dl_phased(sk, cfg, True, g.size)
  got = dlg.dl_pass(scale, g, p, cfg=cfg, interpret=INTERPRET)
  assert got.shape == plain.shape and got.dtype == plain.dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(plain, np.float32))


def _assert_dl_where_written(got, plain, causal, tile):
  """``got == plain`` wherever ``dl_pass`` writes dL (with ``causal_tile = tile``: up to
  the multiple of T keys past the diagonal of the row's group's last row), 0 there above a
  causal diagonal."""
  assert got.shape == plain.shape
  _, sq, sk = plain.shape
  written = np.ones(plain.shape[1:], bool)
  if tile is not None:
    group, keys = tile
    last = np.arange(sq) // group * group + group
    end = (last + (sk - sq) + keys - 1) // keys * keys
    written = np.arange(sk)[None, :] < end[:, None]
  np.testing.assert_array_equal(got[:, written], plain[:, written])
  if causal:
    upper = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
    assert (got[:, written & upper] == 0).all()


@pytest.mark.parametrize("bh, sq, sk, rows, tile", [
    (1, 150, 150, 1, (16, 16)), (2, 130, 200, 2, (32, 32)), (1, 200, 72, 1, (16, 16)),
    (1, 64, 64, 4, (64, 64))])
def test_dl_pass_classes_equals_the_dense_kernel(bh, sq, sk, rows, tile):
  """A causal dL (rows in classes of halving lengths) equals the dense kernel's dL of a P
  and g that are 0 above the diagonal, wherever the GEMMs read it: several classes down to
  64 keys, classes that end mid-block, Sq < Sk and Sq > Sk (rows with no keys), one class."""
  ks = jax.random.split(jax.random.key(22), 2)
  upper = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
  g = jax.random.normal(ks[0], (bh, sq, sk), jnp.float32).astype(jnp.bfloat16)
  p = softmax_probs(ks[1], (bh, sq, sk), jnp.bfloat16)
  g0, p0 = (jnp.where(upper, 0, x).astype(x.dtype) for x in (g, p))
  scale = jnp.full((1,), 0.125, jnp.float32)
  classes = dlg.dl_classes(sq, sk, rows, tile)
  assert classes[-1][0] == 0 and classes[0][1] == sq
  assert all(a[0] == b[1] for a, b in zip(classes, classes[1:]))
  dense = np.asarray(dlg.dl_pass(scale, g0, p0, cfg=qks.DlConfig(rows, 4),
                                 interpret=INTERPRET), np.float32)
  got = np.asarray(dlg.dl_pass(scale, g, p, causal=True, causal_tile=tile,
                               cfg=qks.DlConfig(rows, 4), interpret=INTERPRET), np.float32)
  _assert_dl_where_written(got, dense, True, tile)
  with pytest.raises(ValueError, match="causal_tile"):
    dlg.dl_pass(scale, g, p, causal=True, cfg=qks.DlConfig(rows, 4), interpret=INTERPRET)


def test_dl_pass_classes_lowers_to_triton(pretend_h200):
  """The row-class dL kernel lowers to Triton IR for a GPU: one kernel."""
  shapes = [jax.ShapeDtypeStruct((2, 520, 520), jnp.bfloat16)] * 2
  cfg = qks.DlConfig(1, 8)
  fn = lambda g, p, scale: dlg.dl_pass(scale.reshape(1), g, p, causal=True, cfg=cfg,
                                       causal_tile=(128, 128), interpret=False)
  assert triton_calls_in_gpu_lowering(fn, shapes) == 1


def test_dl_pass_phased_lowers_to_triton(pretend_h200):
  """The phased dL kernel lowers to Triton IR for a GPU: one kernel."""
  shapes = [jax.ShapeDtypeStruct((2, 37, 211), jnp.bfloat16)] * 2
  cfg = qks.DlConfig(8, 8, phased=True)
  fn = lambda g, p, scale: dlg.dl_pass(scale.reshape(1), g, p, cfg=cfg, interpret=False)
  assert triton_calls_in_gpu_lowering(fn, shapes) == 1


def test_dl_gemm_phased_matches_reference():
  """Through the entry point's dl_gemm scheme the phased dL kernel gives the reference's
  gradients; the table's ``dl`` field carries ``phased``; a non-bool is refused."""
  args = make_inputs(19, 1, 2, 37, 211, 64)
  run_and_check(qk_scale_softmax_backward, args, 0.125,
                config=dataclasses.replace(DL_GEMM, dl=qks.DlConfig(2, 4, phased=True)))
  assert qks.dl_config({"rows": 8, "num_warps": 8, "phased": True}, 211).phased
  with pytest.raises(ValueError, match="config.dl.phased"):
    qks.DlConfig(phased=1)


@pytest.mark.parametrize("sq, sk, d", [(131, 300, 64), (256, 512, 128)])
def test_dl_gemms_lowers_to_triton(pretend_h200, sq, sk, d):
  """The GEMM launch lowers for a GPU, ragged (masked) and aligned (unmasked): one kernel."""
  cfg = qks.PassConfig(64, 64, 4, 3)
  shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2, sq, sk), (2, sk, d), (2, sq, d))]
  one = lambda dl, k, q, _: dlg.dl_gemms(dl, q, k, cfg=cfg, interpret=False)
  assert triton_calls_in_gpu_lowering(one, shapes) == 1


def test_dl_gemms_rotate_dense_square_whole_tiles_only():
  """The rotated walk takes dense square problems whose tiles divide them (``dq``: capped)."""
  cfg = qks.DL_GEMM
  assert dlg._rotates(False, 4096, 4096, cfg.capped(4096, 4096))
  assert dlg._rotates(False, 96, 96, qks.PassConfig(32, 16, 4, 2))
  assert not dlg._rotates(True, 4096, 4096, cfg)          # causal
  assert not dlg._rotates(False, 2048, 4096, cfg)         # not square
  assert not dlg._rotates(False, 96, 96, cfg.capped(96, 96))  # 128-row tiles over 96 rows
  assert not dlg._rotates(False, 128, 128, qks.PassConfig(64, 128, 4, 2))  # step > tile


@pytest.mark.parametrize("causal, b, h, sq, sk, d, gemm", [
    (False, 2, 2, 33, 131, 64, qks.PassConfig(32, 16, 4, 2)),
    (True, 1, 3, 40, 40, 40, qks.PassConfig(16, 32, 4, 2)),
    (False, 1, 2, 7, 64, 128, qks.PassConfig(128, 64, 8, 3)),
    (True, 1, 2, 70, 9, 64, qks.DL_GEMM), (True, 1, 2, 131, 33, 64, qks.PassConfig(16, 32, 4, 2)),
    (True, 1, 2, 33, 131, 64, qks.PassConfig(32, 16, 4, 2)),
    (False, 2, 2, 96, 96, 64, qks.PassConfig(32, 16, 4, 2)),
    (False, 1, 2, 128, 128, 40, qks.PassConfig(32, 32, 4, 2)),
    (False, 1, 1, 512, 512, 64, qks.DL_GEMM_DENSE_LARGE),
    (True, 1, 1, 300, 300, 64, qks.DL_GEMM_CAUSAL_LARGE)])
def test_dl_gemm_one_launch(causal, b, h, sq, sk, d, gemm):
  """Both GEMMs in one Triton launch: ragged tiles, causal skips with Sq != Sk both ways
  (rows with no keys), D padding, tiles larger than the problem, and the rotated,
  interleaved walk of dense square problems of whole tiles (two steps per tile side, and
  one)."""
  g, q, k, p = make_inputs(17, b, h, sq, sk, d, causal=causal)
  v = lambda x: x.reshape((b * h,) + x.shape[2:])
  cfg = qks.DlConfig(2, 4, gemm=gemm)
  got = dlg.dl_gemm(jnp.full((1,), 0.125, jnp.float32), v(g), v(p), v(q), v(k),
                              causal=causal, cfg=cfg, interpret=INTERPRET)
  for o, r in zip(got, reference(g, q, k, p, 0.125)):
    assert_close_to_ref("dl_gemm", o.reshape(r.shape), r)


def test_dl_config_gemm_field():
  assert qks.DlConfig().gemm == qks.DL_GEMM
  assert qks.dl_config({"rows": 2, "num_warps": 4}, 512).gemm == qks.DL_GEMM
  big, causal_big = qks.DL_GEMM_DENSE_FROM, qks.DL_GEMM_CAUSAL_FROM
  assert qks.dl_config({"rows": 2, "num_warps": 4}, big, big).gemm == qks.DL_GEMM_DENSE_LARGE
  causal = qks.dl_config(None, causal_big, causal_big, causal=True)
  assert causal.gemm == qks.DL_GEMM_CAUSAL_LARGE
  assert qks.dl_config(None, big, big, causal=True).gemm == qks.DL_GEMM   # 1024 < 2048
  assert qks.dl_config(None, 4 * big, big // 2).gemm == qks.DL_GEMM
  assert qks.dl_gemm_tiles(big // 2, 4 * big, False) == qks.DL_GEMM
  with pytest.raises(TypeError, match="config.dl.gemm"):
    qks.DlConfig(gemm=(64, 64))


def test_dl_gemm_row_limit():
  g, q, k, p = make_inputs(6, 1, 1, 1, qks.MAX_DL_ROW + 1, 16)
  with pytest.raises(ValueError, match="config.scheme: 'dl_gemm'"):
    qk_scale_softmax_backward(g, q, k, p, 0.5, config=DL_GEMM, interpret=INTERPRET)
  g, q, k, p = make_inputs(6, 1, 1, 8, 4096, 16)
  with pytest.raises(ValueError, match="config.dl.rows: 32 rows of 4096"):
    qk_scale_softmax_backward(g, q, k, p, 0.5, config=dataclasses.replace(
        DL_GEMM, dl=qks.DlConfig(32, 8)), interpret=INTERPRET)


def test_dl_gemm_overrides(monkeypatch):
  """With dl_gemm only num_warps applies (to the dL kernel, also when config.dl is None);
  tile overrides raise, naming themselves."""
  g, q, k, p = make_inputs(6, 1, 1, 8, 40, 16)
  with pytest.raises(ValueError, match="block_q, num_stages: the 'dl_gemm' scheme"):
    qk_scale_softmax_backward(g, q, k, p, 0.5, config=DL_GEMM, block_q=16, num_stages=2,
                              interpret=INTERPRET)
  seen = []
  real = pallas_triton._backward
  monkeypatch.setattr(pallas_triton, "_backward",
                      lambda *a, config, **kw: seen.append(config) or real(*a, config=config,
                                                                          **kw))
  qk_scale_softmax_backward(g, q, k, p, 0.5, config=DL_GEMM, num_warps=2, interpret=INTERPRET)
  assert seen[-1].dl == dataclasses.replace(qks.default_dl_config(40), num_warps=2)


def test_dl_gemm_takes_16_bit_inputs_with_d_up_to_128():
  for dtype, d in ((jnp.float32, 64), (jnp.bfloat16, 160)):
    g, q, k, p = make_inputs(17, 1, 2, 33, 131, d, dtype=dtype)
    with pytest.raises(ValueError, match="16-bit inputs with D <= 128"):
      qk_scale_softmax_backward(g, q, k, p, 0.125, config=DL_GEMM, interpret=INTERPRET)


def test_dl_configs():
  """DlConfig names the bad field; default_dl_config and table entries give whole rows of
  at most 8192 elements per program."""
  for bad in (dict(rows=3), dict(rows=0), dict(num_warps=32), dict(rows=True),
              dict(num_warps=2.0)):
    with pytest.raises(ValueError, match=f"config.dl.{next(iter(bad))}"):
      qks.DlConfig(**bad)
  with pytest.raises(TypeError, match="config.dl"):
    dataclasses.replace(DL_GEMM, dl=(1, 8))
  assert qks.default_dl_config(1) == qks.DlConfig(256, 8)
  assert qks.default_dl_config(4096) == qks.DlConfig(1, 8)
  assert qks.default_dl_config(8193) == qks.DlConfig(1, 16)
  assert qks.dl_config(None, 300) == qks.default_dl_config(300)
  assert qks.dl_config({"rows": 64, "num_warps": 4}, 1024) == qks.DlConfig(8, 4)
  with pytest.raises(ValueError, match="config.dl.num_warps"):
    qks.dl_config({"rows": 1, "num_warps": 3}, 1024)


@pytest.mark.parametrize("name, causal, config", [
    ("phased", False, qks.Config(qks.PassConfig(16, 16, 4, 2), qks.PassConfig(16, 16, 4, 2))),
    ("causal", True, qks.Config(qks.PassConfig(16, 16, 4, 2), qks.PassConfig(16, 16, 4, 2))),
    ("per_head", True, qks.Config(qks.PassConfig(16, 16, 4, 2), qks.PassConfig(16, 16, 4, 2),
                                  "per_head")),
    ("dl_gemm", False, dataclasses.replace(DL_GEMM, dl=qks.DlConfig(2, 4))),
    ("dl_classes", True, dataclasses.replace(DL_GEMM, dl=qks.DlConfig(2, 4))),
])
def test_x64_loop_strategies(name, causal, config):
  """Under x64: the phase-aligned row kernel, the causal loops (traced bounds), the per-head
  kernel and the dL + GEMM scheme (causal: the dL kernel's row classes), against the
  reference; ragged rows of several key tiles."""
  with jax.enable_x64(True):
    args = make_inputs(11, 1, 2, 33, 45, 40, causal=causal)
    if name == "phased":
      assert qks.use_phased(config.row, causal, 2, 33, 45, 40)
    run_and_check(qk_scale_softmax_backward, args, 0.125, causal=causal, config=config)


def test_causal_ignores_upper_triangle():
  """With causal=True nothing above the diagonal is used: garbage there changes nothing,
  and skipping tiles gives bit-identical results to the dense walk on clean inputs."""
  sq, sk, d = 33, 65, 40
  g, q, k, p = make_inputs(2, 1, 1, sq, sk, d, causal=True)
  upper = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
  g_bad = jnp.where(upper, jnp.nan, g).astype(g.dtype)
  p_bad = jnp.where(upper, jnp.inf, p).astype(p.dtype)
  kw = dict(causal=True, block_q=16, block_k=16, interpret=INTERPRET,
            config=untuned(sq, sk, d, causal=True))
  clean = qk_scale_softmax_backward(g, q, k, p, 0.125, **kw)
  dirty = qk_scale_softmax_backward(g_bad, q, k, p_bad, 0.125, **kw)
  dense = qk_scale_softmax_backward(g, q, k, p, 0.125, block_q=16, block_k=16, interpret=INTERPRET,
                                    config=untuned(sq, sk, d))
  ref = reference(g, q, k, p, 0.125)
  for a, b, c, r in zip(clean, dirty, dense, ref):
    assert_close_to_ref("causal", a, r)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


@pytest.mark.parametrize("sq, sk", [(1, 1), (7, 33), (33, 7), (64, 64), (131, 33), (33, 131)])
@pytest.mark.parametrize("block_q, block_k", [(16, 16), (16, 64), (64, 16)])
def test_causal_tile_ranges_are_tight(sq, sk, block_q, block_k):
  """The loop bounds visit exactly the tiles that meet j <= i + (Sk - Sq) (brute force)."""
  nq, nk = -(-sq // block_q), -(-sk // block_k)
  live = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
  kt = _common

  def tile_live(i, j):
    return live[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k].any()

  for i in range(nq):
    n = int(kt.row_num_k_tiles(i, sq, sk, block_q, block_k))
    assert [j for j in range(nk) if tile_live(i, j)] == list(range(n)), (i, n)
  for j in range(nk):
    lo = int(kt.col_first_q_tile(j, sq, sk, block_q, block_k))
    assert [i for i in range(nq) if tile_live(i, j)] == list(range(lo, nq)), (j, lo)

  # Tiles loaded without the element-wise mask must hold no element above the diagonal.
  def tile_full(i, j):
    return live[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k].all()

  for i in range(nq):
    n = int(kt.row_num_k_tiles(i, sq, sk, block_q, block_k))
    n_full = int(kt.row_num_full_k_tiles(i, sq, sk, block_q, block_k))
    assert 0 <= n_full <= n and all(tile_full(i, j) for j in range(n_full)), (i, n_full)
  for j in range(nk):
    lo = int(kt.col_first_q_tile(j, sq, sk, block_q, block_k))
    full = int(kt.col_first_full_q_tile(j, sq, sk, block_q, block_k))
    assert lo <= full <= nq and all(tile_full(i, j) for i in range(full, nq)), (j, full)


def _round_bits(x):
  """bf16 round to nearest even on the fp32 bits (integer arithmetic), as fp32."""
  u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
  return u.astype(np.uint32).view(np.float32)


def test_rounding_is_bit_exact():
  """The kernels' bf16 rounding (a conversion and a bitcast) equals round to nearest even."""
  x = jax.random.normal(jax.random.PRNGKey(0), (4096,)) * 10.0 ** jax.random.randint(
      jax.random.PRNGKey(1), (4096,), -30, 30)
  x = jnp.concatenate([x, jnp.array([0.0, -0.0, 1.00390625, 1.01171875, 1e-40])]).astype(jnp.float32)
  got = np.asarray(_common.round_to(x, jnp.bfloat16))
  np.testing.assert_array_equal(got.view(np.uint32), _round_bits(x).view(np.uint32))


# ------------------------------------------------- renormalize=True: the op's form of dL


def _pass(block_q, block_k, **kw):
  return qks.PassConfig(block_q, block_k, 4, 2, **kw)


# scheme: (config, causal, Sq, Sk); every row kernel of two_pass, per_head, and dl_gemm's
# dense, causal (row classes) and phased dL kernels.
RENORMALIZE_SCHEMES = {
    "one_tile": (qks.Config(_pass(16, 64), _pass(16, 16)), False, 33, 40),
    "one_tile_causal": (qks.Config(_pass(16, 64), _pass(16, 16)), True, 40, 40),
    "two_pass": (qks.Config(_pass(16, 16), _pass(16, 16)), False, 33, 70),
    "causal": (qks.Config(_pass(16, 16), _pass(16, 32)), True, 33, 70),
    "phased": (qks.Config(_pass(16, 16, row_align=8), _pass(16, 32)), False, 33, 45),
    "per_head": (qks.Config(_pass(16, 32), _pass(16, 32), "per_head"), True, 33, 70),
    "dl_gemm": (dataclasses.replace(DL_GEMM, dl=qks.DlConfig(4, 4)), False, 33, 70),
    "dl_gemm_causal": (dataclasses.replace(DL_GEMM, dl=qks.DlConfig(4, 4)), True, 33, 70),
    "dl_gemm_phased": (dataclasses.replace(DL_GEMM, dl=qks.DlConfig(2, 4, phased=True)), False,
                       33, 45),
}


@pytest.mark.parametrize("scheme", list(RENORMALIZE_SCHEMES))
def test_renormalize(scheme):
  """``renormalize=True`` on every scheme and row kernel gives the reference's renormalized
  gradients, on peaked rows (``P_ii`` rounds to 1), where they are far from the spec's."""
  config, causal, sq, sk = RENORMALIZE_SCHEMES[scheme]
  args = make_inputs(23, 1, 2, sq, sk, 64, causal=causal, probs="peaked")
  outs = run_and_check(qk_scale_softmax_backward, args, 0.125, causal=causal, config=config,
                       renormalize=True)
  assert_renormalized(outs, args, 0.125)


# --------------------------------------------------------------- configs, errors, lowering


def test_scheme_errors():
  g, q, k, p = make_inputs(6, 1, 1, 8, 600, 16)
  cfg = qks.PassConfig(16, 32, 4, 2)
  with pytest.raises(ValueError, match="config.scheme"):
    qk_scale_softmax_backward(g, q, k, p, 0.5, config=qks.Config(cfg, cfg, "fused"))
  with pytest.raises(ValueError, match="per_head"):
    qk_scale_softmax_backward(g, q, k, p, 0.5, config=qks.Config(cfg, cfg, "per_head"),
                              interpret=INTERPRET)


def test_config_argument_errors():
  g, q, k, p = make_inputs(6, 1, 1, 8, 8, 16)
  with pytest.raises(ValueError, match="block_q"):
    qk_scale_softmax_backward(g, q, k, p, 0.5, block_q=24, interpret=INTERPRET)
  with pytest.raises(ValueError, match="config.row_align"):
    qks.PassConfig(16, 32, 4, 2, row_align=12)
  with pytest.raises(TypeError, match="config.col"):
    qks.Config(qks.PassConfig(16, 32, 4, 2), (16, 32, 4, 2))


@pytest.mark.skipif(ON_GPU, reason="off a GPU only")
def test_compiling_off_a_gpu_says_interpret():
  g, q, k, p = make_inputs(6, 1, 1, 8, 8, 16)
  with pytest.raises(ValueError, match="interpret=True"):
    qk_scale_softmax_backward(g, q, k, p, 0.5)


@pytest.mark.parametrize("device_kind", [None, "NVIDIA H200"])
def test_default_config(device_kind):
  """Heuristic and tuned defaults: powers of two >= 16, capped by the padded lengths."""
  for sq, sk, d, dtype in itertools.product([1, 33, 211, 4096], [1, 200, 449, 4096],
                                            [40, 64, 128], [jnp.bfloat16, jnp.float32]):
    assert_config_fits(qks.default_config(sq, sk, d, dtype, device_kind), sq, sk)


def test_tuned_table():
  """The H200 table holds only configs (named fields, whole-row tiles named), and the
  lookups give the entries' values: per_head with whole-row tiles for rows of 128 keys
  (causal ones too), dL + GEMM for dense and causal rows of 129-4096 keys (ragged ones
  included), with the class's causal_dl for causal calls where it has one."""
  with open(_tuning.table_path(qks_config.KERNEL, "NVIDIA H200")) as f:
    data = json.load(f)
  assert set(data) == {"device_kind", "compute_capability", "date", "jax", "configs"}
  for entry in data["configs"].values():
    assert (set(entry) <= {"scheme", "row", "col", "head", "dl", "causal_dl", "fwd"}
            and entry["scheme"] in qks.SCHEMES)
    for name in {"dl", "causal_dl"} & set(entry):
      assert entry["scheme"] == "dl_gemm" and isinstance(qks.dl_config(entry[name], 4096),
                                                          qks.DlConfig)
    if "fwd" in entry:  # the forward's launch
      assert isinstance(qks.ForwardConfig(**entry["fwd"]), qks.ForwardConfig)
    for name in set(entry) - {"scheme", "dl", "causal_dl", "fwd"}:
      for seq in (100, 211, 449, 4096):  # every entry builds a valid config
        assert isinstance(qks.pass_config(entry[name], seq, seq), qks.PassConfig)
      block_k = entry[name]["block_k"]
      assert block_k == qks.WHOLE_ROW or isinstance(block_k, int)
  h200 = functools.partial(qks.default_config, head_dim=128, dtype=jnp.bfloat16,
                           device_kind="NVIDIA H200")
  two_pass_211 = qks.Config(qks.PassConfig(32, 256, 4, 1), qks.PassConfig(32, 128, 4, 3))
  # Ragged rows: dL + GEMM (the table's dL rows at 211; causal: unphased, in row classes).
  assert h200(211, 211) == dataclasses.replace(two_pass_211, scheme="dl_gemm",
                                               dl=qks.DlConfig(2, 1))
  assert h200(211, 211, causal=True) == dataclasses.replace(two_pass_211, scheme="dl_gemm",
                                                            dl=qks.DlConfig(2, 1))
  assert h200(211, 211, schemes=("two_pass",)) == two_pass_211
  two_pass_449 = qks.Config(qks.PassConfig(32, 64, 4, 2, row_align=16),
                            qks.PassConfig(64, 64, 4, 3))
  assert h200(449, 449) == dataclasses.replace(two_pass_449, scheme="dl_gemm",
                                               dl=qks.DlConfig(1, 1, phased=True))
  assert h200(449, 449, causal=True) == dataclasses.replace(two_pass_449, scheme="dl_gemm",
                                                            dl=qks.DlConfig(1, 1))
  two_pass_4096 = qks.Config(qks.PassConfig(32, 128, 4, 2), qks.PassConfig(32, 64, 4, 3))
  # Aligned rows of >= 512 keys: the dL + GEMM scheme, dense and causal (rows too long to
  # hold in registers: the two-pass kernels).
  # One row on one warp for rows of 512-2048 keys; 4096 keys would be more than
  # DL_MAX_PER_WARP elements on a warp, so that length takes the default dL config.
  # The GEMM launch's tiles by problem size (dl_gemm_tiles).
  assert h200(4096, 4096) == dataclasses.replace(
      two_pass_4096, scheme="dl_gemm",
      dl=dataclasses.replace(qks.default_dl_config(4096), gemm=qks.DL_GEMM_DENSE_LARGE))
  for s in (512, 1024, 2048):
    assert h200(s, s).dl == qks.DlConfig(1, 1, gemm=qks.dl_gemm_tiles(s, s, False)), s
  assert qks.dl_config({"rows": 8, "num_warps": 1}, 449) == qks.default_dl_config(449)
  assert qks.dl_config({"rows": 4, "num_warps": 1}, 449) == qks.DlConfig(4, 1)
  # Causal: the dL kernel's row classes, the default's rows for rows of 1024-4096 keys
  # (an entry without rows), 2 rows on 4 warps for 512, 8 rows on 8 warps for 256.
  assert h200(4096, 4096, causal=True) == dataclasses.replace(
      h200(4096, 4096), dl=qks.dl_config(None, 4096, 4096, causal=True))
  assert h200(2048, 2048, causal=True).dl == dataclasses.replace(
      qks.default_dl_config(2048), gemm=qks.DL_GEMM_CAUSAL_LARGE)
  assert h200(1024, 1024, causal=True).dl.gemm == qks.DL_GEMM
  assert h200(512, 512, causal=True).dl == qks.DlConfig(2, 4)
  assert h200(256, 256, causal=True).dl == qks.DlConfig(8, 8)
  assert qks.dl_config({"phased": True}, 449) == dataclasses.replace(
      qks.default_dl_config(449), phased=True)
  assert h200(4096, 4096, schemes=("two_pass",)) == two_pass_4096
  assert h200(64, 1 << 15).scheme == "two_pass"
  assert h200(64, 2 * qks.DL_TUNED_MAX_ROW).scheme == "two_pass"  # not measured there
  assert h200(512, 512).scheme == "dl_gemm" and h200(449, 449).scheme == "dl_gemm"
  # Rows of 256 keys: dL + GEMM, dense and causal; the class's per_head entry by name.
  head_256 = qks.PassConfig(64, 256, 8, 2)
  assert h200(128, 256).scheme == "dl_gemm" and h200(256, 256).scheme == "dl_gemm"
  assert h200(256, 256, schemes=("two_pass", "per_head")) == qks.Config(head_256, head_256,
                                                                         "per_head")
  # A whole-row entry used for rows longer than MAX_WHOLE_ROW keys (a class borrowing
  # another's entry, _tuning.lookup) takes LONG_ROW_BLOCK_K-key tiles instead.
  whole = {"block_q": 32, "block_k": qks.WHOLE_ROW, "num_warps": 4, "num_stages": 1}
  assert qks.pass_config(whole, 64, 1029) == qks.PassConfig(32, qks_config.LONG_ROW_BLOCK_K, 4, 1)
  assert qks.pass_config(whole, 64, 300) == qks.PassConfig(32, 512, 4, 1)
  # fp32 or D > 128: the heuristic.
  assert h200(449, 449, dtype=jnp.float32) == qks.default_config(449, 449, 128, jnp.float32)


def test_table_entries_round_trip():
  """``table_entry`` writes what ``pass_config`` reads back (the tuners' interface)."""
  for cfg in (qks.PassConfig(32, 64, 4, 2), qks.PassConfig(32, 64, 4, 2, 16)):
    entry = qks.table_entry(cfg)
    assert json.loads(json.dumps(entry)) == entry
    assert qks.pass_config(entry, 4096, 4096) == cfg
  whole = qks.table_entry(qks.PassConfig(16, 256, 4, 3), whole_row=True)
  assert whole == {"block_q": 16, "block_k": qks.WHOLE_ROW, "num_warps": 4, "num_stages": 3}
  assert qks.pass_config(whole, 100, 211) == qks.PassConfig(16, 256, 4, 3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("row_align", [-1, 0])
@pytest.mark.parametrize("renormalize", [False, True])
def test_lowers_to_triton(pretend_h200, causal, dtype, row_align, renormalize):
  """The kernels lower to Triton IR for a GPU (no GPU needed; catches unsupported ops; dl_gemm:
  the dL kernel and the one GEMM launch).
  Rows of 300 keys: dense with ``row_align=-1`` takes the phase-aligned row kernel.
  (Lowers the jitted backward behind the entry point, which says off a GPU that the kernels
  compile only there.)"""
  b, h, sq, sk, d = 1, 2, 131, 300, 64
  shapes = [jax.ShapeDtypeStruct(s, dtype) for s in
            ((b, h, sq, sk), (b, h, sq, d), (b, h, sk, d), (b, h, sq, sk))]
  cfg = qks.PassConfig(32, 64, 4, 2, row_align)
  schemes = (("two_pass", 2), ("per_head", 1))
  if dtype != jnp.float32:  # dl_gemm: the dL kernel and the GEMM launch, 16-bit only
    schemes += (("dl_gemm", 2),)
  for scheme, kernels in schemes:
    assert triton_calls_in_gpu_lowering(functools.partial(pallas_triton._backward,
                                                          interpret=False),
                                        shapes, 0.125, causal=causal,
                                        config=qks.Config(cfg, cfg, scheme),
                                        renormalize=renormalize) == kernels, scheme


@pytest.mark.parametrize("sq, sk, rows", [(70, 33, 2), (33, 70, 1), (97, 97, 8)])
def test_causal_gemms_read_only_what_dl_pass_writes(sq, sk, rows):
  """Causal: with ``causal_tile=causal_tile_of(tiles)`` the dL kernel writes dL on and below
  the diagonal as with a tile wider than the rows (every key written), 0 above it up to the
  tile boundary the GEMMs read, and the GEMM launch reads nothing past that (NaN there)."""
  g, q, k, p = make_inputs(21, 1, 2, sq, sk, 32, causal=True)
  v = lambda x: x.reshape((2,) + x.shape[2:])
  g3, p3, q3, k3 = v(g), v(p), v(q), v(k)
  scale = jnp.full((1,), 0.125, jnp.float32)
  cfg = qks.DlConfig(rows, 4)
  tiles = qks.PassConfig(16, 32, 4, 2)
  side = dlg.causal_tile_of(tiles)[0]
  assert dlg.causal_tile_of(tiles, qks.PassConfig(64, 16, 4, 2)) == (64, 64)
  full = dlg.dl_pass(scale, g3, p3, causal=True, cfg=cfg, interpret=INTERPRET,
                     causal_tile=(128, 128))
  part = dlg.dl_pass(scale, g3, p3, causal=True, cfg=cfg, interpret=INTERPRET,
                     causal_tile=(side, side))
  r, c = np.arange(sq)[:, None], np.arange(sk)[None, :]
  written = c < -(-(r // side * side + side + sk - sq) // side) * side
  np.testing.assert_array_equal(np.asarray(part, np.float32)[:, written],
                                np.asarray(full, np.float32)[:, written])
  dirty = jnp.where(written, part, jnp.nan).astype(full.dtype)
  want_q = jnp.einsum("bqk,bkd->bqd", full, k3, preferred_element_type=jnp.float32)
  want_k = jnp.einsum("bqk,bqd->bkd", full, q3, preferred_element_type=jnp.float32)
  got = dlg.dl_gemms(dirty, q3, k3, causal=True, cfg=tiles, interpret=INTERPRET)
  for o, want in zip(got, (want_q, want_k)):
    assert np.isfinite(np.asarray(o, np.float32)).all()
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(want, np.float32),
                               atol=1e-2 * float(jnp.abs(want).max()), rtol=1e-2)
