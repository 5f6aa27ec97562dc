"""Shared test helpers: input makers, the spec's error test, where kernels run."""

from __future__ import annotations

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

# The tests never read the user's tuned tables: an empty user cache (tests that write one
# point PALLAS_KERNELS_CACHE_DIR elsewhere).
os.environ["PALLAS_KERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="pallas_kernels_cache_")

ON_GPU = jax.default_backend() == "gpu"
# Off a GPU the Pallas kernels run in the interpreter; on a GPU they compile.
INTERPRET = not ON_GPU
# XLA's CPU backend may fuse a multiply and the add it feeds into one FMA (rounded once). At
# --xla_backend_optimization_level=0 (scripts/test.sh sets it off a GPU) whether it does
# depends on the code around them: the fast instruction selector of that level fuses nothing,
# but hands a basic block holding an instruction it cannot select to the full selector, which
# fuses. Two programs with the same arithmetic (a kernel reading a broadcast mask, and the same
# kernel reading the explicit broadcast) can then differ by an ulp. Bit-for-bit comparisons of
# two programs compile them at level 1, the lowest at which every block gets the full selector:
# what is fused then depends on the arithmetic, not on the code beside it. No effect on a GPU.
EXACT_COMPILER_OPTIONS = {} if ON_GPU else {"xla_backend_optimization_level": 1}


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def exact_jit(fn):
  """``jax.jit(fn)`` for comparing bit for bit with another program: compiled with
  :data:`EXACT_COMPILER_OPTIONS` (positional array arguments)."""
  jitted = jax.jit(fn)
  return lambda *args: jitted.lower(*args).compile(EXACT_COMPILER_OPTIONS)(*args)


def assert_close(out, ref, *, atol, rtol, frac=0.99, name="output"):
  """The spec's acceptance: no NaN/Inf, >= ``frac`` of elements within
  ``atol + rtol * |ref|``, and no all-zero output where the reference is not."""
  out = np.asarray(jnp.asarray(out, jnp.float32))
  ref = np.asarray(jnp.asarray(ref, jnp.float32))
  assert out.shape == ref.shape, (name, out.shape, ref.shape)
  assert np.isfinite(out).all(), f"{name}: NaN/Inf in output"
  ok = np.abs(out - ref) <= atol + rtol * np.abs(ref)
  assert ok.mean() >= frac, (
      f"{name}: {ok.mean():.4%} within tolerance, max err {np.abs(out - ref).max():.3g}")
  if np.any(ref != 0):
    assert np.any(out != 0), f"{name}: all-zero output"


def ulps_apart(a, b):
  """Per element, how many ulps of ``a``'s dtype two non-negative arrays are apart."""
  a, b = np.asarray(a), np.asarray(b)
  ints = {2: np.int16, 4: np.int32}[a.dtype.itemsize]
  return np.abs(a.view(ints).astype(np.int64) - b.view(ints).astype(np.int64))


def softmax_probs(key, shape, dtype, scale=1.0):
  """A real softmax of randn logits, rounded to ``dtype``."""
  return jax.nn.softmax(jax.random.normal(key, shape) * scale, axis=-1).astype(dtype)


def keys(seed, n):
  return jax.random.split(jax.random.key(seed), n)


@pytest.fixture
def pretend_h200(monkeypatch):
  """Makes the Triton lowering believe an H200 is present, so kernels lower to
  Triton IR on any machine (catches unsupported ops; compiling to PTX still
  needs a GPU). Skips the test if the JAX internal it patches has moved."""
  try:
    from jax._src.pallas.triton import gpu_info
    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  except (ImportError, AttributeError) as e:
    pytest.skip(f"JAX internals moved: {e}")
  monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: info)


@pytest.fixture
def triton_modules(monkeypatch):
  """A list that gets the Triton IR text (no debug locations) of every Pallas Triton kernel
  lowered from then on, one entry per kernel; the test clears it between lowerings."""
  from jax._src.pallas.triton import lowering
  mods = []
  orig = lowering.lower_jaxpr_to_triton_module

  def capture(*a, **k):
    res = orig(*a, **k)
    mods.append(res.module.operation.get_asm(enable_debug_info=False))
    return res
  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
  return mods


def triton_calls_in_gpu_lowering(kernel, shapes, last=None, **kwargs):
  """Number of Triton kernels when ``kernel(*shapes, last, **kwargs)`` is lowered for a
  GPU (use with ``pretend_h200``). ``last=None`` makes it a traced fp32 scalar argument."""
  shapes = list(shapes)
  if last is None:
    fn = jax.jit(lambda *a: kernel(*a, **kwargs))
    shapes.append(jax.ShapeDtypeStruct((), jnp.float32))
  else:
    fn = jax.jit(lambda *a: kernel(*a, last, **kwargs))
  return fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text().count("xla.gpu.triton")


def pallas_call_outputs(fn, *args):
  """How many outputs each ``pallas_call`` in ``fn``'s jaxpr on ``args`` has (sub-jaxprs
  included, in order)."""
  import jax.extend

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        yield len(eqn.outvars)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from walk(sub)
  return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def assert_configs_fit(config, rows, cols):
  """Every pass of a kernel config (``(block_q, block_k, num_warps, num_stages, ...)``):
  tiles are powers of two >= 16 capped by the padded lengths; sane launch parameters."""
  for c in config:
    if isinstance(c, str):  # a scheme name
      continue
    block_q, block_k, num_warps, num_stages = c[:4]
    for blk in (block_q, block_k):
      assert blk >= 16 and blk & (blk - 1) == 0, c
    assert block_q <= max(16, pl.next_power_of_2(rows)), c
    assert block_k <= max(16, pl.next_power_of_2(cols)), c
    assert num_warps in (2, 4, 8, 16) and 1 <= num_stages <= 4, c


class FakeHopper:
  """A device as the backends' ``supported_on`` sees an H200 (no arrays are placed on it)."""
  platform = "gpu"
  compute_capability = "9.0"
  device_kind = "NVIDIA H200"


class FakeBlackwell(FakeHopper):
  compute_capability = "10.0"
  device_kind = "NVIDIA B200"
