"""Op A's Mosaic GPU forward kernel (``forward_mosaic_gpu``): ``(O, P, O_f32)`` against the
op's jnp forward with the same mask (the Mosaic GPU interpreter off a Hopper GPU, compiled
on one), its variants, its errors, and the backend that uses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, ON_GPU
import jax_ops
from jax_ops.ops.attention_softmax_dropout_value import reference as ref_a
from pallas_kernels._util import is_hopper
from pallas_kernels.attention_softmax_dropout_value import forward_mosaic_gpu as fm

HOPPER = ON_GPU and is_hopper(jax.devices()[0])
needs_kernels = pytest.mark.skipif(ON_GPU and not HOPPER, reason="needs a Hopper GPU")


def _inputs(b, h, kvh, sq, skv, d, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  scores = (3 * jax.random.normal(k[0], (b, h, sq, skv))).astype(jnp.bfloat16)
  value = jax.random.normal(k[1], (b, kvh, skv, d), jnp.bfloat16)
  return scores, value, k[2]


def _reference(scores, value, rng, p):
  keep = jax_ops.dropout_keep_mask(rng, p, scores.shape) if p else None
  rate = jax_ops.effective_dropout_rate(p) if p else 0.0
  out, probs, _, out32 = ref_a.attention_softmax_dropout_value_forward(
      scores, value, keep, rate, with_f32_output=True)
  return out, probs, out32


def _check(got, want):
  out, probs, out32 = (np.asarray(x, np.float32) for x in got)
  r_out, r_probs, r_out32 = (np.asarray(x, np.float32) for x in want)
  # P: the reference's bf16 values, or one ulp apart (the kernel's exp is the GPU's
  # approximate one); a wrong mask or row would be far off in O.
  np.testing.assert_allclose(probs, r_probs, rtol=2 ** -7, atol=0)
  assert np.mean(probs == r_probs) > 0.99
  scale = np.max(np.abs(r_out32))
  assert np.max(np.abs(out32 - r_out32)) < 1e-2 * scale
  assert np.max(np.abs(out - r_out)) < 2e-2 * scale


# (B, H, KVH, Sq, Skv, D, p): G in {1, 4, 10}, D in {64, 128}, one key tile and several.
CASES = [
    (1, 4, 1, 64, 192, 64, 0.1),
    (1, 10, 1, 64, 128, 128, 0.2),
    (2, 2, 2, 128, 64, 64, 0.0),
]


@needs_kernels
@pytest.mark.parametrize("b,h,kvh,sq,skv,d,p", CASES)
def test_matches_the_jnp_forward(b, h, kvh, sq, skv, d, p):
  scores, value, rng = _inputs(b, h, kvh, sq, skv, d)
  check_args = (scores, value, rng, p)
  _check(fm.forward_with_output(scores, value, p, rng, interpret=INTERPRET),
         _reference(*check_args))


@needs_kernels
def test_variants_give_the_same_numbers():
  """A hash per element instead of per pair of columns, and each step waiting for its own
  GEMM instead of the next step: bit for bit the default's outputs."""
  scores, value, rng = _inputs(1, 4, 2, 64, 192, 64, seed=1)
  base = fm.forward_with_output(scores, value, 0.1, rng, interpret=INTERPRET)
  for kw in ({"pair_hash": False}, {"delay": False}, {"delay": False, "stages": 2}):
    got = fm.forward_with_output(scores, value, 0.1, rng, interpret=INTERPRET, **kw)
    for x, y in zip(got, base):
      np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.skipif(ON_GPU, reason="the interpreter's race detector")
def test_race_free(capsys):
  """The interpreter's race detector finds no race in the kernel's TMA and generic accesses
  (it runs wgmma at once and does not track its reads: the delayed GEMM wait is for the
  compiled tests)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  scores, value, rng = _inputs(1, 2, 1, 64, 192, 64, seed=2)
  out = fm.forward_with_output(scores, value, 0.1, rng,
                               interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  jax.effects_barrier()
  assert "RACE DETECTED" not in capsys.readouterr().out
  _check(out, _reference(scores, value, rng, 0.1))


def test_errors_name_the_problem():
  scores, value, rng = _inputs(1, 2, 1, 64, 128, 64)
  with pytest.raises(ValueError, match="seq_k 100"):
    fm.forward_with_output(scores[..., :100], value[:, :, :100], 0.1, rng, interpret=True)
  with pytest.raises(ValueError, match="traced dropout rate"):
    jax.jit(lambda r: fm.forward_with_output(scores, value, r, rng, interpret=True))(0.1)
  with pytest.raises(ValueError, match="delay: needs stages >= 3"):
    fm.forward_with_output(scores, value, 0.1, rng, stages=2, interpret=True)
  with pytest.raises(ValueError, match=r"stages: expected an int in \[2, 8\]"):
    fm.forward_with_output(scores, value, 0.1, rng, stages=1, delay=False, interpret=True)
  with pytest.raises(TypeError, match="value_states: expected dtype bfloat16"):
    fm.forward_with_output(scores, value.astype(jnp.float32), 0.1, rng, interpret=True)
  with pytest.raises(ValueError, match=r"value_states: expected \[B, KVH, Skv, D\]"):
    fm.forward_with_output(scores, value[:, :, :64], 0.1, rng, interpret=True)


@needs_kernels
def test_backend_with_the_mosaic_forward_matches_the_xla_path():
  """``AttentionValueMosaicGpu(forward="mosaic_gpu")`` in the op: its value and gradients
  are the XLA path's for the same key."""
  from jax_ops import registry
  from jax_ops.ops.attention_softmax_dropout_value import pallas_mosaic_gpu as backend_module
  name = "mosaic_gpu_test_mgpu_forward"
  registry.register("attention_softmax_dropout_value", name,
                    type(backend_module.BACKEND)(name, residuals="fused_output",
                                                 forward="mosaic_gpu"))
  scores, value, rng = _inputs(1, 4, 2, 64, 256, 64, seed=3)
  try:
    _check_step(name, scores, value, rng)
  finally:
    registry.unregister("attention_softmax_dropout_value", name)
  with pytest.raises(ValueError, match="forward: expected"):
    type(backend_module.BACKEND)("x", forward="cuda")


def _check_step(name, scores, value, rng):
  from jax_ops.ops.attention_softmax_dropout_value import pallas_mosaic_gpu as backend_module
  calls = []
  mosaic_forward = backend_module.forward_mosaic.forward_with_output

  def spy(*args, **kwargs):
    calls.append(1)
    return mosaic_forward(*args, **kwargs)

  with pytest.MonkeyPatch.context() as m:
    m.setattr(backend_module.forward_mosaic, "forward_with_output", spy)
    _compare_with_xla(name, scores, value, rng)
  assert calls, "the Mosaic GPU forward did not run"


def _compare_with_xla(name, scores, value, rng):
  def loss(impl):
    def f(s, v):
      out = jax_ops.attention_softmax_dropout_value(s, v, dropout_rate=0.1, dropout_rng=rng,
                                                    implementation=impl, interpret=INTERPRET)
      return jnp.sum(out.astype(jnp.float32) ** 2)
    return jax.value_and_grad(f, argnums=(0, 1))(scores, value)

  (lp, gp), (lx, gx) = loss(name), loss("xla")
  np.testing.assert_allclose(float(lp), float(lx), rtol=2e-2)
  for a, b in zip(gp, gx):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.max(np.abs(a - b)) < 5e-2 * np.max(np.abs(b))
