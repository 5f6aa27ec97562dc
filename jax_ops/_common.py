"""Pieces the ops and their references share: matmuls with fp32 accumulation, rounding,
dropout (the keep mask, its scale, the rate's checks), the causal mask."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jax_ops import registry
from jax_ops.backend import Problem
from pallas_kernels import _dropout, validation
from pallas_kernels._util import device_of

f32 = jnp.float32
FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)


def matmul_operand(x):
  """Matmul operands keep their dtype (fp32 accumulate via ``preferred_element_type``)
  on accelerators; XLA:CPU has no bf16 x bf16 -> fp32 dot, so there they are upcast
  (bf16 values are exact in fp32, so the product is the same)."""
  return x.astype(f32) if jax.default_backend() == "cpu" else x


def mm(spec, a, b):
  """einsum of two same-dtype operands: exact products, fp32 accumulation, fp32 result."""
  # fp32 operands ask for full fp32 products (no TF32); bf16 products are exact anyway.
  precision = jax.lax.Precision.HIGHEST if a.dtype == f32 else None
  return jnp.einsum(spec, matmul_operand(a), matmul_operand(b), preferred_element_type=f32,
                    precision=precision)


def round_to(x, dtype):
  """``x`` rounded to ``dtype``'s precision (kept in fp32), never optimised away."""
  if jnp.dtype(dtype) == jnp.bfloat16:  # same exponent range as fp32: no subnormal change
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
  return x.astype(dtype).astype(f32)


def dropout_scale(keep, p, p_static):
  """``keep / (1 - p)`` as fp32, or ``None`` when no dropout is applied (a static p == 0).

  A traced ``p`` of 0 ignores the mask; a traced ``p`` outside [0, 1) (NaN too) makes the
  scale NaN everywhere, so every gradient that depends on it is NaN, never mis-scaled.
  """
  if p_static == 0.0:
    return None
  scale = keep.astype(f32) * (1.0 / (1.0 - jnp.asarray(p, f32)))
  if p_static is None:  # traced rate: p == 0 must ignore the mask, an invalid p gives NaN
    p = jnp.asarray(p, f32)
    scale = validation.nan_unless_rate_valid(p, jnp.where(p > 0, scale, 1.0))
  return scale


def effective_dropout_rate(rate: float | jax.typing.ArrayLike) -> float | jax.Array:
  """The rate the dropout mask draws: ``rate`` rounded to a multiple of ``2**-16``, which
  the ops scale by (``1 / (1 - effective_dropout_rate(rate))``) so that the expectation is
  exact. A Python float gives a Python float. A concrete rate outside [0, 1) (NaN included)
  raises ``ValueError``; a traced one gives NaN."""
  if validation.check_dropout_rate("rate", rate) is None:  # traced
    rate = jnp.asarray(rate, f32)
    rate = validation.nan_unless_rate_valid(rate, rate)
  return _dropout.effective_rate(rate)


def dropout_keep_mask(rng: jax.Array, rate: float | jax.typing.ArrayLike,
                      shape: Sequence[int]) -> jax.Array:
  """The dropout keep mask the ops draw (True = kept): deterministic, counter-based.

  For an array of ``shape`` ``[..., rows, cols]``, with ``(k0, k1) =
  jax.random.bits(rng, (2,), uint32)``, ``n`` the index over the leading dimensions
  (row-major, e.g. ``b * H + h``), row ``r`` and column pair ``w = c // 2``::

    K = mix32(mix32(n * 0x9E3779B9 + k1) ^ k0)                              # per n
    h = mix32((r * ceil(cols / 2) + w) ^ K)                                   # uint32
    u = (h >> (16 * (c % 2))) & 0xFFFF                                        # 16 bits
    keep = u >= round(rate * 2**16)

  with ``mix32`` the lowbias32 mixer (``pallas_kernels._dropout``, which kernels share). So one 32-bit hash draws two
  elements, the rate is rounded to a multiple of ``2**-16`` (:func:`effective_dropout_rate`; a rate
  under ``2**-17`` drops nothing), and the counter wraps past ``2**32`` pairs in one
  ``[rows, cols]`` slice. These are not the masks of ``jax.random.bernoulli``.

  A concrete ``rate`` outside [0, 1) (NaN included) raises ``ValueError``; a traced one is
  clipped to [0, 1 - 2**-16] (NaN: 0), since nothing can raise when it runs (the ops make
  their outputs NaN for such a rate instead). ``rng`` is one PRNG key, typed
  (``jax.random.key``) or a legacy ``uint32`` key (``jax.random.PRNGKey``).
  """
  validation.check_dropout_rate("rate", rate)
  if (not isinstance(shape, (tuple, list)) or len(shape) < 2
      or not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape)):
    raise ValueError(f"shape: expected a tuple [..., rows, cols] of at least 2 non-negative "
                     f"ints, got {shape!r}")
  *lead, rows, cols = shape
  n_lead = int(np.prod(lead)) if lead else 1
  k0, k1 = _dropout.key_words(rng, "rng")
  # Element-wise (each element hashes its pair): one fused loop, no [.., pairs] temporary.
  # A kernel computes one hash per pair and takes both halves.
  dims = (n_lead, rows, cols)
  # The slices' keys once each (the barrier keeps XLA from recomputing them per element).
  key = jax.lax.optimization_barrier(
      _dropout.slice_key(k0, k1, jnp.arange(n_lead, dtype=jnp.uint32))).reshape(-1, 1, 1)
  r, c = (jax.lax.broadcasted_iota(jnp.uint32, dims, i) for i in (1, 2))
  u = _dropout.keyed_bits16(key, r, c, cols).reshape(shape)
  return u >= jnp.asarray(_dropout.rate_threshold(rate), jnp.uint32)


def check_keep(keep, shape, rate) -> None:
  """A jnp forward's ``keep`` (``None``, or a bool mask of the scores' ``shape``) and, with
  a mask, its dropout ``rate`` (in [0, 1) when concrete)."""
  if keep is None:
    return
  validation.check_array("keep", keep, ("B", "H", "Sq", "Sk"), tuple(shape),
                         dtypes=(jnp.bool_,))
  validation.check_dropout_rate("rate", rate)


def apply_dropout(probs, keep, rate):
  """``probs * keep / (1 - rate)`` in fp32, rounded once to ``probs.dtype``."""
  if keep is None:
    return probs
  scaled = probs.astype(f32) * keep * (1.0 / (1.0 - jnp.asarray(rate, f32)))
  return scaled.astype(probs.dtype)


def causal_mask(seq_q: int, seq_k: int) -> jax.Array:
  """``[Sq, Sk]`` bool, True where key ``k <= q + (Sk - Sq)`` (bottom-right aligned)."""
  return jnp.arange(seq_k)[None, :] <= jnp.arange(seq_q)[:, None] + (seq_k - seq_q)


def _checked_dropout(rng, rate):
  """``(p_static, rate)`` of an op's dropout, checked: ``p_static`` the rate as a float
  (``None`` when traced), ``rate`` the rate as an fp32 array (NaN for an invalid traced
  one), neither rounded yet; ``rng`` checked where a rate may be > 0."""
  p_static = validation.check_dropout_rate("dropout_rate", rate)
  if p_static == 0.0:
    return 0.0, jnp.zeros((), f32)
  if rng is None:
    what = f"dropout_rate={p_static}" if p_static is not None else "a traced dropout_rate"
    raise ValueError(f"dropout_rng: {what} needs a PRNG key (jax.random.key(seed)); pass "
                     f"dropout_rate=0 for no dropout")
  validation.check_key("dropout_rng", rng)
  # The ops are not differentiable with respect to the rate: it is a constant to autodiff.
  rate = jax.lax.stop_gradient(jnp.asarray(rate, f32))
  if p_static is None:  # traced: an invalid rate makes the outputs NaN, not mis-scaled
    rate = validation.nan_unless_rate_valid(rate, rate)
  return p_static, rate


def op_dropout_rate(rng, rate):
  """``(rate_static, rate_array)`` of an op's dropout, checked: ``rate_static`` is 0.0 when
  no dropout applies (``rng`` may then be ``None``), ``None`` for a traced rate. The rates
  are the effective ones (:func:`effective_dropout_rate`: rounded to a multiple of
  ``2**-16``), which the mask draws; everything downstream (the forward's scale, the
  backward) uses them.

  A rate that may be > 0 (a Python number > 0, or a traced one) needs a key:
  ``dropout_rng=None`` then raises, as ``flax.nnx.Dropout`` does, instead of silently
  applying no dropout. A traced rate outside [0, 1) makes the outputs NaN (nothing can
  raise when the computation runs).
  """
  p_static, rate = _checked_dropout(rng, rate)
  if p_static is not None:
    p_static = effective_dropout_rate(p_static)
    return p_static, jnp.asarray(p_static, f32)
  return None, effective_dropout_rate(rate)


def op_keep_or_key(rng, p_static, rate, shape, *, backend_draws: bool):
  """``(keep, key)`` that an op's forward takes, from :func:`op_dropout_rate`'s rates:
  ``(None, None)`` without dropout; ``(None, rng)`` for a backend whose kernels draw the
  mask themselves (``backend_draws``); else ``(the jnp mask, None)``. The mask of the
  effective rate is the mask of the rate given (the rounding is idempotent)."""
  if p_static == 0.0:
    return None, None
  if backend_draws:
    return None, rng
  return dropout_keep_mask(rng, known_rate(p_static, rate), shape), None


def rate_for_backward(keep, p_static, rate):
  """What a backward implementation gets as its dropout rate: a float when known."""
  if keep is None:
    return 0.0
  return known_rate(p_static, rate)


def known_rate(p_static, rate):
  """The rate as a kernel takes it: the float ``p_static`` when known (0.0: no dropout),
  else the traced ``rate``."""
  return rate if p_static is None else p_static


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order(name, tree):
  return tree


@_first_order.defjvp
def _first_order_jvp(name, primals, tangents):
  raise NotImplementedError(
      f"implementation={name!r}: the Pallas kernels have no derivatives of their own, so "
      "second-order gradients (the gradient of a gradient, a Hessian) are not supported; "
      "use implementation='xla' for them")


def first_order_only(backend, tree):
  """``tree`` as is; for a Pallas backend, marked so that differentiating through it raises
  ``NotImplementedError`` naming the backend, where the kernels would otherwise fail inside
  Pallas. The ops mark their forward's inputs and their backward's residuals and cotangent:
  a second-order gradient differentiates both."""
  if not getattr(backend, "pallas", False):
    return tree
  return _first_order(backend.name, tree)


def checked_grads(backend, grads, likes, names):
  """``grads`` as is, each checked to have the shape and dtype of its input (``likes``, a
  residual of that shape and dtype): a registered backward that returns, say, fp32 gradients
  for bf16 inputs raises ``TypeError`` naming it, instead of changing the gradients' dtype."""
  for g, like, name in zip(grads, likes, names):
    if g is None or like is None:
      continue
    try:
      chex.assert_trees_all_equal_shapes_and_dtypes(g, like)
    except AssertionError:
      raise TypeError(
          f"implementation={backend.name!r}: its backward returned the gradient of {name} as "
          f"{jnp.dtype(g.dtype).name} {list(g.shape)}, expected {jnp.dtype(like.dtype).name} "
          f"{list(like.shape)} (the input's)") from None
  return grads


def backend_for(op, implementation, interpret, policies, causal=False, **arrays):
  """``(backend, residual policy)`` of a call of ``op`` on these arrays (name -> array): the
  backend :func:`jax_ops.registry.resolve` picks for the call's problem, and the residual
  policy it asks for, which must be one of the op's ``policies``."""
  problem = Problem(
      op=op, shapes=tuple((k, tuple(v.shape)) for k, v in arrays.items()),
      dtype=jnp.dtype(next(iter(arrays.values())).dtype).name, causal=causal,
      device=device_of(*arrays.values()), interpret=bool(interpret))
  backend = registry.resolve(op, implementation, problem)
  policy = backend.residual_policy(problem)
  if policy not in policies:
    raise ValueError(f"{backend!r}: unknown residual policy {policy!r} for {op}")
  return backend, policy
