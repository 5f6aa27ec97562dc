"""Tests of the Pallas kernel for the attention softmax-dropout-value backward (problem A).

The kernel runs in the Pallas interpreter (``interpret=INTERPRET``) on CPU and is compared
with the pure-jnp reference. Sizes are small: the interpreter is slow.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, assert_configs_fit, triton_calls_in_gpu_lowering
from jax_ops.reference import attention_softmax_dropout_value_backward_reference as _reference
from pallas_kernels import attention_softmax_dropout_value as asdv
from pallas_kernels.attention_softmax_dropout_value import (
    attention_softmax_dropout_value_backward as kernel)


def make_inputs(b, h, kvh, sq, skv, d, p, *, dtype=jnp.bfloat16, seed=0):
  """Inputs as a real forward makes them: Pd == round(P * keep / (1 - p)).

  Built with NumPy: eager jax.random ops would each compile, which dominates on CPU.
  """
  rng = np.random.default_rng(seed)
  logits = 2.0 * rng.standard_normal((b, h, sq, skv), np.float32)
  e = np.exp(logits - logits.max(-1, keepdims=True))
  probs = jnp.asarray(e / e.sum(-1, keepdims=True)).astype(dtype)
  keep = rng.uniform(size=(b, h, sq, skv)) > p
  dropped = (np.asarray(probs, np.float32) * keep / np.float32(1.0 - p)).astype(np.float32)
  grad_out = jnp.asarray(rng.standard_normal((b, sq, h, d), np.float32)).astype(dtype)
  value = jnp.asarray(rng.standard_normal((b, kvh, skv, d), np.float32)).astype(dtype)
  return grad_out, probs, jnp.asarray(dropped).astype(dtype), value, jnp.asarray(keep)


def garbage_mask(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).uniform(size=shape) > 0.5)


# Jitted so each shape compiles once instead of op by op.
reference = jax.jit(_reference, static_argnums=5)


def assert_close_fraction(out, ref, atol, rtol, frac=0.99):
  """``|out - ref| <= atol + rtol * |ref|`` on at least ``frac`` of the elements; finite."""
  out = np.asarray(jnp.asarray(out, jnp.float32))
  ref = np.asarray(jnp.asarray(ref, jnp.float32))
  assert out.shape == ref.shape, (out.shape, ref.shape)
  assert np.all(np.isfinite(out)), "non-finite values in the kernel output"
  ok = np.abs(out - ref) <= atol + rtol * np.abs(ref)
  assert ok.mean() >= frac, (
      f"only {ok.mean():.4f} of elements within atol={atol} rtol={rtol}; "
      f"max abs err {np.abs(out - ref).max()}")


def assert_max_error(out, ref, rel):
  """Stricter: the largest absolute error is small relative to the scale of ``ref``."""
  out = np.asarray(jnp.asarray(out, jnp.float32))
  ref = np.asarray(jnp.asarray(ref, jnp.float32))
  err = np.abs(out - ref).max()
  scale = np.abs(ref).max()
  assert err <= rel * scale + 1e-6, f"max abs err {err} vs ref scale {scale}"


def check(outs, refs, dtype=jnp.bfloat16):
  # bf16 ulp is 2^-8 relative: a one-ulp rounding difference at the largest value is
  # below 1% of the scale; fp16/fp32 are tighter.
  rel = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}[dtype]
  for name, out, ref in zip(("grad_attn_scores", "grad_value_states"), outs, refs):
    assert out.dtype == ref.dtype == dtype, name
    assert_close_fraction(out, ref, atol=1e-5, rtol=0.05)
    assert_max_error(out, ref, rel)


# (B, H, KVH, Sq, Skv, D, p): odd lengths, G in {1, 4, 10}, D in {64, 128, 40}.
CASES = [
    (1, 4, 1, 7, 33, 64, 0.1),      # G = 4
    (2, 2, 2, 33, 7, 128, 0.0),     # G = 1, B = 2
    (1, 10, 1, 131, 1, 64, 0.0),    # G = 10, Skv = 1 (p > 0: see test_single_key_dropout)
    (1, 20, 2, 1, 131, 40, 0.1),    # G = 10, Sq = 1, odd D
    (1, 4, 1, 131, 131, 40, 0.1),   # odd D, ragged tails on both axes
    (1, 4, 2, 33, 131, 128, 0.1),   # G = 2, D = 128
]


@pytest.mark.parametrize("b,h,kvh,sq,skv,d,p", CASES)
def test_matches_reference(b, h, kvh, sq, skv, d, p):
  args = make_inputs(b, h, kvh, sq, skv, d, p)
  check(kernel(*args, p, interpret=INTERPRET), reference(*args, p))


def test_single_key_dropout():
  """Skv = 1 with dropout: the exact dS is 0 (P == 1, delta == dW). A row that fits one kv
  tile gets delta = rowsum(dW * P) as the reference computes it, so the kernel gives 0 too."""
  p = 0.1
  args = make_inputs(1, 10, 1, 131, 1, 64, p, seed=5)
  ds, dv = kernel(*args, p, interpret=INTERPRET)
  ref_ds, ref_dv = reference(*args, p)
  np.testing.assert_allclose(np.asarray(dv, np.float32), np.asarray(ref_dv, np.float32),
                             rtol=1e-2, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(ds, np.float32), np.asarray(ref_ds, np.float32))


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_short_rows_exact_delta(p):
  """Short rows (one kv tile): delta from dW and P exactly as the reference, not from pass
  1's partials of dPd * Pd (whose rounding of Pd alone left 98.65% of this case within the
  tolerance, under the 99% bar)."""
  args = make_inputs(1, 4, 2, 16, 15, 16, p, seed=1)
  check(kernel(*args, p, interpret=INTERPRET), reference(*args, p))


def test_small_blocks_many_partials():
  """block_kv = 16 gives many delta partials; block_q = 16 many q tiles per program."""
  args = make_inputs(1, 4, 2, 67, 100, 64, 0.1, seed=1)
  outs = kernel(*args, 0.1, block_q=16, block_kv=16, num_warps=4, num_stages=2,
                interpret=INTERPRET)
  check(outs, reference(*args, 0.1))


def run_with_rate(args, p, config):
  """The kernel with dropout rate ``p``: a float, or ``"traced"`` (0.1 passed into jit)."""
  if p == "traced":
    run = jax.jit(lambda r: kernel(*args, r, config=config, interpret=INTERPRET))
    return run(jnp.float32(0.1))
  return kernel(*args, p, config=config, interpret=INTERPRET)


@pytest.mark.parametrize("heads, prefetch, p", [(2, False, 0.1), (4, False, 0.0),
                                              (3, True, 0.1), (2, False, "traced")])
def test_ds_pass_heads_per_program(heads, prefetch, p):
  """The dS pass with several query heads of a kv group per program (V tiles shared),
  ragged tiles, many delta partials (several chunks of the partials' 2D loads). Rows of
  1100 keys are not 16-byte aligned: ``row_align=0`` keeps them on this path."""
  rate = 0.1 if p == "traced" else p
  args = make_inputs(2, 8, 2, 37, 1100, 64, rate, seed=8)  # G = 4; 3 heads -> 2
  config = asdv.Config(asdv.PassConfig(16, 16, 4, 2),
                       asdv.PassConfig(16, 32, 4, 2, prefetch=prefetch, heads=heads,
                                       row_align=0))
  check(run_with_rate(args, p, config), reference(*args, rate))


def test_group_heads():
  assert [asdv.group_heads(10, n) for n in (1, 2, 3, 4, 5, 6, 10, 16)] == [1, 2, 2, 2, 5, 5, 10, 10]
  assert [asdv.group_heads(1, n) for n in (1, 2)] == [1, 1]
  assert asdv.group_heads(4, 0) == 1


@pytest.mark.parametrize("p", [0.0, 0.1, "traced"])
def test_prefetch_ds_pass(p):
  """The dS pass with the next tile's loads issued early, on ragged tiles and all modes."""
  rate = 0.1 if p == "traced" else p
  args = make_inputs(1, 4, 2, 37, 83, 64, rate, seed=6)
  config = asdv.Config(asdv.PassConfig(16, 32, 4, 2),
                       asdv.PassConfig(16, 32, 4, 2, prefetch=True, row_align=0))
  check(run_with_rate(args, p, config), reference(*args, rate))


# (B, H, KVH, Sq, Skv, D): rows of Skv % 8 != 0 keys; G in {1, 3, 4}; Skv just above a tile
# multiple, Sq below / above the class sizes.
PHASED_CASES = [
    (1, 4, 1, 37, 45, 64),     # G = 4: classes run across the group's heads
    (2, 3, 3, 21, 33, 32),     # G = 1, B = 2, Skv = 2 * 16 + 1
    (1, 6, 2, 9, 99, 40),      # G = 3, odd D, few rows
    (1, 2, 1, 70, 130, 16),    # Skv % 8 == 2: phases repeat every 4 rows
]


@pytest.mark.parametrize("row_align", [-1, 8, 16, 64])
@pytest.mark.parametrize("b,h,kvh,sq,skv,d", PHASED_CASES)
def test_ds_pass_phased(b, h, kvh, sq, skv, d, row_align):
  """The dS pass on aligned tiles of every ``row_align``-th row (``_ds_kernel_phased``):
  against the reference, and against the tiles of consecutive rows (``row_align=0``)."""
  p = 0.1
  args = make_inputs(b, h, kvh, sq, skv, d, p, seed=sq)
  phased = asdv.Config(asdv.PassConfig(16, 16, 4, 2),
                       asdv.PassConfig(16, 16, 4, 2, row_align=row_align))
  plain = asdv.Config(phased.dv, phased.ds._replace(row_align=0))
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
  from pallas_kernels import _phase
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


def test_p_zero_never_reads_mask():
  """With p == 0 the mask content is irrelevant: garbage gives bit-identical results."""
  args = make_inputs(1, 4, 1, 33, 33, 64, 0.0, seed=2)
  garbage = garbage_mask(args[4].shape, 7)
  a = kernel(*args[:4], garbage, 0.0, interpret=INTERPRET)
  b = kernel(*args[:4], jnp.zeros_like(args[4]), 0.0, interpret=INTERPRET)
  c = kernel(*args, 0.0, interpret=INTERPRET)
  for x, y, z in zip(a, b, c):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(z, np.float32))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(z, np.float32))
  check(a, reference(*args, 0.0))


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_traced_dropout_rate(p):
  """p as a jit argument: the mask is read, scaled by 1/(1-p), and ignored when p == 0."""
  args = make_inputs(1, 4, 2, 33, 40, 64, p, seed=3)
  mask = args[4]
  if p == 0.0:  # p == 0 must ignore the mask even when traced
    mask = garbage_mask(mask.shape, 8)
  fn = jax.jit(lambda rate: kernel(*args[:4], mask, rate, interpret=INTERPRET))
  outs = fn(jnp.float32(p))
  check(outs, reference(*args, p))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_other_dtypes(dtype):
  args = make_inputs(1, 4, 2, 20, 37, 64, 0.1, dtype=dtype, seed=4)
  check(kernel(*args, 0.1, interpret=INTERPRET), reference(*args, 0.1), dtype)


def test_argument_errors():
  args = make_inputs(1, 2, 1, 8, 8, 16, 0.1)
  with pytest.raises(ValueError, match="dropout rate"):
    kernel(*args, 1.0, interpret=INTERPRET)
  with pytest.raises(TypeError, match="dropout_mask"):
    kernel(*args[:4], args[4].astype(jnp.float32), 0.1, interpret=INTERPRET)
  with pytest.raises(ValueError, match="value_states"):
    kernel(*args[:3], args[3][:, :, :4], args[4], 0.1, interpret=INTERPRET)
  with pytest.raises(ValueError, match="block_q"):
    kernel(*args, 0.1, block_q=24, interpret=INTERPRET)


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
  assert asdv.auto_split(1, 80, 8, 512, 512, 64, 64) == 4     # 64 programs, 80 steps
  assert asdv.auto_split(1, 80, 8, 1024, 1024, 64, 64) == 2   # 128 programs
  assert asdv.auto_split(32, 80, 8, 512, 512, 64, 64) == 1    # 2048 programs
  assert asdv.auto_split(1, 1, 1, 32, 64, 64, 64) == 1        # one step: nothing to split


@pytest.mark.parametrize("skv", [200, 201])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.1, None])
def test_lowers_to_triton(pretend_h200, p, prefetch, skv):
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
                       asdv.PassConfig(64, 64, 4, 2, prefetch, heads=2))
  assert triton_calls_in_gpu_lowering(kernel, shapes, p, config=config) == 2


@pytest.mark.parametrize("device_kind", [None, "NVIDIA H200"])
def test_default_config(device_kind):
  """Heuristic and tuned defaults: powers of two >= 16, capped by the padded lengths."""
  for sq, skv, d, dtype in itertools.product([1, 33, 211, 4096], [1, 200, 449, 4096],
                                             [40, 64, 128], [jnp.bfloat16, jnp.float32]):
    assert_configs_fit(asdv.default_config(2, 8, 2, sq, skv, d, dtype, device_kind), sq, skv)


def delta_of(args):
  """``rowsum(dO * (Pd @ V))`` [B, H, Sq] fp32: what the op gets from its forward's output."""
  d_o, _, dropped, value, _ = args
  b, h, sq, skv = dropped.shape
  kvh = value.shape[1]
  v = jnp.repeat(value.astype(jnp.float32), h // kvh, axis=1)
  out = jnp.einsum("bhqs,bhsd->bqhd", dropped.astype(jnp.float32), v,
                   precision=jax.lax.Precision.HIGHEST)
  return jnp.einsum("bqhd,bqhd->bhq", d_o.astype(jnp.float32), out)


@pytest.mark.parametrize("b,h,kvh,sq,skv,d,p", CASES)
def test_from_delta_matches_reference(b, h, kvh, sq, skv, d, p):
  """One kernel from P, keep and delta (64-key tiles: rows of <= 64 keys take the in-tile
  delta, longer ones the given one); odd shapes, G in {1, 2, 4, 10}."""
  args = make_inputs(b, h, kvh, sq, skv, d, p, seed=2)
  d_o, probs, _, value, keep = args
  outs = asdv.attention_softmax_dropout_value_backward_from_delta(
      d_o, probs, value, keep, p, delta_of(args), interpret=INTERPRET)
  check(outs, reference(*args, p))


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


def test_from_delta_checks_delta():
  args = make_inputs(1, 4, 2, 8, 16, 16, 0.1)
  d_o, probs, _, value, keep = args
  with pytest.raises(ValueError, match="delta"):
    asdv.attention_softmax_dropout_value_backward_from_delta(
        d_o, probs, value, keep, 0.1, jnp.zeros((1, 4, 9), jnp.float32), interpret=INTERPRET)
  with pytest.raises((ValueError, TypeError), match="delta"):
    asdv.attention_softmax_dropout_value_backward_from_delta(
        d_o, probs, value, keep, 0.1, jnp.zeros((1, 4, 8), jnp.bfloat16), interpret=INTERPRET)


def test_pd_none_is_an_argument_error():
  """Only the backward from delta goes without Pd; the two-kernel one names it."""
  d_o, probs, _, value, keep = make_inputs(1, 4, 2, 8, 16, 16, 0.1)
  with pytest.raises(TypeError, match="attn_weights_dropped"):
    kernel(d_o, probs, None, value, keep, 0.1, interpret=INTERPRET)


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


@pytest.mark.parametrize("skv, row_align, p", [(131, -1, 0.1), (131, -1, "traced"),
                                               (131, 0, 0.0), (96, -1, 0.1)])
def test_given_delta(skv, row_align, p):
  """``delta=`` (from the forward's output): pass 1 makes only dV and the dS pass reads
  one delta per row; rows of Skv % 8 != 0 on row-class tiles (-1) or not (0)."""
  rate = 0.1 if p == "traced" else p
  args = make_inputs(1, 4, 2, 33, skv, 64, rate, seed=10)
  config = asdv.Config(asdv.PassConfig(32, 32, 4, 2),
                       asdv.PassConfig(32, 32, 4, 2, row_align=row_align))
  run = lambda r: kernel(*args, r, delta=delta_of(args), config=config, interpret=INTERPRET)
  outs = jax.jit(run)(jnp.float32(rate)) if p == "traced" else run(p)
  check(outs, reference(*args, rate))


def test_given_delta_unread_for_one_tile_rows():
  """Rows that fit one dS tile take delta in the tile: a wrong given delta changes nothing
  (and a right one is not needed)."""
  args = make_inputs(1, 4, 2, 33, 50, 64, 0.1, seed=11)
  config = asdv.Config(asdv.PassConfig(32, 64, 4, 2), asdv.PassConfig(32, 64, 4, 2))
  wrong = jnp.full((1, 4, 33), 1e3, jnp.float32)
  outs = kernel(*args, 0.1, delta=wrong, config=config, interpret=INTERPRET)
  check(outs, reference(*args, 0.1))


def test_given_delta_checked():
  args = make_inputs(1, 4, 2, 8, 16, 16, 0.1)
  with pytest.raises(ValueError, match=r"delta.*\[B, H, Sq\]"):
    kernel(*args, 0.1, delta=jnp.zeros((1, 4, 9), jnp.float32), interpret=INTERPRET)
  with pytest.raises((ValueError, TypeError), match="delta"):
    kernel(*args, 0.1, delta=jnp.zeros((1, 4, 8), jnp.bfloat16), interpret=INTERPRET)


@pytest.mark.parametrize("p", [0.1, 0.15, 0.3])
def test_static_dropout_scale_is_the_forwards(p):
  """The kernels' static scale is the fp32 ``1 / (1 - p)`` the forward multiplies by (in
  double precision it is one ulp off at p = 0.15), so Pd rebuilt from P and keep matches."""
  from pallas_kernels._util import dropout_scale
  forward = jax.jit(lambda r: 1.0 / (1.0 - jnp.asarray(r, jnp.float32)))(p)
  assert np.float32(dropout_scale(p)) == np.asarray(forward)
