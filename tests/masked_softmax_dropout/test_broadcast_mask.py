"""Attention masks that broadcast to ``[B, 1, Sq, Sk]`` (``[B, 1, 1, Sk]`` padding,
``[Sq, Sk]`` causal, ...) on the Triton kernels: the fused forward, the backward from the
scores and the entry point reading P and keep give exactly (bit for bit) the results of the
explicitly broadcast mask, on odd shapes and configs; they read the mask through its own
shape (one row of a padding mask, no broadcast array in the program); and other shapes
raise naming ``mask`` and the expected shape. The op's tests on every backend are in
``op_base.py``."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, exact_jit, keys, softmax_probs
import jax_ops
from jax_ops import masked_softmax_dropout_backward_reference as reference
from pallas_kernels.masked_softmax_dropout import Config
from pallas_kernels.masked_softmax_dropout import forward
from pallas_kernels.masked_softmax_dropout import pallas_triton as kernels

# Odd sizes; 33 keys are two column chunks (32 + 1) in the backward.
B, H, SQ, SK = 2, 3, 7, 33
FULL = (B, 1, SQ, SK)
# Shapes that broadcast to [B, 1, Sq, Sk], the full one last.
FORMS = [(B, 1, 1, SK), (SQ, SK), (1, 1, SQ, SK), (B, 1, SQ, 1), (SK,), (1, SQ, SK),
         (B, 1, 1, 1), (), FULL]
# Shapes that do not: a mask per head, a wrong batch, rank 5, wrong rows or keys, a
# [B, Sq, Sk] mask (its B aligns with the head axis).
BAD = [(B, H, SQ, SK), (B + 1, 1, SQ, SK), (1, B, 1, SQ, SK), (SQ + 1, SK), (SK - 1,),
       (B, SQ, SK), (2, 1)]


def _inputs(form, seed=0):
  k = keys(seed, 6)
  g = jax.random.normal(k[0], (B, H, SQ, SK))
  scores = 3 * jax.random.normal(k[1], (B, H, SQ, SK))
  mask = jax.random.bernoulli(k[2], 0.7, form)
  probs = softmax_probs(k[3], (B, H, SQ, SK), jnp.float32)
  keep = jax.random.bernoulli(k[4], 0.8, (B, H, SQ, SK))
  return g, scores, mask, jnp.broadcast_to(mask, FULL), probs, keep, k[5]


def _same(got, want):
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _same_for(fn, mask, full):
  """``fn`` of the mask as given equals ``fn`` of its explicit broadcast, bit for bit (each
  compiled by ``conftest.exact_jit``: no FMA contracted in one program and not the other)."""
  _same(exact_jit(fn)(mask), exact_jit(fn)(full))


@pytest.mark.parametrize("form", FORMS, ids=str)
def test_kernels_equal_the_explicit_broadcast(form):
  g, scores, mask, full, probs, keep, rng = _inputs(form)
  run = dict(interpret=INTERPRET)
  fwd = lambda m: forward.masked_softmax_dropout_forward(scores, m, 0.1, rng, **run)
  from_scores = lambda m: kernels.masked_softmax_dropout_backward_from_scores(
      g, scores, m, rng, 0.1, **run)
  entry = lambda m: kernels.masked_softmax_dropout_backward(g, probs, m, keep, 0.1, **run)
  for fn in (fwd, from_scores, entry):
    _same_for(fn, mask, full)
  # And right: the entry point against the reference on the explicit mask.
  np.testing.assert_allclose(np.asarray(entry(mask)),
                             np.asarray(reference(g, probs, full, keep, 0.1)),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", [(B, 1, 1, SK), (SQ, SK), (B, 1, SQ, 1)], ids=str)
@pytest.mark.parametrize("config", [Config(2, 4, True),
                                    Config(1, 4, False, row_group=2, mask_after_sum=True)],
                         ids=["split", "row_group"])
def test_backward_configs_and_no_dropout(form, config):
  """Rows in blocks of 2 with the mask split in two chunks; one row per program in row
  groups (the last programs past the rows) with the mask loaded after the sums; rate 0."""
  g, scores, mask, full, probs, keep, rng = _inputs(form, seed=1)
  run = dict(config=config, interpret=INTERPRET)
  for rate in (0.0, 0.2):
    _same_for(lambda m: kernels.masked_softmax_dropout_backward(g, probs, m, keep, rate, **run),
              mask, full)
    _same_for(lambda m: kernels.masked_softmax_dropout_backward_from_scores(
        g, scores, m, rng, rate, **run), mask, full)
  fwd = lambda m: forward.masked_softmax_dropout_forward(scores, m, 0.0, block_rows=4,
                                                         interpret=INTERPRET)
  _same_for(fwd, mask, full)


def test_traced_rate_and_vmap():
  """A traced rate; vmap over a stack of padding masks (batched mask) and over a stack of
  inputs sharing one causal mask (unbatched mask)."""
  g, scores, _, _, probs, keep, rng = _inputs(FULL, seed=2)
  pads = jax.random.bernoulli(jax.random.key(3), 0.6, (2, B, 1, 1, SK))
  per_mask = exact_jit(jax.vmap(lambda m, r: kernels.masked_softmax_dropout_backward_from_scores(
      g, scores, m, rng, r, interpret=INTERPRET), (0, None)))
  _same(per_mask(pads, jnp.float32(0.3)),
        per_mask(jnp.broadcast_to(pads, (2,) + FULL), jnp.float32(0.3)))
  causal = jax_ops.causal_mask(SQ, SK)
  stack = lambda x: jnp.stack([x, x[::-1]])
  per_input = lambda m: jax.vmap(lambda g, p, k: kernels.masked_softmax_dropout_backward(
      g, p, m, k, 0.1, interpret=INTERPRET))(stack(g), stack(probs), stack(keep))
  _same_for(per_input, causal, jnp.broadcast_to(causal, FULL))


@pytest.mark.parametrize("form", BAD, ids=str)
def test_other_shapes_raise_naming_mask(form):
  g, scores, _, _, probs, keep, rng = _inputs(FULL)
  mask = jnp.ones(form, bool)
  want = (r"mask: expected \[B, 1, Sq, Sk\] = \[2, 1, 7, 33\] or a shape that broadcasts "
          r"to it \(rank <= 4, each dimension 1 or that size\), got "
          + re.escape(str(list(form))) + "$")
  calls = [
      lambda: jax_ops.masked_softmax_dropout(scores, mask),
      lambda: jax_ops.masked_softmax_dropout(scores, mask, implementation="triton",
                                             interpret=True),
      lambda: forward.masked_softmax_dropout_forward(scores, mask, 0.1, rng, interpret=True),
      lambda: kernels.masked_softmax_dropout_backward_from_scores(g, scores, mask, rng, 0.1,
                                                                  interpret=True),
      lambda: kernels.masked_softmax_dropout_backward(g, probs, mask, keep, 0.1, interpret=True),
      lambda: reference(g, probs, mask, keep, 0.1),
  ]
  for call in calls:
    with pytest.raises(ValueError, match=want):
      call()


def test_dtype_and_type_errors_on_a_broadcast_shape():
  _, scores, _, _, _, _, _ = _inputs(FULL)
  with pytest.raises(TypeError, match="mask: expected dtype bool, got float32"):
    jax_ops.masked_softmax_dropout(scores, jnp.ones((B, 1, 1, SK)))
  with pytest.raises(TypeError, match="mask: expected dtype bool, got int32"):
    jax_ops.masked_softmax_dropout(scores, jnp.ones((SQ, SK), jnp.int32))
  with pytest.raises(TypeError, match=r"mask: expected an array of shape \[B, 1, Sq, Sk\] or "
                                      "one that broadcasts to it, got list"):
    jax_ops.masked_softmax_dropout(scores, [[True] * SK] * SQ)


# --- What the lowered program reads ----------------------------------------------------

@pytest.fixture
def lowered(pretend_h200, triton_modules, monkeypatch):
  """``lower(fn, shapes)``: ``(StableHLO text, the Triton kernels' IR lines with a load)``
  of ``fn`` lowered for a GPU (a pretended H200; no GPU needed)."""
  for module in (forward, kernels):
    monkeypatch.setattr(module._util, "check_can_compile", lambda *a, **k: None)
  mods = triton_modules

  def lower(fn, shapes):
    mods.clear()
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == len(mods) == 1
    return text, [l.strip() for l in mods[0].splitlines() if "tt.load" in l]
  return lower


@pytest.mark.parametrize("form,tile", [((2, 1, 1, 131), "1x128"), ((131, 131), "4x128"),
                                       ((2, 1, 131, 131), "4x128"), ((2, 1, 131, 1), "4x1")])
def test_the_kernels_read_the_mask_through_its_shape(lowered, form, tile):
  """No bool array of the scores' rows and keys is made (only the keep mask the entry
  point takes is that big); the backward's first mask chunk loads one row of a padding
  mask, the rows of a causal or full one, one column of a row mask."""
  f32 = jax.ShapeDtypeStruct((2, 4, 131, 131), jnp.float32)
  m = jax.ShapeDtypeStruct(form, jnp.bool_)
  keep = jax.ShapeDtypeStruct((2, 4, 131, 131), jnp.bool_)
  rng = jax.random.key(0)
  config = Config(4, 4, True)   # 4 rows, 131 keys as chunks of 128 + 4 columns
  for fn, shapes in (
      (lambda s, m: forward.masked_softmax_dropout_forward(s, m, 0.1, rng), (f32, m)),
      (lambda g, s, m: kernels.masked_softmax_dropout_backward_from_scores(
          g, s, m, rng, 0.1, config=config), (f32, f32, m)),
      (lambda g, p, m, k: kernels.masked_softmax_dropout_backward(g, p, m, k, 0.1,
                                                                   config=config),
       (f32, f32, m, keep))):
    text, _ = lowered(fn, shapes)
    sizes = {math.prod(int(d) for d in t.split("x"))
             for t in re.findall(r"tensor<((?:\d+x)*\d+)xi1>", text)}
    assert sizes, text   # the mask is there
    assert sizes - {math.prod(keep.shape)} <= set(range(math.prod(form) + 1)), sizes
  _, loads = lowered(lambda g, s, m: kernels.masked_softmax_dropout_backward_from_scores(
      g, s, m, rng, 0.1, config=config), (f32, f32, m))
  mask_loads = [l for l in loads if "!tt.ptr<i8>>" in l]
  assert len(mask_loads) == 2   # one per column chunk
  assert f"tensor<{tile}x!tt.ptr<i8>>" in mask_loads[0]
