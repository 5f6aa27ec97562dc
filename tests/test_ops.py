"""The differentiable ops' API across the three ops: the errors bad input gets, dropout
keys, vmap of gradients. (Each op's numbers, for every backend: tests/<op>/op_base.py.)"""

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, assert_close, keys
import jax_ops

F32 = jnp.float32


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
      d_o, probs, probs, value, keep, p, block_q=16, block_k=16, interpret=INTERPRET))(bad)
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
  # XLA fusions of the bf16 forward and the kernels' launches (the dV split of
  # attention_softmax_dropout_value depends on it), hence roundings and the order of fp32
  # sums; the softmax backward's cancellation (P * (dW - delta)) magnifies them. bf16: the
  # workloads' rtol (0.05).
  rtol = 5e-2 if xs[0].dtype == jnp.bfloat16 else 1e-6
  for i in range(2):
    single = jax.jit(grad)(*(x[i] for x in xs))
    for got, want in zip(batched, single):
      assert_close(got[i], want, atol=1e-6, rtol=rtol)


def test_dropout_needs_a_key():
  """A rate that may be > 0 without a key raises (as flax.nnx.Dropout does) instead of
  silently applying no dropout; a rate of 0 needs none."""
  k = keys(3, 2)
  scores = jax.random.normal(k[0], (1, 2, 5, 5))
  mask = jnp.ones((1, 1, 5, 5), bool)
  with pytest.raises(ValueError, match=r"dropout_rng: dropout_rate=0.5 needs a PRNG key"):
    jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=0.5, dropout_rng=None)
  with pytest.raises(ValueError, match=r"dropout_rng: a traced dropout_rate needs a PRNG key"):
    jax.jit(lambda p: jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=p))(0.1)
  with pytest.raises(ValueError, match=r"dropout_rng: dropout_rate=0.1 needs a PRNG key"):
    jax_ops.attention_softmax_dropout_value(_bf16(1, 2, 2, 3), _bf16(1, 1, 3, 8),
                                            dropout_rate=0.1)
  a = jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=0.0, dropout_rng=None)
  b = jax_ops.masked_softmax_dropout(scores, mask)
  assert bool(jnp.all(a == b))
  assert_close(jnp.sum(a, -1), jnp.ones((1, 2, 5)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad", [0.0, -0.1])
def test_scaling_must_be_positive(bad):
  with pytest.raises(ValueError, match=r"scaling: expected a finite number > 0, got"):
    jax_ops.qk_scale_softmax(_bf16(1, 2, 3, 8), _bf16(1, 2, 3, 8), scaling=bad)


def test_masked_softmax_dropout_blames_the_argument_that_disagrees():
  import pallas_kernels
  g, mask, keep = jnp.ones((2, 1, 4, 5)), jnp.ones((2, 1, 4, 5), bool), jnp.ones((2, 1, 4, 5), bool)
  with pytest.raises(ValueError, match=r"p_attn: expected \[B, H, Sq, Sk\] = \[2, 1, 4, 5\], got \[2, 1, 4, 6\]"):
    pallas_kernels.masked_softmax_dropout_backward(g, jnp.ones((2, 1, 4, 6)), mask, keep, 0.1,
                                                   interpret=True)
  with pytest.raises(ValueError, match=r"grad_output: expected \[B, H, Sq, Sk\] = \[2, 1, 4, 5\], got \[2, 1, 4, 6\]"):
    pallas_kernels.masked_softmax_dropout_backward(jnp.ones((2, 1, 4, 6)), g, mask, keep, 0.1,
                                                   interpret=True)
  with pytest.raises(ValueError, match=r"p_attn: expected"):
    jax_ops.masked_softmax_dropout_backward_reference(g, jnp.ones((2, 1, 3, 5)), mask, keep, 0.1)


def test_reference_forwards_check_their_inputs():
  """The plain-jnp forwards name the bad argument, as the ops do."""
  from jax_ops import reference as R
  bf = jnp.bfloat16
  with pytest.raises(ValueError, match="KVH"):
    R.attention_softmax_dropout_value_forward(jnp.zeros((1, 3, 4, 4), bf),
                                              jnp.zeros((1, 2, 4, 8), bf), None, 0.0)
  with pytest.raises(ValueError, match="value_states"):
    R.attention_softmax_dropout_value_forward(jnp.zeros((1, 2, 4, 4), bf),
                                              jnp.zeros((1, 1, 5, 8), bf), None, 0.0)
  with pytest.raises(ValueError, match="keep"):
    R.attention_softmax_dropout_value_forward(jnp.zeros((1, 2, 4, 4), bf),
                                              jnp.zeros((1, 1, 4, 8), bf),
                                              jnp.ones((1, 2, 4, 5), bool), 0.1)
  with pytest.raises(ValueError, match="rate"):
    R.attention_softmax_dropout_value_forward(jnp.zeros((1, 2, 4, 4), bf),
                                              jnp.zeros((1, 1, 4, 8), bf),
                                              jnp.ones((1, 2, 4, 4), bool), 1.0)
  with pytest.raises(ValueError, match="mask"):
    R.masked_softmax_dropout_forward(jnp.zeros((1, 2, 4, 4)), jnp.zeros((1, 1, 4, 3), bool),
                                     None, 0.0)
  with pytest.raises((ValueError, TypeError), match="mask"):
    R.masked_softmax_dropout_forward(jnp.zeros((1, 1, 2, 2)), jnp.ones((1, 1, 2, 2)), None, 0.0)
  with pytest.raises((ValueError, TypeError), match="scaling"):
    R.qk_scale_softmax_forward(jnp.zeros((1, 2, 5, 8)), jnp.zeros((1, 2, 5, 8)), None, False)
  with pytest.raises(ValueError, match="causal: needs Sq <= Sk"):
    R.qk_scale_softmax_forward(jnp.ones((1, 1, 5, 8)), jnp.ones((1, 1, 3, 8)), 0.5, True)
  with pytest.raises(ValueError, match="key"):
    R.qk_scale_softmax_forward(jnp.ones((1, 1, 5, 8)), jnp.ones((1, 2, 3, 8)), 0.5)
