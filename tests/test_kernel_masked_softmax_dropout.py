"""Kernel B (masked softmax -> dropout backward) against the jnp reference."""

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, assert_close, keys, softmax_probs, triton_calls_in_gpu_lowering
from jax_ops import masked_softmax_dropout_backward_reference as reference
from pallas_kernels import masked_softmax_dropout_backward as kernel
from pallas_kernels.masked_softmax_dropout import Config, column_chunks


def make_inputs(b, h, sq, sk, seed=0, dtype=jnp.float32):
  k = keys(seed, 4)
  probs = softmax_probs(k[0], (b, h, sq, sk), dtype)
  grad = jax.random.normal(k[1], (b, h, sq, sk), dtype)
  mask = jax.random.bernoulli(k[2], 0.5, (b, 1, sq, sk))
  keep = jax.random.bernoulli(k[3], 0.5, (b, h, sq, sk))
  return grad, probs, mask, keep


@pytest.mark.parametrize("b,h,s", [(2, 3, 1), (1, 2, 7), (2, 2, 131), (1, 1, 293), (1, 2, 64)])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_matches_reference(b, h, s, p):
  args = make_inputs(b, h, s, s, seed=s)
  out = kernel(*args, p, interpret=INTERPRET)
  ref = reference(*args, p)
  assert out.dtype == jnp.float32 and out.shape == (b, h, s, s)
  assert_close(out, ref, atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(out - ref).max()) < 1e-5


@pytest.mark.parametrize("sq,sk", [(5, 33), (33, 5), (3, 100)])
@pytest.mark.parametrize("config", [None, Config(1, 4, False), Config(4, 4, True), Config(2, 8, False)])
def test_rectangular_and_configs(sq, sk, config):
  args = make_inputs(2, 2, sq, sk, seed=1)
  out = kernel(*args, 0.2, config=config, interpret=INTERPRET)
  assert_close(out, reference(*args, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sk,split,want", [
    (128, True, ((0, 128),)), (131, True, ((0, 128), (128, 4))), (131, False, ((0, 256),)),
    (919, True, ((0, 512), (512, 512))), (1, True, ((0, 1),)), (7, True, ((0, 4), (4, 4)))])
def test_column_chunks_cover_the_row(sk, split, want):
  chunks = column_chunks(sk, split)
  assert chunks == want
  assert chunks[-1][0] + chunks[-1][1] >= sk


def test_masked_positions_are_exactly_zero():
  grad, probs, mask, keep = make_inputs(1, 2, 9, 9)
  out = kernel(grad, probs, mask, keep, 0.1, interpret=INTERPRET)
  assert bool(jnp.all(jnp.where(mask, 0.0, out) == 0.0))


def test_zero_rate_never_reads_dropout_mask():
  grad, probs, mask, keep = make_inputs(1, 2, 9, 9)
  out = kernel(grad, probs, mask, None, 0.0, interpret=INTERPRET)
  assert_close(out, reference(grad, probs, mask, keep, 0.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_traced_rate(p):
  grad, probs, mask, keep = make_inputs(1, 2, 9, 17)
  run = jax.jit(lambda rate: kernel(grad, probs, mask, keep, rate, interpret=INTERPRET))
  assert_close(run(jnp.float32(p)), reference(grad, probs, mask, keep, p), atol=1e-5, rtol=1e-5)


def test_bfloat16_inputs():
  args = make_inputs(1, 2, 7, 19, dtype=jnp.bfloat16)
  out = kernel(*args, 0.1, interpret=INTERPRET)
  assert out.dtype == jnp.bfloat16
  assert_close(out, reference(*args, 0.1), atol=1e-2, rtol=1e-2)


def test_deterministic():
  args = make_inputs(1, 2, 31, 31)
  a = kernel(*args, 0.1, interpret=INTERPRET)
  b = kernel(*args, 0.1, interpret=INTERPRET)
  assert bool(jnp.all(a == b))


def test_vmap_over_extra_axis():
  grads, probs, masks, keeps = zip(*(make_inputs(1, 2, 7, 7, seed=i) for i in range(3)))
  stack = lambda xs: jnp.stack(xs)
  out = jax.vmap(lambda g, p, m, k: kernel(g, p, m, k, 0.1, interpret=INTERPRET))(
      stack(grads), stack(probs), stack(masks), stack(keeps))
  for i in range(3):
    assert_close(out[i], reference(grads[i], probs[i], masks[i], keeps[i], 0.1),
                 atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.1, None])
@pytest.mark.parametrize("split", [True, False])
def test_lowers_to_triton(pretend_h200, p, split):
  """The kernel lowers to Triton IR for a GPU (no GPU needed; catches unsupported ops)."""
  b, h, s = 2, 3, 131
  shapes = [jax.ShapeDtypeStruct((b, h, s, s), jnp.float32)] * 2 + [
      jax.ShapeDtypeStruct((b, 1, s, s), jnp.bool_), jax.ShapeDtypeStruct((b, h, s, s), jnp.bool_)]
  assert triton_calls_in_gpu_lowering(kernel, shapes, p, config=Config(4, 4, split)) == 1
