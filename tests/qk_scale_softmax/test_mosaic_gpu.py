"""The Mosaic GPU kernel of op C's backward (``pallas_mosaic_gpu``): numbers against the jnp
reference on the shapes it takes (the Mosaic GPU interpreter off a Hopper GPU, compiled on
one), the entry point's dispatch and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, ON_GPU
import pallas_kernels
from pallas_kernels._util import is_hopper
from pallas_kernels import _mosaic
from pallas_kernels.qk_scale_softmax import dispatch
from pallas_kernels.qk_scale_softmax import pallas_mosaic_gpu as mg

from .kernel_base import assert_close, make_inputs, reference

HOPPER = ON_GPU and is_hopper(jax.devices()[0])
needs_kernels = pytest.mark.skipif(ON_GPU and not HOPPER, reason="needs a Hopper GPU")
SCALE = 1.0 / np.sqrt(128)


def backward(*args, **kw):
  return pallas_kernels.qk_scale_softmax_backward(
      *args, implementation="mosaic_gpu", interpret=INTERPRET, **kw)


def check(args, scaling=SCALE, **kw):
  out_q, out_k = backward(*args, scaling, **kw)
  ref_q, ref_k = reference(*args, scaling)
  assert_close("grad_query", out_q, ref_q)
  assert_close("grad_key", out_k, ref_k)
  return out_q, out_k


# (B, H, Sq, Sk): 128 keys (one and several heads per program) and 256 (two programs per
# head); odd numbers of row tiles, Sq != Sk.
CASES = [(1, 3, 128, 128), (2, 1, 192, 128), (1, 1, 64, 128), (1, 2, 320, 128),
         (1, 2, 128, 256), (2, 1, 192, 256)]


@needs_kernels
@pytest.mark.parametrize("b,h,sq,sk", CASES)
def test_matches_reference(b, h, sq, sk):
  check(make_inputs(0, b, h, sq, sk, 128))


@needs_kernels
def test_heads_past_the_last_program(monkeypatch):
  """5 heads of 3 row tiles over programs of 3 heads: dK carried over a head's tiles, reset
  between heads, and the last program redoes the last head (same values)."""
  monkeypatch.setattr(_mosaic, "SMS", 2)
  assert mg.heads_per_program(5) == 3
  check(make_inputs(1, 1, 5, 192, 128, 128))


@needs_kernels
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_a_non_finite_head_stays_in_its_head(monkeypatch):
  """All heads in one program: an Inf in head 0's g makes head 0's gradients non-finite,
  as in the reference, and leaves head 1's as the reference's."""
  monkeypatch.setattr(_mosaic, "SMS", 1)
  g, q, k, p = make_inputs(2, 1, 2, 128, 128, 128)
  g = g.at[0, 0, 5, 7].set(jnp.inf)
  dq, dk = backward(g, q, k, p, SCALE)
  ref_q, ref_k = reference(g, q, k, p, SCALE)
  assert not np.all(np.isfinite(np.asarray(dk[0, 0], np.float32)))
  assert_close("grad_query", dq[0, 1], ref_q[0, 1])
  assert_close("grad_key", dk[0, 1], ref_k[0, 1])


@needs_kernels
@pytest.mark.parametrize("probs", ["sharp", "randn"])
def test_roundings_of_dl(probs):
  """A "randn" P (large delta) misses the 99% bar unless dL is rounded as the reference."""
  check(make_inputs(2, 1, 2, 64, 128, 128, probs=probs), scaling=0.3)
  check(make_inputs(2, 1, 1, 64, 256, 128, probs=probs), scaling=0.3)


@needs_kernels
def test_causal_and_float16():
  check(make_inputs(3, 1, 2, 128, 128, 128, causal=True), causal=True)
  check(make_inputs(3, 1, 1, 256, 256, 128, causal=True), causal=True)
  check(make_inputs(4, 1, 2, 128, 128, 128, dtype=jnp.float16))
  check(make_inputs(4, 1, 1, 64, 256, 128, dtype=jnp.float16))


@needs_kernels
def test_vmap_and_jit():
  args = make_inputs(5, 2, 2, 64, 128, 128)
  ref_q, ref_k = reference(*args, SCALE)
  dq, dk = jax.vmap(lambda *a: backward(*a, SCALE))(*(x[:, None] for x in args))
  assert_close("grad_query", dq[:, 0], ref_q)
  assert_close("grad_key", dk[:, 0], ref_k)
  dq, dk = jax.jit(lambda *a: backward(*a, SCALE))(*args)
  assert_close("grad_query", dq, ref_q)


@pytest.mark.parametrize("shape,dtype,match", [
    ((1, 1, 64, 384), jnp.bfloat16, "seq_k 384"),
    ((1, 1, 65, 128), jnp.bfloat16, "seq_q 65"),
    ((1, 1, 64, 128), jnp.float32, "dtype float32"),
])
def test_unsupported_problems_say_why(shape, dtype, match):
  b, h, sq, sk = shape
  args = make_inputs(0, b, h, sq, sk, 128, dtype=dtype)
  with pytest.raises(ValueError, match=match):
    pallas_kernels.qk_scale_softmax_backward(*args, SCALE, implementation="mosaic_gpu",
                                             interpret=True)


def test_head_dim_and_traced_scale_say_why():
  args = make_inputs(0, 1, 1, 64, 128, 64)
  with pytest.raises(ValueError, match="head dim 64"):
    pallas_kernels.qk_scale_softmax_backward(*args, 0.125, implementation="mosaic_gpu",
                                             interpret=True)
  args = make_inputs(0, 1, 1, 64, 128, 128)
  with pytest.raises(ValueError, match="traced scaling"):
    jax.jit(lambda s: pallas_kernels.qk_scale_softmax_backward(
        *args, s, implementation="mosaic_gpu", interpret=True))(jnp.float32(0.1))


@pytest.mark.skipif(HOPPER, reason="off a Hopper GPU only")
def test_needs_hopper_without_interpret():
  args = make_inputs(0, 1, 1, 64, 128, 128)
  with pytest.raises(ValueError, match="Hopper"):
    pallas_kernels.qk_scale_softmax_backward(*args, SCALE, implementation="mosaic_gpu")


def test_dispatch():
  args = make_inputs(0, 1, 1, 64, 128, 128)
  assert dispatch.kernels_for(*args, SCALE, interpret=True) == "triton"
  expected = "mosaic_gpu" if HOPPER else "triton"
  assert dispatch.kernels_for(*args, SCALE) == expected
  assert dispatch.kernels_for(*args, SCALE, causal=True) == expected
  for sk in (256, 384):   # 256: the pair kernel runs only when named (measured slower)
    other = make_inputs(0, 1, 1, 64, sk, 128)
    assert dispatch.kernels_for(*other, SCALE) == "triton"
  with pytest.raises(ValueError, match="implementation"):
    pallas_kernels.qk_scale_softmax_backward(*args, SCALE, implementation="cuda")
  with pytest.raises(TypeError, match="Triton options"):
    pallas_kernels.qk_scale_softmax_backward(*args, SCALE, implementation="mosaic_gpu",
                                             block_q=16, interpret=True)
  # Triton options pick the Triton kernels (under the interpreter here).
  out = pallas_kernels.qk_scale_softmax_backward(*args, SCALE, block_q=16, interpret=True)
  ref = reference(*args, SCALE)
  assert_close("grad_query", out[0], ref[0])


def test_dispatch_on_a_hopper(monkeypatch):
  """kernels_for's choice on a Hopper GPU, seen from any machine (a stand-in device)."""
  from conftest import FakeHopper
  monkeypatch.setattr(dispatch, "device_of", lambda *arrays: FakeHopper())
  on = lambda sq, sk, d=128, dtype=jnp.bfloat16, **kw: dispatch.kernels_for(
      *make_inputs(0, 1, 1, sq, sk, d, dtype=dtype), SCALE, **kw)
  assert on(128, 128) == "mosaic_gpu"
  assert on(128, 128, causal=True) == "mosaic_gpu"
  assert on(64, 256) == "triton"          # the pair kernel: measured slower, only when named
  assert on(64, 128, d=64) == "triton"
  assert on(65, 128) == "triton"
  assert on(64, 128, dtype=jnp.float32) == "triton"
  assert on(128, 128, interpret=True) == "triton"


@pytest.mark.parametrize("sk", [128, 256])
def test_lowers_for_a_gpu(sk):
  """The kernels go through the Mosaic GPU lowering rules for CUDA on any host (catches an
  unsupported op before a GPU sees it; the Mosaic passes and ptxas still need one)."""
  s = jax.ShapeDtypeStruct
  bh, sq = 4, 128
  args = [s((bh, sq, sk), jnp.bfloat16)] * 2 + [s((bh, sq, 128), jnp.bfloat16),
                                              s((bh, sk, 128), jnp.bfloat16)]
  kernel = mg.backward_kernel if sk == mg.SEQ_K else mg.pair_backward_kernel
  fn = jax.jit(lambda g, p, q, k: kernel(g, p, q, k, scale=0.1))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


# --- The band kernel (dQ and dL in one launch; not the entry point's choice) ---------------

@needs_kernels
@pytest.mark.parametrize("bh,sq,sk,programs,options", [
    (3, 128, 384, 4, {}),                    # 6 bands on 4 programs: the last ones redo one
    (3, 64, 256, 2, {"stage_dl": True}),     # dL (and dQ) through the staging tile
    (2, 128, 256, None, {"k_resident": True})])
def test_band_backward_matches_reference(bh, sq, sk, programs, options):
  """dL rounded as the reference rounds it, dQ from it in the kernel, and dK by the Triton
  GEMM from the dL it writes, against the reference."""
  g, q, k, p = make_inputs(3, 1, bh, sq, sk, 128)
  dq, dk = mg.band_backward(g.reshape(bh, sq, sk), p.reshape(bh, sq, sk),
                            q.reshape(bh, sq, 128), k.reshape(bh, sk, 128), scale=SCALE,
                            programs=programs, interpret=INTERPRET, **options)
  ref_q, ref_k = reference(g, q, k, p, SCALE)
  assert_close("grad_query", dq.reshape(ref_q.shape), ref_q)
  assert_close("grad_key", dk.reshape(ref_k.shape), ref_k)


def test_band_kernel_says_what_it_takes():
  assert mg.band_unsupported_reason(1, 2, 128, 384, 128, jnp.bfloat16, 0.1) is None
  assert "seq_k 449" in mg.band_unsupported_reason(1, 2, 128, 449, 128, jnp.bfloat16, 0.1)
  assert "head dim" in mg.band_unsupported_reason(1, 2, 128, 256, 64, jnp.bfloat16, 0.1)
  x = jnp.zeros((1, 64, 384), jnp.bfloat16)
  with pytest.raises(ValueError, match="k_resident takes rows of 256"):
    mg.band_kernel(x, x, jnp.zeros((1, 384, 128), jnp.bfloat16), scale=0.1, k_resident=True,
                   interpret=True)


# --- The dl_gemm scheme's GEMMs as one Mosaic GPU launch (DlConfig.mosaic_gemm) -------------

from pallas_kernels import qk_scale_softmax as qks  # noqa: E402
from pallas_kernels.qk_scale_softmax import gemm_mosaic_gpu, pallas_triton  # noqa: E402


@needs_kernels
@pytest.mark.parametrize("bh,sq,sk,d,causal,stages,programs", [
    (2, 128, 256, 128, False, 4, 0), (3, 256, 128, 128, False, 3, 4),
    (1, 128, 256, 64, False, 2, None), (1, 256, 256, 64, True, 4, 0),
    (1, 128, 384, 128, True, 3, 0)])
def test_mosaic_gemms_match_xla(bh, sq, sk, d, causal, stages, programs):
  """dQ and dK tiles in one launch (more dK than dQ tiles and the reverse, D of 64 and
  128, ring depths); dense: persistent programs walking several tiles (the last program of
  a kind redoing its last tile: 6 dQ tiles on 3 programs, 3 dK tiles on 1), or one program
  per tile (``None``). Causal: dL as the dL kernel writes it for these GEMMs (NaN past what
  it writes: the GEMMs must not read it), the steps above the diagonal skipped."""
  g, q, k, p = make_inputs(4, 1, bh, sq, sk, d, causal=causal)
  v = lambda x: x.reshape((bh,) + x.shape[2:])
  g3, p3, q3, k3 = v(g), v(p), v(q), v(k)
  scale = jnp.full((1,), SCALE, jnp.float32)
  cfg = qks.DlConfig(2, 4)
  full = pallas_triton.dl_pass(scale, g3, p3, causal=causal, cfg=cfg, interpret=INTERPRET)
  dl = full
  if causal:
    part = pallas_triton.dl_pass(scale, g3, p3, causal=True, cfg=cfg, interpret=INTERPRET,
                                 causal_tile=gemm_mosaic_gpu.CAUSAL_TILE)
    rows, cols = np.arange(sq)[:, None], np.arange(sk)[None, :]
    written = cols < -(-((rows // 64 + 1) * 64 + sk - sq) // 128) * 128
    np.testing.assert_array_equal(np.asarray(part, np.float32)[:, written],
                                  np.asarray(full, np.float32)[:, written])
    dl = jnp.where(written, part, jnp.nan).astype(part.dtype)
  got_q, got_k = gemm_mosaic_gpu.dl_gemms(dl, q3, k3, causal=causal, stages=stages,
                                          programs=programs, interpret=INTERPRET)
  f32 = jnp.float32
  want_q = jnp.einsum("bqk,bkd->bqd", full, k3, preferred_element_type=f32)
  want_k = jnp.einsum("bqk,bqd->bkd", full, q3, preferred_element_type=f32)
  for got, want in ((got_q, want_q), (got_k, want_k)):
    assert got.shape == want.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, f32), np.asarray(want, f32),
                               atol=1e-2 * float(jnp.abs(want).max()), rtol=1e-2)


def check_dl_gemm_with_mosaic_gemms(args, causal):
  """The Triton entry point's dl_gemm scheme with ``DlConfig(mosaic_gemm=True)`` against the
  reference."""
  config = qks.Config(qks.PassConfig(64, 64, 4, 2), qks.PassConfig(64, 64, 4, 2), "dl_gemm",
                      qks.DlConfig(1, 4, mosaic_gemm=True))
  out = pallas_kernels.qk_scale_softmax_backward(*args, SCALE, causal=causal, config=config,
                                                 interpret=INTERPRET)
  for name, o, r in zip(("grad_query", "grad_key"), out, reference(*args, SCALE)):
    assert_close(name, o, r)


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_dl_gemm_with_mosaic_gemms_through_the_entry_point(causal):
  """``DlConfig(mosaic_gemm=True)`` through the Triton entry point: the reference's
  gradients, dense and causal; a problem the launch does not take (Sq = 192, dense) falls
  back to the Triton GEMMs."""
  for sq in (128,) if causal else (128, 192):
    check_dl_gemm_with_mosaic_gemms(make_inputs(5, 1, 2, sq, 256, 128, causal=causal), causal)


def test_mosaic_gemm_programs_split_by_tiles():
  assert gemm_mosaic_gpu.split_programs(3, 256, 128, 4) == (3, 1)
  assert gemm_mosaic_gpu.split_programs(8, 512, 512, 132) == (32, 32)  # one per tile at most
  assert gemm_mosaic_gpu.split_programs(1024, 256, 512, 132) == (44, 88)
  assert gemm_mosaic_gpu.split_programs(1, 128, 128, 132) == (1, 1)


def test_mosaic_gemms_say_what_they_take():
  assert gemm_mosaic_gpu.unsupported_reason(128, 256, 128, jnp.bfloat16) is None
  assert "multiples of 128" in gemm_mosaic_gpu.unsupported_reason(192, 256, 128, jnp.bfloat16)
  assert "head dim 96" in gemm_mosaic_gpu.unsupported_reason(128, 256, 96, jnp.bfloat16)
  assert "float32" in gemm_mosaic_gpu.unsupported_reason(128, 256, 128, jnp.float32)
  assert "rows with no keys" in gemm_mosaic_gpu.unsupported_reason(256, 128, 128, jnp.float16,
                                                                    causal=True)
  x = jnp.zeros((1, 192, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiples of 128"):
    gemm_mosaic_gpu.dl_gemms(x, jnp.zeros((1, 192, 128), x.dtype),
                             jnp.zeros((1, 256, 128), x.dtype), interpret=True)
  with pytest.raises(ValueError, match="config.dl.mosaic_gemm"):
    qks.DlConfig(mosaic_gemm=1)


@needs_kernels
def test_mosaic_gemms_under_x64():
  """Dense calls run under x64; causal ones (a step count per tile) are refused by name, and
  the dl_gemm scheme then takes the Triton GEMMs (the reference's gradients)."""
  jax.config.update("jax_enable_x64", True)  # the global flag: the interpreter traces later
  try:
    x = jnp.ones((1, 128, 256), jnp.bfloat16)
    q, k = jnp.ones((1, 128, 64), x.dtype), jnp.ones((1, 256, 64), x.dtype)
    dq, dk = gemm_mosaic_gpu.dl_gemms(x, q, k, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(dq, np.float32), 256.0)
    np.testing.assert_array_equal(np.asarray(dk, np.float32), 128.0)
    assert "x64" in gemm_mosaic_gpu.unsupported_reason(128, 256, 64, x.dtype, causal=True)
    with pytest.raises(ValueError, match="jax_enable_x64"):
      gemm_mosaic_gpu.dl_gemms(x, q, k, causal=True, interpret=INTERPRET)
    check_dl_gemm_with_mosaic_gemms(make_inputs(6, 1, 1, 128, 256, 128, causal=True), True)
  finally:
    jax.config.update("jax_enable_x64", False)


def test_mosaic_gemms_lower_for_a_gpu():
  s = jax.ShapeDtypeStruct
  args = [s((2, 256, 512), jnp.bfloat16), s((2, 256, 128), jnp.bfloat16),
          s((2, 512, 128), jnp.bfloat16)]
  for causal in (False, True):
    fn = jax.jit(lambda dl, q, k: gemm_mosaic_gpu.dl_gemms(dl, q, k, causal=causal))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
