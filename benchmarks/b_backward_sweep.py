"""Launches of kernel B's two backwards on row lengths of the training-step table: the entry
point (P and keep read) and the op's backward from the scores (P recomputed, the mask drawn
from the key), each at the config the device's tuned table (or the heuristic) gives and at
the launches named by ``--configs``, on a GPU.

Usage::

    PYTHONPATH=. python3 -m benchmarks.b_backward_sweep [--calls 20] [--out DIR]
        [--shapes 8,16,1024;32,8,256] [--configs 1/4,1/4/cg,2/8/ef]

A launch is ``block_rows/num_warps`` with an optional design: ``ef`` (evict-first store),
``cg`` (g, P/scores and keep loaded ``.cg`` without an eviction hint, evict-first store),
``pub`` (``cg`` with the mask loaded ``.ca`` after the row sums; the backward from the
scores needs the mask first and loads it with the others); ``r`` or ``<design>+r``: the rows
of a head fastest, on a 1-D grid (``Config.row_group``). Every launch's gradient must
equal the default's to 1e-6. Median device time (JAX profiler), two input sets rotated; the
floor is the minimum bytes over the copy ceiling measured in the same run. Writes
``<out>/b_backward_sweep.json``.
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

import jax_ops
from benchmarks.timing import copy_ceiling, device_times_us, no_gpu
from pallas_kernels.masked_softmax_dropout import Config, default_config, pallas_triton

SHAPES = [(8, 16, 1024), (32, 8, 256), (16, 8, 2048)]   # (B, H, S)
RATE = 0.1
DESIGNS = {
    "": {},
    "ef": dict(store_eviction="evict_first"),
    "cg": dict(stream_cache=".cg", stream_eviction=None, store_eviction="evict_first"),
    "pub": dict(stream_cache=".cg", stream_eviction=None, store_eviction="evict_first",
                mask_cache=".ca", mask_after_sum=True),
}
# ``<design>+r``: the same with the rows of a head fastest on a 1-D grid (Config.row_group).
DESIGNS.update({f"{k}+r" if k else "r": dict(v, row_group=1 << 16) for k, v in list(DESIGNS.items())})


def parse_launch(text: str) -> Config:
  rows, warps, *design = text.split("/")
  return Config(int(rows), int(warps), split=True, **DESIGNS[design[0] if design else ""])


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--out", default=".")
  parser.add_argument("--shapes", default=None, help="';'-separated B,H,S")
  parser.add_argument("--configs", default="1/4,1/4/cg,1/8,1/8/cg,2/4,2/8,4/4")
  args = parser.parse_args(argv)
  if no_gpu("timing op B's backward launches", "nothing timed"):
    return 2
  shapes = ([tuple(map(int, s.split(","))) for s in args.shapes.split(";")] if args.shapes
            else SHAPES)
  launches = {name: parse_launch(name) for name in args.configs.split(",")}
  ceiling = copy_ceiling()["TBps"]
  kind = jax.devices()[0].device_kind
  rate = jax_ops.effective_dropout_rate(RATE)
  rows, ok = [], True
  for b, h, s in shapes:
    default = default_config(s, s, kind)
    configs = {"default": default, **launches}
    sets = []
    for i in range(2):
      k = jax.random.split(jax.random.key(i), 4)
      scores = jax.random.normal(k[0], (b, h, s, s), jnp.float32)
      mask = jax.random.bernoulli(k[1], 0.9, (b, 1, s, s))
      keep = jax_ops.dropout_keep_mask(k[2], RATE, scores.shape)
      g = jax.random.normal(k[3], scores.shape, jnp.float32)
      probs = jax.nn.softmax(jnp.where(mask, scores, -1e4), axis=-1)
      sets.append((g, scores, probs, mask, keep, k[2]))
    entry = {n: jax.jit(lambda g, s_, p, m, keep, r, c=c:
                        pallas_triton.masked_softmax_dropout_backward(g, p, m, keep, rate,
                                                                      config=c))
             for n, c in configs.items()}
    scored = {n: jax.jit(lambda g, s_, p, m, keep, r, c=c:
                         pallas_triton.masked_softmax_dropout_backward_from_scores(
                             g, s_, m, r, RATE, config=dataclasses.replace(c, chunk=0)))
              for n, c in configs.items()}
    elements, masks = b * h * s * s, b * s * s
    floors = {"entry": (elements * 13 + masks) / ceiling / 1e6,
              "scores": (elements * 12 + masks) / ceiling / 1e6}
    row = {"shape": [b, h, s], "default": str(default), "floor_us": floors}
    for kind_, fns in (("entry", entry), ("scores", scored)):
      ref = fns["default"](*sets[0])
      errs = {n: float(jnp.max(jnp.abs(fn(*sets[0]) - ref))) for n, fn in fns.items()}
      times = device_times_us(list(fns.values()), sets, calls=args.calls)
      row[kind_] = {n: {"us": t["median_us"], "max_err": errs[n]}
                    for n, t in zip(fns, times)}
      ok &= all(e < 1e-6 for e in errs.values())
      best = min(row[kind_], key=lambda n: row[kind_][n]["us"])
      print(f"B={b} H={h} S={s} {kind_:6s} floor {floors[kind_]:.0f} us: "
            + ", ".join(f"{n} {v['us']:.0f} ({floors[kind_] / v['us']:.0%})"
                        for n, v in row[kind_].items())
            + f"; best {best}", flush=True)
    rows.append(row)
  with open(os.path.join(args.out, "b_backward_sweep.json"), "w") as f:
    json.dump({"device": kind, "ceiling_tbps": ceiling,
               "commit": os.environ.get("BENCH_COMMIT"), "rows": rows}, f, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
