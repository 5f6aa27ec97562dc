"""The op's fused forward kernel (``forward.py``): the mask it draws is
``jax_ops.dropout_keep_mask``'s bit for bit; ``P`` matches the jnp forward's to within one
ulp of the input dtype (bit for bit in all but a small share of the elements); ``Pd`` is
made from the kernel's ``P`` exactly as the reference makes it; ``O`` and the fp32 ``O``
match the jnp forward. Odd lengths, GQA groups 1, 4 and 10, D = 64, 80 and 128, fp32,
bf16 and fp16, static and traced rates."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, ON_GPU, ulps_apart
import jax_ops
from jax_ops._common import apply_dropout
from jax_ops.ops.attention_softmax_dropout_value import reference
from pallas_kernels.attention_softmax_dropout_value.forward import (
    attention_softmax_dropout_value_forward as forward)


def _inputs(b, h, kvh, sq, sk, d, dtype=jnp.float32, seed=0, scale=2.0):
  k = jax.random.split(jax.random.key(seed), 3)
  scores = (jax.random.normal(k[0], (b, h, sq, sk), jnp.float32) * scale).astype(dtype)
  value = jax.random.normal(k[1], (b, kvh, sk, d), jnp.float32).astype(dtype)
  return scores, value, k[2]


def _f32(x):
  return np.asarray(jnp.asarray(x, jnp.float32))


@functools.partial(jax.jit, static_argnames="rate")
def _reference(scores, value, rng, *, rate):
  """``(keep, (O, P, Pd, O_f32))`` of the jnp forward, the mask drawn for a static rate
  (``None`` for 0)."""
  keep = jax_ops.dropout_keep_mask(rng, rate, scores.shape) if rate else None
  eff = jax_ops.effective_dropout_rate(rate)
  return keep, reference.attention_softmax_dropout_value_forward(
      scores, value, keep, eff, with_f32_output=True)


@jax.jit
def _dropped(p, keep, rate):
  """The reference's Pd made from ``p`` (``apply_dropout``)."""
  return apply_dropout(p, keep, rate)


def _check(scores, value, rng, rate, out, *, store_dropped=True, store_keep=True,
           store_f32=True):
  """``out`` (the kernel's five outputs) against the jnp forward at the static ``rate``."""
  o, p, pd, keep, o32 = out
  dtype = scores.dtype
  b, h, sq, _ = scores.shape
  d = value.shape[3]
  ref_keep, (ref_o, ref_p, ref_pd, ref_o32) = _reference(scores, value, rng, rate=rate)
  if ref_keep is None or not store_keep:
    assert keep is None
  else:
    assert keep.dtype == jnp.bool_ and keep.shape == scores.shape
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(ref_keep))
  # P: at most one ulp of the dtype from the reference's (fp32: a few), most elements equal.
  assert p.dtype == dtype and p.shape == scores.shape
  ulps = ulps_apart(p, ref_p)
  assert ulps.max() <= (1 if dtype != jnp.float32 else 8), ulps.max()
  if dtype != jnp.float32:
    assert (ulps == 0).mean() >= 0.999, (ulps == 0).mean()
  # Pd: the reference's rounding applied to the kernel's own P, bit for bit.
  if store_dropped:
    assert pd.dtype == dtype and pd.shape == scores.shape
    if ref_keep is None:
      np.testing.assert_array_equal(_f32(pd), _f32(p))
    else:
      want = _dropped(p, ref_keep, jnp.float32(jax_ops.effective_dropout_rate(rate)))
      np.testing.assert_array_equal(_f32(pd), _f32(want))
    np.testing.assert_allclose(_f32(pd), _f32(ref_pd), rtol=2e-2 if dtype != jnp.float32
                               else 1e-6, atol=1e-6)
  else:
    assert pd is None
  # O: the kernel's fp32 O is Pd @ V up to the order of the fp32 sums.
  assert o.dtype == dtype and o.shape == (b, sq, h, d)
  assert (o32 is None) == (not store_f32)
  if o32 is None:
    np.testing.assert_allclose(_f32(o), _f32(ref_o), rtol=1e-2, atol=1e-2)
    return
  assert o32.dtype == jnp.float32 and o32.shape == (b, sq, h, d)
  np.testing.assert_allclose(_f32(o32), _f32(ref_o32), rtol=1e-5,
                             atol=1e-5 if dtype == jnp.float32 else 1e-3)
  np.testing.assert_allclose(_f32(o), _f32(ref_o), rtol=1e-2, atol=1e-2 if dtype != jnp.float32
                             else 1e-5)
  np.testing.assert_array_equal(_f32(o), _f32(o32.astype(dtype)))   # O is fp32 O, rounded


@pytest.mark.parametrize("b,kvh,group,sq,sk,d,dtype,rate", [
    (2, 1, 4, 7, 131, 64, jnp.bfloat16, 0.1),     # several key tiles, the last ragged
    (1, 2, 1, 1, 7, 128, jnp.float32, 0.1),       # one row, a key tile mostly padding
    (1, 1, 10, 7, 1, 80, jnp.bfloat16, 0.0),      # one key; D padded to 128
    (1, 2, 4, 131, 7, 64, jnp.float32, 0.0),      # several row tiles, the last ragged
    (1, 1, 10, 7, 33, 128, jnp.float32, 0.1),
    (1, 1, 4, 20, 24, 80, jnp.float16, 0.1),
])
def test_matches_the_jnp_forward(b, kvh, group, sq, sk, d, dtype, rate):
  scores, value, rng = _inputs(b, kvh * group, kvh, sq, sk, d, dtype)
  out = forward(scores, value, rate, rng, store_dropped=True, interpret=INTERPRET)
  _check(scores, value, rng, rate, out)
  if rate == 0.0:  # no dropout: no key needed, keep is None, Pd is P or None
    bare = forward(scores, value, 0.0, interpret=INTERPRET)
    assert bare[2] is None and bare[3] is None
    # Pd asked for without P: Pd is P, which the kernel writes for it.
    pd_only = forward(scores, value, 0.0, store_probs=False, store_dropped=True,
                      interpret=INTERPRET)
    assert pd_only[1] is None
    np.testing.assert_array_equal(_f32(pd_only[2]), _f32(out[1]))
    for i in (0, 1, 4):
      np.testing.assert_array_equal(_f32(bare[i]), _f32(out[i]))


def test_small_tiles_without_stored_pd_or_keep():
  """Tiles of 16 (several key and row tiles, each ragged at its end); with
  ``store_dropped`` / ``store_keep`` off, Pd and keep are ``None``."""
  scores, value, rng = _inputs(1, 4, 2, 19, 37, 64, jnp.bfloat16, seed=3)
  out = forward(scores, value, 0.2, rng, store_keep=False, block_q=16, block_k=16,
                interpret=INTERPRET)
  _check(scores, value, rng, 0.2, out, store_dropped=False, store_keep=False)
  # Pd without keep or the fp32 O (the Mosaic GPU backend's "fused_inputs"): the same P, Pd and O.
  lean = forward(scores, value, 0.2, rng, store_dropped=True, store_keep=False,
                 store_f32=False, block_q=16, block_k=16, interpret=INTERPRET)
  assert lean[3] is None and lean[4] is None
  _check(scores, value, rng, 0.2, lean, store_keep=False, store_f32=False)
  for i in (0, 1):
    np.testing.assert_array_equal(_f32(lean[i]), _f32(out[i]))
  # O alone (the op's value without a gradient): the same O.
  bare = forward(scores, value, 0.2, rng, store_probs=False, store_keep=False,
                 store_f32=False, block_q=16, block_k=16, interpret=INTERPRET)
  assert bare[1:] == (None, None, None, None)
  np.testing.assert_array_equal(_f32(bare[0]), _f32(out[0]))


@pytest.mark.parametrize("sq,sk,block_k", [(9, 131, 64), (5, 7, 16)])
def test_pair_hash_draws_the_same_mask(sq, sk, block_k):
  """One hash per pair of columns (odd and ragged rows, one and several key tiles): the
  jnp mask bit for bit."""
  scores, value, rng = _inputs(1, 4, 2, sq, sk, 64, jnp.bfloat16, seed=4)
  out = forward(scores, value, 0.3, rng, store_dropped=True, block_k=block_k,
                interpret=INTERPRET)
  _check(scores, value, rng, 0.3, out)


def test_bf16_and_a_traced_rate():
  scores, value, rng = _inputs(1, 4, 1, 6, 40, 64, jnp.bfloat16, seed=1)
  fn = jax.jit(lambda s, v, r: forward(s, v, r, rng, store_dropped=True,
                                       interpret=INTERPRET))
  _check(scores, value, rng, 0.1, fn(scores, value, jnp.float32(0.1)))
  # A traced rate of 0 draws an all-kept mask (threshold 0) and scales by 1.
  out = fn(scores, value, jnp.float32(0.0))
  _check(scores, value, rng, 0.0, out[:3] + (None,) + out[4:])
  assert bool(jnp.all(out[3]))
  o, p, pd, _, o32 = fn(scores, value, jnp.float32(1.5))   # invalid: NaN, not wrong
  assert np.all(np.isnan(_f32(o))) and np.all(np.isnan(_f32(o32)))
  assert np.all(np.isnan(_f32(pd)))


def _bad_inputs():
  return _inputs(1, 4, 2, 4, 8, 64, jnp.float32)


@pytest.mark.parametrize("change,exc,match", [
    (lambda s, v: (s[0], v), ValueError, "scores"),                      # rank
    (lambda s, v: (s, v[:, :, :5]), ValueError, "value_states"),         # Skv differs
    (lambda s, v: (s, v[None]), ValueError, "value_states"),                # rank
    (lambda s, v: (s, jnp.concatenate([v, v[:, :1]], 1)), ValueError, "KVH"),  # 3 of 4 heads
    (lambda s, v: (s, v.astype(jnp.bfloat16)), TypeError, "value_states"),
    (lambda s, v: (s.astype(jnp.int32), v), TypeError, "scores"),
    (lambda s, v: (s[:, :, :0], v), ValueError, "scores"),                # empty
])
def test_array_errors(change, exc, match):
  scores, value, rng = _bad_inputs()
  scores, value = change(scores, value)
  with pytest.raises(exc, match=match):
    forward(scores, value, 0.1, rng, interpret=True)


def test_argument_errors():
  scores, value, rng = _bad_inputs()
  with pytest.raises(ValueError, match="dropout_rng"):
    forward(scores, value, 0.1, interpret=True)
  with pytest.raises(ValueError, match="dropout_rng"):
    jax.jit(lambda r: forward(scores, value, r, interpret=True))(jnp.float32(0.1))
  for rate in (1.0, -0.1, float("nan")):
    with pytest.raises(ValueError, match="dropout_rate"):
      forward(scores, value, rate, rng, interpret=True)
  with pytest.raises(TypeError, match="dropout_rate"):
    forward(scores, value, "0.1", rng, interpret=True)
  with pytest.raises(TypeError, match="store_dropped"):
    forward(scores, value, 0.1, rng, store_dropped=1, interpret=True)
  with pytest.raises(TypeError, match="store_keep"):
    forward(scores, value, 0.1, rng, store_keep=None, interpret=True)
  with pytest.raises(TypeError, match="store_probs"):
    forward(scores, value, 0.1, rng, store_probs=0, interpret=True)
  with pytest.raises(TypeError, match="store_f32"):
    forward(scores, value, 0.1, rng, store_f32="no", interpret=True)
  for key in (3, jnp.zeros(2), jax.random.split(rng, 2)):
    with pytest.raises(TypeError, match="dropout_rng: expected one PRNG key"):
      forward(scores, value, 0.1, key, interpret=True)
  for kwargs, field in ((dict(block_q=24), "block_q"), (dict(block_k=8), "block_k"),
                        (dict(num_warps=3), "num_warps"), (dict(num_stages=0), "num_stages")):
    with pytest.raises(ValueError, match=field):
      forward(scores, value, 0.1, rng, interpret=True, **kwargs)


@pytest.mark.skipif(ON_GPU, reason="off a GPU only")
def test_off_gpu_without_interpret_says_so():
  scores, value, rng = _bad_inputs()
  with pytest.raises(ValueError, match="interpret=True"):
    forward(scores, value, 0.1, rng)


@pytest.fixture
def pretend_gpu(pretend_h200, monkeypatch):
  """Lowering for a pretended H200 on any host (the "compiles only on a GPU" check off)."""
  from pallas_kernels.attention_softmax_dropout_value import forward as module
  monkeypatch.setattr(module._util, "check_can_compile", lambda *a, **k: None)


@pytest.mark.parametrize("dtype,d,rate", [
    (jnp.float32, 80, 0.0), (jnp.bfloat16, 64, None), (jnp.bfloat16, 128, 0.1)])
def test_lowers_to_triton(pretend_gpu, dtype, d, rate):
  """The kernel (hash, dot and the inline-PTX division included; the pair hash's join and
  reshape) lowers to Triton IR for a GPU, as one kernel (no GPU needed). ``rate=None``: a
  traced rate."""
  from conftest import triton_calls_in_gpu_lowering
  shapes = [jax.ShapeDtypeStruct((2, 8, 131, 131), dtype),
            jax.ShapeDtypeStruct((2, 2, 131, d), dtype)]
  rng = jax.random.key(0)
  fn = lambda s, v, r: forward(s, v, r, rng, store_dropped=True)
  assert triton_calls_in_gpu_lowering(fn, shapes, rate) == 1


def test_unnormalized_forward_with_masked_leading_keys():
  """Rows whose first key tiles are all ``-inf`` (masked scores): the running max starts at
  0 instead of ``-inf``, so no NaN; rows whose max jumps by less and by more than the
  slack in a later tile; P and O match the jnp forward."""
  from pallas_kernels.attention_softmax_dropout_value.forward import (
      attention_softmax_dropout_value_forward_unnormalized as unnormalized, probs_from_exp)
  scores, value, rng = _inputs(1, 2, 1, 16, 320, 64, jnp.bfloat16, seed=7)
  scores = (scores.at[0, 0, :4, :200].set(-jnp.inf).at[0, 1, 5, 100:].set(-jnp.inf)
            .at[0, 1, 6:, 130:].add(7.0).at[0, 1, 9:, 250:].add(20.0))   # the max jumps
  o, e, row_scale, o32 = unnormalized(scores, value, 0.0, block_q=16, block_k=64,
                                      interpret=INTERPRET)
  _, (ref_o, ref_p, _, ref_o32) = _reference(scores, value, rng, rate=0.0)
  np.testing.assert_allclose(np.asarray(probs_from_exp(e, row_scale)), _f32(ref_p),
                             rtol=1e-2, atol=1e-6)
  # O sums P rounded to bf16 elsewhere than the reference's P (E, not P): within 0.5% of
  # O's scale, and O in bf16 within about an ulp of that scale.
  np.testing.assert_allclose(_f32(o32), _f32(ref_o32), rtol=1e-2, atol=5e-3)
  np.testing.assert_allclose(_f32(o), _f32(ref_o), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("b,kvh,group,sq,sk,d,dtype,rate,blocks", [
    (2, 1, 4, 7, 131, 64, jnp.bfloat16, 0.1, (None, None)),   # the last key tile ragged
    (1, 2, 1, 19, 37, 80, jnp.float16, 0.2, (16, 64)),        # ragged rows and keys, D 80
    (1, 2, 2, 24, 300, 64, jnp.bfloat16, 0.1, (16, 128)),     # two 64-key scales a tile
    (1, 1, 2, 5, 33, 64, jnp.float32, 0.0, (None, None)),
])
def test_unnormalized_forward(b, kvh, group, sq, sk, d, dtype, rate, blocks):
  """``E * row_scale`` is the jnp forward's P to within P's rounding; O and the fp32 O match
  the jnp forward; O is the fp32 O rounded; E is fp16 (fp32 for fp32 scores); with nothing
  else asked for, the same O."""
  from pallas_kernels.attention_softmax_dropout_value.forward import (
      attention_softmax_dropout_value_forward_unnormalized as unnormalized, probs_from_exp)
  scores, value, rng = _inputs(b, kvh * group, kvh, sq, sk, d, dtype, seed=5)
  o, e, row_scale, o32 = unnormalized(scores, value, rate, rng if rate else None,
                                      block_q=blocks[0], block_k=blocks[1],
                                      interpret=INTERPRET)
  _, (ref_o, ref_p, _, ref_o32) = _reference(scores, value, rng, rate=rate)
  assert e.shape == scores.shape
  assert row_scale.shape == (b, kvh * group, -(-sk // 64), sq)
  assert e.dtype == (jnp.float32 if dtype == jnp.float32 else jnp.float16)
  assert row_scale.dtype == jnp.float32 and o32.dtype == jnp.float32 and o.dtype == dtype
  p = np.asarray(probs_from_exp(e, row_scale))
  np.testing.assert_allclose(p, _f32(ref_p), rtol=1e-2 if dtype != jnp.float32 else 1e-5,
                             atol=1e-6)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(_f32(o32), _f32(ref_o32), rtol=tol, atol=tol)
  np.testing.assert_allclose(_f32(o), _f32(ref_o), rtol=tol, atol=tol)
  np.testing.assert_array_equal(_f32(o), _f32(o32.astype(dtype)))
  bare = unnormalized(scores, value, rate, rng if rate else None, store_exp=False,
                      store_f32=False, block_q=blocks[0], block_k=blocks[1],
                      interpret=INTERPRET)
  assert bare[1] is None and bare[3] is None
  np.testing.assert_array_equal(_f32(bare[0]), _f32(o))
  with pytest.raises(TypeError, match="store_exp"):
    unnormalized(scores, value, rate, rng, store_exp=1, interpret=True)
  with pytest.raises(ValueError, match="block_k: at least 64"):
    unnormalized(scores, value, rate, rng, block_k=32, interpret=True)
