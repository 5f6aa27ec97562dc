"""The differentiable ops: gradients against jax.vjp of the plain-jnp forward,
every implementation, and the errors bad input gets."""

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, assert_close, keys
import jax_ops
from jax_ops import reference, registry

F32 = jnp.float32


def _vjp(forward, primals, cotangent):
  out, pullback = jax.vjp(forward, *primals)
  return out, pullback(cotangent)


def _impls(op):
  return [name for name in registry.available(op)]


@pytest.mark.parametrize("implementation", _impls("masked_softmax_dropout"))
@pytest.mark.parametrize("b,h,sq,sk,rate", [(2, 3, 7, 7, 0.1), (1, 2, 13, 5, 0.0)])
def test_masked_softmax_dropout_grad(implementation, b, h, sq, sk, rate):
  k = keys(0, 4)
  scores = jax.random.normal(k[0], (b, h, sq, sk), F32)
  mask = jax.random.bernoulli(k[1], 0.7, (b, 1, sq, sk))
  ct = jax.random.normal(k[3], (b, h, sq, sk), F32)
  op = lambda s: jax_ops.masked_softmax_dropout(
      s, mask, dropout_rate=rate, dropout_rng=k[2], implementation=implementation,
      interpret=INTERPRET)
  keep = reference.dropout_keep_mask(k[2], rate, scores.shape) if rate else None
  plain = lambda s: reference.masked_softmax_dropout_forward(s, mask, keep, rate)[0]
  out, (grad,) = _vjp(jax.jit(op), (scores,), ct)
  ref_out, (ref_grad,) = _vjp(plain, (scores,), ct)
  assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
  assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", _impls("attention_softmax_dropout_value"))
@pytest.mark.parametrize("b,h,kvh,sq,skv,d,rate", [
    (2, 4, 2, 7, 9, 16, 0.1),
    (1, 10, 1, 5, 33, 64, 0.0),
    (1, 3, 3, 17, 4, 40, 0.2),
])
def test_attention_softmax_dropout_value_grad(implementation, b, h, kvh, sq, skv, d, rate):
  k = keys(1, 4)
  scores = jax.random.normal(k[0], (b, h, sq, skv), jnp.bfloat16)
  value = jax.random.normal(k[1], (b, kvh, skv, d), jnp.bfloat16)
  ct = jax.random.normal(k[3], (b, sq, h, d), jnp.bfloat16)
  op = lambda s, v: jax_ops.attention_softmax_dropout_value(
      s, v, dropout_rate=rate, dropout_rng=k[2], implementation=implementation,
      interpret=INTERPRET)
  keep = reference.dropout_keep_mask(k[2], rate, scores.shape) if rate else None
  # The plain forward in fp32: autodiff of it is the exact gradient.
  plain = lambda s, v: reference.attention_softmax_dropout_value_forward(
      s.astype(F32), v.astype(F32), keep, rate)[0]
  out, (g_s, g_v) = _vjp(jax.jit(op), (scores, value), ct)
  ref_out, (r_s, r_v) = _vjp(plain, (scores, value), ct.astype(F32))
  assert out.shape == (b, sq, h, d) and out.dtype == jnp.bfloat16
  assert g_s.dtype == jnp.bfloat16 and g_v.dtype == jnp.bfloat16
  assert_close(out, ref_out, atol=1e-2, rtol=2e-2, name="output")
  # bf16 forward residuals against an fp32 forward: compare at bf16 resolution.
  assert_close(g_s, r_s, atol=2e-3 * float(jnp.abs(r_s).max()), rtol=5e-2, name="d_scores")
  assert_close(g_v, r_v, atol=1e-2 * float(jnp.abs(r_v).max()), rtol=5e-2, name="d_value")


@pytest.mark.parametrize("b,h,kvh,sq,skv,d,rate", [
    (2, 4, 2, 7, 16, 16, 0.1),
    (1, 10, 1, 5, 40, 64, 0.0),
    (1, 4, 2, 9, 80, 40, "traced"),
    (1, 4, 1, 6, 136, 16, 0.1),
])
def test_attention_softmax_dropout_value_grad_from_delta(monkeypatch, b, h, kvh, sq, skv, d,
                                                         rate):
  """The Pallas backward that takes delta from the saved output (the op's path on rows of
  >= 512 aligned keys; the threshold lowered here so small rows take it), against
  autodiff of the fp32 forward; 64-key tiles: rows of 80 and 136 keys read the delta made
  from the saved output, shorter ones compute it in the tile."""
  from jax_ops import ops
  monkeypatch.setattr(ops, "_FROM_DELTA_MIN_KEYS", 8)
  k = keys(7, 4)
  p = 0.15 if rate == "traced" else rate
  scores = jax.random.normal(k[0], (b, h, sq, skv), jnp.bfloat16)
  value = jax.random.normal(k[1], (b, kvh, skv, d), jnp.bfloat16)
  ct = jax.random.normal(k[3], (b, sq, h, d), jnp.bfloat16)
  op = lambda s, v, r: jax_ops.attention_softmax_dropout_value(
      s, v, dropout_rate=r, dropout_rng=k[2], implementation="pallas", interpret=INTERPRET)
  if rate == "traced":
    backward = lambda s, v, r: jax.vjp(lambda s, v: op(s, v, r), s, v)[1](ct)
    args = (scores, value, jnp.float32(p))
  else:
    backward = lambda s, v: jax.vjp(lambda s, v: op(s, v, p), s, v)[1](ct)
    args = (scores, value)
  assert "attention_dropout_value_bwd_ds_dv" in str(jax.make_jaxpr(backward)(*args))
  g_s, g_v = jax.jit(backward)(*args)
  keep = reference.dropout_keep_mask(k[2], p, scores.shape) if p else None
  plain = lambda s, v: reference.attention_softmax_dropout_value_forward(
      s.astype(F32), v.astype(F32), keep, p)[0]
  _, (r_s, r_v) = _vjp(plain, (scores, value), ct.astype(F32))
  assert_close(g_s, r_s, atol=2e-3 * float(jnp.abs(r_s).max()), rtol=5e-2, name="d_scores")
  assert_close(g_v, r_v, atol=1e-2 * float(jnp.abs(r_v).max()), rtol=5e-2, name="d_value")


def test_attention_softmax_dropout_value_backward_choice():
  """Short or unaligned rows keep the two-kernel backward (from Pd); rows of >= 512 keys
  that are a multiple of 8 take the one from delta."""
  k = keys(8, 2)
  def kernels(skv):
    s = jnp.zeros((1, 2, 3, skv), jnp.bfloat16)
    v = jnp.zeros((1, 1, skv, 16), jnp.bfloat16)
    op = lambda s, v: jax_ops.attention_softmax_dropout_value(
        s, v, dropout_rate=0.1, dropout_rng=k[0], implementation="pallas", interpret=INTERPRET)
    ct = jnp.zeros((1, 3, 2, 16), jnp.bfloat16)
    return str(jax.make_jaxpr(lambda s, v: jax.vjp(op, s, v)[1](ct))(s, v))
  for skv, from_delta in ((256, False), (515, False), (512, True)):
    jaxpr = kernels(skv)
    assert ("attention_dropout_value_bwd_ds_dv" in jaxpr) == from_delta, skv
    assert ("attention_dropout_value_bwd_dv" in jaxpr) != from_delta, skv


@pytest.mark.parametrize("implementation", _impls("qk_scale_softmax"))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,h,sq,sk,d", [(2, 3, 7, 7, 16), (1, 2, 5, 33, 64), (1, 1, 17, 17, 40)])
def test_qk_scale_softmax_grad(implementation, causal, b, h, sq, sk, d):
  k = keys(2, 3)
  query = jax.random.normal(k[0], (b, h, sq, d), jnp.bfloat16)
  key = jax.random.normal(k[1], (b, h, sk, d), jnp.bfloat16)
  ct = jax.random.normal(k[2], (b, h, sq, sk), jnp.bfloat16)
  op = lambda q, kk: jax_ops.qk_scale_softmax(q, kk, causal=causal, implementation=implementation,
                                              interpret=INTERPRET)
  plain = lambda q, kk: reference.qk_scale_softmax_forward(
      q.astype(F32), kk.astype(F32), d ** -0.5, causal)
  out, (g_q, g_k) = _vjp(jax.jit(op), (query, key), ct)
  ref_out, (r_q, r_k) = _vjp(plain, (query, key), ct.astype(F32))
  assert_close(out, ref_out, atol=1e-2, rtol=2e-2, name="probs")
  if causal:
    assert bool(jnp.all(jnp.where(reference.causal_mask(sq, sk), 0, out) == 0))
  assert_close(g_q, r_q, atol=1e-2 * float(jnp.abs(r_q).max()), rtol=5e-2, name="d_query")
  assert_close(g_k, r_k, atol=1e-2 * float(jnp.abs(r_k).max()), rtol=5e-2, name="d_key")


def test_no_rng_means_no_dropout():
  k = keys(3, 2)
  scores = jax.random.normal(k[0], (1, 2, 5, 5))
  mask = jnp.ones((1, 1, 5, 5), bool)
  a = jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=0.5, dropout_rng=None)
  b = jax_ops.masked_softmax_dropout(scores, mask)
  assert bool(jnp.all(a == b))
  assert_close(jnp.sum(a, -1), jnp.ones((1, 2, 5)), atol=1e-6, rtol=0)


def test_traced_dropout_rate_under_jit():
  k = keys(4, 3)
  scores = jax.random.normal(k[0], (1, 2, 6, 6))
  mask = jax.random.bernoulli(k[1], 0.7, (1, 1, 6, 6))
  grad_at = lambda rate: jax.grad(lambda s: jnp.sum(jax_ops.masked_softmax_dropout(
      s, mask, dropout_rate=rate, dropout_rng=k[2], implementation="pallas",
      interpret=INTERPRET) ** 2))(scores)
  for rate in (0.0, 0.25):
    keep = reference.dropout_keep_mask(k[2], rate, scores.shape) if rate else None
    want = jax.grad(lambda s: jnp.sum(
        reference.masked_softmax_dropout_forward(s, mask, keep, rate)[0] ** 2))(scores)
    assert_close(jax.jit(grad_at)(jnp.float32(rate)), want, atol=1e-5, rtol=1e-5)


# --- bad input ------------------------------------------------------------------------------

def _bf16(*shape):
  return jnp.ones(shape, jnp.bfloat16)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_rate_out_of_range(rate):
  with pytest.raises(ValueError, match="dropout_rate"):
    jax_ops.masked_softmax_dropout(jnp.ones((1, 1, 2, 2)), jnp.ones((1, 1, 2, 2), bool),
                                   dropout_rate=rate, dropout_rng=jax.random.key(0))
  with pytest.raises(ValueError, match="p_dropout"):
    jax_ops.masked_softmax_dropout_backward_reference(
        jnp.ones((1, 1, 2, 2)), jnp.ones((1, 1, 2, 2)), jnp.ones((1, 1, 2, 2), bool),
        jnp.ones((1, 1, 2, 2), bool), rate)
  with pytest.raises(ValueError, match="attention_dropout"):
    jax_ops.attention_softmax_dropout_value_backward_reference(
        _bf16(1, 2, 1, 4), _bf16(1, 1, 2, 3), _bf16(1, 1, 2, 3), _bf16(1, 1, 3, 4),
        jnp.ones((1, 1, 2, 3), bool), rate)


# 1.0 is the boundary of the valid range; values above it take the same check.
@pytest.mark.parametrize("bad", [-0.5, 1.0, float("nan")])
def test_traced_dropout_rate_out_of_range_gives_nan(bad):
  """A traced rate's value is unknown at trace time and cannot raise when the computation
  runs: an invalid one makes the op's output and gradient NaN (jit, grad, vmap with one bad
  rate in the batch), never mis-scaled values; a valid traced rate works under
  jax.checkpoint as well."""
  k = keys(5, 2)
  scores = jax.random.normal(k[0], (1, 2, 4, 5))
  mask = jnp.ones((1, 1, 4, 5), bool)
  op = lambda s, p: jax_ops.masked_softmax_dropout(s, mask, dropout_rate=p, dropout_rng=k[1],
                                                   interpret=INTERPRET)
  loss = lambda s, p: op(s, p).sum()
  assert bool(jnp.all(jnp.isnan(jax.jit(op)(scores, bad))))
  assert bool(jnp.all(jnp.isnan(jax.jit(jax.grad(loss))(scores, bad))))
  both = jax.vmap(op, (None, 0))(scores, jnp.array([0.1, bad]))
  assert bool(jnp.all(jnp.isfinite(both[0]))) and bool(jnp.all(jnp.isnan(both[1])))
  ok = jax.jit(jax.grad(jax.checkpoint(loss)))(scores, 0.25)
  want = jax.grad(loss)(scores, 0.25)
  assert_close(ok, want, atol=1e-6, rtol=1e-6)
  value = jax.random.normal(k[0], (1, 1, 5, 8), jnp.bfloat16)
  out = jax.jit(lambda p: jax_ops.attention_softmax_dropout_value(
      scores.astype(jnp.bfloat16), value, dropout_rate=p, dropout_rng=k[1]))(bad)
  assert bool(jnp.all(jnp.isnan(out.astype(F32))))


@pytest.mark.parametrize("bad", [-0.5, 1.0])
def test_kernels_turn_invalid_traced_rates_into_nan(bad):
  """The kernels (arrays in, arrays out) cannot raise on a traced rate's value; an invalid
  one gives NaN gradients instead of silently mis-scaled ones."""
  import pallas_kernels
  k = keys(6, 4)
  g = jax.random.normal(k[0], (1, 2, 4, 5))
  probs = jax.nn.softmax(jax.random.normal(k[1], (1, 2, 4, 5)), -1)
  keep = jax.random.bernoulli(k[2], 0.7, (1, 2, 4, 5))
  out = jax.jit(lambda p: pallas_kernels.masked_softmax_dropout_backward(
      g, probs, jnp.ones((1, 1, 4, 5), bool), keep, p, interpret=INTERPRET))(bad)
  assert bool(jnp.all(jnp.isnan(out)))
  d_o = jax.random.normal(k[3], (1, 4, 2, 8), jnp.bfloat16)
  pb = probs.astype(jnp.bfloat16)
  value = jax.random.normal(k[0], (1, 1, 5, 8), jnp.bfloat16)
  d_s, _ = jax.jit(lambda p: pallas_kernels.attention_softmax_dropout_value_backward(
      d_o, pb, pb, value, keep, p, interpret=INTERPRET))(bad)
  assert bool(jnp.all(jnp.isnan(d_s.astype(F32))))
  # Rows of 40 keys: the two-kernel backward sums delta partials of 16-key tiles, and the
  # one from delta reads the delta it is given; dropped elements are NaN too.
  probs = jax.nn.softmax(jax.random.normal(k[1], (1, 2, 4, 40)), -1).astype(jnp.bfloat16)
  keep = jax.random.bernoulli(k[2], 0.7, (1, 2, 4, 40))
  value = jax.random.normal(k[0], (1, 1, 40, 8), jnp.bfloat16)
  d_s, _ = jax.jit(lambda p: pallas_kernels.attention_softmax_dropout_value_backward(
      d_o, probs, probs, value, keep, p, block_q=16, block_kv=16, interpret=INTERPRET))(bad)
  assert bool(jnp.all(jnp.isnan(d_s.astype(F32))))
  from pallas_kernels.attention_softmax_dropout_value import PassConfig
  outs = jax.jit(lambda p: pallas_kernels.attention_softmax_dropout_value_backward_from_delta(
      d_o, probs, value, keep, p, jnp.ones((1, 2, 4), F32), config=PassConfig(16, 16, 4, 2),
      interpret=INTERPRET))(bad)
  assert all(bool(jnp.all(jnp.isnan(x.astype(F32)))) for x in outs)


def test_argument_type_errors_name_the_argument():
  import pallas_kernels
  scores, mask = jnp.ones((1, 1, 2, 2)), jnp.ones((1, 1, 2, 2), bool)
  with pytest.raises(TypeError, match="dropout_rng: expected one PRNG key"):
    jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=0.1, dropout_rng=3)
  with pytest.raises(TypeError, match="dropout_rng: expected one PRNG key"):
    jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=0.1,
                                   dropout_rng=jnp.zeros((3,), jnp.uint32))
  with pytest.raises(TypeError, match="dropout_rate: expected a real number"):
    jax_ops.masked_softmax_dropout(scores, mask, dropout_rate="0.1",
                                   dropout_rng=jax.random.key(0))
  q, k = _bf16(1, 2, 3, 8), _bf16(1, 2, 4, 8)
  with pytest.raises(TypeError, match="scaling: expected a real number"):
    jax_ops.qk_scale_softmax(q, k, scaling="a")
  for bad in (float("nan"), float("inf")):
    with pytest.raises(ValueError, match="scaling: expected a finite number"):
      jax_ops.qk_scale_softmax(q, k, scaling=bad)
  with pytest.raises(TypeError, match="causal: expected a Python bool"):
    jax.jit(lambda c: jax_ops.qk_scale_softmax(q, k, causal=c))(True)
  w = _bf16(1, 2, 3, 4)
  with pytest.raises(TypeError, match="scaling: expected a real number"):
    pallas_kernels.qk_scale_softmax_backward(w, q, k, w, None, interpret=True)
  with pytest.raises(TypeError, match="causal: expected a Python bool"):
    jax.jit(lambda c: pallas_kernels.qk_scale_softmax_backward(w, q, k, w, 0.3, causal=c,
                                                               interpret=True))(True)
  # Still accepted: bool-like rates (``training and 0.1``), 0-d concrete causal flags.
  jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=False, dropout_rng=jax.random.key(0))
  jax_ops.qk_scale_softmax(q, k, causal=jnp.array(True))
  with pytest.raises(ValueError, match="num_stages must be >= 1"):
    pallas_kernels.masked_softmax_dropout_backward(
        scores, scores, mask, mask, 0.1, num_stages=0, interpret=True)


def test_shape_errors_name_argument_and_expected_shape():
  with pytest.raises(ValueError, match=r"value_states: expected \[B, KVH, Skv, D\] = \[1, \*, 3, \*\], got \[1, 1, 4, 8\]"):
    jax_ops.attention_softmax_dropout_value(_bf16(1, 2, 2, 3), _bf16(1, 1, 4, 8))
  with pytest.raises(ValueError, match=r"grad_attn_output: expected \[B, Sq, H, D\] = \[1, 2, 2, 8\]"):
    jax_ops.attention_softmax_dropout_value_backward_reference(
        _bf16(1, 2, 1, 8), _bf16(1, 2, 2, 3), _bf16(1, 2, 2, 3), _bf16(1, 1, 3, 8),
        jnp.ones((1, 2, 2, 3), bool), 0.1)
  with pytest.raises(ValueError, match=r"mask: expected \[B, 1, Sq, Sk\] = \[1, 1, 2, 2\]"):
    jax_ops.masked_softmax_dropout(jnp.ones((1, 3, 2, 2)), jnp.ones((1, 3, 2, 2), bool))
  with pytest.raises(ValueError, match=r"key: expected \[B, H, Sk, D\] = \[1, 2, \*, 8\]"):
    jax_ops.qk_scale_softmax(_bf16(1, 2, 3, 8), _bf16(1, 2, 3, 4))


def test_rank_dtype_and_head_errors():
  with pytest.raises(ValueError, match=r"scores: expected rank 4"):
    jax_ops.masked_softmax_dropout(jnp.ones((2, 2, 2)), jnp.ones((2, 1, 2, 2), bool))
  with pytest.raises(TypeError, match=r"mask: expected dtype bool, got float32"):
    jax_ops.masked_softmax_dropout(jnp.ones((1, 1, 2, 2)), jnp.ones((1, 1, 2, 2)))
  with pytest.raises(TypeError, match=r"key: expected dtype bfloat16, got float32"):
    jax_ops.qk_scale_softmax(_bf16(1, 2, 3, 8), jnp.ones((1, 2, 3, 8)))
  with pytest.raises(TypeError, match=r"scores: expected dtype"):
    jax_ops.masked_softmax_dropout(jnp.ones((1, 1, 2, 2), jnp.int32), jnp.ones((1, 1, 2, 2), bool))
  with pytest.raises(ValueError, match=r"KVH=3 must divide the query heads H=4"):
    jax_ops.attention_softmax_dropout_value(_bf16(1, 4, 2, 3), _bf16(1, 3, 3, 8))
  with pytest.raises(ValueError, match=r"must be >= 1"):
    jax_ops.qk_scale_softmax(_bf16(1, 2, 0, 8), _bf16(1, 2, 3, 8))
  with pytest.raises(ValueError, match=r"causal: needs Sq <= Sk"):
    jax_ops.qk_scale_softmax(_bf16(1, 2, 5, 8), _bf16(1, 2, 3, 8), causal=True)
  with pytest.raises(ValueError, match=r"implementation: expected one of"):
    jax_ops.masked_softmax_dropout(jnp.ones((1, 1, 2, 2)), jnp.ones((1, 1, 2, 2), bool),
                                   implementation="cuda")


def test_kernel_validates_its_arguments():
  import pallas_kernels
  with pytest.raises(ValueError, match=r"dropout_mask: expected \[B, H, Sq, Sk\] = \[1, 2, 3, 3\]"):
    pallas_kernels.masked_softmax_dropout_backward(
        jnp.ones((1, 2, 3, 3)), jnp.ones((1, 2, 3, 3)), jnp.ones((1, 1, 3, 3), bool),
        jnp.ones((1, 1, 3, 3), bool), 0.1, interpret=True)
  from pallas_kernels.masked_softmax_dropout import Config
  with pytest.raises(ValueError, match="block_rows"):
    pallas_kernels.masked_softmax_dropout_backward(
        jnp.ones((1, 2, 3, 3)), jnp.ones((1, 2, 3, 3)), jnp.ones((1, 1, 3, 3), bool),
        None, 0.0, config=Config(3, 4), interpret=True)


def test_registry_defaults():
  # None means XLA off a GPU and the measured-default kernel on one; with interpret=True
  # the measured-default kernel runs anywhere.
  on_gpu = jax.default_backend() == "gpu"
  assert registry.resolve("masked_softmax_dropout", None, False)[0] == (
      "pallas" if on_gpu else "xla")
  assert registry.resolve("masked_softmax_dropout", None, True)[0] == "pallas"
  assert registry.resolve("attention_softmax_dropout_value", None, True)[0] == "pallas"
  assert registry.resolve("qk_scale_softmax", None, True)[0] == "pallas"
  assert registry.resolve("qk_scale_softmax", None, False)[0] == ("pallas" if on_gpu else "xla")
  assert registry.resolve("qk_scale_softmax", "xla", True)[0] == "xla"
  if on_gpu:
    assert registry.resolve("qk_scale_softmax", "pallas", False)[0] == "pallas"
  else:  # a forced Pallas kernel off a GPU needs the interpreter: said at once, not in grad
    with pytest.raises(ValueError, match="implementation='pallas'.*interpret=True"):
      registry.resolve("qk_scale_softmax", "pallas", False)
  assert set(registry.available("attention_softmax_dropout_value")) == {"xla", "pallas"}


@pytest.mark.parametrize("op_name", ["attention_softmax_dropout_value", "masked_softmax_dropout",
                                     "qk_scale_softmax"])
def test_vmap_of_grad_over_extra_axis(op_name):
  """vmap over a leading axis of the op's gradient equals a loop over it."""
  k = keys(5, 4)
  if op_name == "attention_softmax_dropout_value":
    xs = (jax.random.normal(k[0], (2, 1, 4, 5, 7), jnp.bfloat16),
          jax.random.normal(k[1], (2, 1, 2, 7, 16), jnp.bfloat16))
    fn = lambda s, v: jax_ops.attention_softmax_dropout_value(
        s, v, dropout_rate=0.1, dropout_rng=k[2], implementation="pallas", interpret=INTERPRET)
  elif op_name == "masked_softmax_dropout":
    mask = jax.random.bernoulli(k[3], 0.7, (1, 1, 5, 5))
    xs = (jax.random.normal(k[0], (2, 1, 3, 5, 5), F32),)
    fn = lambda s: jax_ops.masked_softmax_dropout(
        s, mask, dropout_rate=0.1, dropout_rng=k[2], implementation="pallas", interpret=INTERPRET)
  else:
    xs = (jax.random.normal(k[0], (2, 1, 2, 5, 16), jnp.bfloat16),
          jax.random.normal(k[1], (2, 1, 2, 6, 16), jnp.bfloat16))
    fn = lambda q, kk: jax_ops.qk_scale_softmax(q, kk, causal=True, implementation="pallas",
                                                interpret=INTERPRET)
  loss = lambda *a: jnp.sum(fn(*a).astype(F32) ** 2)
  argnums = tuple(range(len(xs)))
  grad = jax.grad(loss, argnums=argnums)
  batched = jax.jit(jax.vmap(grad))(*xs)
  # bf16 results may differ by a few roundings (2^-8 relative each): batching changes the
  # XLA fusions of the bf16 forward and the kernels' launches (kernel A's dV split depends
  # on it), hence roundings and the order of fp32 sums; the softmax backward's cancellation
  # (P * (dW - delta)) magnifies them. bf16: the workloads' rtol (0.05).
  rtol = 5e-2 if xs[0].dtype == jnp.bfloat16 else 1e-6
  for i in range(2):
    single = jax.jit(grad)(*(x[i] for x in xs))
    for got, want in zip(batched, single):
      assert_close(got[i], want, atol=1e-6, rtol=rtol)
