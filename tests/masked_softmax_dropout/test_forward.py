"""The fused forward kernel of masked softmax -> dropout (``forward.py``): the mask it
draws is ``jax_ops.dropout_keep_mask``'s bit for bit, and ``y`` and ``P`` match the jnp
forward, on odd shapes, static and traced rates, fp32 and bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET
import jax_ops
from jax_ops import reference
from pallas_kernels.masked_softmax_dropout.forward import masked_softmax_dropout_forward


def _inputs(b, h, sq, sk, dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  scores = jax.random.normal(k[0], (b, h, sq, sk), jnp.float32).astype(dtype)
  mask = jax.random.bernoulli(k[1], 0.8, (b, 1, sq, sk))
  return scores, mask, k[2]


def _check(scores, mask, rng, rate, y, p, keep, tol):
  ref_keep = jax_ops.dropout_keep_mask(rng, rate, scores.shape) if rate else None
  ref_y, ref_p = reference.masked_softmax_dropout_forward(
      scores, mask, ref_keep, jax_ops.effective_dropout_rate(rate))
  if ref_keep is None:
    assert keep is None
  else:
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(ref_keep))
  for out, ref in ((y, ref_y), (p, ref_p)):
    assert out.dtype == scores.dtype and out.shape == scores.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("b,h,sq,sk,rate", [
    (2, 3, 7, 33, 0.1), (1, 2, 1, 131, 0.2), (1, 1, 9, 293, 0.5), (2, 2, 5, 7, 0.0),
    (1, 1, 3, 1, 0.1)])
def test_matches_the_jnp_forward(b, h, sq, sk, rate):
  scores, mask, rng = _inputs(b, h, sq, sk)
  out = masked_softmax_dropout_forward(scores, mask, rate, rng, interpret=INTERPRET)
  _check(scores, mask, rng, rate, *out, tol=1e-6)


def test_bf16_and_a_traced_rate():
  scores, mask, rng = _inputs(1, 2, 6, 40, jnp.bfloat16, seed=1)
  fn = jax.jit(lambda s, r: masked_softmax_dropout_forward(s, mask, r, rng,
                                                           interpret=INTERPRET))
  out = fn(scores, jnp.float32(0.25))
  _check(scores, mask, rng, 0.25, *out, tol=1e-2)
  y, _, _ = fn(scores, jnp.float32(1.5))            # an invalid traced rate: NaN, not wrong
  assert np.all(np.isnan(np.asarray(y, np.float32)))


def test_block_rows_do_not_change_the_result():
  """The mask is bit for bit the same; y and P agree to rounding (compiled, another block
  shape reduces the row in another order: 1-2 ulp apart, found on the H200)."""
  scores, mask, rng = _inputs(1, 2, 19, 24, seed=2)
  a = masked_softmax_dropout_forward(scores, mask, 0.1, rng, interpret=INTERPRET)
  b = masked_softmax_dropout_forward(scores, mask, 0.1, rng, block_rows=4, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(a[2]), np.asarray(b[2]))
  for x, y in zip(a[:2], b[:2]):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rate", [0.1, "traced", 0.0])
def test_without_storing_keep(rate):
  """``store_keep=False``: no keep mask comes back (nor is written), ``y`` and ``P`` are
  those of the call that stores it, bit for bit."""
  scores, mask, rng = _inputs(1, 3, 7, 33, seed=3)
  call = lambda r, store: masked_softmax_dropout_forward(scores, mask, r, rng,
                                                         store_keep=store, interpret=INTERPRET)
  if rate == "traced":
    fn = jax.jit(call, static_argnums=1)
    stored, bare = fn(jnp.float32(0.25), True), fn(jnp.float32(0.25), False)
  else:
    stored, bare = call(rate, True), call(rate, False)
  assert bare[2] is None and (stored[2] is None) == (rate == 0.0)
  for x, y in zip(stored[:2], bare[:2]):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The kernel has one output less (y, P): the keep mask is not allocated.
  jaxpr = str(jax.make_jaxpr(lambda s: call(0.1, False))(scores))
  assert "bool[3,7,33]" not in jaxpr and "bool[1,3,7,33]" not in jaxpr


# (The default hashes per pair: the other tests check it against the jnp forward's mask.)
@pytest.mark.parametrize("sq,sk,block_rows", [(5, 1, None), (9, 293, 2)])
def test_pair_hash_draws_the_same_mask(sq, sk, block_rows):
  """One hash per pair of columns (one column, odd rows, several row blocks): the jnp mask
  bit for bit, and every output equal to the per-element hash's."""
  scores, mask, rng = _inputs(1, 2, sq, sk, seed=4)
  outs = [masked_softmax_dropout_forward(scores, mask, 0.3, rng, pair_hash=pair_hash,
                                         block_rows=block_rows, interpret=INTERPRET)
          for pair_hash in (True, False)]
  _check(scores, mask, rng, 0.3, *outs[0], tol=1e-6)
  for x, y in zip(*outs):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_argument_errors():
  scores, mask, rng = _inputs(1, 2, 4, 8)
  with pytest.raises(ValueError, match="mask"):
    masked_softmax_dropout_forward(scores, mask[:, :, :3], 0.1, rng, interpret=True)
  with pytest.raises(ValueError, match="dropout_rng"):
    masked_softmax_dropout_forward(scores, mask, 0.1, interpret=True)
  with pytest.raises(ValueError, match="dropout_rate"):
    masked_softmax_dropout_forward(scores, mask, 1.0, rng, interpret=True)
  with pytest.raises(TypeError, match="store_keep"):
    masked_softmax_dropout_forward(scores, mask, 0.1, rng, store_keep=None, interpret=True)
  with pytest.raises(TypeError, match="pair_hash"):
    masked_softmax_dropout_forward(scores, mask, 0.1, rng, pair_hash=1, interpret=True)
  for key in (3, jnp.zeros(2), jax.random.split(rng, 2)):
    with pytest.raises(TypeError, match="dropout_rng: expected one PRNG key"):
      masked_softmax_dropout_forward(scores, mask, 0.1, key, interpret=True)
  for name, bad in (("block_rows", 0), ("block_rows", -1), ("block_rows", 3), ("block_rows", 2.5),
                    ("num_warps", 3), ("num_warps", 64), ("num_warps", True)):
    with pytest.raises(ValueError, match=f"{name}: expected None or a power of two"):
      masked_softmax_dropout_forward(scores, mask, 0.1, rng, interpret=True, **{name: bad})


@pytest.fixture
def pretend_gpu(pretend_h200, monkeypatch):
  """Lowering for a pretended H200 on any host (the "compiles only on a GPU" check off)."""
  from pallas_kernels.masked_softmax_dropout import forward
  monkeypatch.setattr(forward._util, "check_can_compile", lambda *a, **k: None)


@pytest.mark.parametrize("rate", [0.0, 0.1])
def test_lowers_to_triton(pretend_gpu, rate):
  """The kernel, hash included, lowers to Triton IR for a GPU (no GPU needed)."""
  from conftest import triton_calls_in_gpu_lowering
  shapes = [jax.ShapeDtypeStruct((2, 3, 131, 131), jnp.float32),
            jax.ShapeDtypeStruct((2, 1, 131, 131), jnp.bool_)]
  rng = jax.random.key(0)
  fn = lambda s, m, r: masked_softmax_dropout_forward(s, m, r, rng)
  assert triton_calls_in_gpu_lowering(fn, shapes, rate) == 1


@pytest.mark.parametrize("rate,pair_hash", [(0.1, False), (None, False), (0.1, True)])
def test_lowers_to_triton_without_storing_keep(pretend_gpu, rate, pair_hash):
  """``store_keep=False`` (the op's forward) lowers too, static and traced rates, and with
  the pair hash (its join and reshape)."""
  from conftest import triton_calls_in_gpu_lowering
  shapes = [jax.ShapeDtypeStruct((2, 3, 131, 131), jnp.float32),
            jax.ShapeDtypeStruct((2, 1, 131, 131), jnp.bool_)]
  rng = jax.random.key(0)
  fn = lambda s, m, r: masked_softmax_dropout_forward(s, m, r, rng, store_keep=False,
                                                      pair_hash=pair_hash)
  assert triton_calls_in_gpu_lowering(fn, shapes, rate) == 1
