"""The ops' dropout mask (``jax_ops.dropout_keep_mask``): a counter-based hash of (key,
leading index, row, column) with 16-bit thresholds. Statistics, determinism, the rounding
of the rate, and that the ops use it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ops
from jax_ops import _common
from pallas_kernels import _dropout

SHAPE = (4, 4, 96, 130)   # B, H, rows, cols: 200k elements, odd pairs per row


def _mask(seed, rate, shape=SHAPE):
  return np.asarray(_common.dropout_keep_mask(jax.random.key(seed), rate, shape))


@pytest.mark.parametrize("rate", [0.05, 0.1, 0.5, 0.9])
def test_keep_fraction_within_4_sigma(rate):
  m = _mask(0, rate)
  keep = 1.0 - _common.effective_dropout_rate(rate)
  sigma = np.sqrt(keep * (1 - keep) / m.size)
  assert abs(m.mean() - keep) < 4 * sigma, (m.mean(), keep)


@pytest.mark.parametrize("axis", [0, 1, 2, 3])   # batch entries, heads, rows, columns
def test_no_correlation_between_neighbours(axis):
  m = _mask(1, 0.5).astype(np.float64)
  a = np.take(m, np.arange(m.shape[axis] - 1), axis=axis).ravel()
  b = np.take(m, np.arange(1, m.shape[axis]), axis=axis).ravel()
  corr = np.corrcoef(a, b)[0, 1]
  assert abs(corr) < 4 / np.sqrt(a.size), corr


def test_columns_of_one_hash_are_independent():
  """Columns 2w and 2w + 1 come from the two halves of one 32-bit hash."""
  m = _mask(2, 0.3).astype(np.float64)
  corr = np.corrcoef(m[..., 0:-1:2].ravel(), m[..., 1::2].ravel())[0, 1]
  assert abs(corr) < 4 / np.sqrt(m[..., 1::2].size), corr


def test_keys_differ_and_repeat():
  a, b = _mask(3, 0.5), _mask(4, 0.5)
  agree = (a == b).mean()
  assert abs(agree - 0.5) < 0.01, agree      # two independent fair masks agree half the time
  np.testing.assert_array_equal(a, _mask(3, 0.5))
  jitted = jax.jit(lambda k: _common.dropout_keep_mask(k, jnp.float32(0.5), SHAPE))
  np.testing.assert_array_equal(np.asarray(jitted(jax.random.key(3))), a)
  raw = np.asarray(_common.dropout_keep_mask(jax.random.PRNGKey(3), 0.5, SHAPE))
  np.testing.assert_array_equal(raw, a)       # a raw uint32 key draws the same mask


def test_the_function_is_pinned():
  """The documented function, on a small case (a change of the hash fails here)."""
  m = _mask(42, 0.5, (1, 2, 3, 5)).astype(int).tolist()
  assert m == [[[[0, 0, 0, 0, 0], [1, 0, 0, 0, 1], [1, 1, 0, 1, 0]],
                [[1, 0, 1, 0, 1], [1, 1, 1, 1, 0], [1, 0, 1, 0, 1]]]]


def test_each_of_the_16_bits_is_fair():
  """Every bit of ``u`` (not only the top one a rate of 0.5 reads) is 1 half the time."""
  k0, k1 = np.uint32(0x1234567), np.uint32(0x89ABCDEF)
  n, r, c = (jax.lax.broadcasted_iota(jnp.uint32, (4, 96, 130), i) for i in range(3))
  u = np.asarray(_dropout.bits16(k0, k1, n, r, c, 130))
  means = ((u[..., None] >> np.arange(16, dtype=np.uint32)) & 1).reshape(-1, 16).mean(0)
  assert np.all(np.abs(means - 0.5) < 4 * 0.5 / np.sqrt(u.size)), means


def test_x64_draws_the_same_mask():
  a = _mask(5, 0.2)
  with jax.enable_x64(True):
    b = np.asarray(_common.dropout_keep_mask(jax.random.key(5), 0.2, SHAPE))
  np.testing.assert_array_equal(a, b)


def test_rate_rounding():
  assert _common.effective_dropout_rate(0.1) == 6554 / 65536
  assert _common.effective_dropout_rate(0.0) == 0.0
  assert _common.effective_dropout_rate(1e-6) == 0.0            # under 2**-17: nothing dropped
  assert _common.effective_dropout_rate(0.99999) == 65535 / 65536
  assert float(_common.effective_dropout_rate(jnp.float32(0.1))) == pytest.approx(6554 / 65536)
  # A traced rate outside [0, 1) gives NaN; a concrete one raises, naming the argument.
  for bad in (np.nan, -0.1, 1.0, 1.5):
    traced = jax.jit(_common.effective_dropout_rate)(jnp.float32(bad))
    assert np.isnan(float(traced)), bad
    for concrete in (bad, jnp.float32(bad)):
      with pytest.raises(ValueError, match=r"rate: expected a dropout rate in \[0, 1\)"):
        _common.effective_dropout_rate(concrete)
  assert _mask(6, 1e-6).all()


@pytest.mark.parametrize("rate", [6553.5 / 65536 - 1e-12, 0.15, 3.5 / 65536 + 1e-13, 0.1])
def test_a_python_rate_rounds_as_a_traced_one(rate):
  """A Python float is rounded in fp32 as a traced rate is, so eager and jitted calls (and
  the reference and the kernels, which take the rate traced) draw the same mask."""
  eager = _common.effective_dropout_rate(rate)
  assert float(jax.jit(_common.effective_dropout_rate)(rate)) == eager
  rng = jax.random.key(3)
  jitted = jax.jit(lambda r: _common.dropout_keep_mask(rng, r, SHAPE))(rate)
  np.testing.assert_array_equal(_common.dropout_keep_mask(rng, rate, SHAPE), jitted)


def test_keep_mask_checks_its_arguments():
  rng = jax.random.key(0)
  for bad in (np.nan, -0.1, 1.0, 1.5):
    with pytest.raises(ValueError, match=r"rate: expected a dropout rate in \[0, 1\)"):
      _common.dropout_keep_mask(rng, bad, (1, 1, 4, 4))
  for shape in ((4,), 4, (2, -1), (2, 3.0)):
    with pytest.raises(ValueError, match=r"shape: expected a tuple \[\.\.\., rows, cols\]"):
      _common.dropout_keep_mask(rng, 0.1, shape)
  for key in (0, None, jnp.zeros(2), jax.random.split(rng, 2)):
    with pytest.raises(TypeError, match="rng: expected one PRNG key"):
      _common.dropout_keep_mask(key, 0.1, (1, 1, 4, 4))
  # Traced: clipped, since nothing can raise when it runs.
  draw = jax.jit(lambda r: _common.dropout_keep_mask(rng, r, (1, 1, 4, 4)))
  assert bool(draw(jnp.float32(-0.1)).all()) and not bool(draw(jnp.float32(1.5)).any())


def test_the_ops_drop_with_it_and_scale_by_the_rate_drawn():
  """masked_softmax_dropout's output is softmax * keep / (1 - effective rate), keep from the
  documented mask, and its gradient runs."""
  k = jax.random.split(jax.random.key(7), 3)
  scores = jax.random.normal(k[0], (2, 3, 8, 10), jnp.float32)
  mask = jnp.ones((2, 1, 8, 10), bool)
  rate = 0.3
  out = jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=rate, dropout_rng=k[1],
                                       implementation="xla")
  keep = _common.dropout_keep_mask(k[1], rate, scores.shape)
  expected = jax.nn.softmax(scores, -1) * keep / (1 - _common.effective_dropout_rate(rate))
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-7)
  grad = jax.grad(lambda s: jnp.sum(jax_ops.masked_softmax_dropout(
      s, mask, dropout_rate=rate, dropout_rng=k[1], implementation="xla") * jnp.arange(10.0)))(
          scores)
  assert np.all(np.isfinite(np.asarray(grad)))
  assert not np.allclose(np.asarray(grad), 0)
