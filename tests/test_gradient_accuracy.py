"""The ops' gradients against a float64 truth, on every backend: XLA, Triton (the interpreter
off a GPU) and Mosaic GPU (its interpreter off a Hopper GPU, on the shapes it takes).

An op's error is ``max over its inputs of ||grad - grad64|| / ||grad64||``, where ``grad64``
is ``jax.vjp`` of the same forward in float64 (x64 on). It is compared with the error of
``jax.grad`` of the plain mixed-precision jnp forward a user would write (bf16 inputs, fp32
logits and softmax, P cast to the input dtype as the op's forward does). The target is at
most :data:`TARGET` times that error. Sharp cases (query == key, scores scaled by 8) are where
a backward that only has the rounded P loses the gradient: P_ii rounds to 1 and
``g - rowsum(g * P)`` cancels. Cases with dropout give the plain forward the op's keep mask
(``jax_ops.dropout_keep_mask``).

Where an op misses the target today, :data:`KNOWN_GAPS` holds the ratio it must stay under,
and the case fails once it is under CLOSED * TARGET (then its entry goes). The gaps and fixes
are in ``docs/qk_scale_softmax.md`` ("The op's gradient on a sharp softmax") and
``docs/attention_softmax_dropout_value.md`` ("Open").
"""

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, keys
import jax_ops
from jax_ops.reference import causal_mask

F32 = jnp.float32
F64 = jnp.float64
TARGET = 1.5
# (op, case): the ratio to the plain forward's error that the op stays under until the gap is
# closed; about 1.3x the ratio measured with the interpreters (the backends agree to 1%). A
# gap counts as closed (its entry must go) once the ratio is under CLOSED * TARGET: a case on
# the target's edge may land either side of it on another machine.
CLOSED = 0.9
KNOWN_GAPS = {
    ("qk_scale_softmax", "sharp_d64"): 2.0,              # 1.50x
    ("qk_scale_softmax", "sharp_d128"): 3.0,             # 2.29x
    ("qk_scale_softmax", "sharp_causal_d64"): 2.1,       # 1.63x
    ("qk_scale_softmax", "random_d64"): 2.3,             # 1.74x
    ("qk_scale_softmax", "mosaic:sharp_causal_d128"): 2.1,  # 1.58x
    ("qk_scale_softmax", "mosaic:random_d128"): 2.2,     # 1.65x
    ("attention_softmax_dropout_value", "sharp"): 2.3,   # 1.75x
    ("attention_softmax_dropout_value", "mosaic:sharp"): 2.3,  # 1.65x
}


def rel_error(grads, truth):
  """``max_i ||grads[i] - truth[i]|| / ||truth[i]||`` in float64."""
  with jax.enable_x64(True):
    return max(float(jnp.linalg.norm(g.astype(F64) - t) / jnp.linalg.norm(t))
               for g, t in zip(grads, truth))


def vjp(forward, primals, cotangent):
  return jax.vjp(forward, *primals)[1](cotangent)


def truth(forward64, primals, cotangent):
  """The gradients of ``forward64`` (a float64 forward) at the primals, in float64."""
  with jax.enable_x64(True):
    return vjp(forward64, [x.astype(F64) for x in primals], cotangent.astype(F64))


def check(op, implementation, case, op_grads, plain_grads, true_grads):
  op_err, plain_err = rel_error(op_grads, true_grads), rel_error(plain_grads, true_grads)
  ratio = op_err / plain_err
  what = (f"{op} {implementation} {case}: gradient error {op_err:.3e} against {plain_err:.3e} "
          f"for jax.grad of the plain jnp forward ({ratio:.2f}x)")
  gap = KNOWN_GAPS.get((op, case))
  if gap is None:
    assert ratio <= TARGET, f"{what}, over the target {TARGET}x"
  else:
    assert ratio <= gap, f"{what}, over the known gap's {gap}x"
    assert ratio > CLOSED * TARGET, f"{what}: the gap is closed, take the case out of KNOWN_GAPS"


# --- qk_scale_softmax: (B, H, Sq, Sk, D), sharp (the last Sq keys equal the queries), causal.
QK_CASES = {
    "sharp_d64": ((1, 2, 40, 40, 64), True, False),
    "sharp_d128": ((1, 2, 40, 40, 128), True, False),
    "sharp_causal_d64": ((1, 2, 33, 40, 64), True, True),
    "random_d64": ((1, 2, 24, 40, 64), False, False),
}
# Mosaic GPU takes rows of 128 keys, D = 128, Sq % 64 == 0.
QK_MOSAIC_CASES = {
    "mosaic:sharp_d128": ((1, 2, 64, 128, 128), True, False),
    "mosaic:sharp_causal_d128": ((1, 2, 64, 128, 128), True, True),
    "mosaic:random_d128": ((1, 2, 64, 128, 128), False, False),
}
QK_PARAMS = ([(impl, c) for impl in ("xla", "triton") for c in QK_CASES]
             + [(impl, c) for impl in ("xla", "mosaic_gpu") for c in QK_MOSAIC_CASES])


def qk_problem(case):
  (b, h, sq, sk, d), sharp, causal = {**QK_CASES, **QK_MOSAIC_CASES}[case]
  k = keys(45, 3)
  query = jax.random.normal(k[0], (b, h, sq, d), jnp.bfloat16)
  key = jax.random.normal(k[1], (b, h, sk, d), jnp.bfloat16)
  if sharp:
    key = key.at[:, :, sk - sq:].set(query)
  ct = jax.random.normal(k[2], (b, h, sq, sk), jnp.bfloat16)
  return query, key, ct, causal


def qk_forward(query, key, causal, dtype):
  """The jnp forward a user writes: logits in ``dtype`` (fp32 accumulate), P in the input
  dtype (``dtype`` float64: the truth)."""
  logits = jnp.einsum("bhqd,bhkd->bhqk", query, key, preferred_element_type=dtype)
  logits = logits * query.shape[-1] ** -0.5
  if causal:
    logits = jnp.where(causal_mask(query.shape[2], key.shape[2]), logits, -jnp.inf)
  return jax.nn.softmax(logits, axis=-1).astype(query.dtype)


@pytest.mark.parametrize("implementation,case", QK_PARAMS)
def test_qk_scale_softmax(implementation, case):
  query, key, ct, causal = qk_problem(case)
  op = jax.jit(lambda q, k: jax_ops.qk_scale_softmax(
      q, k, causal=causal, implementation=implementation,
      interpret=INTERPRET and implementation != "xla"))
  check("qk_scale_softmax", implementation, case, vjp(op, (query, key), ct),
        vjp(lambda q, k: qk_forward(q, k, causal, F32), (query, key), ct),
        truth(lambda q, k: qk_forward(q, k, causal, F64), (query, key), ct))


def dropout(probs, keep, rate, dtype):
  """The plain forward's dropout: kept elements scaled by ``1 / (1 - rate)`` in ``dtype``."""
  if not rate:
    return probs
  rate = jax_ops.effective_dropout_rate(rate)
  return jnp.where(keep, probs.astype(dtype) / (1 - rate), 0).astype(probs.dtype)


# --- attention_softmax_dropout_value: scores [B, H, Sq, Skv] (x 8: sharp), value
# [B, KVH, Skv, D], dropout rate.
ASDV_CASES = {
    "sharp": ((1, 4, 2, 24, 40, 64), 8.0, 0.0),
    "random": ((1, 4, 2, 24, 40, 64), 1.0, 0.0),
    "random_dropout": ((1, 4, 2, 24, 40, 64), 1.0, 0.1),
}
# Mosaic GPU: D 64 or 128, Sq % 64 == 0, Skv % 128 == 0.
ASDV_MOSAIC_CASES = {
    "mosaic:sharp": ((1, 2, 1, 64, 128, 64), 8.0, 0.0),
    "mosaic:random": ((1, 2, 1, 64, 128, 64), 1.0, 0.0),
    "mosaic:random_dropout": ((1, 2, 1, 64, 128, 64), 1.0, 0.1),
}
ASDV_PARAMS = ([(impl, c) for impl in ("xla", "triton") for c in ASDV_CASES]
               + [("mosaic_gpu", c) for c in ASDV_MOSAIC_CASES])


def asdv_forward(scores, value, keep, rate, dtype):
  b, h, sq, skv = scores.shape
  kvh, d = value.shape[1], value.shape[3]
  probs = jax.nn.softmax(scores.astype(dtype), axis=-1).astype(scores.dtype)
  probs = dropout(probs, keep, rate, dtype)
  out = jnp.einsum("bkgqs,bksd->bqkgd", probs.reshape(b, kvh, h // kvh, sq, skv), value,
                   preferred_element_type=dtype)
  return out.reshape(b, sq, h, d).astype(scores.dtype)


@pytest.mark.parametrize("implementation,case", ASDV_PARAMS)
def test_attention_softmax_dropout_value(implementation, case):
  (b, h, kvh, sq, skv, d), scale, rate = {**ASDV_CASES, **ASDV_MOSAIC_CASES}[case]
  k = keys(46, 4)
  scores = (scale * jax.random.normal(k[0], (b, h, sq, skv), F32)).astype(jnp.bfloat16)
  value = jax.random.normal(k[1], (b, kvh, skv, d), jnp.bfloat16)
  ct = jax.random.normal(k[2], (b, sq, h, d), jnp.bfloat16)
  keep = jax_ops.dropout_keep_mask(k[3], rate, scores.shape) if rate else None
  op = jax.jit(lambda s, v: jax_ops.attention_softmax_dropout_value(
      s, v, dropout_rate=rate, dropout_rng=k[3], implementation=implementation,
      interpret=INTERPRET and implementation != "xla"))
  check("attention_softmax_dropout_value", implementation, case,
        vjp(op, (scores, value), ct),
        vjp(lambda s, v: asdv_forward(s, v, keep, rate, F32), (scores, value), ct),
        truth(lambda s, v: asdv_forward(s, v, keep, rate, F64), (scores, value), ct))


# --- masked_softmax_dropout (fp32): scores [B, H, S, S] (x 8: sharp), mask [B, 1, S, S],
# dropout rate.
MSD_CASES = {"sharp": ((1, 2, 24, 40), 8.0, 0.0), "random": ((1, 2, 24, 40), 1.0, 0.0),
             "random_dropout": ((1, 2, 24, 40), 1.0, 0.1)}


def msd_forward(scores, mask, keep, rate):
  probs = jax.nn.softmax(jnp.where(mask, scores, -1e4), axis=-1)
  return dropout(probs, keep, rate, probs.dtype)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize("case", list(MSD_CASES))
def test_masked_softmax_dropout(implementation, case):
  (b, h, sq, sk), scale, rate = MSD_CASES[case]
  k = keys(47, 4)
  scores = scale * jax.random.normal(k[0], (b, h, sq, sk), F32)
  mask = jax.random.bernoulli(k[1], 0.8, (b, 1, sq, sk))
  ct = jax.random.normal(k[2], (b, h, sq, sk), F32)
  keep = jax_ops.dropout_keep_mask(k[3], rate, scores.shape) if rate else None
  op = jax.jit(lambda s: jax_ops.masked_softmax_dropout(
      s, mask, dropout_rate=rate, dropout_rng=k[3], implementation=implementation,
      interpret=INTERPRET and implementation != "xla"))
  check("masked_softmax_dropout", implementation, case, vjp(op, (scores,), ct),
        vjp(lambda s: msd_forward(s, mask, keep, rate), (scores,), ct),
        truth(lambda s: msd_forward(s, mask, keep, rate), (scores,), ct))
