"""Op C's fused forward (``pallas_kernels.qk_scale_softmax.forward``) against the op's jnp
forward, at the training-step benchmark's shapes, on a GPU.

Usage::

    PYTHONPATH=. python3 -m benchmarks.c_forward [--calls 20] [--out DIR]
        [--configs 128/64/8/2,64/64/4/3]   # block_q/block_k/num_warps/num_stages each
        [--shapes 1,32,4096,0;4,32,1024,0]  # B,H,S,causal each (default: the step's C shapes)
        [--mosaic 128/3/0,128/3/1/1]        # the Mosaic GPU forward: keys/stages/split
                                            # [/pingpong] each (dense shapes only)

Every config's ``P`` is checked against the jnp forward (at most one bf16 ulp apart, at
least 99.9% of the elements equal). Median device time (JAX profiler), two input sets
rotated; the kernel's rate is P's bytes written plus Q's and K's read, over its time. Writes
``<out>/c_forward.json``; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import compile_all, device_times_us, no_gpu
from jax_ops.ops.qk_scale_softmax import reference
from pallas_kernels.qk_scale_softmax import forward_mosaic_gpu
from pallas_kernels.qk_scale_softmax.forward import (ForwardConfig, default_forward_config,
                                                     qk_scale_softmax_forward)

SHAPES = [(1, 32, 4096, False), (1, 32, 4096, True), (4, 32, 1024, False),
          (32, 32, 128, False), (8, 32, 256, False)]   # (B, H, S, causal), D = 128
D = 128


def parse_configs(text):
  return [ForwardConfig(*map(int, c.split("/"))) for c in text.split(",")] if text else []


def parse_mosaic(text):
  """``keys/stages/split[/pingpong]`` items of the Mosaic GPU forward, as keyword dicts."""
  out = []
  for item in (text.split(",") if text else []):
    keys, stages, split, *pingpong = map(int, item.split("/"))
    out.append({"keys": keys, "stages": stages, "split": bool(split),
                "pingpong": bool(pingpong and pingpong[0])})
  return out


def parse_shapes(text):
  if not text:
    return SHAPES
  out = []
  for item in text.split(";"):
    b, h, s, c = map(int, item.split(","))
    out.append((b, h, s, bool(c)))
  return out


def ulp_check(probs, ref):
  a = np.asarray(probs).view(np.int16).astype(np.int64)
  b = np.asarray(ref).view(np.int16).astype(np.int64)
  ulps = np.abs(a - b)
  return int(ulps.max()), float((ulps == 0).mean())


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--out", default=".")
  parser.add_argument("--configs", default="")
  parser.add_argument("--shapes", default="")
  parser.add_argument("--mosaic", default="")
  args = parser.parse_args(argv)
  if no_gpu("timing op C's forward", "nothing timed"):
    return 2
  rows, ok = [], True
  scaling = D ** -0.5
  for b, h, s, causal in parse_shapes(args.shapes):
    sets = []
    for i in range(2):
      k = jax.random.split(jax.random.key(i), 2)
      sets.append((jax.random.normal(k[0], (b, h, s, D), jnp.bfloat16),
                   jax.random.normal(k[1], (b, h, s, D), jnp.bfloat16)))
    configs = [default_forward_config(s, s, D)] + [
        c for c in parse_configs(args.configs) if c != default_forward_config(s, s, D)]
    fns = [functools.partial(reference.qk_scale_softmax_forward, scaling=scaling,
                             causal=causal)]
    fns += [functools.partial(qk_scale_softmax_forward, scaling=scaling, causal=causal,
                              config=c) for c in configs]
    mosaic = [] if causal else parse_mosaic(args.mosaic)
    fns += [functools.partial(forward_mosaic_gpu.qk_scale_softmax_forward, scaling=scaling,
                              **kw) for kw in mosaic]
    compiled = compile_all(fns, sets[0])
    ref = compiled[0](*sets[0])
    names = ["jnp"] + [f"{c.block_q}/{c.block_k}/{c.num_warps}/{c.num_stages}"
                       for c in configs]
    names += [f"mgpu:{kw['keys']}/{kw['stages']}/{int(kw['split'])}/{int(kw['pingpong'])}"
              for kw in mosaic]
    failed = [n for n, f in zip(names, compiled) if f is None]
    if failed:   # a candidate over the shared memory, say; the default must compile
      print(f"  did not compile: {', '.join(failed)}", flush=True)
      ok &= names[1] not in failed
    live = [(n, f) for n, f in zip(names, compiled) if f is not None]
    times = device_times_us([f for _, f in live], sets, calls=args.calls)
    nbytes = 2 * b * h * s * s + 2 * 2 * b * h * s * D
    row = {"shape": [b, h, s, D], "causal": causal, "results": {}, "failed": failed}
    for (name, fn), t in zip(live, times):
      max_ulps, equal = ulp_check(fn(*sets[0]), ref)
      good = max_ulps <= 1 and equal >= 0.999
      ok &= good
      row["results"][name] = {"us": t["median_us"], "max_ulps": max_ulps, "equal": equal,
                              "tb_s": nbytes / t["median_us"] / 1e6, "check": good}
    rows.append(row)
    jnp_us = row["results"]["jnp"]["us"]
    best = min(((r["us"], n) for n, r in row["results"].items() if n != "jnp"),
               default=(float("nan"), "none"))
    print(f"B={b} H={h} S={s}{' causal' if causal else ''}: jnp {jnp_us:.0f} us; "
          + "; ".join(f"{n} {r['us']:.0f} us ({r['tb_s']:.2f} TB/s, x{jnp_us / r['us']:.2f}, "
                      f"ulps {r['max_ulps']}, {r['equal']:.5f} equal)"
                      for n, r in row["results"].items() if n != "jnp")
          + f"; best {best[1]} {best[0]:.0f} us", flush=True)
  with open(os.path.join(args.out, "c_forward.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
