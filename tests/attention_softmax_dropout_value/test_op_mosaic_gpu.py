"""The op's base suite on the ``"mosaic_gpu"`` backend (the Mosaic GPU interpreter off a
Hopper GPU), on the aligned shapes it takes, and how the op picks it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, FakeBlackwell, FakeHopper, keys, pallas_call_outputs
import jax_ops
from jax_ops import registry
from jax_ops.backend import Problem

from .op_base import *  # noqa: F401,F403

GRAD_CASES = [  # (B, H, KVH, Sq, Skv, D, rate): G = 2 and 10, D = 64 and 128, one key block
    (1, 4, 2, 64, 256, 64, 0.1),
    (1, 10, 1, 64, 128, 128, 0.0),
]
TRACED_RATE_SHAPE = (1, 2, 1, 64, 128, 64)  # a traced rate runs the Triton kernels


@pytest.fixture
def implementation():
  return "mosaic_gpu"


def _problem(shape_s, shape_v, *, interpret=True, device=None, causal=False):
  return Problem(op="attention_softmax_dropout_value",
                 shapes=(("scores", shape_s), ("value_states", shape_v)), dtype="bfloat16",
                 causal=causal, device=device, interpret=interpret)


def test_not_picked_by_default_in_the_interpreter():
  """Under interpret=True, None and "pallas" keep the portable Triton kernels."""
  problem = _problem((1, 4, 64, 128), (1, 2, 128, 64))
  op = "attention_softmax_dropout_value"
  assert registry.resolve(op, None, problem).name == "triton"
  assert registry.resolve(op, "pallas", problem).name == "triton"
  assert registry.resolve(op, "mosaic_gpu", problem).name == "mosaic_gpu"


def test_picked_first_on_hopper_for_the_shapes_it_takes():
  op = "attention_softmax_dropout_value"
  on = lambda s, v, dev, **kw: registry.resolve(
      op, None, _problem(s, v, interpret=False, device=dev, **kw)).name
  assert on((2, 80, 256, 512), (2, 8, 512, 128), FakeHopper()) == "mosaic_gpu"
  assert on((2, 80, 256, 512), (2, 8, 512, 128), FakeBlackwell()) == "triton"
  assert on((2, 80, 211, 293), (2, 8, 293, 128), FakeHopper()) == "triton"   # ragged
  assert on((2, 80, 256, 512), (2, 8, 512, 40), FakeHopper()) == "triton"    # D = 40
  assert on((2, 80, 256, 256), (2, 8, 256, 128), FakeHopper(), causal=True) == "triton"


def test_forced_on_a_shape_it_does_not_take_says_why():
  scores = jnp.zeros((1, 2, 64, 131), jnp.bfloat16)
  value = jnp.zeros((1, 1, 131, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"mosaic_gpu.*seq_k 131"):
    jax_ops.attention_softmax_dropout_value(scores, value, implementation="mosaic_gpu",
                                            interpret=True)


def test_forced_off_hopper_says_why():
  if registry.get("attention_softmax_dropout_value", "mosaic_gpu").supported_on(
      jax.devices()[0]):
    pytest.skip("this GPU is a Hopper")
  scores = jnp.zeros((1, 2, 64, 128), jnp.bfloat16)
  value = jnp.zeros((1, 1, 128, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="does not compile"):
    jax_ops.attention_softmax_dropout_value(scores, value, implementation="mosaic_gpu")


def test_gradient_types_under_shard_map(monkeypatch):
  """Inside ``shard_map(check_vma=True)`` the kernels' outputs vary over the inputs' mesh
  axes, as the custom VJP needs (traced only: the types, not a run)."""
  from jax.sharding import PartitionSpec as P
  from jax_ops import backend
  from pallas_kernels import _mosaic, _util
  monkeypatch.setattr(backend, "is_hopper", lambda device: True)
  monkeypatch.setattr(_mosaic, "is_hopper", lambda device: True)
  # The fused (Triton) forward kernel: traced for a GPU on this host too.
  monkeypatch.setattr(_util, "check_can_compile", lambda *a, **k: None)
  mesh = jax.make_mesh((1,), ("b",))
  k = keys(3, 3)
  sharded = jax.sharding.NamedSharding(mesh, P("b"))
  scores = jax.ShapeDtypeStruct((2, 4, 64, 256), jnp.bfloat16, sharding=sharded)
  value = jax.ShapeDtypeStruct((2, 1, 256, 64), jnp.bfloat16, sharding=sharded)

  def loss(s, v):
    return jnp.sum(jax_ops.attention_softmax_dropout_value(
        s, v, dropout_rate=0.1, dropout_rng=k[2], implementation="mosaic_gpu").astype(
            jnp.float32))
  grad = jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh, in_specs=(P("b"), P("b")),
                       out_specs=(P("b"), P("b")), check_vma=True)
  g_s, g_v = jax.eval_shape(grad, scores, value)
  assert g_s.shape == scores.shape and g_v.shape == value.shape


@pytest.mark.parametrize("rate", [0.1, 0.0, "traced"])
def test_fused_output_policy_equals_the_xla_path(rate):
  """The Mosaic GPU backend on rows of 256 keys (policy "fused_output": the fused forward
  kernel writing no Pd and no mask; the backward from delta, drawing keep again from the
  key; a traced rate: the Triton kernel from delta) against the XLA path, to bf16 rounding
  (the kernel's P can be one ulp off the jnp softmax's)."""
  import jax_ops
  k = jax.random.split(jax.random.key(4), 4)
  scores = jax.random.normal(k[0], (1, 4, 64, 256), jnp.bfloat16)
  value = jax.random.normal(k[1], (1, 2, 256, 64), jnp.bfloat16)
  ct = jax.random.normal(k[3], (1, 64, 4, 64), jnp.bfloat16)
  p = 0.1 if rate == "traced" else rate

  def run(impl):
    def f(s, v, r):
      op = lambda s, v: jax_ops.attention_softmax_dropout_value(
          s, v, dropout_rate=r, dropout_rng=k[2], implementation=impl, interpret=INTERPRET)
      out, pullback = jax.vjp(op, s, v)
      return (out, *pullback(ct))
    if rate == "traced":
      return jax.jit(f)(scores, value, jnp.float32(p))
    return jax.jit(f, static_argnums=2)(scores, value, p)
  got, want = run("mosaic_gpu"), run("xla")
  for g, w, name in zip(got, want, ("out", "d_scores", "d_value")):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, atol=2e-2 * float(np.abs(w).max()), rtol=5e-2,
                               err_msg=name)


def test_fused_output_policy_saves_no_mask():
  """Under "fused_output" the Mosaic GPU backend's forward saves no bool mask and no Pd (one
  residual of the scores' shape: the unnormalized softmax E, fp16, with its scales per row and 64 keys), and
  of the mask only the key's seeds (``[4]`` uint32; the backward draws keep again)."""
  k = keys(6, 3)
  scores = jax.ShapeDtypeStruct((1, 4, 64, 256), jnp.bfloat16)
  value = jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.bfloat16)
  op = lambda s, v: jax_ops.attention_softmax_dropout_value(
      s, v, dropout_rate=0.1, dropout_rng=k[2], implementation="mosaic_gpu",
      interpret=INTERPRET)
  leaves = jax.tree.leaves(jax.eval_shape(lambda s, v: jax.vjp(op, s, v)[1], scores, value))
  assert not [r for r in leaves if r.dtype == jnp.bool_]
  assert [r.dtype for r in leaves if r.shape == scores.shape] == [jnp.float16]
  assert [r.dtype for r in leaves if r.shape == (1, 4, 256 // 64, 64)] == [jnp.float32]
  mask = [(r.shape, r.dtype) for r in leaves if r.dtype in (jnp.int32, jnp.uint32)]
  assert mask == [((4,), jnp.uint32)]


def test_fused_inputs_policy_saves_no_keep_mask():
  """Rows of 128 keys (policy ``"fused_inputs"``): P, Pd and V from the fused forward
  kernel, no keep mask saved; a traced rate saves the jnp forward's keep mask too (the
  Triton kernels it runs read it). Longer rows take ``"fused_output"``; problems past the
  kernel's int32 offsets ``"inputs"``."""
  from jax_ops.backend import FUSED_INPUTS, FUSED_OUTPUT, INPUTS
  k = keys(5, 3)
  scores = jax.random.normal(k[0], (1, 4, 64, 128), jnp.bfloat16)
  value = jax.random.normal(k[1], (1, 2, 128, 64), jnp.bfloat16)

  def full_residuals(rate):
    op = lambda s, v: jax_ops.attention_softmax_dropout_value(
        s, v, dropout_rate=rate, dropout_rng=k[2], implementation="mosaic_gpu",
        interpret=INTERPRET)
    _, pullback = jax.vjp(op, scores, value)
    return [r for r in jax.tree.leaves(pullback) if r.shape == scores.shape]

  assert [r.dtype for r in full_residuals(0.1)] == [jnp.bfloat16] * 2      # P, Pd
  # What the fused kernel writes: O, P and Pd under a gradient, O alone without one (the
  # same O).
  op = lambda s, v: jax_ops.attention_softmax_dropout_value(
      s, v, dropout_rate=0.1, dropout_rng=k[2], implementation="mosaic_gpu",
      interpret=INTERPRET)
  assert pallas_call_outputs(op, scores, value) == [1]
  assert pallas_call_outputs(lambda s, v: jax.vjp(op, s, v)[0], scores, value) == [3]
  np.testing.assert_array_equal(np.asarray(op(scores, value), np.float32),
                                np.asarray(jax.vjp(op, scores, value)[0], np.float32))
  traced = jax.jit(full_residuals)(jnp.float32(0.1))
  assert sorted(str(r.dtype) for r in traced) == ["bfloat16", "bfloat16", "bool"]
  backend = registry.get("attention_softmax_dropout_value", "mosaic_gpu")
  assert backend.residual_policy(_problem((2, 80, 256, 512), (2, 8, 512, 128))) == FUSED_OUTPUT
  assert backend.residual_policy(_problem((2, 80, 256, 128), (2, 8, 128, 128))) == FUSED_INPUTS
  huge = _problem((64, 64, 1024, 1024), (64, 8, 1024, 128))   # 2**32 scores
  assert backend.residual_policy(huge) == INPUTS


def test_default_policy_under_vmap_with_a_key_per_example():
  """The default policy saves the key's seeds: under ``vmap`` with a key per example they
  are batched with the rest, and each example's backward draws its own mask (the XLA
  path's gradients, to bf16 rounding)."""
  k = jax.random.split(jax.random.key(7), 4)
  n = 2
  scores = jax.random.normal(k[0], (n, 1, 2, 64, 256), jnp.bfloat16)
  value = jax.random.normal(k[1], (n, 1, 1, 256, 64), jnp.bfloat16)
  ct = jax.random.normal(k[3], (n, 1, 64, 2, 64), jnp.bfloat16)
  rngs = jax.random.split(k[2], n)

  def run(impl):
    def f(s, v, r, c):
      op = lambda s, v: jax_ops.attention_softmax_dropout_value(
          s, v, dropout_rate=0.1, dropout_rng=r, implementation=impl, interpret=INTERPRET)
      out, pullback = jax.vjp(op, s, v)
      return (out, *pullback(c))
    return jax.jit(jax.vmap(f))(scores, value, rngs, ct)
  for g, w, name in zip(run("mosaic_gpu"), run("xla"), ("out", "d_scores", "d_value")):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, atol=2e-2 * float(np.abs(w).max()), rtol=5e-2,
                               err_msg=name)
