"""The backend registry: names, defaults per device, forced names, backends added by a user."""

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, assert_close, keys
import jax_ops
from jax_ops import backend, registry

OPS = ("attention_softmax_dropout_value", "masked_softmax_dropout", "qk_scale_softmax")


def _problem(op, interpret, device=None):
  return backend.Problem(op=op, shapes=(), dtype="bfloat16", device=device or jax.devices()[0],
                         interpret=interpret)


@pytest.mark.parametrize("op", OPS)
def test_available_lists_xla_and_triton(op):
  assert {"xla", "triton"} <= set(registry.available(op))
  assert registry.get(op, "triton").pallas and not registry.get(op, "xla").pallas


@pytest.mark.parametrize("op", OPS)
def test_defaults(op):
  """None: the Triton kernel on a GPU (or anywhere with interpret=True), XLA elsewhere, never
  an error because of the device; "pallas": the best Pallas backend."""
  on_gpu = jax.default_backend() == "gpu"
  assert registry.resolve(op, None, _problem(op, False)).name == ("triton" if on_gpu else "xla")
  assert registry.resolve(op, None, _problem(op, True)).name == "triton"
  assert registry.resolve(op, "pallas", _problem(op, True)).name == "triton"
  assert registry.resolve(op, "xla", _problem(op, True)).name == "xla"
  if on_gpu:
    assert registry.resolve(op, "pallas", _problem(op, False)).name == "triton"
  else:  # a forced Pallas kernel off a GPU needs the interpreter: said at once, not in grad
    with pytest.raises(ValueError, match="implementation='pallas'.*interpret=True"):
      registry.resolve(op, "pallas", _problem(op, False))
    with pytest.raises(ValueError, match="implementation='triton'.*interpret=True"):
      registry.resolve(op, "triton", _problem(op, False))


def test_unknown_names():
  with pytest.raises(ValueError, match=r"implementation: expected one of \['triton', 'xla'\]"):
    registry.get("qk_scale_softmax", "cuda")
  with pytest.raises(ValueError, match="op: expected one of"):
    registry.available("softmax")
  with pytest.raises(ValueError, match="alias"):
    registry.register("qk_scale_softmax", "pallas", lambda *a: a)


def test_device_of_the_arrays():
  x = jnp.ones(3)
  assert registry.device_of(x) == next(iter(x.devices()))
  assert registry.device_of() == jax.devices()[0]


def test_a_registered_backend_is_used_by_the_op():
  """register(op, name, fn): ``implementation=name`` runs fn as the op's backward, with the
  reference backward's arguments; it is listed and never the default."""
  calls = []

  def doubled(grad_output, query, key, attn_weights, scaling):
    calls.append(scaling)
    dq, dk = jax_ops.qk_scale_softmax_backward_reference(grad_output, query, key, attn_weights,
                                                         scaling)
    return 2 * dq, 2 * dk

  registry.register("qk_scale_softmax", "doubled", doubled)
  try:
    assert "doubled" in registry.available("qk_scale_softmax")
    assert registry.resolve("qk_scale_softmax", None,
                            _problem("qk_scale_softmax", False)).name != "doubled"
    k = keys(3, 2)
    q = jax.random.normal(k[0], (1, 2, 5, 16), jnp.bfloat16)
    kk = jax.random.normal(k[1], (1, 2, 6, 16), jnp.bfloat16)
    loss = lambda impl: (lambda q, kk: jnp.sum(jax_ops.qk_scale_softmax(
        q, kk, implementation=impl, interpret=INTERPRET).astype(jnp.float32) ** 2))
    got = jax.grad(loss("doubled"), (0, 1))(q, kk)
    want = jax.grad(loss("xla"), (0, 1))(q, kk)
    assert calls == [0.25]
    for g, w in zip(got, want):
      assert_close(g, 2 * w.astype(jnp.float32), atol=1e-6, rtol=1e-2)
  finally:
    registry.unregister("qk_scale_softmax", "doubled")
  assert "doubled" not in registry.available("qk_scale_softmax")
