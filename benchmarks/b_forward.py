"""Kernel B's fused forward (``pallas_kernels.masked_softmax_dropout.forward``) against the
op's jnp forward (mask drawn by ``jax_ops.dropout_keep_mask``), and the backward that draws
the mask from the key against the one that reads it, on a GPU.

Usage::

    PYTHONPATH=. python3 -m benchmarks.b_forward [--calls 20] [--out DIR]
        [--configs 4/8,2/4,8/16]   # the op's forward (y alone) at block_rows/num_warps each

Both forwards produce ``(y, P, keep)``; the keep masks must agree bit for bit and ``y``
within 1e-6. The kernel is also timed writing ``y`` alone (the op's forward), with one hash
per element and with one per pair of columns (``pair_hash``; their ``y`` equal bit for bit).
The two backwards must agree bit for bit, and the op's backward (from the scores) with one
hash per element and per pair of columns (``Config.pair_hash``) too.
Median device time (JAX profiler), two input sets rotated. Writes ``<out>/b_forward.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_ops
from benchmarks.timing import device_times_us, no_gpu
from jax_ops import reference
from pallas_kernels.masked_softmax_dropout import default_config, pallas_triton
from pallas_kernels.masked_softmax_dropout.forward import masked_softmax_dropout_forward

SHAPES = [(8, 16, 1024), (32, 8, 256), (16, 8, 2048), (4, 4, 4096)]   # (B, H, S)
RATE = 0.1


def jnp_forward(scores, mask, rng):
  keep = jax_ops.dropout_keep_mask(rng, RATE, scores.shape)
  y, p = reference.masked_softmax_dropout_forward(scores, mask, keep,
                                                  jax_ops.effective_dropout_rate(RATE))
  return y, p, keep


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--out", default=".")
  parser.add_argument("--configs", default=None,
                      help="comma-separated block_rows/num_warps launches of the op's forward "
                           "(y alone, a hash per pair of columns), each timed besides the "
                           "default launch")
  args = parser.parse_args(argv)
  if no_gpu("timing op B's forward and backward", "nothing timed"):
    return 2
  launches = ([tuple(map(int, c.split("/"))) for c in args.configs.split(",")]
              if args.configs else [])
  fns = {"jnp": jax.jit(jnp_forward),
         "kernel": jax.jit(lambda s, m, r: masked_softmax_dropout_forward(
             s, m, RATE, r, pair_hash=False)),
         # The op's forward (y alone), one hash per element and per pair of columns.
         "kernel_y": jax.jit(lambda s, m, r: masked_softmax_dropout_forward(
             s, m, RATE, r, store_keep=False, store_probs=False, pair_hash=False)),
         "kernel_y_pairs": jax.jit(lambda s, m, r: masked_softmax_dropout_forward(
             s, m, RATE, r, store_keep=False, store_probs=False, pair_hash=True))}
  for rows_, warps in launches:
    fns[f"y_pairs_{rows_}/{warps}"] = jax.jit(
        lambda s, m, r, rows_=rows_, warps=warps: masked_softmax_dropout_forward(
            s, m, RATE, r, store_keep=False, store_probs=False, pair_hash=True,
            block_rows=rows_, num_warps=warps))
  rows = []
  for b, h, s in SHAPES:
    sets = []
    for i in range(2):
      k = jax.random.split(jax.random.key(i), 3)
      sets.append((jax.random.normal(k[0], (b, h, s, s), jnp.float32),
                   jax.random.bernoulli(k[1], 0.9, (b, 1, s, s)), k[2]))
    ref, out = fns["jnp"](*sets[0]), fns["kernel"](*sets[0])
    same_keep = bool(jnp.all(ref[2] == out[2]))
    y_err = float(jnp.max(jnp.abs(ref[0] - out[0])))
    times = device_times_us(list(fns.values()), sets, calls=args.calls)
    pairs_y = fns["kernel_y_pairs"](*sets[0])[0]
    same_pairs = bool(jnp.all(pairs_y == fns["kernel_y"](*sets[0])[0]))
    row = {"shape": [b, h, s], "jnp_us": times[0]["median_us"],
           "kernel_us": times[1]["median_us"], "kernel_y_us": times[2]["median_us"],
           "kernel_y_pairs_us": times[3]["median_us"], "same_pairs": same_pairs,
           "launches_us": {name[len("y_pairs_"):]: t["median_us"]
                           for name, t in zip(fns, times) if name.startswith("y_pairs_")},
           "same_keep": same_keep, "max_y_err": y_err}
    # The backwards: keep read (1 B per element) or drawn from the key.
    rate = jax_ops.effective_dropout_rate(RATE)
    bwd = [jax.jit(lambda g, p, m, keep, r: pallas_triton.masked_softmax_dropout_backward(
               g, p, m, keep, rate)),
           jax.jit(lambda g, p, m, keep, r: pallas_triton.masked_softmax_dropout_backward_from_key(
               g, p, m, r, RATE))]
    bsets = []
    for scores, mask, rng in sets:
      y, p, keep = fns["jnp"](scores, mask, rng)
      bsets.append((jax.random.normal(rng, scores.shape, jnp.float32), p, mask, keep, rng))
    row["same_grad"] = bool(jnp.all(bwd[0](*bsets[0]) == bwd[1](*bsets[0])))
    bt = device_times_us(bwd, bsets, calls=args.calls)
    row["bwd_keep_us"], row["bwd_key_us"] = bt[0]["median_us"], bt[1]["median_us"]
    # The op's backward (P recomputed from the scores): one hash per element, and per pair
    # of columns, both with the default config (whole rows).
    config = dataclasses.replace(default_config(s, s, jax.devices()[0].device_kind), chunk=0)
    from_scores = [jax.jit(functools.partial(
        pallas_triton.masked_softmax_dropout_backward_from_scores, p_dropout=RATE,
        config=dataclasses.replace(config, pair_hash=pair))) for pair in (False, True)]
    ssets = [(bs[0], scores, mask, rng) for bs, (scores, mask, rng) in zip(bsets, sets)]
    row["same_grad_pairs"] = bool(jnp.all(from_scores[0](*ssets[0]) == from_scores[1](*ssets[0])))
    st = device_times_us(from_scores, ssets, calls=args.calls)
    row["bwd_scores_us"], row["bwd_scores_pairs_us"] = st[0]["median_us"], st[1]["median_us"]
    rows.append(row)
    print(f"B={b} H={h} S={s}: jnp {row['jnp_us']:.0f} us, kernel {row['kernel_us']:.0f} us "
          f"(x{row['jnp_us'] / row['kernel_us']:.2f}); y alone {row['kernel_y_us']:.0f} us, "
          f"a hash per pair {row['kernel_y_pairs_us']:.0f} us (equal {same_pairs}); "
          f"keep equal {same_keep}, "
          f"max |y err| {y_err:.2g}; backward: keep read {row['bwd_keep_us']:.0f} us, drawn "
          f"{row['bwd_key_us']:.0f} us, equal {row['same_grad']}; from the scores "
          f"{row['bwd_scores_us']:.0f} us, a hash per pair {row['bwd_scores_pairs_us']:.0f} us "
          f"(equal {row['same_grad_pairs']})"
          + "".join(f"; y alone, pairs, {k}: {v:.0f} us" for k, v in row["launches_us"].items()),
          flush=True)
  with open(os.path.join(args.out, "b_forward.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
  ok = all(r["same_keep"] and r["same_grad"] and r["same_pairs"] and r["same_grad_pairs"]
           and r["max_y_err"] < 1e-6 for r in rows)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
