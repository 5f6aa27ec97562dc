"""Op A's fused forward (``pallas_kernels.attention_softmax_dropout_value.forward``) against
the op's jnp forward (``reference.attention_softmax_dropout_value_forward`` under jit, mask
drawn by ``jax_ops.dropout_keep_mask``), on a GPU.

Usage::

    PYTHONPATH=. python3 -m benchmarks.a_forward [--calls 20] [--out DIR]
        [--block-q 32] [--block-k 64] [--num-warps 4] [--num-stages 3]
        [--configs 32/64/4/3,64/64/8/2]   # several launch configs, each timed (a sweep)

Shapes: ``(B, S)`` in :data:`SHAPES` with H=80, KVH=8, D=128, bf16, dropout 0.1. The jnp
forward returns ``(O, P, Pd, keep, O_f32)``; the kernel is timed writing ``(O, P, keep,
O_f32)`` (``kernel``: what op A's residual policy ``"output"`` saves) and also ``Pd``
(``kernel_pd``: policy ``"inputs"``), and writing ``(O, P, Pd, O_f32)`` without keep
(``kernel_pd_nokeep``), and without keep and the fp32 O (``kernel_p_pd``: what op A's
Mosaic GPU backend saves under ``"fused_inputs"``), that with one hash per pair of columns (``kernel_p_pd_pairs``,
its outputs checked equal to ``kernel_p_pd``'s), and writing ``(O, P, keep bits, O_f32)``
(``kernel_bits``, ``forward_with_keep_bits``: what op A's Mosaic GPU backend saves with
``keep="bits"``; its bits checked equal to the jnp mask's). Checks: keep bit for bit; ``P`` equal, or
the share of elements one bf16 ulp apart (no more is allowed); ``O`` and the fp32 ``O``
within 1e-2 of the largest |O| (an element of ``P`` one ulp off moves ``O`` by about 1e-3
of it). Median device time (JAX profiler), two input sets rotated. Writes ``<out>/a_forward.json``.

Measured on an H200 (defaults 32/64/4/3, one hash per element): 1.21-1.34x faster than the
jnp forward without Pd, 0.83-0.94x with it; bf16 ``P`` 99.9986-99.9991% equal, the rest 1 ulp
apart. ``(O, P, Pd)`` alone: 1.22-1.40x, and with one hash per pair of columns (the default
since) 1.38-1.58x (``benchmarks/results/runs/a_forward_pairs_17ee78a.log``).
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
from jax_ops.ops.attention_softmax_dropout_value import reference
from pallas_kernels.attention_softmax_dropout_value.forward import (
    attention_softmax_dropout_value_forward, forward_with_keep_bits)
from pallas_kernels.attention_softmax_dropout_value.pallas_mosaic_gpu import keep_bits_of

SHAPES = [(2, 2048), (8, 512), (4, 1024)]   # (B, S): Sq = Skv = S
H, KVH, D = 80, 8, 128
DTYPE = jnp.bfloat16
RATE = 0.1


def jnp_forward(scores, value_states, rng):
  keep = jax_ops.dropout_keep_mask(rng, RATE, scores.shape)
  out, probs, dropped, out32 = reference.attention_softmax_dropout_value_forward(
      scores, value_states, keep, jax_ops.effective_dropout_rate(RATE), with_f32_output=True)
  return out, probs, dropped, keep, out32


def _ulps_apart(a, b):
  """Per element: how many bf16 ulps ``a`` and ``b`` (bf16, non-negative) are apart."""
  ia = jax.lax.bitcast_convert_type(a, jnp.int16).astype(jnp.int32)
  ib = jax.lax.bitcast_convert_type(b, jnp.int16).astype(jnp.int32)
  return jnp.abs(ia - ib)


@jax.jit
def _compare(ref, out):
  """The checks of one shape, on the device (no large host copies)."""
  r_out, r_p, r_pd, r_keep, r_o32 = ref
  k_out, k_p, k_pd, k_keep, k_o32 = out
  ulps = _ulps_apart(r_p, k_p)
  f = lambda x: x.astype(jnp.float32)
  o_scale = jnp.max(jnp.abs(r_o32))
  return {
      "same_keep": jnp.all(r_keep == k_keep),
      "p_equal_frac": jnp.mean(ulps == 0),
      "p_max_ulps": jnp.max(ulps),
      "pd_max_ulps": jnp.max(_ulps_apart(r_pd, k_pd)),
      "max_out_err": jnp.max(jnp.abs(f(r_out) - f(k_out))) / o_scale,
      "max_out32_err": jnp.max(jnp.abs(r_o32 - k_o32)) / o_scale,
  }


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--out", default=".")
  parser.add_argument("--block-q", type=int, default=None)
  parser.add_argument("--block-k", type=int, default=None)
  parser.add_argument("--num-warps", type=int, default=None)
  parser.add_argument("--num-stages", type=int, default=None)
  parser.add_argument("--configs", default=None,
                      help="comma-separated block_q/block_k/num_warps/num_stages launch "
                           "configs, each timed (the other launch flags are then ignored)")
  parser.add_argument("--lean", action="store_true",
                      help="time only the forwards of op A's Mosaic GPU policies: writing "
                           "(O, P, Pd), (O, P, O_f32) (the default) and (O, P, keep bits, "
                           "O_f32) (with --lean-bits), a hash per pair of columns")
  parser.add_argument("--lean-bits", action="store_true",
                      help="with --lean: the forward writing keep bits too")
  args = parser.parse_args(argv)
  if no_gpu("timing op A's forward", "nothing timed"):
    return 2
  if args.lean:
    return _lean_sweep(args)
  launches = _launches(args)
  rows = []
  for launch in launches:
    rows += _time_launch(launch, args.calls)
  with open(os.path.join(args.out, "a_forward.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "launches": launches, "rows": rows}, f,
              indent=1)
  print("| launch | shape | jnp us | P, keep | P, Pd, keep | P, Pd | P, Pd, no O_f32 | "
        "the same, a hash per pair | P, keep bits (pairs) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['launch']} | B={r['shape'][0]} S={r['shape'][3]} | {r['jnp_us']:.0f} | "
          + " | ".join(f"{r[k + '_us']:.0f} (x{r['jnp_us'] / r[k + '_us']:.2f})"
                       for k in ("kernel", "kernel_pd", "kernel_pd_nokeep", "kernel_p_pd",
                                 "kernel_p_pd_pairs", "kernel_bits"))
          + " |")
  ok = all(r["same_keep"] and r["p_max_ulps"] <= 1 and r["max_out_err"] < 1e-2
           and r["max_out32_err"] < 1e-2 and r["pairs_equal"] and r["bits_equal"]
           for r in rows)
  return 0 if ok else 1


_FIELDS = ("block_q", "block_k", "num_warps", "num_stages")


def _launches(args):
  """The launch configs to time: ``--configs``, else the single one of the launch flags."""
  if args.configs:
    return [dict(zip(_FIELDS, map(int, c.split("/")))) for c in args.configs.split(",")]
  return [dict(block_q=args.block_q, block_k=args.block_k, num_warps=args.num_warps,
               num_stages=args.num_stages)]


def _inputs(b, s):
  sets = []
  for i in range(2):
    k = jax.random.split(jax.random.key(i), 3)
    sets.append((jax.random.normal(k[0], (b, H, s, s), jnp.float32).astype(DTYPE),
                 jax.random.normal(k[1], (b, KVH, s, D), jnp.float32).astype(DTYPE), k[2]))
  return sets


def _lean_sweep(args):
  """``--lean``: per launch config and shape, the forward writing (O, P, Pd), (O, P, O_f32)
  and (O, P, keep bits, O_f32), the bits checked against the jnp mask's (the packings
  measured at 2fe55ff: ``benchmarks/results/runs/a_forward_bits_2fe55ff.json``). Writes
  ``<out>/a_forward_lean.json``."""
  launches = _launches(args)
  methods = ["bits"] if args.lean_bits else []
  rows, ok = [], True
  for launch in launches:
    label = "/".join("-" if launch[k] is None else str(launch[k]) for k in _FIELDS)
    fns = {"p_pd": jax.jit(lambda s, v, r: attention_softmax_dropout_value_forward(
        s, v, RATE, r, store_dropped=True, store_keep=False, store_f32=False, **launch)),
           "p_o32": jax.jit(lambda s, v, r: attention_softmax_dropout_value_forward(
               s, v, RATE, r, store_keep=False, **launch))}
    for m in methods:
      fns[m] = jax.jit(lambda s, v, r: forward_with_keep_bits(s, v, RATE, r, **launch))
    for b, s in SHAPES:
      sets = _inputs(b, s)
      want = keep_bits_of(jax_ops.dropout_keep_mask(sets[0][2], RATE, sets[0][0].shape), KVH)
      row = {"launch": label, "shape": [b, H, KVH, s, D]}
      for m in methods:
        row[m + "_equal"] = bool(jnp.all(fns[m](*sets[0])[2] == want))
        ok &= row[m + "_equal"]
      del want
      times = device_times_us(list(fns.values()), sets, calls=args.calls)
      row.update({f"{n}_us": t["median_us"] for n, t in zip(fns, times)})
      rows.append(row)
      print(f"[{label}] B={b} S={s}: " + "; ".join(
          f"{n} {row[n + '_us']:.0f} us" + (f" ({row[n + '_equal']})" if n in methods else "")
          for n in fns), flush=True)
  with open(os.path.join(args.out, "a_forward_lean.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
  return 0 if ok else 1


def _time_launch(launch, calls):
  """The checked and timed rows of one launch config, one per shape."""
  def kernel(store_dropped, store_keep=True, store_f32=True, pair_hash=False):
    return jax.jit(lambda s, v, r: attention_softmax_dropout_value_forward(
        s, v, RATE, r, store_dropped=store_dropped, store_keep=store_keep,
        store_f32=store_f32, pair_hash=pair_hash, **launch))

  fns = {"jnp": jax.jit(jnp_forward), "kernel": kernel(False), "kernel_pd": kernel(True),
         "kernel_pd_nokeep": kernel(True, False), "kernel_p_pd": kernel(True, False, False),
         "kernel_p_pd_pairs": kernel(True, False, False, True),
         "kernel_bits": jax.jit(lambda s, v, r: forward_with_keep_bits(s, v, RATE, r,
                                                                       **launch))}
  label = "/".join("-" if launch[k] is None else str(launch[k])
                   for k in ("block_q", "block_k", "num_warps", "num_stages"))
  rows = []
  for b, s in SHAPES:
    sets = _inputs(b, s)
    ref, out = fns["jnp"](*sets[0]), fns["kernel_pd"](*sets[0])
    checks = {k: v.item() for k, v in _compare(ref, out).items()}
    del ref, out
    per_element, pairs = fns["kernel_p_pd"](*sets[0]), fns["kernel_p_pd_pairs"](*sets[0])
    checks["pairs_equal"] = all(bool(jnp.all(x == y)) for x, y in zip(per_element[:3], pairs[:3]))
    del per_element, pairs
    bits = fns["kernel_bits"](*sets[0])[2]
    want = keep_bits_of(jax_ops.dropout_keep_mask(sets[0][2], RATE, sets[0][0].shape), KVH)
    checks["bits_equal"] = bool(jnp.all(bits == want))
    del bits, want
    times = device_times_us(list(fns.values()), sets, calls=calls)
    row = {"launch": label, "shape": [b, H, KVH, s, D],
           **{f"{name}_us": t["median_us"] for name, t in zip(fns, times)}, **checks}
    rows.append(row)
    print(f"[{label}] B={b} S={s} H={H} KVH={KVH} D={D}: jnp {row['jnp_us']:.0f} us, kernel "
          f"{row['kernel_us']:.0f} us (x{row['jnp_us'] / row['kernel_us']:.2f}), with Pd "
          f"{row['kernel_pd_us']:.0f} us (x{row['jnp_us'] / row['kernel_pd_us']:.2f}); "
          f"keep equal {row['same_keep']}, P equal {row['p_equal_frac']:.6%} (max "
          f"{row['p_max_ulps']} ulp), Pd max {row['pd_max_ulps']} ulp; max |O err| "
          f"{row['max_out_err']:.2g}, max |O_f32 err| {row['max_out32_err']:.2g} (of max |O|)",
          flush=True)
  return rows


if __name__ == "__main__":
  sys.exit(main())
