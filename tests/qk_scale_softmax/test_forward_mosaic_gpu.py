"""The qk_scale_softmax Mosaic GPU forward kernel (``forward_mosaic_gpu``): ``P`` against the jnp forward
(the Mosaic GPU interpreter off a Hopper GPU, compiled on one), its variants, its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, ON_GPU, ulps_apart
from jax_ops.ops.qk_scale_softmax import reference
from pallas_kernels._util import is_hopper
from pallas_kernels.qk_scale_softmax import forward_mosaic_gpu as fm

HOPPER = ON_GPU and is_hopper(jax.devices()[0])
needs_kernels = pytest.mark.skipif(ON_GPU and not HOPPER, reason="needs a Hopper GPU")


def _inputs(b, h, sq, sk, d, dtype=jnp.bfloat16, seed=0):
  k = jax.random.split(jax.random.key(seed), 2)
  return (jax.random.normal(k[0], (b, h, sq, d), jnp.float32).astype(dtype),
          jax.random.normal(k[1], (b, h, sk, d), jnp.float32).astype(dtype))


def _check(query, key, probs, scaling):
  ref = reference.qk_scale_softmax_forward(query, key, scaling, False)
  assert probs.dtype == query.dtype and probs.shape == ref.shape
  # The jnp softmax's values, or one ulp apart (the kernel's exp2 is the GPU's approximate
  # one, and its row sum runs in another order); a wrong tile or row is far off.
  ulps = ulps_apart(probs, ref)
  assert ulps.max() <= 1, ulps.max()
  assert (ulps == 0).mean() >= 0.99, (ulps == 0).mean()
  np.testing.assert_allclose(np.asarray(probs, np.float32).sum(-1), 1.0, atol=2e-2)


# (B, H, Sq, Sk, D, dtype, keys): one and several key tiles, two row blocks, both head
# dims, fp16, both step widths.
CASES = [
    (1, 2, 128, 192, 64, jnp.bfloat16, 64),
    (1, 1, 256, 256, 128, jnp.bfloat16, None),
    (2, 1, 128, 128, 128, jnp.float16, 128),
    (1, 1, 128, 384, 64, jnp.bfloat16, 128),
]


@needs_kernels
@pytest.mark.parametrize("b,h,sq,sk,d,dtype,keys", CASES)
def test_matches_the_jnp_forward(b, h, sq, sk, d, dtype, keys):
  query, key = _inputs(b, h, sq, sk, d, dtype)
  scaling = d ** -0.5
  probs = fm.qk_scale_softmax_forward(query, key, scaling, keys=keys, interpret=INTERPRET)
  _check(query, key, probs, scaling)


@needs_kernels
def test_variants():
  """Another ring depth gives the default's P bit for bit; 64-key steps sum the rows in
  another order (one ulp apart at most, and checked against jnp)."""
  query, key = _inputs(1, 2, 128, 256, 64, seed=1)
  base = fm.qk_scale_softmax_forward(query, key, 0.3, interpret=INTERPRET)
  got = fm.qk_scale_softmax_forward(query, key, 0.3, stages=2, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(base, np.float32))
  for kw in ({"keys": 64, "stages": 4},):
    got = fm.qk_scale_softmax_forward(query, key, 0.3, interpret=INTERPRET, **kw)
    assert ulps_apart(got, base).max() <= 1
    _check(query, key, got, 0.3)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's race detector")
def test_race_free(capsys):
  """The interpreter's race detector finds no race in the kernel's TMA and generic accesses
  (it runs wgmma at once and does not track its reads)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  query, key = _inputs(1, 1, 128, 256, 64, seed=2)
  probs = fm.qk_scale_softmax_forward(query, key, 0.125,
                                      interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(probs)
  jax.effects_barrier()
  assert "RACE DETECTED" not in capsys.readouterr().out
  _check(query, key, probs, 0.125)


def test_errors_name_the_problem():
  query, key = _inputs(1, 1, 128, 128, 64)
  with pytest.raises(ValueError, match="seq_q 64"):
    fm.qk_scale_softmax_forward(query[:, :, :64], key, 0.1, interpret=True)
  with pytest.raises(ValueError, match="seq_k 100"):
    fm.qk_scale_softmax_forward(query, key[:, :, :100], 0.1, interpret=True)
  with pytest.raises(ValueError, match="head dim 32"):
    fm.qk_scale_softmax_forward(query[..., :32], key[..., :32], 0.1, interpret=True)
  with pytest.raises(ValueError, match="causal"):
    fm.qk_scale_softmax_forward(query, key, 0.1, True, interpret=True)
  with pytest.raises(ValueError, match="float32"):
    fm.qk_scale_softmax_forward(query.astype(jnp.float32), key.astype(jnp.float32), 0.1,
                                interpret=True)
  with pytest.raises(ValueError, match="traced scaling"):
    jax.jit(lambda s: fm.qk_scale_softmax_forward(query, key, s, interpret=True))(0.1)
  with pytest.raises(ValueError, match=r"stages: expected an int in \[2, 8\]"):
    fm.qk_scale_softmax_forward(query, key, 0.1, stages=1, interpret=True)
  with pytest.raises(ValueError, match=r"key: expected"):
    fm.qk_scale_softmax_forward(query, key[:, :, :, :32], 0.1, interpret=True)
  with pytest.raises(ValueError, match="scaling: expected a finite number > 0"):
    fm.qk_scale_softmax_forward(query, key, -1.0, interpret=True)


def test_the_op_picks_it_compiled_on_hopper_for_long_dense_rows(monkeypatch):
  """The Mosaic GPU forward compiled on a Hopper GPU, on dense rows of more than 256 keys
  that it takes; the Triton forward in the interpreter, on other GPUs, on short rows,
  causal calls and shapes it does not take; no Pallas forward past int32 offsets."""
  from conftest import FakeBlackwell, FakeHopper
  from pallas_kernels.qk_scale_softmax import dispatch
  q = jax.ShapeDtypeStruct((1, 2, 256, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 2, 512, 128), jnp.bfloat16)
  pick = lambda q, k, causal=False, interpret=False: dispatch.forward_kernel_for(
      q, k, 0.1, causal=causal, interpret=interpret)
  monkeypatch.setattr(dispatch, "device_of", lambda *a: FakeHopper())
  assert pick(q, k) == "mosaic_gpu"
  assert pick(q, k, interpret=True) == "triton"
  assert pick(q, k, causal=True) == "triton"
  assert pick(q, jax.ShapeDtypeStruct((1, 2, 256, 128), jnp.bfloat16)) == "triton"  # 256 keys
  assert pick(jax.ShapeDtypeStruct((1, 2, 200, 128), jnp.bfloat16), k) == "triton"  # seq_q 200
  huge = jax.ShapeDtypeStruct((1, 1, 1 << 16, 16), jnp.bfloat16)
  assert pick(huge, huge, interpret=True) is None
  monkeypatch.setattr(dispatch, "device_of", lambda *a: FakeBlackwell())
  assert pick(q, k) == "triton"


@needs_kernels
def test_op_with_the_mosaic_forward_matches_the_xla_path():
  """The op with the Mosaic GPU forward (as the dispatch picks it compiled on a Hopper
  GPU): its P and gradients are the XLA path's, and the Mosaic GPU forward ran."""
  import jax_ops
  from pallas_kernels.qk_scale_softmax import dispatch
  query, key = _inputs(1, 2, 128, 384, 64, seed=4)
  ct = jax.random.normal(jax.random.key(5), (1, 2, 128, 384), jnp.float32)
  calls = []
  kernel = fm.qk_scale_softmax_forward

  def spy(*args, **kwargs):
    calls.append(1)
    return kernel(*args, **kwargs)

  def run(impl):
    op = lambda q, k: jax_ops.qk_scale_softmax(q, k, implementation=impl, interpret=INTERPRET)
    f = lambda q, k: jnp.sum(op(q, k) * ct)
    return op(query, key), jax.value_and_grad(f, argnums=(0, 1))(query, key)

  with pytest.MonkeyPatch.context() as m:
    m.setattr(fm, "qk_scale_softmax_forward", spy)
    m.setattr(dispatch, "pick_forward", lambda *a, **kw: "mosaic_gpu")
    pp, (lp, gp) = run("triton")
  px, (lx, gx) = run("xla")
  assert calls, "the Mosaic GPU forward did not run"
  np.testing.assert_allclose(np.asarray(pp, np.float32), np.asarray(px, np.float32),
                             rtol=1e-2, atol=1e-5)  # ~2 bf16 ulps
  np.testing.assert_allclose(float(lp), float(lx), rtol=2e-2, atol=1e-2)
  for a, b in zip(gp, gx):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.max(np.abs(a - b)) < 5e-2 * np.max(np.abs(b))
