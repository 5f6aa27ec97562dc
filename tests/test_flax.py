"""The Flax NNX layers: shapes, dropout from nnx.Rngs, deterministic mode, and
gradients through the Pallas kernels against the XLA references."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, assert_close
import jax_ops

nnx = pytest.importorskip("flax.nnx")
from jax_ops.nnx import GQASelfAttention, MaskedAttention, QKSoftmaxAttention  # noqa: E402

E, S = 32, 9


def _layers(impl):
  kw = dict(implementation=impl, interpret=INTERPRET)
  return {
      "gqa": (GQASelfAttention(E, 4, 2, 8, dropout_rate=0.1, rngs=nnx.Rngs(params=0, dropout=1),
                               **kw), jnp.bfloat16),
      "masked": (MaskedAttention(E, 4, 8, dropout_rate=0.1, rngs=nnx.Rngs(params=0, dropout=1),
                                 **kw), jnp.float32),
      "qk": (QKSoftmaxAttention(E, 4, 8, causal=True, rngs=nnx.Rngs(params=0), **kw),
             jnp.bfloat16),
  }


def _call(name, layer, x, **kw):
  if name == "masked":
    mask = jnp.ones((x.shape[0], 1, S, S), bool).at[1, :, :, -3:].set(False)
    return layer(x, mask, **kw)
  return layer(x, **kw)


@pytest.mark.parametrize("name", ["gqa", "masked", "qk"])
def test_grads_match_xla_under_nnx_jit(name):
  x = jax.random.normal(jax.random.key(0), (2, S, E))
  results = {}
  for impl in ("pallas", "xla"):
    layer, dtype = _layers(impl)[name]

    @nnx.jit
    def step(layer, x):
      loss = lambda m: jnp.mean(_call(name, m, x).astype(jnp.float32) ** 2)
      return nnx.value_and_grad(loss)(layer)

    loss, grads = step(layer, x.astype(dtype))
    results[impl] = (loss, jax.tree.leaves(nnx.state(grads)))
  assert_close(results["pallas"][0], results["xla"][0], atol=1e-6, rtol=1e-5, name="loss")
  for got, want in zip(results["pallas"][1], results["xla"][1]):
    scale = float(jnp.abs(want).max())
    assert_close(got, want, atol=2e-2 * scale, rtol=2e-2, name="grad")


@pytest.mark.parametrize("name", ["gqa", "masked"])
def test_dropout_keys_from_rngs_and_deterministic_mode(name):
  layer, dtype = _layers("xla")[name]
  x = jax.random.normal(jax.random.key(1), (2, S, E)).astype(dtype)
  a, b = _call(name, layer, x), _call(name, layer, x)
  assert not bool(jnp.all(a == b))  # each call draws a fresh dropout key
  c = _call(name, layer, x, deterministic=True)
  d = _call(name, layer, x, deterministic=True)
  assert bool(jnp.all(c == d))
  layer.dropout_rate = 0.0
  assert bool(jnp.all(_call(name, layer, x) == c))


def test_layer_errors():
  with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
    GQASelfAttention(E, 4, 3, 8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_kv_heads: expected an int >= 1, got 0"):
    GQASelfAttention(E, 4, 0, 8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="head_dim: expected an int >= 1, got 8.0"):
    QKSoftmaxAttention(E, 4, 8.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"dropout_rate: expected a dropout rate in \[0, 1\)"):
    MaskedAttention(E, 4, 8, dropout_rate=1.5, rngs=nnx.Rngs(0))
  layer, _ = _layers("xla")["masked"]
  with pytest.raises(ValueError, match=r"mask: expected \[B, 1, Sq, Sk\]"):
    layer(jnp.ones((2, S, E)), jnp.ones((2, 4, S, S), bool))


def test_layers_check_x_and_masks():
  """x must be [B, S, E] with the layer's width; a masked layer takes any mask that
  broadcasts to [B, 1, S, S] (a [B, 1, 1, S] padding mask, say), as the GQA layer does."""
  layers = _layers("xla")
  for name, (layer, _) in layers.items():
    args = (jnp.ones((2, S, S), bool),) if name == "masked" else ()
    with pytest.raises(ValueError, match=r"x: expected rank 3 \[B, S, E\], got shape \[2, 32\]"):
      layer(jnp.ones((2, E)), *args)
    with pytest.raises(ValueError, match=rf"x: expected \[B, S, E\] = \[\*, \*, {E}\], got \[2, {S}, {E + 1}\]"):
      layer(jnp.ones((2, S, E + 1)), *args)
  x = jax.random.normal(jax.random.key(0), (2, S, E))
  pad = jnp.arange(S)[None, None, None, :] < jnp.array([S, S - 3])[:, None, None, None]
  masked, _ = layers["masked"]
  a = masked(x, pad, deterministic=True)
  b = masked(x, jnp.broadcast_to(pad, (2, 1, S, S)), deterministic=True)
  assert bool(jnp.all(a == b))
  with pytest.raises(ValueError, match=r"mask: expected a shape that broadcasts"):
    masked(x, jnp.ones((3, 1, S, S), bool))
  with pytest.raises(ValueError, match=r"mask: expected a shape that broadcasts to \[B, 1, S, S\]"):
    masked(x, jnp.ones((4, S, S), bool))  # per head: broadcasts to [B, H, S, S], not [B, 1, S, S]
  with pytest.raises(TypeError, match=r"mask: expected dtype bool"):
    masked(x, jnp.ones((2, 1, S, S)))
  gqa, _ = layers["gqa"]
  gqa(x.astype(jnp.bfloat16), pad, deterministic=True)
  assert jax_ops.causal_mask(3, 3).shape == (3, 3)


def test_layers_take_float64_under_x64():
  """Under x64 ``jax.random.normal`` makes float64: the projections cast it to the layer's
  dtype, as ``nnx.Linear`` does."""
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(0), (2, S, E))
    assert x.dtype == jnp.float64
    for name, (layer, dtype) in _layers("xla").items():
      y = _call(name, layer, x, **({} if name == "qk" else {"deterministic": True}))
      assert y.shape == (2, S, E) and y.dtype == dtype, name


def test_layers_that_hand_their_dtype_to_the_op_refuse_float64():
  """The GQA and QK layers hand their op arrays of their ``dtype``, which must be one the
  ops take; the masked layer hands its op fp32 scores, so it takes any float dtype."""
  with pytest.raises(TypeError, match=r"^dtype: expected bfloat16, float16 or float32 "
                                      r"\(the op's dtypes\), got float64$"):
    GQASelfAttention(E, 4, 2, 8, dtype=jnp.float64, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"^dtype: expected .*, got float64$"):
    QKSoftmaxAttention(E, 4, 8, dtype=jnp.float64, rngs=nnx.Rngs(0))
  with jax.enable_x64(True):
    layer = MaskedAttention(E, 4, 8, dtype=jnp.float64, implementation="xla", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, S, E))
    assert _call("masked", layer, x, deterministic=True).dtype == jnp.float64


def test_import_without_flax_names_the_extra():
  """``import jax_ops.nnx`` where flax cannot be imported (``None`` in ``sys.modules`` makes
  the import fail, as a missing package does) names the ``[flax]`` extra."""
  code = ("import sys\n"
          "sys.modules['flax'] = None\n"
          "try:\n"
          "  import jax_ops.nnx\n"
          "except ImportError as e:\n"
          "  print(type(e).__name__, e)\n"
          "else:\n"
          "  print('imported')\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == (
      "ImportError jax_ops.nnx needs flax, which the [flax] extra installs: "
      "pip install 'attention-backward-kernels[flax]'"), out.stdout
