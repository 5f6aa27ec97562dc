"""The GPU-only diagnostic scripts import on CPU, say they need a GPU and exit 2, and parse
what they are given."""

import pytest

from conftest import ON_GPU
from benchmarks import (a_hash_cost, b_backward_sweep, b_ncu_driver, b_triton_row, c_band,
                        c_backward_step, c_dl_gemm, c_dq_atomic, c_forward, l2_read,
                        ptx_dump, ragged_tma_probe, size_ceiling)
from pallas_kernels.qk_scale_softmax import DlConfig
from pallas_kernels.masked_softmax_dropout import Config


@pytest.mark.skipif(ON_GPU, reason="on a GPU the scripts run")
@pytest.mark.parametrize("script, argv", [
    (a_hash_cost, []),
    (b_backward_sweep, ["--configs", "1/8/pub"]),
    (b_triton_row, ["--only", "4,4,4096"]),
    (b_triton_row, ["--only", "4,4,4096", "--carveout", "100"]),
    (b_ncu_driver, ["4,4,4096,0.1"]),
    (ptx_dump, ["--out", "/nonexistent"]),
    (size_ceiling, []),
    (l2_read, ["--sizes-mb", "8"]),
    (c_band, ["--workloads", "2", "--programs", "132,66"]),
    (c_forward, ["--configs", "64/64/4/3", "--shapes", "1,2,256,1"]),
    (c_backward_step, ["--shapes", "1,2,256", "--rows", "16/128/4/2"]),
    (c_dq_atomic, ["--shapes", "1,2,256", "--configs", "16/32/4/1"]),
    (c_dl_gemm, ["--dl", "1/8", "--workloads", "0"]),
    (ragged_tma_probe, ["--lengths", "449"]),
])
def test_scripts_exit_2_without_a_gpu(script, argv, capsys):
  assert script.main(argv) == 2
  assert "needs a CUDA GPU" in capsys.readouterr().err


def test_dl_variant_names():
  assert c_dl_gemm.parse_dls("1/8,4/4/pad,8/8/phased") == {
      "dl": None, "dl:1/8": DlConfig(1, 8), "dl:4/4/pad": DlConfig(4, 4, pad_rows=True),
      "dl:8/8/phased": DlConfig(8, 8, phased=True)}
  with pytest.raises(ValueError, match="config.dl.rows"):
    c_dl_gemm.parse_dls("3/8")
  with pytest.raises(ValueError, match="rows/num_warps"):
    c_dl_gemm.parse_dls("1")


def test_sweep_launch_names():
  assert b_backward_sweep.parse_launch("2/8") == Config(2, 8, True)
  assert b_backward_sweep.parse_launch("1/4/ef") == Config(1, 4, True,
                                                           store_eviction="evict_first")
  pub = b_backward_sweep.parse_launch("1/16/pub+r")
  assert (pub.stream_cache, pub.stream_eviction, pub.mask_cache, pub.mask_after_sum,
          pub.row_group) == (".cg", None, ".ca", True, 1 << 16)
  with pytest.raises(KeyError):
    b_backward_sweep.parse_launch("1/4/nope")


def test_c_forward_parses_configs_and_shapes():
  from pallas_kernels.qk_scale_softmax.forward import ForwardConfig
  assert c_forward.parse_configs("64/128/4/2,128/64/8/3") == [ForwardConfig(64, 128, 4, 2),
                                                              ForwardConfig(128, 64, 8, 3)]
  assert c_forward.parse_shapes("1,32,4096,1;2,4,128,0") == [(1, 32, 4096, True),
                                                             (2, 4, 128, False)]
  assert c_forward.parse_shapes("") == c_forward.SHAPES


def test_c_backward_step_parses_shapes_and_rows():
  from pallas_kernels.qk_scale_softmax import PassConfig
  assert c_backward_step.parse_shapes("1,32,4096;4,2,128") == [(1, 32, 4096), (4, 2, 128)]
  assert c_backward_step.parse_shapes("") == c_backward_step.SHAPES
  assert c_backward_step.parse_rows("16/128/4/2") == [PassConfig(16, 128, 4, 2)]
  with pytest.raises(ValueError):
    c_backward_step.parse_rows("16/24/4/2")


def test_dq_atomic_variant_matches_the_reference_in_the_interpreter(capsys):
  """The experiment's kernel (dQ by atomics) is checked before it is timed: odd lengths and
  a padded head dim in the interpreter; its check fails on a wrong dQ."""
  assert c_dq_atomic.main(["--interpret"]) == 0
  assert "dq 1.0000, dk 1.0000" in capsys.readouterr().out


def test_dq_atomic_variant_lowers_to_triton(pretend_h200, monkeypatch):
  import jax
  import jax.numpy as jnp
  from conftest import triton_calls_in_gpu_lowering
  from pallas_kernels.qk_scale_softmax import PassConfig
  shapes = [jax.ShapeDtypeStruct((1, 2, 300, 300), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 2, 300, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 2, 300, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 2, 300, 300), jnp.bfloat16)]
  fn = lambda g, q, k, p, s: c_dq_atomic.backward(g, q, k, p, s, cfg=PassConfig(64, 128, 8, 2))
  assert triton_calls_in_gpu_lowering(fn, shapes) == 1


def test_l2_read_kernels_read_what_they_say(capsys):
  """The L2 read kernels in the interpreters: program p sums blocks (p + r P) mod blocks
  (every block read the same number of times); the TMA ring builds and runs."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  x = jax.random.normal(jax.random.key(0), (l2_read._BLOCK * 6,), jnp.float32)
  got = np.asarray(l2_read.triton_read(x, repeats=2, programs=4, interpret=True))
  blocks = np.asarray(x).reshape(6, -1).sum(1)
  want = [sum(blocks[(p + r * 4) % 6] for r in range(3)) for p in range(4)]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  y = jnp.ones((l2_read._TILE[0] * 6, l2_read._TILE[1]), jnp.bfloat16)
  assert l2_read.tma_read(y, repeats=2, programs=4, interpret=True).shape == (4,)


@pytest.mark.parametrize("length", [37, 130])
def test_ragged_tma_probe_sums_class_rows(length):
  """The probe's rows (odd lengths, one class of every 8th row per program, masked past the
  row's end) sum as jnp sums them, in the Mosaic GPU interpreter; it lowers for CUDA at 449."""
  import jax
  import jax.numpy as jnp
  x = jax.random.normal(jax.random.key(length), (8 * 64, length), jnp.bfloat16)
  want = jnp.sum(x.astype(jnp.float32), axis=1)
  tol = 1e-4 * float(jnp.max(jnp.abs(want)))
  got = ragged_tma_probe.class_row_sums(x, interpret=True)
  assert float(jnp.max(jnp.abs(got - want))) <= tol
  # Tiles of consecutive rows from a first row that is not a multiple of 8.
  for swizzle in (False, True):
    got = ragged_tma_probe.tile_row_sums(x[:8 * 60], row0=32, swizzle=swizzle, interpret=True)
    assert float(jnp.max(jnp.abs(got - want[32:8 * 60]))) <= tol
  if length >= 64:   # every element in and out through the boxes, exactly
    got = ragged_tma_probe.tile_round_trip(x, swizzle=True, interpret=True)
    assert bool(jnp.all(got == x * 2))
  for fn in (ragged_tma_probe.class_row_sums, ragged_tma_probe.tile_row_sums,
             ragged_tma_probe.tile_round_trip):
    lowered = jax.jit(fn).trace(jax.ShapeDtypeStruct((8 * 64 * 2, 449), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
