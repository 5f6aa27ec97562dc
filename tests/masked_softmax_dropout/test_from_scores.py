"""The backward given the scores instead of P (``masked_softmax_dropout_backward_from_scores``):
it recomputes P in the kernel, as the fused forward computes it, and draws the keep mask
from the key; against the keep-reading kernel fed the jnp P and ``jax_ops.dropout_keep_mask``,
and against the reference, on odd shapes and configs, static and traced rates, fp32 and
bf16, and lowered to Triton IR."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, triton_calls_in_gpu_lowering
import jax_ops
from jax_ops import reference
from pallas_kernels.masked_softmax_dropout import Config
from pallas_kernels.masked_softmax_dropout import pallas_triton as kernels


def _inputs(b, h, sq, sk, dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  g = jax.random.normal(k[0], (b, h, sq, sk), dtype)
  scores = (3 * jax.random.normal(k[1], (b, h, sq, sk))).astype(dtype)
  mask = jax.random.bernoulli(k[2], 0.8, (b, 1, sq, sk))
  return g, scores, mask, k[3]


def _from_p(g, scores, mask, rng, rate, **kw):
  """The keep-reading kernel fed the jnp forward's P and the jnp keep mask."""
  keep = jax_ops.dropout_keep_mask(rng, rate, g.shape) if rate else None
  _, p = reference.masked_softmax_dropout_forward(scores, mask, None, 0.0)
  return p, kernels.masked_softmax_dropout_backward(
      g, p, mask, keep, jax_ops.effective_dropout_rate(rate), interpret=INTERPRET, **kw)


@pytest.mark.parametrize("b,h,sq,sk,rate", [(2, 3, 7, 33, 0.1), (1, 2, 5, 131, 0.3),
                                            (1, 1, 1, 293, 0.0), (1, 2, 3, 1, 0.3)])
@pytest.mark.parametrize("config", [None, Config(2, 4, True),
                                    Config(1, 4, False, row_group=2, mask_after_sum=True)])
def test_matches_the_backward_fed_p(b, h, sq, sk, rate, config):
  """Split rows (two chunks: 131 = 128 + 3, 293 = 256 + 37), a one-column row, rows in
  groups, a mask asked after the sums (loaded first here: P needs it)."""
  g, scores, mask, rng = _inputs(b, h, sq, sk)
  kw = {} if config is None else {"config": config}
  _, want = _from_p(g, scores, mask, rng, rate, **kw)
  got = kernels.masked_softmax_dropout_backward_from_scores(g, scores, mask, rng, rate,
                                                            interpret=INTERPRET, **kw)
  assert got.shape == scores.shape and got.dtype == scores.dtype
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_matches_the_reference_in_bf16_and_with_a_traced_rate():
  g, scores, mask, rng = _inputs(1, 2, 6, 40, jnp.bfloat16, seed=1)
  fn = jax.jit(lambda r: kernels.masked_softmax_dropout_backward_from_scores(
      g, scores, mask, rng, r, interpret=INTERPRET))
  keep = jax_ops.dropout_keep_mask(rng, 0.25, g.shape)
  _, p = reference.masked_softmax_dropout_forward(scores, mask, None, 0.0)  # bf16, as saved
  want = reference.masked_softmax_dropout_backward_reference(g, p, mask, keep, 0.25)
  got = fn(jnp.float32(0.25))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=1e-2, atol=1e-5)  # ~2 bf16 ulps
  assert np.all(np.isnan(np.asarray(fn(jnp.float32(1.5)), np.float32)))  # invalid: NaN


def test_traced_rate_equals_the_static_rate():
  g, scores, mask, rng = _inputs(1, 2, 6, 40, seed=3)
  fn = jax.jit(lambda r: kernels.masked_softmax_dropout_backward_from_scores(
      g, scores, mask, rng, r, interpret=INTERPRET))
  static = kernels.masked_softmax_dropout_backward_from_scores(g, scores, mask, rng, 0.25,
                                                               interpret=INTERPRET)
  # The same mask; the scale 1 / (1 - p) computed in the kernel or folded in: to rounding.
  np.testing.assert_allclose(np.asarray(fn(jnp.float32(0.25))), np.asarray(static),
                             rtol=1e-6, atol=1e-7)


def test_matches_the_reference_backward_with_the_reference_p():
  g, scores, mask, rng = _inputs(2, 2, 9, 24, seed=2)
  rate = 0.1
  p = jax.nn.softmax(jnp.where(mask, scores, -1e4), axis=-1)
  keep = jax_ops.dropout_keep_mask(rng, rate, g.shape)
  want = reference.masked_softmax_dropout_backward_reference(
      g, p, mask, keep, jax_ops.effective_dropout_rate(rate))
  got = kernels.masked_softmax_dropout_backward_from_scores(g, scores, mask, rng, rate,
                                                            interpret=INTERPRET)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_errors():
  g, scores, mask, rng = _inputs(1, 1, 4, 8)
  with pytest.raises(ValueError, match="dropout_rng"):
    kernels.masked_softmax_dropout_backward_from_scores(g, scores, mask, None, 0.1,
                                                        interpret=True)
  with pytest.raises(ValueError, match="mask"):
    kernels.masked_softmax_dropout_backward_from_scores(g, scores, mask[:, :, :3], rng, 0.1,
                                                        interpret=True)
  with pytest.raises(ValueError, match="scores"):
    kernels.masked_softmax_dropout_backward_from_scores(g, scores[0], mask, rng, 0.1,
                                                        interpret=True)
  for key in (3, jnp.zeros(2), jax.random.split(rng, 2)):
    with pytest.raises(TypeError, match="dropout_rng: expected one PRNG key"):
      kernels.masked_softmax_dropout_backward_from_scores(g, scores, mask, key, 0.1,
                                                          interpret=True)
  with pytest.raises(TypeError, match="config"):
    kernels.masked_softmax_dropout_backward_from_scores(g, scores, mask, rng, 0.1,
                                                        config=(1, 4), interpret=True)


@pytest.fixture
def pretend_gpu(pretend_h200, monkeypatch):
  monkeypatch.setattr(kernels._util, "check_can_compile", lambda *a, **k: None)


@pytest.mark.parametrize("rate,config", [(0.1, None), (None, None), (0.0, None),
                                         (0.1, Config(2, 4, True))])
def test_lowers_to_triton(pretend_gpu, rate, config):
  shapes = [jax.ShapeDtypeStruct((2, 3, 131, 131), jnp.float32)] * 2 + [
      jax.ShapeDtypeStruct((2, 1, 131, 131), jnp.bool_)]
  rng = jax.random.key(0)
  fn = lambda g, s, m, r: kernels.masked_softmax_dropout_backward_from_scores(
      g, s, m, rng, r, config=config)
  assert triton_calls_in_gpu_lowering(fn, shapes, rate) == 1
