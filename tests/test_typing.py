"""The public API is typed: every function's annotations resolve (``typing.get_type_hints``),
arrays go in as ``jax.typing.ArrayLike`` and come out as ``jax.Array``, and both packages
ship ``py.typed``. The dtype checks go through chex and keep their messages."""

import importlib.resources
import inspect
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ops
import jax_ops.reference
import pallas_kernels
from jax_ops import registry
from pallas_kernels import validation

OPS = [jax_ops.attention_softmax_dropout_value, jax_ops.masked_softmax_dropout,
       jax_ops.qk_scale_softmax]
HELPERS = [jax_ops.causal_mask, jax_ops.dropout_keep_mask, jax_ops.effective_dropout_rate]
REFERENCES = [getattr(jax_ops.reference, n) for n in jax_ops.reference.__all__
              if n.endswith(("_reference", "_forward"))]
KERNELS = [getattr(pallas_kernels, n) for n in pallas_kernels.__all__]
REGISTRY = [registry.register, registry.unregister, registry.available, registry.get,
            registry.resolve]
PUBLIC = list(dict.fromkeys(OPS + REFERENCES + HELPERS + KERNELS + REGISTRY + [
    getattr(jax_ops, n) for n in jax_ops.__all__ if callable(getattr(jax_ops, n))]))

ARRAY_IN = jax.typing.ArrayLike
RATE = float | jax.typing.ArrayLike


def _ids(fns):
  return [f"{f.__module__}.{f.__qualname__}" for f in fns]


def _layer_methods():
  try:
    from jax_ops import nnx as layers
  except ImportError:
    return []
  return [getattr(cls, m) for cls in (layers.GQASelfAttention, layers.MaskedAttention,
                                      layers.QKSoftmaxAttention)
          for m in ("__init__", "__call__")]


LAYER_METHODS = _layer_methods()


@pytest.mark.parametrize("fn", PUBLIC + LAYER_METHODS, ids=_ids(PUBLIC + LAYER_METHODS))
def test_annotations_resolve_and_cover_every_argument(fn):
  hints = typing.get_type_hints(fn)
  assert "return" in hints, "no return type"
  params = inspect.signature(fn).parameters.values()
  missing = [p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD
             and p.name not in hints]
  assert not missing, f"not annotated: {missing}"


ARRAY_PARAMS = {"scores", "value_states", "mask", "query", "key", "grad_output",
                "grad_attn_output", "attn_weights", "attn_weights_dropped", "dropout_mask",
                "p_attn", "keep", "delta"}


def _array_params(fn):
  hints = typing.get_type_hints(fn)
  params = {n: hints[n] for n in inspect.signature(fn).parameters if n in ARRAY_PARAMS}
  assert params, "no array parameters"
  return params


@pytest.mark.parametrize("fn", OPS + REFERENCES + KERNELS, ids=_ids(OPS + REFERENCES + KERNELS))
def test_arrays_in_and_out(fn):
  hints = typing.get_type_hints(fn)
  for name, hint in _array_params(fn).items():
    # dropout_mask may be None where the rate is 0.
    assert hint in (ARRAY_IN, ARRAY_IN | None), f"{name}: {hint}"
  ret = hints["return"]
  assert ret is jax.Array or (typing.get_origin(ret) is tuple
                              and set(typing.get_args(ret)) <= {jax.Array, Ellipsis}), ret
  for name in ("dropout_rate", "attention_dropout", "p_dropout"):
    if name in hints:
      assert hints[name] == RATE, f"{name}: {hints[name]}"
  if "dropout_rng" in hints:
    assert hints["dropout_rng"] == jax.Array | None
  if "implementation" in hints:
    assert hints["implementation"] == str | None
  if "interpret" in hints:
    assert hints["interpret"] is bool


def test_helpers_types():
  hints = typing.get_type_hints(jax_ops.dropout_keep_mask)
  assert hints["rng"] is jax.Array and hints["rate"] == RATE and hints["return"] is jax.Array
  assert typing.get_type_hints(jax_ops.effective_dropout_rate) == {"rate": RATE,
                                                                   "return": float | jax.Array}
  assert typing.get_type_hints(jax_ops.causal_mask) == {"seq_q": int, "seq_k": int,
                                                         "return": jax.Array}


@pytest.mark.parametrize("package", ["jax_ops", "pallas_kernels"])
def test_py_typed_ships(package):
  """PEP 561: the marker sits in the package, so type checkers read its annotations."""
  assert importlib.resources.files(package).joinpath("py.typed").is_file()


def test_dtype_checks_through_chex_keep_their_messages():
  with pytest.raises(TypeError, match=r"^mask: expected dtype bool, got float32$"):
    validation.check_dtype("mask", np.zeros((2, 3), np.float32), (jnp.bool_,))
  with pytest.raises(TypeError, match=r"^key: expected dtype float16 or float32, got bfloat16$"):
    validation.check_array("key", jnp.zeros((2, 3), jnp.bfloat16), ("A", "B"),
                           dtypes=(jnp.float16, jnp.float32, jnp.float16))
  # chex reads the dtype float64 (== float) as "any float": the check asks for the type.
  with pytest.raises(TypeError, match=r"^x: expected dtype float64, got float32$"):
    validation.check_dtype("x", np.zeros(2, np.float32), (jnp.float64,))
  with pytest.raises(TypeError, match=r"^x: expected dtype int64, got int8$"):
    validation.check_dtype("x", np.zeros(2, np.int8), (np.int64,))
  validation.check_dtype("x", jax.ShapeDtypeStruct((2,), jnp.bool_), (jnp.bool_,))
  validation.check_dtype("x", jnp.zeros(2, jnp.bfloat16), (jnp.float32, jnp.bfloat16))
  with pytest.raises(TypeError,
                     match=r"^dropout_rng: expected one PRNG key .* got shape \[2\] int32$"):
    validation.check_key("dropout_rng", jnp.zeros(2, jnp.int32))
  validation.check_key("dropout_rng", jax.random.PRNGKey(0))
  validation.check_key("dropout_rng", jax.random.key(0))


def test_ops_take_numpy_arrays_and_both_key_kinds():
  """``ArrayLike`` in: NumPy arrays work as well as jax arrays; a typed key and a legacy
  uint32 key draw the same mask."""
  rng = np.random.default_rng(0)
  scores = rng.standard_normal((1, 2, 5, 7)).astype(np.float32)
  mask = rng.random((1, 1, 5, 7)) < 0.8
  typed = jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=0.25,
                                         dropout_rng=jax.random.key(3))
  legacy = jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=0.25,
                                          dropout_rng=jax.random.PRNGKey(3))
  assert isinstance(typed, jax.Array) and typed.shape == scores.shape
  np.testing.assert_array_equal(np.asarray(typed), np.asarray(legacy))
  value = rng.standard_normal((1, 1, 7, 4)).astype(np.float32)
  out = jax_ops.attention_softmax_dropout_value(scores, value)
  assert isinstance(out, jax.Array) and out.shape == (1, 5, 2, 4)
  q = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
  probs = jax_ops.qk_scale_softmax(q, q)
  assert isinstance(probs, jax.Array) and probs.shape == (1, 2, 5, 5)


def test_ops_take_numpy_float64_as_jax_does():
  """NumPy's default float64 becomes float32 as in any ``jnp`` function (x64 off); under
  x64 it stays float64, which no op takes: a ``TypeError`` that names the argument."""
  rng = np.random.default_rng(1)
  scores, q = rng.standard_normal((1, 2, 5, 7)), rng.standard_normal((1, 2, 5, 4))
  value, mask = rng.standard_normal((1, 1, 7, 4)), np.ones((5, 7), bool)
  calls = {"scores": lambda: jax_ops.attention_softmax_dropout_value(scores, value),
           "query": lambda: jax_ops.qk_scale_softmax(q, q)}
  assert jax_ops.masked_softmax_dropout(scores, mask).dtype == jnp.float32
  for call in calls.values():
    assert call().dtype == jnp.float32
  with jax.enable_x64(True):
    for name, call in calls.items():
      with pytest.raises(TypeError, match=f"^{name}: expected dtype bfloat16 or float16 or "
                                          "float32, got float64$"):
        call()


def test_kernel_entry_points_take_numpy_float64_as_jax_does():
  """The kernel entry points convert NumPy inputs as the ops do: float64 -> float32."""
  rng = np.random.default_rng(2)
  g, probs = rng.standard_normal((1, 2, 4, 8)), np.full((1, 2, 4, 8), 1 / 8)
  q, k = rng.standard_normal((1, 2, 4, 16)), rng.standard_normal((1, 2, 8, 16))
  value, d_o = rng.standard_normal((1, 1, 8, 16)), rng.standard_normal((1, 4, 2, 16))
  mask, keep = np.ones((1, 1, 4, 8), bool), np.ones((1, 2, 4, 8), bool)
  outs = [
      pallas_kernels.masked_softmax_dropout_backward(g, probs, mask, None, 0.0, interpret=True),
      *pallas_kernels.qk_scale_softmax_backward(g, q, k, probs, 0.25, interpret=True),
      *pallas_kernels.attention_softmax_dropout_value_backward(
          d_o, probs, probs, value, keep, 0.0, implementation="triton", interpret=True),
      *pallas_kernels.attention_softmax_dropout_value_backward_from_delta(
          d_o, probs, value, keep, 0.0, np.zeros((1, 2, 4), np.float32), interpret=True)]
  assert all(o.dtype == jnp.float32 for o in outs)
