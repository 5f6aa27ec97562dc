"""The qk_scale_softmax fused forward kernel (``forward.py``): ``P`` matches the jnp forward to within one
ulp of a 16-bit input dtype (bit for bit in all but a small share of the elements; fp32:
within 2e-5 relative); causal rows
are exactly zero above the diagonal and sum to one; odd lengths, several row and key tiles
with ragged last tiles, D = 40, 64 and 128, fp32, bf16 and fp16; argument errors name the
argument; the kernel lowers to one Triton kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, ON_GPU, ulps_apart
from jax_ops._common import causal_mask
from jax_ops.ops.qk_scale_softmax import reference
from pallas_kernels.qk_scale_softmax.forward import (ForwardConfig, default_forward_config,
                                                     qk_scale_softmax_forward as forward)


def _inputs(b, h, sq, sk, d, dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 2)
  return (jax.random.normal(k[0], (b, h, sq, d), jnp.float32).astype(dtype),
          jax.random.normal(k[1], (b, h, sk, d), jnp.float32).astype(dtype))


def _check(query, key, probs, causal, scaling):
  sq, sk = query.shape[2], key.shape[2]
  ref = jax.jit(reference.qk_scale_softmax_forward, static_argnums=(2, 3))(
      query, key, scaling, causal)
  assert probs.dtype == query.dtype and probs.shape == ref.shape
  if query.dtype == jnp.float32:
    # fp32 logits summed in another order: relative errors of a few 1e-6 at D = 128-256
    # (28 and 44 ulps in the interpreter), far below a wrong result's.
    p32, r32 = np.asarray(probs), np.asarray(ref)
    rel = np.abs(p32 - r32) / np.maximum(np.abs(r32), np.float32(1e-30))
    assert rel.max() <= 2e-5, rel.max()
  else:
    ulps = ulps_apart(probs, ref)
    assert ulps.max() <= 1, ulps.max()
    if ulps.size >= 10_000:
      assert (ulps == 0).mean() >= 0.999, (ulps == 0).mean()
  p32 = np.asarray(probs.astype(jnp.float32))
  np.testing.assert_allclose(p32.sum(-1), 1.0, atol=2e-2 if query.dtype != jnp.float32
                             else 1e-5)
  if causal:
    assert not np.any(np.where(np.asarray(causal_mask(sq, sk)), 0.0, p32))


@pytest.mark.parametrize("b,h,sq,sk,d,dtype,causal,config", [
    (1, 2, 7, 131, 64, jnp.bfloat16, False, None),     # key tiles, the last ragged
    (1, 1, 131, 293, 128, jnp.bfloat16, True, None),   # row tiles; Sq < Sk causal
    (2, 1, 33, 33, 40, jnp.float32, True, ForwardConfig(16, 16, 4, 2)),  # D padded; diagonal tiles
    (1, 1, 1, 5, 16, jnp.float16, False, None),        # one row, a tile mostly padding
    (1, 1, 293, 1, 64, jnp.bfloat16, False, ForwardConfig(64, 16, 4, 1)),  # one key
    (1, 1, 20, 100, 64, jnp.bfloat16, True, ForwardConfig(16, 32, 4, 2)),  # zero tiles stored
    (1, 2, 70, 100, 64, jnp.bfloat16, True, None),     # one key tile, causal, 2 row tiles
])
def test_matches_the_jnp_forward(b, h, sq, sk, d, dtype, causal, config):
  query, key = _inputs(b, h, sq, sk, d, dtype)
  scaling = d ** -0.5
  probs = forward(query, key, scaling, causal, config=config, interpret=INTERPRET)
  _check(query, key, probs, causal, scaling)


def test_traced_scaling_and_vmap():
  """A traced scaling (under jit) and a vmapped call give the jnp forward's P."""
  query, key = _inputs(2, 1, 9, 24, 32, jnp.bfloat16, seed=1)
  fn = jax.jit(lambda q, k, s: forward(q, k, s, True, interpret=INTERPRET))
  _check(query, key, fn(query, key, jnp.float32(0.3)), True, 0.3)
  batched = jax.vmap(lambda q, k: forward(q, k, 0.3, interpret=INTERPRET))(query[None],
                                                                          key[None])
  _check(query, key, batched[0], False, 0.3)


def test_default_config_fits_the_lengths():
  assert default_forward_config(4096, 4096, 128) == ForwardConfig(128, 64, 8, 3)
  assert default_forward_config(100, 300, 64) == ForwardConfig(128, 64, 8, 3)
  assert default_forward_config(100, 257, 64) == ForwardConfig(128, 64, 8, 3)
  assert default_forward_config(7, 5, 64) == ForwardConfig(16, 16, 4, 2)     # one key tile
  assert default_forward_config(512, 128, 64) == ForwardConfig(64, 128, 4, 2)
  assert default_forward_config(256, 256, 128) == ForwardConfig(64, 256, 8, 2)
  # Wider heads (bytes per K row): smaller tiles, fewer stages.
  assert default_forward_config(4096, 4096, 256) == ForwardConfig(64, 64, 4, 2)
  assert default_forward_config(200, 200, 128, jnp.float32) == ForwardConfig(64, 64, 4, 2)
  assert default_forward_config(200, 200, 64, jnp.float32) == ForwardConfig(64, 256, 8, 2)
  assert default_forward_config(4096, 4096, 256, jnp.float32) == ForwardConfig(32, 32, 4, 1)


def test_argument_errors():
  query, key = _inputs(1, 2, 8, 16, 32, jnp.bfloat16)
  with pytest.raises(ValueError, match="key"):
    forward(query, key[:, :1], 0.1, interpret=True)          # heads differ
  with pytest.raises(ValueError, match="key"):
    forward(query, key[..., :16], 0.1, interpret=True)       # head dims differ
  with pytest.raises(TypeError, match="key"):
    forward(query, key.astype(jnp.float32), 0.1, interpret=True)
  with pytest.raises(ValueError, match="query"):
    forward(query[0], key, 0.1, interpret=True)              # rank
  with pytest.raises(TypeError, match="query"):
    forward(query.astype(jnp.int32), key.astype(jnp.int32), 0.1, interpret=True)
  for bad in (0.0, -1.0, float("inf")):
    with pytest.raises(ValueError, match="scaling"):
      forward(query, key, bad, interpret=True)
  with pytest.raises(ValueError, match="causal"):
    forward(key, query, 0.1, True, interpret=True)          # Sq > Sk
  with pytest.raises(TypeError, match="config"):
    forward(query, key, 0.1, config=(16, 16, 4, 2), interpret=True)
  for kwargs, field in ((dict(block_q=24), "block_q"), (dict(block_k=8), "block_k"),
                        (dict(num_warps=3), "num_warps"), (dict(block_k=512), "block_k"),
                        (dict(num_stages=0), "num_stages")):
    with pytest.raises(ValueError, match=field):
      ForwardConfig(**kwargs)


def test_entry_point_rank_errors_name_the_argument():
  """The dispatching entry point and its kernel rule check ranks before reading shapes."""
  from pallas_kernels.qk_scale_softmax import dispatch
  query, key = _inputs(1, 2, 8, 16, 32, jnp.bfloat16)
  for fn in (dispatch.qk_scale_softmax_forward, dispatch.forward_kernel_for):
    with pytest.raises(ValueError, match=r"query: expected rank 4"):
      fn(query[0], key, 0.1, interpret=True)
    with pytest.raises(ValueError, match=r"key: expected rank 4"):
      fn(query, key[0], 0.1, interpret=True)
    with pytest.raises(TypeError, match="key"):
      fn(query, key.astype(jnp.float32), 0.1, interpret=True)


@pytest.mark.skipif(ON_GPU, reason="off a GPU only")
def test_off_gpu_without_interpret_says_so():
  query, key = _inputs(1, 1, 8, 8, 16, jnp.bfloat16)
  with pytest.raises(ValueError, match="interpret=True"):
    forward(query, key, 0.25)


@pytest.fixture
def pretend_gpu(pretend_h200, monkeypatch):
  from pallas_kernels.qk_scale_softmax import forward as module
  monkeypatch.setattr(module._util, "check_can_compile", lambda *a, **k: None)


@pytest.mark.parametrize("dtype,d,sk,causal", [
    (jnp.bfloat16, 128, 293, False), (jnp.float32, 40, 293, True),
    (jnp.bfloat16, 128, 200, True),      # one tile
    (jnp.bfloat16, 256, 293, False), (jnp.float32, 256, 200, True)])   # wide heads
def test_lowers_to_triton(pretend_gpu, dtype, d, sk, causal):
  """The kernel lowers to Triton IR for a GPU as one kernel (no GPU needed)."""
  from conftest import triton_calls_in_gpu_lowering
  shapes = [jax.ShapeDtypeStruct((2, 4, 131, d), dtype),
            jax.ShapeDtypeStruct((2, 4, sk, d), dtype)]
  assert triton_calls_in_gpu_lowering(lambda q, k, s: forward(q, k, s, causal),
                                      shapes) == 1


@pytest.mark.parametrize("implementation,kernels", [("triton", 1), ("mosaic_gpu", 1),
                                                    ("xla", 0)])
def test_the_op_runs_the_fused_forward(pretend_gpu, monkeypatch, implementation, kernels):
  """The op's forward is the fused kernel on both Pallas backends (one Triton kernel when
  lowered for a GPU), jnp on ``"xla"``; past the kernel's int32 offsets the Pallas backends
  fall back to jnp."""
  import jax_ops
  from conftest import FakeHopper, triton_calls_in_gpu_lowering
  from jax_ops import _common
  from pallas_kernels.qk_scale_softmax import forward as forward_module
  monkeypatch.setattr(_common, "device_of", lambda *a: FakeHopper())
  shapes = [jax.ShapeDtypeStruct((1, 2, 128, 128), jnp.bfloat16)] * 2
  fn = lambda q, k, _: jax_ops.qk_scale_softmax(q, k, implementation=implementation)
  assert triton_calls_in_gpu_lowering(fn, shapes, 0.0) == kernels
  monkeypatch.setattr(forward_module, "takes", lambda *a: False)
  assert triton_calls_in_gpu_lowering(fn, shapes, 0.0) == 0


def test_size_error_names_the_array():
  query = jax.ShapeDtypeStruct((1, 1, 65536, 16), jnp.bfloat16)
  key = jax.ShapeDtypeStruct((1, 1, 65536, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="the output P"):
    forward(query, key, 0.25, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk,causal", [(1024, 1024, False), (1000, 1537, True),
                                          (4096, 4096, True), (128, 128, False),
                                          (256, 256, True), (200, 250, False)])
def test_compiled_matches_the_jnp_forward(sq, sk, causal):
  query, key = _inputs(1, 4, sq, sk, 128, jnp.bfloat16, seed=3)
  _check(query, key, forward(query, key, 128 ** -0.5, causal), causal, 128 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype,sk", [(256, jnp.bfloat16, 200), (256, jnp.bfloat16, 700),
                                        (128, jnp.float32, 200), (256, jnp.float32, 700)])
def test_compiled_wide_heads(d, dtype, sk):
  """The default tiles of wide heads fit the GPU's shared memory and registers."""
  query, key = _inputs(1, 2, 150, sk, d, dtype, seed=4)
  _check(query, key, forward(query, key, d ** -0.5, True), True, d ** -0.5)


def test_x64_mode():
  """Under jax_enable_x64 (Python ints are int64 there) the one-tile kernel (where a Python
  int start once slipped in), causal, indexes in int32 and matches the jnp forward; the
  two-pass loops index through the int32 loop helper the backward kernels' x64 tests cover."""
  with jax.enable_x64(True):
    query, key = _inputs(1, 2, 20, 100, 32, jnp.bfloat16, seed=2)
    _check(query, key, forward(query, key, 0.2, True, interpret=INTERPRET), True, 0.2)
