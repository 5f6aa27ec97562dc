"""What drawing op A's dropout mask in the kernels costs, on a GPU (Hopper for the dS-dV
kernel).

Usage::

    PYTHONPATH=. python3 -m benchmarks.a_hash_cost [--calls 20] [--out DIR]

At op A's step shapes (:data:`SHAPES`, H=80, KVH=8, D=128, bf16, dropout 0.1), median device
time (JAX profiler, two input sets rotated) of

- the backward from the output (``pallas_mosaic_gpu.backward_from_output``: the delta einsum
  and the Mosaic GPU dS-dV kernel) with keep drawn from the key's seeds, one hash per pair
  of columns split in registers (``pairs``, the default) and one per element (``element``),
  with a ring of 2 slots instead of 3 (``pairs_s2``), and each step waiting for its own dV
  GEMM (``undelayed``, ``undelayed_element``: ``Config(delay_dv=False, rebuild_stages=2)``);
  with keep read as bits packed by XLA from the bool mask (``bits``); and at rate 0 (no
  mask, P read twice: ``no_dropout``). Checks: the seeded variants equal to ``bits`` bit for
  bit.
- the fused Triton forward writing ``(O, P, O_f32)`` (what the default policy saves) at rate
  0.1 (``forward``) and 0 (``forward_no_dropout``, no hash); the Mosaic GPU forward
  (``forward_mosaic_gpu.forward_with_output``, the same outputs) with a hash per pair of
  columns (``forward_mosaic``), per element (``forward_mosaic_element``), each step waiting
  for its own P·V GEMM (``forward_mosaic_undelayed``) and at rate 0
  (``forward_mosaic_no_dropout``); checked against the Triton forward (P within one ulp,
  O_f32 within 1e-2 of its largest value).

The differences are the hash's cost inside each kernel. Writes ``<out>/a_hash_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_ops
from benchmarks.timing import device_times_us, no_gpu
from pallas_kernels.attention_softmax_dropout_value import forward_mosaic_gpu as fm
from pallas_kernels.attention_softmax_dropout_value import pallas_mosaic_gpu as mg
from pallas_kernels.attention_softmax_dropout_value.forward import (
    attention_softmax_dropout_value_forward)

SHAPES = [(2, 2048), (8, 512), (4, 1024)]   # (B, S): Sq = Skv = S
H, KVH, D = 80, 8, 128
DTYPE = jnp.bfloat16
RATE = 0.1
VARIANTS = ("pairs", "element", "pairs_s2", "undelayed", "undelayed_element", "bits",
            "no_dropout", "forward", "forward_no_dropout", "forward_mosaic",
            "forward_mosaic_element", "forward_mosaic_undelayed", "forward_mosaic_no_dropout")
CHECKED = ("pairs", "element", "pairs_s2", "undelayed", "undelayed_element")


def _inputs(b, s, seed):
  k = jax.random.split(jax.random.key(seed), 5)
  scores = jax.random.normal(k[0], (b, H, s, s), DTYPE)
  value = jax.random.normal(k[1], (b, KVH, s, D), DTYPE)
  d_o = jax.random.normal(k[2], (b, s, H, D), DTYPE)
  out32 = jax.random.normal(k[3], (b, s, H, D), jnp.float32)
  probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(DTYPE)
  keep = jax_ops.dropout_keep_mask(k[4], RATE, scores.shape)
  seeds = mg.keep_seeds_of(k[4], RATE)
  return scores, probs, value, d_o, out32, keep, seeds, k[4]


def _fns():
  rate = jax_ops.effective_dropout_rate(RATE)
  unread = lambda keep: jax.ShapeDtypeStruct(keep.shape, jnp.bool_)

  def seeded(**kw):
    config = mg.Config(**kw)
    return jax.jit(lambda s, p, v, do, o, keep, sd, rng: mg.backward_from_output(
        do, p, v, unread(keep), rate, o, keep_seeds=sd, config=config))

  return {
      "pairs": seeded(),
      "element": seeded(pair_hash=False),
      "pairs_s2": seeded(rebuild_stages=2),
      "undelayed": seeded(delay_dv=False, rebuild_stages=2),
      "undelayed_element": seeded(delay_dv=False, rebuild_stages=2, pair_hash=False),
      "bits": jax.jit(lambda s, p, v, do, o, keep, sd, rng: mg.backward_from_output(
          do, p, v, keep, rate, o)),
      "no_dropout": jax.jit(lambda s, p, v, do, o, keep, sd, rng: mg.backward_from_output(
          do, p, v, keep, 0.0, o)),
      "forward": jax.jit(
          lambda s, p, v, do, o, keep, sd, rng: attention_softmax_dropout_value_forward(
              s, v, RATE, rng, store_keep=False)),
      "forward_mosaic": jax.jit(lambda s, p, v, do, o, keep, sd, rng: fm.forward_with_output(
          s, v, RATE, rng)),
      "forward_mosaic_element": jax.jit(
          lambda s, p, v, do, o, keep, sd, rng: fm.forward_with_output(s, v, RATE, rng,
                                                                       pair_hash=False)),
      "forward_mosaic_undelayed": jax.jit(
          lambda s, p, v, do, o, keep, sd, rng: fm.forward_with_output(s, v, RATE, rng,
                                                                       delay=False)),
      "forward_mosaic_no_dropout": jax.jit(
          lambda s, p, v, do, o, keep, sd, rng: fm.forward_with_output(s, v, 0.0)),
      "forward_no_dropout": jax.jit(
          lambda s, p, v, do, o, keep, sd, rng: attention_softmax_dropout_value_forward(
              s, v, 0.0, None, store_keep=False)),
  }


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--out", default=".")
  args = parser.parse_args(argv)
  if no_gpu("timing op A's mask in the kernels", "nothing timed"):
    return 2
  fns = _fns()
  rows = []
  for b, s in SHAPES:
    sets = [_inputs(b, s, seed) for seed in (0, 1)]
    got = {k: fns[k](*sets[0]) for k in CHECKED + ("bits",)}
    equal = all(np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
                for k in CHECKED for x, y in zip(got[k], got["bits"]))
    del got
    # The Mosaic GPU forward against the Triton one (the same mask): P equal or one ulp
    # apart, O and O_f32 close.
    o_t, p_t, _, _, o32_t = fns["forward"](*sets[0])
    mosaic_checks = {}
    for name in ("forward_mosaic", "forward_mosaic_element"):
      o_m, p_m, o32_m = fns[name](*sets[0])
      pt, pm = np.asarray(p_t, np.float32), np.asarray(p_m, np.float32)
      scale = float(np.max(np.abs(np.asarray(o32_t))))
      check = {"p_equal": float(np.mean(pt == pm)),
               "p_max_rel": float(np.max(np.abs(pt - pm) / np.maximum(np.abs(pt), 1e-30))),
               "o32_err": float(np.max(np.abs(np.asarray(o32_m) - np.asarray(o32_t)))) / scale,
               "o_err": float(np.max(np.abs(np.asarray(o_m, np.float32)
                                             - np.asarray(o_t, np.float32)))) / scale}
      print(name, "against the Triton forward:", check, flush=True)
      mosaic_checks[name] = check
    del o_t, p_t, o32_t, o_m, p_m, o32_m
    times = device_times_us([fns[k] for k in VARIANTS], sets, calls=args.calls)
    ok = all(c["o32_err"] < 1e-2 and c["p_max_rel"] < 1e-2 for c in mosaic_checks.values())
    row = {"shape": [b, H, s, s], "equal": equal and ok, "mosaic_forward": mosaic_checks,
           **{f"{k}_us": t["median_us"] for k, t in zip(VARIANTS, times)},
           "split_ok": all(t["split_ok"] for t in times)}
    rows.append(row)
    del sets
  with open(os.path.join(args.out, "a_hash_cost.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rate": RATE,
               "rows": rows}, f, indent=1)
  print("| shape | " + " | ".join(VARIANTS) + " | seeded = bits |")
  print("|---" * (len(VARIANTS) + 2) + "|")
  for r in rows:
    print(f"| B={r['shape'][0]} S={r['shape'][3]} | "
          + " | ".join(f"{r[k + '_us']:.0f}" for k in VARIANTS) + f" | {r['equal']} |")
  return 0 if all(r["equal"] and r["split_ok"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
