"""Kernel B's backward with the keep mask drawn from the key in the kernel
(``masked_softmax_dropout_backward_from_key``): bit for bit the keep-reading kernel fed
``jax_ops.dropout_keep_mask``, on odd shapes, configs, static and traced rates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, triton_calls_in_gpu_lowering
import jax_ops
from pallas_kernels.masked_softmax_dropout import Config
from pallas_kernels.masked_softmax_dropout import pallas_triton as kernels


def _inputs(b, h, sq, sk, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  g = jax.random.normal(k[0], (b, h, sq, sk), jnp.float32)
  p = jax.nn.softmax(jax.random.normal(k[1], (b, h, sq, sk), jnp.float32), axis=-1)
  mask = jax.random.bernoulli(k[2], 0.8, (b, 1, sq, sk))
  return g, p, mask, k[3]


def _keep_reading(g, p, mask, rng, rate, **kw):
  keep = jax_ops.dropout_keep_mask(rng, rate, g.shape)
  return kernels.masked_softmax_dropout_backward(
      g, p, mask, keep, jax_ops.effective_dropout_rate(rate), interpret=INTERPRET, **kw)


_KEEP_CONFIGS = (None, Config(2, 4, True), Config(1, 4, False, heads_per_program=2))


# Each shape with two of the configs, each config on two or three shapes.
@pytest.mark.parametrize("b,h,sq,sk,rate,config", [
    (*shape, _KEEP_CONFIGS[(i + j) % 3])
    for i, shape in enumerate([(2, 3, 7, 33, 0.1), (1, 2, 5, 131, 0.3), (1, 1, 1, 293, 0.5),
                               (1, 2, 4, 8, 0.0)]) for j in (0, 1)])
def test_equals_the_keep_reading_kernel(b, h, sq, sk, rate, config):
  g, p, mask, rng = _inputs(b, h, sq, sk)
  kw = {} if config is None else {"config": config}
  want = _keep_reading(g, p, mask, rng, rate, **kw)
  got = kernels.masked_softmax_dropout_backward_from_key(g, p, mask, rng, rate,
                                                         interpret=INTERPRET, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("entry,config", [
    ("from_key", Config(1, 4, False, chunk=32)),
    ("from_key", Config(1, 4, True, heads_per_program=2)),
    ("from_scores", Config(2, 4, True))])   # from_scores: no chunk
def test_pair_hash_draws_the_same_mask(entry, config):
  """One hash per pair of columns (``Config.pair_hash``; split rows 131 = 128 + 3, two-pass
  column chunks, two heads per program, and a one-column row, whose one-column tiles hash
  per element): bit for bit the per-element hash's gradient."""
  import dataclasses
  backward = getattr(kernels, f"masked_softmax_dropout_backward_{entry}")
  for shape in ((1, 2, 5, 131), (1, 2, 3, 1)):
    g, p, mask, rng = _inputs(*shape, seed=2)
    got, want = (backward(g, p, mask, rng, 0.3, interpret=INTERPRET,
                          config=dataclasses.replace(config, pair_hash=pair))
                 for pair in (True, False))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_traced_rate():
  g, p, mask, rng = _inputs(1, 2, 6, 40, seed=1)
  fn = jax.jit(lambda r: kernels.masked_softmax_dropout_backward_from_key(
      g, p, mask, rng, r, interpret=INTERPRET))
  np.testing.assert_array_equal(np.asarray(fn(jnp.float32(0.25))),
                                np.asarray(_keep_reading(g, p, mask, rng, 0.25)))
  assert np.all(np.isnan(np.asarray(fn(jnp.float32(1.5)))))   # invalid: NaN, not wrong


def test_errors():
  g, p, mask, rng = _inputs(1, 1, 4, 8)
  with pytest.raises(ValueError, match="dropout_rng"):
    kernels.masked_softmax_dropout_backward_from_key(g, p, mask, None, 0.1, interpret=True)
  with pytest.raises(ValueError, match="mask"):
    kernels.masked_softmax_dropout_backward_from_key(g, p, mask[:, :, :3], rng, 0.1,
                                                     interpret=True)


@pytest.fixture
def pretend_gpu(pretend_h200, monkeypatch):
  monkeypatch.setattr(kernels._util, "check_can_compile", lambda *a, **k: None)


@pytest.mark.parametrize("entry", ["from_key", "from_scores"])
@pytest.mark.parametrize("rate,config", [(0.1, None), (None, None),
                                         (0.1, Config(2, 4, True, pair_hash=True))])
def test_lowers_to_triton(pretend_gpu, rate, config, entry):
  """This entry point and the one given the scores (test_from_scores.py), the pair hash's
  join and reshape too."""
  shapes = [jax.ShapeDtypeStruct((2, 3, 131, 131), jnp.float32)] * 2 + [
      jax.ShapeDtypeStruct((2, 1, 131, 131), jnp.bool_)]
  rng = jax.random.key(0)
  backward = getattr(kernels, f"masked_softmax_dropout_backward_{entry}")
  fn = lambda g, p, m, r: backward(g, p, m, rng, r, config=config)
  assert triton_calls_in_gpu_lowering(fn, shapes, rate) == 1
