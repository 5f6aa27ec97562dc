"""The qk_scale_softmax base suite on the ``"mosaic_gpu"`` backend (the Mosaic GPU interpreter off a
Hopper GPU), on the shapes it takes, and how the op picks it."""

import jax
import jax.numpy as jnp
import pytest

from conftest import FakeBlackwell, FakeHopper
import jax_ops
from jax_ops import registry
from jax_ops.backend import Problem

from .op_base import *  # noqa: F401,F403

GRAD_CASES = [(1, 2, 64, 128, 128), (2, 1, 128, 128, 128)]  # (B, H, Sq, Sk, D); Sq <= Sk (causal)
CAUSAL = [False, True]
OP = "qk_scale_softmax"


@pytest.fixture
def implementation():
  return "mosaic_gpu"


def _problem(sq, sk, d, *, interpret=False, device=None, causal=False, dtype="bfloat16"):
  return Problem(op=OP, shapes=(("query", (2, 4, sq, d)), ("key", (2, 4, sk, d))),
                 dtype=dtype, causal=causal, device=device, interpret=interpret)


def test_picked_first_on_hopper_for_the_shapes_it_takes():
  on = lambda *a, **kw: registry.resolve(OP, None, _problem(*a, **kw)).name
  assert on(128, 128, 128, device=FakeHopper()) == "mosaic_gpu"
  assert on(128, 128, 128, device=FakeBlackwell()) == "triton"
  assert on(128, 128, 128, device=FakeHopper(), causal=True) == "mosaic_gpu"
  assert on(128, 256, 128, device=FakeHopper()) == "triton"
  assert on(128, 384, 128, device=FakeHopper()) == "triton"
  assert on(128, 128, 64, device=FakeHopper()) == "triton"
  assert on(128, 128, 128, device=FakeHopper(), dtype="float32") == "triton"
  assert on(128, 128, 128, device=FakeHopper(), interpret=True) == "triton"
  assert registry.resolve(OP, "mosaic_gpu", _problem(128, 128, 128, interpret=True)).name == (
      "mosaic_gpu")


def test_forced_on_a_problem_it_does_not_take_says_why():
  q = jnp.zeros((1, 1, 64, 128), jnp.bfloat16)
  k = jnp.zeros((1, 1, 384, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"mosaic_gpu.*seq_k 384"):
    jax_ops.qk_scale_softmax(q, k, implementation="mosaic_gpu", interpret=True)
  k = jnp.zeros((1, 1, 256, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"mosaic_gpu.*seq_k 256"):
    jax_ops.qk_scale_softmax(q, k, implementation="mosaic_gpu", interpret=True)


def test_forced_off_hopper_says_why():
  if registry.get(OP, "mosaic_gpu").supported_on(jax.devices()[0]):
    pytest.skip("this GPU is a Hopper")
  q = jnp.zeros((1, 1, 64, 128), jnp.bfloat16)
  k = jnp.zeros((1, 1, 128, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="does not compile"):
    jax_ops.qk_scale_softmax(q, k, implementation="mosaic_gpu")
