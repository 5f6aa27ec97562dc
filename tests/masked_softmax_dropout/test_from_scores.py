"""Kernel B's backward given the scores instead of P
(``masked_softmax_dropout_backward_from_scores``): it recomputes P in the kernel, as the
fused forward computes it, and draws the keep mask from the key; against the key-drawn
backward fed the forward kernel's P, and against the reference, on odd shapes and configs,
static and traced rates, fp32 and bf16. Its Triton lowering is tested in test_from_key.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET
from jax_ops import reference
from pallas_kernels.masked_softmax_dropout import Config
from pallas_kernels.masked_softmax_dropout import pallas_triton as kernels
from pallas_kernels.masked_softmax_dropout.forward import masked_softmax_dropout_forward


def _inputs(b, h, sq, sk, dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  g = jax.random.normal(k[0], (b, h, sq, sk), dtype)
  scores = (3 * jax.random.normal(k[1], (b, h, sq, sk))).astype(dtype)
  mask = jax.random.bernoulli(k[2], 0.8, (b, 1, sq, sk))
  return g, scores, mask, k[3]


def _from_p(g, scores, mask, rng, rate, **kw):
  """The key-drawn backward fed the P of the forward kernel."""
  _, p, _ = masked_softmax_dropout_forward(scores, mask, rate, rng, interpret=INTERPRET)
  return p, kernels.masked_softmax_dropout_backward_from_key(g, p, mask, rng, rate,
                                                             interpret=INTERPRET, **kw)


@pytest.mark.parametrize("b,h,sq,sk,rate", [(2, 3, 7, 33, 0.1), (1, 2, 5, 131, 0.3),
                                            (1, 1, 1, 293, 0.0)])
@pytest.mark.parametrize("config", [None, Config(2, 4, True),
                                    Config(1, 4, False, heads_per_program=2, row_group=2,
                                           mask_after_sum=True)])
def test_matches_the_backward_fed_p(b, h, sq, sk, rate, config):
  """Split rows (two chunks: 131 = 128 + 3, 293 = 256 + 37), two heads per program, a mask
  asked after the sums (loaded first here: P needs it)."""
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
  p, want = _from_p(g, scores, mask, rng, 0.25)
  got = fn(jnp.float32(0.25))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-3)
  assert np.all(np.isnan(np.asarray(fn(jnp.float32(1.5)), np.float32)))  # invalid: NaN


def test_matches_the_reference_backward_with_the_reference_p():
  import jax_ops
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
  with pytest.raises(ValueError, match="config.chunk"):
    kernels.masked_softmax_dropout_backward_from_scores(g, scores, mask, rng, 0.1,
                                                        config=Config(1, 4, False, chunk=4),
                                                        interpret=True)


def test_forward_without_p():
  _, scores, mask, rng = _inputs(1, 2, 7, 33)
  full = masked_softmax_dropout_forward(scores, mask, 0.1, rng, interpret=INTERPRET)
  y, p, keep = masked_softmax_dropout_forward(scores, mask, 0.1, rng, store_probs=False,
                                              store_keep=False, interpret=INTERPRET)
  assert p is None and keep is None
  np.testing.assert_array_equal(np.asarray(y), np.asarray(full[0]))
  with pytest.raises(TypeError, match="store_probs"):
    masked_softmax_dropout_forward(scores, mask, 0.1, rng, store_probs=1, interpret=True)


def test_warp_rows_config_takes_the_row_kernel():
  """A ``warp_rows`` config (no P in memory to sum: the row kernel at the same warps instead)
  gives the backward fed P."""
  g, scores, mask, rng = _inputs(1, 2, 3, 300, seed=5)
  config = Config(1, 4, False, warp_rows=True)
  _, want = _from_p(g, scores, mask, rng, 0.2, config=config)
  got = kernels.masked_softmax_dropout_backward_from_scores(g, scores, mask, rng, 0.2,
                                                            config=config, interpret=INTERPRET)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
