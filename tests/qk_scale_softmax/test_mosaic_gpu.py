"""The Mosaic GPU kernel of the qk_scale_softmax backward (``pallas_mosaic_gpu``): numbers against the jnp
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

from .kernel_base import assert_close, assert_renormalized, make_inputs, reference

HOPPER = ON_GPU and is_hopper(jax.devices()[0])
needs_kernels = pytest.mark.skipif(ON_GPU and not HOPPER, reason="needs a Hopper GPU")
SCALE = 1.0 / np.sqrt(128)


def backward(*args, **kw):
  return pallas_kernels.qk_scale_softmax_backward(
      *args, implementation="mosaic_gpu", interpret=INTERPRET, **kw)


def check(args, scaling=SCALE, **kw):
  out_q, out_k = backward(*args, scaling, **kw)
  ref_q, ref_k = reference(*args, scaling, renormalize=kw.get("renormalize", False))
  assert_close("grad_query", out_q, ref_q)
  assert_close("grad_key", out_k, ref_k)
  return out_q, out_k


# (B, H, Sq, Sk): one and several heads per program; odd numbers of row tiles, Sq != Sk.
CASES = [(1, 3, 128, 128), (2, 1, 192, 128), (1, 1, 64, 128), (1, 2, 320, 128)]


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
  for got, ref in ((dq, ref_q), (dk, ref_k)):   # head 0: non-finite where the reference is
    np.testing.assert_array_equal(np.isfinite(np.asarray(got[0, 0], np.float32)),
                                  np.isfinite(np.asarray(ref[0, 0], np.float32)))
  assert not np.all(np.isfinite(np.asarray(dk[0, 0], np.float32)))
  assert_close("grad_query", dq[0, 1], ref_q[0, 1])
  assert_close("grad_key", dk[0, 1], ref_k[0, 1])


@needs_kernels
@pytest.mark.parametrize("probs", ["sharp", "randn"])
def test_roundings_of_dl(probs):
  """A "randn" P (large delta) misses the 99% bar unless dL is rounded as the reference."""
  check(make_inputs(2, 1, 2, 64, 128, 128, probs=probs), scaling=0.3)


@needs_kernels
def test_causal_and_float16():
  check(make_inputs(3, 1, 2, 128, 128, 128, causal=True), causal=True)
  check(make_inputs(3, 1, 1, 64, 128, 128, causal=True), causal=True)
  check(make_inputs(4, 1, 2, 128, 128, 128, dtype=jnp.float16))


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_renormalize(causal):
  """``renormalize=True`` gives the reference's renormalized gradients on peaked rows
  (``P_ii`` rounds to 1), where they are far from the spec's."""
  args = make_inputs(6, 1, 2, 128, 128, 128, causal=causal, probs="peaked")
  assert_renormalized(check(args, causal=causal, renormalize=True), args, SCALE)


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
    ((1, 1, 64, 256), jnp.bfloat16, "seq_k 256"),
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
  for sk in (256, 384):
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
  assert on(64, 256) == "triton"
  assert on(64, 128, d=64) == "triton"
  assert on(65, 128) == "triton"
  assert on(64, 128, dtype=jnp.float32) == "triton"
  assert on(128, 128, interpret=True) == "triton"


@pytest.mark.parametrize("renormalize", [False, True])
def test_lowers_for_a_gpu(renormalize):
  """The kernel goes through the Mosaic GPU lowering rules for CUDA on any host (catches an
  unsupported op before a GPU sees it; the Mosaic passes and ptxas still need one)."""
  s = jax.ShapeDtypeStruct
  bh, sq, sk = 4, 128, 128
  args = [s((bh, sq, sk), jnp.bfloat16)] * 2 + [s((bh, sq, 128), jnp.bfloat16),
                                              s((bh, sk, 128), jnp.bfloat16)]
  fn = jax.jit(lambda g, p, q, k: mg.backward_kernel(g, p, q, k, scale=0.1,
                                                     renormalize=renormalize))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_grids_take_the_devices_sm_count(monkeypatch):
  """The persistent grids are sized by the device's SM count; 132 (H100/H200 SXM) where it
  is unknown: in the interpreter, or a device without ``core_count``."""
  class Device:
    platform = "gpu"
    core_count = 114
  monkeypatch.setattr(_mosaic, "device_of", lambda *arrays: Device())
  assert _mosaic.sm_count(False) == 114
  assert _mosaic.sm_count(True) == _mosaic.SMS == 132
  Device.core_count = None
  assert _mosaic.sm_count(False) == 132
  assert mg.heads_per_program(264, 114) == 3 and mg.heads_per_program(264) == 2
