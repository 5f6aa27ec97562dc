"""The kernel suite (``kernel_base``) on the Pallas Triton backend, and the tests of that
backend's own passes, loop strategies, configs, tuned table and lowering to Triton IR."""

from __future__ import annotations

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from conftest import INTERPRET, ON_GPU, triton_calls_in_gpu_lowering
from pallas_kernels import _phase, _tuning
from pallas_kernels import attention_softmax_dropout_value as asdv
from pallas_kernels.attention_softmax_dropout_value import pallas_triton, pallas_triton_from_delta

from .kernel_base import *  # noqa: F401,F403
from .kernel_base import assert_close_fraction, check, delta_of, make_inputs, reference

kernel = pallas_triton.attention_softmax_dropout_value_backward


@pytest.fixture
def backward():
  return pallas_triton.attention_softmax_dropout_value_backward


@pytest.fixture
def backward_from_delta():
  return asdv.attention_softmax_dropout_value_backward_from_delta


@pytest.fixture
def lowering_for_h200(pretend_h200, monkeypatch):
  """Lowering to Triton IR on any host: an H200 is pretended (``pretend_h200``), and the
  entry points' check that the arrays sit on a CUDA GPU is skipped (the traced arguments
  of a cross-lowering hold no device)."""
  for module in (pallas_triton, pallas_triton_from_delta):
    monkeypatch.setattr(module, "check_can_compile", lambda *a, **k: None)


def run_with_rate(args, p, config):
  """The kernel with dropout rate ``p``: a float, or ``"traced"`` (0.1 passed into jit)."""
  if p == "traced":
    run = jax.jit(lambda r: kernel(*args, r, config=config, interpret=INTERPRET))
    return run(jnp.float32(0.1))
  return kernel(*args, p, config=config, interpret=INTERPRET)


def test_small_blocks_many_partials():
  """block_k = 16 gives many delta partials; block_q = 16 many q tiles per program."""
  args = make_inputs(1, 4, 2, 67, 100, 64, 0.1, seed=1)
  outs = kernel(*args, 0.1, block_q=16, block_k=16, num_warps=4, num_stages=2,
                interpret=INTERPRET)
  check(outs, reference(*args, 0.1))


def test_block_kv_is_not_a_keyword():
  args = make_inputs(1, 2, 1, 8, 8, 16, 0.1)
  with pytest.raises(TypeError, match="block_kv"):
    kernel(*args, 0.1, block_kv=32, interpret=INTERPRET)


@pytest.mark.parametrize("heads, p", [(2, "traced"), (4, 0.0), (3, 0.1)])
def test_ds_pass_heads_per_program(heads, p):
  """The dS pass with several query heads of a kv group per program (V tiles shared),
  ragged tiles, many delta partials (34 of 16 keys: two chunks of the partials' 2D loads of
  up to 32). Rows of 530 keys are not 16-byte aligned: ``row_align=0`` keeps them on this
  path."""
  rate = 0.1 if p == "traced" else p
  args = make_inputs(2, 8, 2, 19, 530, 64, rate, seed=8)  # G = 4; 3 heads -> 2
  config = asdv.Config(asdv.PassConfig(16, 16, 4, 2),
                       asdv.PassConfig(16, 32, 4, 2, heads=heads, row_align=0))
  check(run_with_rate(args, p, config), reference(*args, rate))


def test_group_heads():
  assert [asdv.group_heads(10, n) for n in (1, 2, 3, 4, 5, 6, 10, 16)] == [1, 2, 2, 2, 5, 5, 10, 10]
  assert [asdv.group_heads(1, n) for n in (1, 2)] == [1, 1]
  assert asdv.group_heads(4, 0) == 1


# (B, H, KVH, Sq, Skv, D): rows of Skv % 8 != 0 keys; G in {1, 3, 4}; Skv just above a tile
# multiple, Sq below / above the class sizes.
PHASED_CASES = [
    (1, 4, 1, 37, 45, 64),     # G = 4: classes run across the group's heads
    (2, 3, 3, 21, 33, 32),     # G = 1, B = 2, Skv = 2 * 16 + 1
    (1, 6, 2, 9, 99, 40),      # G = 3, odd D, few rows
    (1, 2, 1, 70, 130, 16),    # Skv % 8 == 2: phases repeat every 4 rows
]


_ALIGNS = (-1, 8, 16, 64)


# Each case at two of the alignments, each alignment on two cases.
@pytest.mark.parametrize("b,h,kvh,sq,skv,d,row_align", [
    (*case, _ALIGNS[(i + j) % 4]) for i, case in enumerate(PHASED_CASES) for j in (0, 1)])
def test_ds_pass_phased(b, h, kvh, sq, skv, d, row_align):
  """The dS pass on aligned tiles of every ``row_align``-th row (``_ds_kernel_phased``):
  against the reference, and against the tiles of consecutive rows (``row_align=0``)."""
  p = 0.1
  args = make_inputs(b, h, kvh, sq, skv, d, p, seed=sq)
  phased = asdv.Config(asdv.PassConfig(16, 16, 4, 2),
                       asdv.PassConfig(16, 16, 4, 2, row_align=row_align))
  plain = asdv.Config(phased.dv, dataclasses.replace(phased.ds, row_align=0))
  ds_pass_args = (b, h, sq, skv, d, 1, 1)
  assert asdv.use_phased(phased.ds, *ds_pass_args) and not asdv.use_phased(plain.ds,
                                                                            *ds_pass_args)
  outs = kernel(*args, p, config=phased, interpret=INTERPRET)
  check(outs, reference(*args, p))
  base = kernel(*args, p, config=plain, interpret=INTERPRET)
  for out, ref in zip(outs, base):  # same math; the dot's summation order may differ
    assert_close_fraction(out, ref, atol=1e-5, rtol=1e-2, frac=0.999)


@pytest.mark.parametrize("row_align", [32, 64])
def test_ds_pass_phased_wide_classes(row_align):
  """64-key tiles allow classes of every 32nd / 64th row: phases of up to 63 keys."""
  b, h, kvh, sq, skv, d, p = 1, 8, 2, 40, 150, 32, 0.1
  assert _phase.resolve(row_align, (h // kvh) * sq, 16, 64) == (row_align, 16)
  args = make_inputs(b, h, kvh, sq, skv, d, p, seed=3)
  config = asdv.Config(asdv.PassConfig(16, 16, 4, 2),
                       asdv.PassConfig(16, 64, 4, 2, row_align=row_align))
  check(kernel(*args, p, config=config, interpret=INTERPRET), reference(*args, p))


@pytest.mark.parametrize("p", [0.0, "traced"])
def test_ds_pass_phased_dropout_modes(p):
  rate = 0.1 if p == "traced" else p
  args = make_inputs(1, 4, 2, 37, 83, 64, rate, seed=6)
  config = asdv.Config(asdv.PassConfig(16, 32, 4, 2), asdv.PassConfig(16, 32, 4, 2))
  check(run_with_rate(args, p, config), reference(*args, rate))


def test_ds_pass_phased_under_x64():
  """The phase-aligned dS pass with 64-bit types enabled (this module's own indices are
  int32; what fails is in the shared ``_phase`` helpers)."""
  with jax.enable_x64(True):
    args = make_inputs(1, 4, 2, 21, 37, 24, 0.1, seed=12)
    config = asdv.Config(asdv.PassConfig(16, 16, 4, 2), asdv.PassConfig(16, 16, 4, 2))
    check(kernel(*args, 0.1, config=config, interpret=True), reference(*args, 0.1))


def test_argument_errors_in_config():
  args = make_inputs(1, 2, 1, 8, 8, 16, 0.1)
  with pytest.raises(ValueError, match="block_q"):
    kernel(*args, 0.1, block_q=24, interpret=INTERPRET)


@pytest.mark.skipif(ON_GPU, reason="compiles on a GPU")
def test_compiling_off_a_gpu_says_interpret():
  """Off a CUDA GPU the Triton kernels cannot compile: a clear error naming interpret=True."""
  args = make_inputs(1, 2, 1, 8, 8, 16, 0.1)
  with pytest.raises(ValueError, match="interpret=True"):
    kernel(*args, 0.1)
  d_o, probs, _, value, keep = args
  with pytest.raises(ValueError, match="interpret=True"):
    asdv.attention_softmax_dropout_value_backward_from_delta(d_o, probs, value, keep, 0.1,
                                                             delta_of(args))


@pytest.mark.parametrize("split", [1, 3, 4])
def test_dv_pass_split(split):
  """The dV pass with its (heads x Sq tiles) loop split over programs (fp32 partial dV;
  with 4 shares of 3 steps the last share is empty)."""
  args = make_inputs(1, 4, 2, 37, 83, 64, 0.1, seed=8)
  dv_cfg = asdv.PassConfig(16, 32, 4, 2, split=split)
  config = asdv.Config(dv_cfg, asdv.PassConfig(16, 32, 4, 2))
  check(kernel(*args, 0.1, config=config, interpret=INTERPRET), reference(*args, 0.1))


def test_auto_split():
  """Small launches split the dV pass's loop; large ones and short loops do not."""
  from pallas_kernels.attention_softmax_dropout_value.config import auto_split_for_launch
  assert auto_split_for_launch(64, 80) == 4     # 64 programs, 80 steps
  assert auto_split_for_launch(128, 160) == 2   # 128 programs
  assert auto_split_for_launch(2048, 80) == 1    # 2048 programs
  assert auto_split_for_launch(1, 1) == 1        # one step: nothing to split


@pytest.mark.parametrize("skv", [200, 201])
@pytest.mark.parametrize("p", [0.0, 0.1, None])
def test_lowers_to_triton(lowering_for_h200, p, skv):
  """The kernels lower to Triton IR (no GPU needed; catches unsupported ops early).

  Pretends an H200 is present by patching JAX's internal GPU-info lookup (skipped if
  that internal moves). Compiling the IR to PTX still needs a GPU.
  """
  b, h, kvh, sq, d = 2, 8, 2, 131, 40
  dt = jnp.bfloat16
  shapes = [jax.ShapeDtypeStruct(s, t) for s, t in (
      ((b, sq, h, d), dt), ((b, h, sq, skv), dt), ((b, h, sq, skv), dt),
      ((b, kvh, skv, d), dt), ((b, h, sq, skv), jnp.bool_))]
  config = asdv.Config(asdv.PassConfig(64, 64, 4, 3, split=2),
                       asdv.PassConfig(64, 64, 4, 2, heads=2))
  assert triton_calls_in_gpu_lowering(kernel, shapes, p, config=config) == 2


@pytest.mark.parametrize("p", [0.1, None])
def test_from_delta_lowers_to_triton(lowering_for_h200, p):
  """The kernel from delta lowers to one Triton kernel; ``p=None``: a traced rate."""
  b, h, kvh, sq, skv, d = 2, 8, 2, 131, 200, 40
  dt = jnp.bfloat16
  s = jax.ShapeDtypeStruct
  shapes = [s((b, sq, h, d), dt), s((b, h, sq, skv), dt), s((b, kvh, skv, d), dt),
            s((b, h, sq, skv), jnp.bool_)]
  fn = lambda do, probs, v, keep, r: asdv.attention_softmax_dropout_value_backward_from_delta(
      do, probs, v, keep, r, jnp.zeros((b, h, sq), jnp.float32))
  assert triton_calls_in_gpu_lowering(fn, shapes, p) == 1


def assert_config_fits(config, rows, cols):
  """Every pass of a :class:`Config`: tiles are powers of two >= 16 capped by the padded
  lengths; sane launch parameters."""
  for c in (config.dv, config.ds):
    for blk in (c.block_q, c.block_k):
      assert blk >= 16 and blk & (blk - 1) == 0, c
    assert c.block_q <= max(16, pl.next_power_of_2(rows)), c
    assert c.block_k <= max(16, pl.next_power_of_2(cols)), c
    assert c.num_warps in (2, 4, 8, 16) and 1 <= c.num_stages <= 4, c


@pytest.mark.parametrize("device_kind", [None, "NVIDIA H200"])
def test_default_config(device_kind):
  """Heuristic and tuned defaults: powers of two >= 16, capped by the padded lengths."""
  for sq, skv, d, dtype in itertools.product([1, 33, 211, 4096], [1, 200, 449, 4096],
                                             [40, 64, 128], [jnp.bfloat16, jnp.float32]):
    assert_config_fits(asdv.default_config(2, 8, 2, sq, skv, d, dtype, device_kind), sq, skv)


def test_tuned_table_named_fields():
  """The H200 table: named fields only, every entry a valid Config, written back unchanged
  by ``Config.to_json`` up to defaults; the classes the workloads use."""
  path = _tuning.table_path("attention_softmax_dropout_value", "NVIDIA H200")
  with open(path) as f:
    data = json.load(f)
  assert set(data) == {"device_kind", "compute_capability", "date", "jax", "configs"}
  for key, entry in data["configs"].items():
    cfg = asdv.Config.from_json(entry)
    assert asdv.Config.from_json(cfg.to_json()) == cfg, key
    assert set(entry) <= {"dv", "ds", "fwd", "backend"}, key
    if "fwd" in entry:  # the forward's launch
      assert isinstance(_tuning.TritonPassConfig(**entry["fwd"]), _tuning.TritonPassConfig)
  tuned = asdv.default_config(4, 80, 8, 1024, 2048, 128, jnp.bfloat16, "NVIDIA H200")
  assert tuned == asdv.Config(asdv.PassConfig(128, 128, 8, 3),
                              asdv.PassConfig(64, 128, 8, 2, heads=2))
  short = asdv.default_config(64, 80, 8, 128, 128, 128, jnp.bfloat16, "NVIDIA H200")
  assert short == asdv.Config(asdv.PassConfig(64, 64, 4, 4), asdv.PassConfig(64, 128, 8, 2))
  assert asdv.length_class(449) == "512-ragged" and asdv.length_class(2048) == "1024"


def test_pass_config_validation():
  assert asdv.PassConfig(64, 64, 4, 2).split == "auto"
  for bad in (0, -1, "half", True):
    with pytest.raises(ValueError, match="split"):
      asdv.PassConfig(64, 64, 4, 2, split=bad)
  with pytest.raises(ValueError, match="heads"):
    asdv.PassConfig(64, 64, 4, 2, heads=0)
  with pytest.raises(ValueError, match="row_align"):
    asdv.PassConfig(64, 64, 4, 2, row_align=12)
  with pytest.raises(ValueError, match="unknown fields"):
    asdv.PassConfig.from_json({"block_q": 64, "block_kv": 64, "num_warps": 4, "num_stages": 2})
  with pytest.raises(TypeError, match="config.ds"):
    asdv.Config(asdv.PassConfig(64, 64, 4, 2), (64, 64, 4, 2))


@pytest.mark.parametrize("p", [0.0, 0.2, "traced"])
def test_from_delta_split_and_ragged_rows(p):
  """Several programs per kv block (``split``), a ragged last tile of the group's rows,
  16-key tiles (delta read) and a traced rate."""
  rate = 0.2 if p == "traced" else p
  args = make_inputs(2, 8, 2, 37, 50, 64, rate, seed=4)
  d_o, probs, _, value, keep = args
  delta = delta_of(args)
  cfg = asdv.PassConfig(32, 16, 4, 2, split=3)
  run = lambda r: asdv.attention_softmax_dropout_value_backward_from_delta(
      d_o, probs, value, keep, r, delta, config=cfg, interpret=INTERPRET)
  outs = jax.jit(run)(jnp.float32(rate)) if p == "traced" else run(p)
  check(outs, reference(*args, rate))


def test_dv_pass_without_partials():
  """``partials=False`` (no dPd GEMM, no V) gives the same dV as the full pass 1."""
  d_o, _, dropped, value, _ = make_inputs(1, 4, 2, 37, 83, 64, 0.1, seed=9)
  cfg = asdv.PassConfig(16, 32, 4, 2, split=2)
  args = (d_o, dropped.reshape(4, 37, 83), value.reshape(2, 83, 64))
  dv, dpart = asdv.dv_pass(*args, num_heads=4, cfg=cfg, interpret=INTERPRET)
  dv_only, none = asdv.dv_pass(*args, num_heads=4, cfg=cfg, interpret=INTERPRET,
                               partials=False)
  assert dpart.shape == (4, 3, 37) and none is None
  np.testing.assert_array_equal(np.asarray(dv_only, np.float32), np.asarray(dv, np.float32))


@pytest.mark.parametrize("p", [0.1, 0.15, 0.3])
def test_static_dropout_scale_is_the_forwards(p):
  """The kernels' static scale is the fp32 ``1 / (1 - p)`` the forward multiplies by (in
  double precision it is one ulp off at p = 0.15), so Pd rebuilt from P and keep matches."""
  from pallas_kernels._util import dropout_scale
  forward = jax.jit(lambda r: 1.0 / (1.0 - jnp.asarray(r, jnp.float32)))(p)
  assert np.float32(dropout_scale(p)) == np.asarray(forward)
