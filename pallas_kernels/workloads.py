"""The spec's workloads of the three backward problems, their inputs and their acceptance rule.

``workloads.json`` (package data) holds, per problem ``<op>_backward``, the constants and the
16 workloads of the spec, each with its accepted error: ``|out - ref| <= atol + rtol * |ref|``
on at least 99% of the elements, no NaN/Inf (:func:`check`). This module makes a workload's
inputs (the kernel entry point's positional arguments), counts its minimum DRAM bytes and
names the kernels the entry point picks for it. ``python -m pallas_kernels.check`` and the
scripts in ``benchmarks/`` share it; it imports nothing of ``jax_ops``.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import _tuning
from pallas_kernels import attention_softmax_dropout_value as asdv
from pallas_kernels import qk_scale_softmax as qks

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads.json")
OPS = ("attention_softmax_dropout_value", "masked_softmax_dropout", "qk_scale_softmax")
F32, BF16 = jnp.float32, jnp.bfloat16
ROTATE_BYTES = 256 << 20  # input sets rotated per workload: several times an H100's L2
MIN_WITHIN = 0.99         # the fraction of elements that must be within tolerance

# Small problems for a quick run (the Pallas interpreter on a CPU): odd and non-power-of-two
# lengths, the spec's tolerances.
QUICK = {
    "attention_softmax_dropout_value_backward": {
        "constants": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                      "attention_dropout": 0.1, "dtype": "bfloat16"},
        "workloads": [
            {"batch_size": 2, "seq_len_q": 37, "seq_len_kv": 67, "atol": 1e-05, "rtol": 0.05},
            {"batch_size": 1, "seq_len_q": 64, "seq_len_kv": 128, "atol": 1e-05, "rtol": 0.05}]},
    "masked_softmax_dropout_backward": {
        "constants": {"dtype": "float32"},
        "workloads": [
            {"batch_size": 2, "n_heads": 3, "seq_len": 45, "p_dropout": 0.1,
             "atol": 1e-05, "rtol": 1e-05},
            {"batch_size": 1, "n_heads": 2, "seq_len": 128, "p_dropout": 0.0,
             "atol": 1e-05, "rtol": 1e-05}]},
    "qk_scale_softmax_backward": {
        "constants": {"num_heads": 2, "head_dim": 32, "scaling": 32 ** -0.5,
                      "dtype": "bfloat16"},
        "workloads": [
            {"batch_size": 2, "seq_len_q": 33, "seq_len_k": 33, "atol": 1e-05, "rtol": 0.05},
            {"batch_size": 1, "seq_len_q": 24, "seq_len_k": 80, "atol": 1e-05, "rtol": 0.05}]},
}


@functools.cache
def spec() -> dict:
  """``workloads.json``: ``{"<op>_backward": {"constants": ..., "workloads": [...]}}``."""
  with open(PATH) as f:
    return json.load(f)


def problem(op: str, *, quick: bool = False, causal: bool = False) -> tuple[dict, list[dict]]:
  """``(constants, workloads)`` of ``op`` (the spec's, or :data:`QUICK`'s); ``causal`` keeps
  the square ones (a causal P of ``qk_scale_softmax``)."""
  entry = (QUICK if quick else spec())[op + "_backward"]
  workloads = entry["workloads"]
  if causal:
    workloads = [w for w in workloads if w["seq_len_q"] == w["seq_len_k"]]
  return entry["constants"], workloads


def _softmax(key, shape, dtype, causal=False):
  """The softmax of standard normal logits over the last axis (``causal``: logits above the
  bottom-right diagonal of each ``[Sq, Sk]`` matrix set to -inf), in ``dtype``.

  Made as a 2D ``[rows, Sk]`` array, then reshaped: XLA on a GPU compiles a softmax over a
  rank-4 shape far more slowly than over a 2D one (it searches tilings of every dimension),
  and the PRNG's bits follow the flattened index, so the logits are those of the 4D call."""
  rows, sk = math.prod(shape[:-1]), shape[-1]
  logits = jax.random.normal(key, (rows, sk), F32)
  if causal:
    sq = shape[-2]
    query = jnp.arange(rows)[:, None] % sq
    logits = jnp.where(jnp.arange(sk)[None, :] <= query + (sk - sq), logits, -jnp.inf)
  return jax.nn.softmax(logits, axis=-1).astype(dtype).reshape(shape)


# --- attention_softmax_dropout_value -----------------------------------------------------

def attention_dims(w, c):
  """``(B, H, KVH, Sq, Skv, D)``."""
  return (w["batch_size"], c["num_attention_heads"], c["num_key_value_heads"], w["seq_len_q"],
          w["seq_len_kv"], c["head_dim"])


@functools.partial(jax.jit, static_argnums=(0, 1))
def attention_inputs(dims, p, key):
  """``(dO, P, Pd, V, keep)``: P the bf16 softmax, ``Pd = bf16(P * keep / (1 - p))``."""
  b, h, kvh, sq, skv, d = dims
  k = jax.random.split(key, 4)
  # The barrier keeps XLA from making Pd out of the unrounded fp32 softmax (on a GPU it
  # drops the bf16 round trip, and 24% of Pd then misses bf16(P * keep / (1 - p)) by an
  # ulp): Pd is made from the bf16 P, as the spec's precondition says.
  probs = jax.lax.optimization_barrier(_softmax(k[0], (b, h, sq, skv), BF16))
  keep = jax.random.uniform(k[1], (b, h, sq, skv)) > p
  dropped = (probs.astype(F32) * keep / (1.0 - p)).astype(BF16)
  d_o = jax.random.normal(k[2], (b, sq, h, d), BF16)
  value = jax.random.normal(k[3], (b, kvh, skv, d), BF16)
  return d_o, probs, dropped, value, keep


def attention_floor(w, c):
  b, h, kvh, sq, skv, d = attention_dims(w, c)
  return 7 * b * h * sq * skv + 2 * (b * sq * h * d + 2 * b * kvh * skv * d)


# --- masked_softmax_dropout --------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(0,))
def masked_inputs(dims, key):
  """``(dY, P, mask, keep)`` in fp32 for ``dims = (B, H, S)``."""
  b, h, s = dims
  k = jax.random.split(key, 4)
  grad = jax.random.normal(k[0], (b, h, s, s), F32)
  probs = _softmax(k[1], (b, h, s, s), F32)
  mask = jax.random.bernoulli(k[2], 0.5, (b, 1, s, s))
  keep = jax.random.bernoulli(k[3], 0.5, (b, h, s, s))
  return grad, probs, mask, keep


def masked_floor(w, c):
  b, h, s, p = w["batch_size"], w["n_heads"], w["seq_len"], w["p_dropout"]
  return b * h * s * s * (12 + (1 if p > 0 else 0)) + b * s * s


# --- qk_scale_softmax --------------------------------------------------------------------

def qk_dims(w, c):
  """``(B, H, Sq, Sk, D)``."""
  return (w["batch_size"], c["num_heads"], w["seq_len_q"], w["seq_len_k"], c["head_dim"])


@functools.partial(jax.jit, static_argnums=(0, 1))
def qk_inputs(dims, causal, key):
  """``(g, Q, K, P)`` in bf16; with ``causal``, P is zero above the bottom-right diagonal."""
  b, h, sq, sk, d = dims
  k = jax.random.split(key, 4)
  probs = _softmax(k[0], (b, h, sq, sk), BF16, causal)
  grad = jax.random.normal(k[1], (b, h, sq, sk), BF16)
  query = jax.random.normal(k[2], (b, h, sq, d), BF16)
  key_ = jax.random.normal(k[3], (b, h, sk, d), BF16)
  return grad, query, key_, probs


def causal_elements(sq: int, sk: int) -> int:
  """Elements of an ``[Sq, Sk]`` attention matrix on or below the causal diagonal
  (``k <= q + (Sk - Sq)``), the ones a causal P may have non-zero."""
  return sum(min(sk, max(0, i + sk - sq + 1)) for i in range(sq))


def qk_floor(w, c, causal=False):
  """Read g and P once (4 B per element; with ``causal`` only the elements on or below the
  diagonal), plus Q, K, dQ, dK."""
  b, h, sq, sk, d = qk_dims(w, c)
  elements = causal_elements(sq, sk) if causal else sq * sk
  return 4 * b * h * elements + 2 * 2 * b * h * (sq + sk) * d


# --- per op --------------------------------------------------------------------------------

def label(op: str, w: dict, causal: bool = False) -> str:
  """The workload's short label: its batch and lengths (and rate)."""
  if op == OPS[0]:
    return f"{w['batch_size']}, {w['seq_len_q']}, {w['seq_len_kv']}"
  if op == OPS[1]:
    return f"{w['batch_size']}, {w['n_heads']}, {w['seq_len']}, {w['p_dropout']}"
  return f"{w['batch_size']}, {w['seq_len_q']}, {w['seq_len_k']}" + (" causal" if causal else "")


def make_inputs(op: str, w: dict, c: dict, key, causal: bool = False) -> tuple:
  """The entry point's positional arrays for workload ``w``, from PRNG key ``key``."""
  if op == OPS[0]:
    return attention_inputs(attention_dims(w, c), c["attention_dropout"], key)
  if op == OPS[1]:
    return masked_inputs((w["batch_size"], w["n_heads"], w["seq_len"]), key)
  return qk_inputs(qk_dims(w, c), causal, key)


def scalar(op: str, w: dict, c: dict) -> float:
  """The entry point's last positional argument: the dropout rate, or the scale."""
  return {OPS[0]: lambda: c["attention_dropout"], OPS[1]: lambda: w["p_dropout"],
          OPS[2]: lambda: c["scaling"]}[op]()


def floor_bytes(op: str, w: dict, c: dict, causal: bool = False) -> int:
  """The problem's minimum DRAM bytes (each input read and each output written once)."""
  if op == OPS[2]:
    return qk_floor(w, c, causal)
  return (attention_floor if op == OPS[0] else masked_floor)(w, c)


def entry_kernels(op: str, args: tuple, c: dict, *, causal: bool = False,
                  interpret: bool = False) -> str:
  """The kernels the entry point ``pallas_kernels.<op>_backward`` picks for ``args``:
  ``"mosaic_gpu"`` or ``"triton"`` (qk_scale_softmax's Triton with its scheme)."""
  if op == OPS[0]:
    return asdv.kernels_for(*args, c["attention_dropout"], causal=causal, interpret=interpret)
  if op == OPS[1]:
    return "triton"
  used = qks.kernels_for(*args, c["scaling"], causal=causal, interpret=interpret)
  if used != "triton":
    return used
  g, q, k, _ = args  # the Triton kernels' scheme, as the entry point picks it
  scheme = qks.default_config(q.shape[2], k.shape[2], q.shape[3], q.dtype,
                              _tuning.device_kind_of(*args, interpret=interpret),
                              causal=causal).scheme
  return f"triton ({scheme})"


# --- acceptance, input sets ------------------------------------------------------------------

@jax.jit
def _check_stats(out, ref, atol, rtol):
  out, ref = out.astype(F32), ref.astype(F32)
  err = jnp.abs(out - ref)
  return (jnp.all(jnp.isfinite(out)),
          jnp.mean((err <= atol + rtol * jnp.abs(ref)).astype(F32)),
          jnp.any(out != 0) | ~jnp.any(ref != 0),
          jnp.max(jnp.where(jnp.isnan(err), jnp.inf, err)))


def check(out, ref, atol, rtol) -> dict:
  """The spec's acceptance of one output (computed on the device: outputs are large): no
  NaN/Inf, at least :data:`MIN_WITHIN` of the elements within ``atol + rtol * |ref|``, and
  not all zero where the reference is not. ``max_err``: the largest ``|out - ref|``."""
  finite, within, nonzero, max_err = (x.item() for x in _check_stats(out, ref, atol, rtol))
  finite, nonzero = bool(finite), bool(nonzero)
  return {"within": float(within), "finite": finite, "nonzero": nonzero,
          "max_err": float(max_err), "ok": finite and nonzero and within >= MIN_WITHIN}


def input_sets(make: Callable, index: int, max_sets: int = 32) -> list[tuple]:
  """Input sets of workload ``index`` (``make(key)`` -> a tuple of arrays), rotated by a
  timing so that L2 is cold: together at least :data:`ROTATE_BYTES`, 2 to ``max_sets``."""
  first = make(jax.random.key(index))
  set_bytes = sum(x.size * x.dtype.itemsize for x in first)
  n_sets = int(min(max_sets, max(2, math.ceil(ROTATE_BYTES / set_bytes))))
  return [first] + [make(jax.random.key(1000 * index + i)) for i in range(1, n_sets)]
