"""The backend registry: names, defaults per device, forced names, backends added by a user."""

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, assert_close, keys
import jax_ops
from jax_ops import backend, registry
from pallas_kernels._util import device_of

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
    registry.get("masked_softmax_dropout", "cuda")
  with pytest.raises(ValueError, match="op: expected one of"):
    registry.available("softmax")
  with pytest.raises(ValueError, match="alias"):
    registry.register("qk_scale_softmax", "pallas", lambda *a: a)


def test_device_of_the_arrays():
  x = jnp.ones(3)
  assert device_of(x) == next(iter(x.devices()))
  assert device_of() == jax.devices()[0]


def test_a_registered_backend_is_used_by_the_op():
  """register(op, name, fn): ``implementation=name`` runs fn as the op's backward, with the
  reference backward's arguments; it is listed and never the default."""
  calls = []

  def doubled(grad_output, query, key, attn_weights, scaling):
    calls.append(scaling)
    dq, dk = jax_ops.qk_scale_softmax_backward_reference(grad_output, query, key, attn_weights,
                                                         scaling, renormalize=True)
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


@pytest.mark.parametrize("op", OPS)
def test_a_registered_backward_of_the_wrong_dtype_is_named(op):
  """A registered backward that returns fp32 gradients for bf16 inputs raises, naming it and
  the input, instead of changing the gradients' dtype."""
  ref = {"attention_softmax_dropout_value": jax_ops.attention_softmax_dropout_value_backward_reference,
         "masked_softmax_dropout": jax_ops.masked_softmax_dropout_backward_reference,
         "qk_scale_softmax": jax_ops.qk_scale_softmax_backward_reference}[op]
  as_f32 = lambda *args: jax.tree.map(lambda g: g.astype(jnp.float32), ref(*args))
  registry.register(op, "f32grads", as_f32)
  try:
    k = keys(4, 3)
    x = jax.random.normal(k[0], (1, 2, 5, 8), jnp.bfloat16)
    if op == "attention_softmax_dropout_value":
      v = jax.random.normal(k[1], (1, 1, 8, 4), jnp.bfloat16)
      f, name = lambda x: jax_ops.attention_softmax_dropout_value(x, v, implementation="f32grads"), "scores"
    elif op == "masked_softmax_dropout":
      m = jnp.ones((1, 1, 5, 8), bool)
      f, name = lambda x: jax_ops.masked_softmax_dropout(x, m, implementation="f32grads"), "scores"
    else:
      kk = jax.random.normal(k[1], (1, 2, 6, 8), jnp.bfloat16)
      f, name = lambda x: jax_ops.qk_scale_softmax(x, kk, implementation="f32grads"), "query"
    with pytest.raises(TypeError, match=rf"implementation='f32grads': its backward returned the "
                                        rf"gradient of {name} as float32 .*, expected bfloat16"):
      jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32)))(x)
  finally:
    registry.unregister(op, "f32grads")


def test_register_checks_its_arguments():
  with pytest.raises(TypeError, match="name: expected a non-empty string"):
    registry.register("qk_scale_softmax", "", lambda *a: a)
  with pytest.raises(TypeError, match="name: expected a non-empty string"):
    registry.register("qk_scale_softmax", None, lambda *a: a)
  with pytest.raises(TypeError, match="expected a Backend instance or a function, got the class"):
    registry.register("qk_scale_softmax", "cls", backend.Backend)
  assert registry.available("qk_scale_softmax") == ("xla", "triton", "mosaic_gpu")


def test_device_of_a_platform_name_default():
  """``jax.default_device`` may hold a platform name: the call runs on that platform."""
  with jax.default_device("cpu"):
    assert device_of().platform == "cpu"


def test_kernel_entry_points_check_the_config_type():
  import pallas_kernels
  from pallas_kernels.masked_softmax_dropout import Config as BConfig
  w = jnp.ones((1, 2, 3, 4), jnp.bfloat16)
  q, k = jnp.ones((1, 2, 3, 8), jnp.bfloat16), jnp.ones((1, 2, 4, 8), jnp.bfloat16)
  with pytest.raises(TypeError, match=r"config: expected a qk_scale_softmax.Config, got Config"):
    pallas_kernels.qk_scale_softmax_backward(w, q, k, w, 0.3, config=BConfig(1, 4), interpret=True)
  with pytest.raises(TypeError, match=r"config: expected a attention_softmax_dropout_value.Config"):
    pallas_kernels.attention_softmax_dropout_value_backward(
        jnp.ones((1, 3, 2, 8), jnp.bfloat16), w, w, jnp.ones((1, 1, 4, 8), jnp.bfloat16),
        jnp.ones((1, 2, 3, 4), bool), 0.1, config=BConfig(1, 4), interpret=True)
