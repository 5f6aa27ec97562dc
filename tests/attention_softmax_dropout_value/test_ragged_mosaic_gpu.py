"""Kernel A's backward with the Mosaic GPU dS pass for rows of any length (ragged_mosaic_gpu):
against the reference in the Mosaic GPU interpreter on CPU, compiled on a Hopper GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, ON_GPU
from pallas_kernels._util import is_hopper
from pallas_kernels.attention_softmax_dropout_value import ragged_mosaic_gpu as rg

from .kernel_base import assert_close_fraction, check, delta_of, make_inputs, reference

HOPPER = ON_GPU and is_hopper(jax.devices()[0])
needs_kernels = pytest.mark.skipif(ON_GPU and not HOPPER, reason="needs a Hopper GPU")


# (B, H, KVH, Sq, Skv, D, p, split): odd row lengths, one that is a multiple of 64, G of 1, 2,
# 4 and 10, D of 64 and 128, a kv group's rows in one share and in two, a first row of a
# group that is not a multiple of 8 (G * seq_q = 76, 34, ...), three key blocks (the last
# overlapping), no dropout.
CASES = [
    (1, 4, 2, 38, 75, 64, 0.1, None),
    (2, 2, 1, 34, 67, 128, 0.2, 1),
    (1, 2, 1, 36, 64, 64, 0.0, 1),
    (1, 4, 1, 34, 70, 64, 0.1, 2),
    (1, 10, 1, 8, 69, 64, 0.1, 1),
    (1, 2, 2, 68, 130, 64, 0.0, 1),
]


@needs_kernels
@pytest.mark.parametrize("b,h,kvh,sq,skv,d,p,split", CASES)
def test_matches_reference(b, h, kvh, sq, skv, d, p, split):
  """The default: the delta kernel, then the dS pass with dV (the rows that an overlapping
  last tile repeats counted once)."""
  args = make_inputs(b, h, kvh, sq, skv, d, p, seed=3)
  out = rg.attention_softmax_dropout_value_backward(*args, p, split=split, interpret=INTERPRET)
  check(out, reference(*args, p))


@needs_kernels
@pytest.mark.parametrize("case,options", [
    (CASES[0], dict(first_pass="triton")),
    (CASES[3], dict(first_pass="triton")),   # two shares
    (CASES[0], dict(first_pass="xla")),
    (CASES[3], dict(swizzle=False)),
    (CASES[1], dict(stages=3)),
])
def test_other_first_passes_and_options(case, options):
  """delta (and dV) from the Triton kernels' first pass or XLA's ``Pd @ V``; the boxes'
  tiles unswizzled; a third ring slot."""
  b, h, kvh, sq, skv, d, p, split = case
  args = make_inputs(b, h, kvh, sq, skv, d, p, seed=3)
  out = rg.attention_softmax_dropout_value_backward(*args, p, split=split, interpret=INTERPRET,
                                                    **options)
  check(out, reference(*args, p))


@needs_kernels
@pytest.mark.parametrize("b,h,kvh,sq,skv,d,split", [
    (1, 4, 2, 38, 75, 64, None),   # the last key block overlapping: its first keys masked
    (1, 4, 1, 34, 130, 128, 2),    # three key blocks, two shares
])
def test_delta_pass_matches_the_rows_sums(b, h, kvh, sq, skv, d, split):
  args = make_inputs(b, h, kvh, sq, skv, d, 0.1, seed=5)
  got = rg.delta_pass(args[0], args[2], args[3], split=split, interpret=INTERPRET)
  want = delta_of(args)
  assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * float(jnp.max(jnp.abs(want)))


@pytest.mark.skipif(ON_GPU, reason="the Mosaic GPU interpreter's race detector")
@pytest.mark.parametrize("stages", [2, 3])
def test_the_ring_has_no_read_write_race(stages, capsys):
  """The detector finds no race on a ring slot or a staging tile, in the dS pass or the delta
  kernel. What it does report are the overlapping tiles' stores of the same values (writes
  only): the last row tile and the last key block overlap the one before, and both write."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  p = 0.1
  args = make_inputs(1, 4, 2, 38, 75, 64, p, seed=3)
  detect = plgpu.InterpretGPUParams(detect_races=True)
  ds = rg.ds_pass(*args[:4], delta_of(args), rate=p, stages=stages, split=1, interpret=detect)
  delta = rg.delta_pass(args[0], args[2], args[3], stages=stages, split=1, interpret=detect)
  jax.block_until_ready((ds, delta))
  jax.effects_barrier()
  report = capsys.readouterr().out
  assert "read of" not in report
  assert_close_fraction(ds, reference(*args, p)[0], atol=1e-5, rtol=0.05)


def test_unsupported_problems_say_why():
  args = make_inputs(1, 2, 1, 36, 64, 64, 0.1)
  with pytest.raises(ValueError, match=r"B \* H \* seq_q = 74 \(a multiple of 8 only\)"):
    rg.attention_softmax_dropout_value_backward(*make_inputs(1, 2, 1, 37, 64, 64, 0.1), 0.1,
                                                interpret=True)
  with pytest.raises(ValueError, match="seq_k 40 \\(at least 64\\)"):
    rg.attention_softmax_dropout_value_backward(*make_inputs(1, 2, 1, 36, 40, 64, 0.1), 0.1,
                                                interpret=True)
  with pytest.raises(ValueError, match="head dim 32"):
    rg.attention_softmax_dropout_value_backward(*make_inputs(1, 2, 1, 36, 64, 32, 0.1), 0.1,
                                                interpret=True)
  with pytest.raises(ValueError, match="a traced dropout rate"):
    jax.jit(lambda r: rg.attention_softmax_dropout_value_backward(*args, r, interpret=True))(
        jnp.float32(0.1))
  with pytest.raises(ValueError, match=r"split: expected an int in \[1, 1\]"):
    rg.ds_pass(*args[:4], delta_of(args), rate=0.1, split=2, interpret=True)
  with pytest.raises(ValueError, match=r"stages: expected an int in \[2, 4\]"):
    rg.ds_pass(*args[:4], delta_of(args), rate=0.1, stages=1, interpret=True)
  with pytest.raises(ValueError, match="first_pass: expected one of"):
    rg.attention_softmax_dropout_value_backward(*args, 0.1, first_pass="cuda", interpret=True)


@pytest.mark.skipif(ON_GPU, reason="lowering for a pretended GPU")
@pytest.mark.parametrize("b,sq,skv,p", [(8, 373, 449, 0.1), (4, 211, 293, 0.0)])
def test_lowers_for_a_gpu_at_the_benchmark_shapes(b, sq, skv, p):
  """Mosaic GPU's own checks pass at two ragged benchmark workloads (H = 80, KVH = 8, D = 128;
  the layouts, the shared memory of 2 and 4 ring stages)."""
  s = jax.ShapeDtypeStruct
  args = (s((b, sq, 80, 128), jnp.bfloat16), s((b, 80, sq, skv), jnp.bfloat16),
          s((b, 80, sq, skv), jnp.bfloat16), s((b, 8, skv, 128), jnp.bfloat16),
          s((b, 80, sq), jnp.float32))
  for stages, with_dv, swizzle in ((2, False, True), (4, True, True), (2, True, False)):
    lowered = jax.jit(lambda *a: rg.ds_pass(*a, rate=p, stages=stages, with_dv=with_dv,
                                            swizzle=swizzle)).trace(*args).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
  for stages in (2, 4):
    lowered = jax.jit(lambda d_o, pd, v: rg.delta_pass(d_o, pd, v, stages=stages)).trace(
        args[0], args[2], args[3]).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
