"""The fused forward kernel of masked softmax -> dropout (``forward.py``): the mask it
draws is ``jax_ops.dropout_keep_mask``'s bit for bit (where a row attends, an element of
``y`` is nonzero exactly where it is kept), and ``y`` matches the jnp forward, on odd shapes,
static and traced rates, fp32 and bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, pallas_call_outputs
import jax_ops
from jax_ops import reference
from pallas_kernels.masked_softmax_dropout.forward import masked_softmax_dropout_forward


def _inputs(b, h, sq, sk, dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  scores = jax.random.normal(k[0], (b, h, sq, sk), jnp.float32).astype(dtype)
  mask = jax.random.bernoulli(k[1], 0.8, (b, 1, sq, sk))
  return scores, mask, k[2]


def _check(scores, mask, rng, rate, y, tol, atol=None):
  ref_keep = jax_ops.dropout_keep_mask(rng, rate, scores.shape) if rate else None
  ref_y, ref_p = reference.masked_softmax_dropout_forward(
      scores, mask, ref_keep, jax_ops.effective_dropout_rate(rate))
  assert y.dtype == scores.dtype and y.shape == scores.shape
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref_y, np.float32),
                             rtol=tol, atol=tol if atol is None else atol)
  if ref_keep is not None:   # the mask bit for bit where P > 0
    live = np.asarray(ref_p, np.float32) > 0
    np.testing.assert_array_equal(np.asarray(y, np.float32)[live] != 0,
                                  np.asarray(ref_keep)[live])


@pytest.mark.parametrize("b,h,sq,sk,rate", [
    (2, 3, 7, 33, 0.1), (1, 2, 1, 131, 0.2), (1, 1, 9, 293, 0.5), (2, 2, 5, 7, 0.0),
    (1, 1, 3, 1, 0.1), (1, 2, 5, 1, 0.3)])
def test_matches_the_jnp_forward(b, h, sq, sk, rate):
  scores, mask, rng = _inputs(b, h, sq, sk)
  y = masked_softmax_dropout_forward(scores, mask, rate, rng, interpret=INTERPRET)
  _check(scores, mask, rng, rate, y, tol=1e-6)


def test_bf16_and_a_traced_rate():
  scores, mask, rng = _inputs(1, 2, 6, 40, jnp.bfloat16, seed=1)
  fn = jax.jit(lambda s, r: masked_softmax_dropout_forward(s, mask, r, rng,
                                                           interpret=INTERPRET))
  _check(scores, mask, rng, 0.25, fn(scores, jnp.float32(0.25)), tol=1e-2,
         atol=1e-5)  # ~2 bf16 ulps
  y = fn(scores, jnp.float32(1.5))            # an invalid traced rate: NaN, not wrong
  assert np.all(np.isnan(np.asarray(y, np.float32)))


@pytest.mark.parametrize("rate", [0.1, 0.0])
def test_block_rows_do_not_change_the_result(rate):
  """y agrees to rounding (compiled, another block shape reduces the row in another order:
  1-2 ulp apart); its zeros, the mask's, are the same."""
  scores, mask, rng = _inputs(1, 2, 19, 24, seed=2)
  a = masked_softmax_dropout_forward(scores, mask, rate, rng, interpret=INTERPRET)
  b = masked_softmax_dropout_forward(scores, mask, rate, rng, block_rows=4, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(a) == 0, np.asarray(b) == 0)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_writes_only_the_output():
  """One kernel, one output: neither P nor the keep mask is written."""
  scores, mask, rng = _inputs(1, 3, 7, 33, seed=3)
  fn = lambda s: masked_softmax_dropout_forward(s, mask, 0.1, rng, interpret=INTERPRET)
  assert pallas_call_outputs(fn, scores) == [1]


def test_argument_errors():
  scores, mask, rng = _inputs(1, 2, 4, 8)
  with pytest.raises(ValueError, match="mask"):
    masked_softmax_dropout_forward(scores, mask[:, :, :3], 0.1, rng, interpret=True)
  with pytest.raises(ValueError, match="dropout_rng"):
    masked_softmax_dropout_forward(scores, mask, 0.1, interpret=True)
  with pytest.raises(ValueError, match="dropout_rate"):
    masked_softmax_dropout_forward(scores, mask, 1.0, rng, interpret=True)
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


@pytest.mark.parametrize("rate", [0.0, 0.1, None])
def test_lowers_to_triton(pretend_gpu, rate):
  """The kernel, the pair hash's join and reshape included, lowers to Triton IR for a GPU
  (no GPU needed), static and traced rates."""
  from conftest import triton_calls_in_gpu_lowering
  shapes = [jax.ShapeDtypeStruct((2, 3, 131, 131), jnp.float32),
            jax.ShapeDtypeStruct((2, 1, 131, 131), jnp.bool_)]
  rng = jax.random.key(0)
  fn = lambda s, m, r: masked_softmax_dropout_forward(s, m, r, rng)
  assert triton_calls_in_gpu_lowering(fn, shapes, rate) == 1
