"""Tests of the problem-C Pallas kernel (``pallas_kernels.qk_scale_softmax``) in interpret mode.

Every case compares with ``jax_ops.reference.qk_scale_softmax_backward_reference`` at the
project's tolerance (|out - ref| <= 1e-5 + 0.05 |ref| on >= 99% of elements, no NaN/Inf)
and bounds the largest error relative to the reference's scale. Sizes are small: interpret
mode runs the kernel body in Python-level XLA ops on the CPU.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, assert_configs_fit, triton_calls_in_gpu_lowering
from jax_ops.reference import qk_scale_softmax_backward_reference as reference
from pallas_kernels import qk_scale_softmax as qks
from pallas_kernels.qk_scale_softmax import qk_scale_softmax_backward

ATOL, RTOL, MIN_FRACTION = 1e-5, 0.05, 0.99


def assert_close(name, out, ref, *, max_rel=0.02):
  """Project tolerance on >= 99% of elements, finite output, and a bounded worst case."""
  assert out.shape == ref.shape, (name, out.shape, ref.shape)
  assert out.dtype == ref.dtype, (name, out.dtype, ref.dtype)
  o = np.asarray(out.astype(jnp.float32), np.float64)
  r = np.asarray(ref.astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(o)), f"{name}: NaN/Inf in kernel output"
  err = np.abs(o - r)
  ok = err <= ATOL + RTOL * np.abs(r)
  assert ok.mean() >= MIN_FRACTION, f"{name}: only {ok.mean():.4%} of elements within tolerance"
  scale = max(np.abs(r).max(), 1e-30)
  assert err.max() <= max_rel * scale + ATOL, f"{name}: max error {err.max():g} vs scale {scale:g}"


def make_inputs(seed, b, h, sq, sk, d, *, causal=False, probs="softmax", dtype=jnp.bfloat16):
  """g, Q, K ~ randn; P = softmax(randn logits) (causal: masked with the Sk - Sq offset)."""
  kg, kq, kk, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
  g = jax.random.normal(kg, (b, h, sq, sk), jnp.float32)
  q = jax.random.normal(kq, (b, h, sq, d), jnp.float32)
  k = jax.random.normal(kk, (b, h, sk, d), jnp.float32)
  logits = jax.random.normal(kp, (b, h, sq, sk), jnp.float32)
  if probs == "randn":  # not a probability: large delta, stresses the cancellation in dL
    p = logits
  else:
    if probs == "sharp":
      logits = logits * 4.0
    p = jax.nn.softmax(logits, axis=-1)
  if causal:
    allowed = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
    p = jnp.where(allowed, p, 0.0)
    if probs != "randn":  # renormalise the rows that keep any key
      p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
  return tuple(x.astype(dtype) for x in (g, q, k, p))


def run_and_check(args, scaling, **kwargs):
  ref_q, ref_k = reference(*args, scaling)
  out_q, out_k = qk_scale_softmax_backward(*args, scaling, interpret=INTERPRET, **kwargs)
  assert_close("grad_query", out_q, ref_q)
  assert_close("grad_key", out_k, ref_k)
  return out_q, out_k


# Dense: odd lengths, Sq != Sk, D in {64, 128, 40}; small explicit tiles force several tiles
# in both loops (and the row kernel's two-pass path), default tiles hit the one-tile path.
@pytest.mark.parametrize(
    "sq, sk, d, blocks",
    [
        (7, 33, 64, {}),
        (33, 7, 128, {}),
        (131, 33, 40, dict(block_q=32, block_k=16)),
        (1, 131, 64, {}),
        (33, 131, 64, dict(block_q=16, block_k=32)),
        (131, 1, 64, {}),
    ],
)
def test_dense(sq, sk, d, blocks):
  args = make_inputs(0, 1, 2, sq, sk, d)
  run_and_check(args, 1.0 / np.sqrt(d), **blocks)


@pytest.mark.parametrize(
    "sq, sk, d, blocks",
    [
        (33, 131, 64, dict(block_q=16, block_k=32)),   # Sq < Sk: every row has keys
        (131, 33, 64, dict(block_q=32, block_k=16)),   # Sq > Sk: leading rows have none
        (7, 131, 128, {}),
    ],
)
def test_causal(sq, sk, d, blocks):
  args = make_inputs(1, 1, 2, sq, sk, d, causal=True)
  run_and_check(args, 1.0 / np.sqrt(d), causal=True, **blocks)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk, bq, bk", [(33, 131, 16, 32), (131, 33, 32, 16), (1, 70, 16, 16)])
def test_prefetch(causal, sq, sk, bq, bk):
  """Both kernels with the next tile's loads issued early: tails, causal, empty rows.
  (``row_align=0``: these ragged rows would otherwise take the phase-aligned row kernel.)"""
  cfg = qks.PassConfig(bq, bk, 4, 2, prefetch=True, row_align=0)
  args = make_inputs(2, 1, 2, sq, sk, 64, causal=causal)
  run_and_check(args, 0.125, causal=causal, config=qks.Config(cfg, cfg))


# (Sq, Sk, D, block_k): rows of Sk % 8 != 0 keys spanning several key tiles.
PHASED_CASES = [(33, 131, 64, 32), (131, 33, 40, 16), (7, 70, 128, 16), (200, 45, 64, 16)]


@pytest.mark.parametrize("row_align", [-1, 8, 32, 64])
@pytest.mark.parametrize("sq, sk, d, block_k", PHASED_CASES)
def test_row_kernel_phased(sq, sk, d, block_k, row_align):
  """The row kernel on aligned tiles of every ``row_align``-th row (``_row_kernel_phased``):
  against the reference, and against tiles of consecutive rows (``row_align=0``; the
  tiles group the keys differently, so sums may round differently)."""
  args = make_inputs(8, 2, 1, sq, sk, d)
  row = qks.PassConfig(16, block_k, 4, 2, row_align=row_align)
  col = qks.PassConfig(16, 32, 4, 2)
  assert qks.use_phased(row, False, 2, sq, sk, d)
  assert not qks.use_phased(row._replace(row_align=0), False, 2, sq, sk, d)
  assert not qks.use_phased(row, True, 2, sq, sk, d)  # causal keeps the plain row kernel
  outs = run_and_check(args, 0.125, config=qks.Config(row, col))
  base = qk_scale_softmax_backward(*args, 0.125, interpret=INTERPRET,
                                   config=qks.Config(row._replace(row_align=0), col))
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
  run_and_check(args, 0.125, causal=causal, config=qks.Config(cfg, cfg, "per_head"))


def test_scheme_errors():
  g, q, k, p = make_inputs(6, 1, 1, 8, 600, 16)
  cfg = qks.PassConfig(16, 32, 4, 2)
  with pytest.raises(ValueError, match="config.scheme"):
    qk_scale_softmax_backward(g, q, k, p, 0.5, config=qks.Config(cfg, cfg, "fused"))
  with pytest.raises(ValueError, match="per_head"):
    qk_scale_softmax_backward(g, q, k, p, 0.5, config=qks.Config(cfg, cfg, "per_head"))


def test_causal_ignores_upper_triangle():
  """With causal=True nothing above the diagonal is used: garbage there changes nothing,
  and skipping tiles gives bit-identical results to the dense walk on clean inputs."""
  sq, sk, d = 33, 65, 40
  g, q, k, p = make_inputs(2, 1, 1, sq, sk, d, causal=True)
  upper = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
  g_bad = jnp.where(upper, jnp.nan, g).astype(g.dtype)
  p_bad = jnp.where(upper, jnp.inf, p).astype(p.dtype)
  kw = dict(causal=True, block_q=16, block_k=16, interpret=INTERPRET)
  clean = qk_scale_softmax_backward(g, q, k, p, 0.125, **kw)
  dirty = qk_scale_softmax_backward(g_bad, q, k, p_bad, 0.125, **kw)
  dense = qk_scale_softmax_backward(g, q, k, p, 0.125, block_q=16, block_k=16, interpret=INTERPRET)
  ref = reference(g, q, k, p, 0.125)
  for a, b, c, r in zip(clean, dirty, dense, ref):
    assert_close("causal", a, r)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


@pytest.mark.parametrize("sq, sk", [(1, 1), (7, 33), (33, 7), (64, 64), (131, 33), (33, 131)])
@pytest.mark.parametrize("block_q, block_k", [(16, 16), (16, 64), (64, 16)])
def test_causal_tile_ranges_are_tight(sq, sk, block_q, block_k):
  """The loop bounds visit exactly the tiles that meet j <= i + (Sk - Sq) (brute force)."""
  nq, nk = -(-sq // block_q), -(-sk // block_k)
  live = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)

  def tile_live(i, j):
    return live[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k].any()

  for i in range(nq):
    n = int(qks._row_num_k_tiles(i, sq, sk, block_q, block_k))
    assert [j for j in range(nk) if tile_live(i, j)] == list(range(n)), (i, n)
  for j in range(nk):
    lo = int(qks._col_first_q_tile(j, sq, sk, block_q, block_k))
    assert [i for i in range(nq) if tile_live(i, j)] == list(range(lo, nq)), (j, lo)

  # Tiles loaded without the element-wise mask must hold no element above the diagonal.
  def tile_full(i, j):
    return live[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k].all()

  for i in range(nq):
    n = int(qks._row_num_k_tiles(i, sq, sk, block_q, block_k))
    n_full = int(qks._row_num_full_k_tiles(i, sq, sk, block_q, block_k))
    assert 0 <= n_full <= n and all(tile_full(i, j) for j in range(n_full)), (i, n_full)
  for j in range(nk):
    lo = int(qks._col_first_q_tile(j, sq, sk, block_q, block_k))
    full = int(qks._col_first_full_q_tile(j, sq, sk, block_q, block_k))
    assert lo <= full <= nq and all(tile_full(i, j) for i in range(full, nq)), (j, full)


@pytest.mark.parametrize("probs", ["softmax", "sharp", "randn"])
def test_realistic_long_rows(probs):
  """Sk = 512 with the default tiles (row kernel: two passes over 4 key tiles).

  "randn" P (not a probability) makes delta large; a kernel that did not reproduce the
  reference's bf16 roundings of dL would miss the 99% bar here (see the module docstring).
  """
  sq, sk, d = 64, 512, 64
  args = make_inputs(3, 1, 1, sq, sk, d, probs=probs)  # one shape: compiled once
  run_and_check(args, 1.0 / np.sqrt(d))


def test_traced_scaling_under_jit():
  args = make_inputs(4, 2, 1, 33, 47, 64)
  fn = jax.jit(lambda g, q, k, p, s: qk_scale_softmax_backward(g, q, k, p, s, interpret=INTERPRET))
  out_q, out_k = fn(*args, jnp.float32(0.3))
  ref_q, ref_k = reference(*args, 0.3)
  assert_close("grad_query", out_q, ref_q)
  assert_close("grad_key", out_k, ref_k)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_other_dtypes(dtype):
  args = make_inputs(5, 1, 2, 33, 40, 64, dtype=dtype)
  run_and_check(args, 0.125, causal=False)


def test_argument_errors():
  g, q, k, p = make_inputs(6, 1, 1, 8, 8, 16)
  with pytest.raises(ValueError, match="grad_output"):
    qk_scale_softmax_backward(g[..., :7], q, k, p, 0.5, interpret=INTERPRET)
  with pytest.raises(TypeError, match="dtype"):
    qk_scale_softmax_backward(*(x.astype(jnp.int32) for x in (g, q, k, p)), 0.5, interpret=INTERPRET)
  with pytest.raises(TypeError, match="key"):
    qk_scale_softmax_backward(g, q, k.astype(jnp.float32), p, 0.5, interpret=INTERPRET)
  with pytest.raises(ValueError, match="block_q"):
    qk_scale_softmax_backward(g, q, k, p, 0.5, block_q=24, interpret=INTERPRET)
  with pytest.raises(ValueError, match="scaling"):
    qk_scale_softmax_backward(g, q, k, p, jnp.ones(2), interpret=INTERPRET)


@pytest.mark.parametrize("device_kind", [None, "NVIDIA H200"])
def test_default_config(device_kind):
  """Heuristic and tuned defaults: powers of two >= 16, capped by the padded lengths."""
  for sq, sk, d, dtype in itertools.product([1, 33, 211, 4096], [1, 200, 449, 4096],
                                            [40, 64, 128], [jnp.bfloat16, jnp.float32]):
    assert_configs_fit(qks.default_config(sq, sk, d, dtype, device_kind), sq, sk)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("prefetch, row_align", [(False, -1), (True, 0), (False, 0)])
def test_lowers_to_triton(pretend_h200, causal, dtype, prefetch, row_align):
  """Both kernels lower to Triton IR for a GPU (no GPU needed; catches unsupported ops).
  Rows of 300 keys: dense with ``row_align=-1`` takes the phase-aligned row kernel."""
  b, h, sq, sk, d = 1, 2, 131, 300, 64
  shapes = [jax.ShapeDtypeStruct(s, dtype) for s in
            ((b, h, sq, sk), (b, h, sq, d), (b, h, sk, d), (b, h, sq, sk))]
  cfg = qks.PassConfig(32, 64, 4, 2, prefetch, row_align)
  for scheme, kernels in (("two_pass", 2), ("per_head", 1)):
    assert triton_calls_in_gpu_lowering(qk_scale_softmax_backward, shapes, 0.125,
                                        causal=causal,
                                        config=qks.Config(cfg, cfg, scheme)) == kernels, scheme


def test_rounding_is_bit_exact():
  """The kernel's bit-level bf16 rounding equals a plain conversion (round to nearest even)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (4096,)) * 10.0 ** jax.random.randint(
      jax.random.PRNGKey(1), (4096,), -30, 30)
  x = jnp.concatenate([x, jnp.array([0.0, -0.0, 1.00390625, 1.01171875, 1e-40])]).astype(jnp.float32)
  want = x.astype(jnp.bfloat16).astype(jnp.float32)
  for bits in (False, True):
    got = qks._round_to(x, jnp.bfloat16, bits=bits)
    assert bool(jnp.all(got.view(jnp.uint32) == want.view(jnp.uint32))), bits


@pytest.mark.gpu
def test_dl_rounding_paths_agree(monkeypatch):
  """The kernels' dL with the conversion-based bf16 rounding is bit-identical to the
  integer-arithmetic rounding: catches a compiler folding the conversion pair away, which
  would keep fp32 precision (GPU only: the interpreter's XLA:CPU rounds either way;
  ``test_rounding_is_bit_exact`` checks the two functions)."""
  args = make_inputs(9, 1, 2, 45, 131, 64, probs="randn")
  cfg = qks.Config(qks.PassConfig(16, 32, 4, 2), qks.PassConfig(16, 32, 4, 2))
  run = lambda: qk_scale_softmax_backward(*args, 0.125, config=cfg, interpret=INTERPRET)
  fast = run()
  jax.clear_caches()
  monkeypatch.setattr(qks, "_round_to", functools.partial(qks._round_to, bits=True))
  exact = run()
  jax.clear_caches()
  for a, b in zip(fast, exact):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
