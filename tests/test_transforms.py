"""The ops under JAX transformations: value_and_grad, checkpoint, shard_map."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, assert_close, keys
import jax_ops
from jax_ops import reference

HERE = os.path.dirname(os.path.abspath(__file__))


def _loss(q, k, v, mask, rng):
  ops = dict(implementation="pallas", interpret=INTERPRET)
  scores = jnp.einsum("bhqd,bhkd->bhqk", q, k)
  a = jax_ops.attention_softmax_dropout_value(scores.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                                              dropout_rate=0.1, dropout_rng=rng, **ops)
  b = jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=0.2, dropout_rng=rng, **ops)
  c = jax_ops.qk_scale_softmax(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), causal=True, **ops)
  return (jnp.sum(a.astype(jnp.float32) ** 2) + jnp.sum(b ** 2)
          + jnp.sum(c.astype(jnp.float32) ** 2))


def _inputs():
  k = keys(11, 5)
  q = jax.random.normal(k[0], (1, 4, 9, 16))
  kk = jax.random.normal(k[1], (1, 4, 9, 16))
  v = jax.random.normal(k[2], (1, 2, 9, 16))
  mask = jax.random.bernoulli(k[3], 0.8, (1, 1, 9, 9))
  return q, kk, v, mask, k[4]


def test_value_and_grad_and_checkpoint_agree():
  q, k, v, mask, rng = _inputs()
  plain = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1, 2)))(q, k, v, mask, rng)
  remat = jax.jit(jax.value_and_grad(jax.checkpoint(_loss), argnums=(0, 1, 2)))(q, k, v, mask, rng)
  grads_only = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))(q, k, v, mask, rng)
  assert_close(remat[0], plain[0], atol=1e-6, rtol=1e-6, name="loss")
  for a, b, c in zip(plain[1], remat[1], grads_only):
    assert_close(b, a, atol=1e-6, rtol=1e-6, name="checkpointed grad")
    assert_close(c, a, atol=1e-6, rtol=1e-6, name="grad")


def _second_order(op, implementation):
  """The gradient of a function of one op's gradient (a Hessian-vector product's shape)."""
  q, k, v, mask, rng = _inputs()
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
  kw = dict(implementation=implementation, interpret=INTERPRET)
  inner = {
      "attention_softmax_dropout_value": lambda s: jax_ops.attention_softmax_dropout_value(
          s, v, dropout_rate=0.1, dropout_rng=rng, **kw),
      "masked_softmax_dropout": lambda s: jax_ops.masked_softmax_dropout(
          s, mask, dropout_rate=0.2, dropout_rng=rng, **kw),
      "qk_scale_softmax": lambda q: jax_ops.qk_scale_softmax(q, k, scaling=0.25, **kw),
      "qk_scale_softmax_jnp": lambda q: reference.qk_scale_softmax_forward(q, k, 0.25),
  }[op]
  x = q if op.startswith("qk_scale_softmax") else s
  g = lambda x: jax.grad(lambda x: jnp.sum(inner(x) ** 3))(x)
  return jax.grad(lambda x: jnp.sum(g(x) ** 2))(x)


@pytest.mark.parametrize("op", ["attention_softmax_dropout_value", "masked_softmax_dropout",
                                "qk_scale_softmax"])
def test_second_order_gradients(op):
  """The XLA path's gradients are differentiable again; a Pallas backend's say they are not,
  by name, instead of failing inside Pallas."""
  xla = _second_order(op, "xla")
  assert bool(jnp.isfinite(xla).all())
  if op == "qk_scale_softmax":   # no dropout: jnp autodiff of the forward is the same function
    assert_close(xla, _second_order("qk_scale_softmax_jnp", None), atol=1e-5, rtol=1e-4,
                 name="second order")
  with pytest.raises(NotImplementedError, match="implementation='triton'.*second-order"):
    _second_order(op, "triton")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="forces 4 CPU devices")
def test_shard_map_training_step_matches_one_device():
  """A batch-sharded training step over a 4-device CPU mesh: runs the Pallas kernels
  per shard, all-gathers nothing, and matches the single-device gradients."""
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, os.path.join(HERE, "shard_map_check.py")], env=env,
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads(run.stdout.strip().splitlines()[-1])
  assert result["devices"] == 4
  assert result["all_gathers"] == []
  assert result["all_reduces"] >= 1  # the gradients' psum over the batch axis
  assert result["max_rel_diff"] < 1e-2  # bf16 paths: agreement at bf16 precision


def test_attention_from_delta_under_vmap_and_checkpoint(monkeypatch):
  """The op's backward from delta (its path on rows of >= 512 aligned keys; the threshold
  lowered here) under vmap of grad and under checkpoint: equal to a loop over the batch."""
  from pallas_kernels.attention_softmax_dropout_value import dispatch
  monkeypatch.setattr(dispatch, "FROM_OUTPUT_MIN_KEYS", 8)
  k = keys(12, 3)
  s = jax.random.normal(k[0], (2, 1, 4, 5, 16), jnp.bfloat16)
  v = jax.random.normal(k[1], (2, 1, 2, 16, 16), jnp.bfloat16)
  op = lambda s, v: jax_ops.attention_softmax_dropout_value(
      s, v, dropout_rate=0.1, dropout_rng=k[2], implementation="pallas", interpret=INTERPRET)
  loss = lambda s, v: jnp.sum(op(s, v).astype(jnp.float32) ** 2)
  grad = jax.grad(loss, argnums=(0, 1))
  assert "attention_dropout_value_bwd_ds_dv" in str(jax.make_jaxpr(grad)(s[0], v[0]))
  batched = jax.jit(jax.vmap(grad))(s, v)
  remat = jax.jit(jax.vmap(jax.grad(jax.checkpoint(loss), argnums=(0, 1))))(s, v)
  for i in range(2):
    one = jax.jit(grad)(s[i], v[i])
    for a, b, c in zip(batched, remat, one):
      assert_close(a[i], c, atol=1e-6, rtol=1e-6, name="vmap(grad)")
      assert_close(b[i], c, atol=1e-6, rtol=1e-6, name="vmap(grad(checkpoint))")
