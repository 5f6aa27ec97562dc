"""Kernel C's Mosaic GPU kernel on the H200: compile, check and time variants in one run.

Usage (on a Hopper GPU)::

    PYTHONPATH=. python3 -m benchmarks.c_mosaic_variants [--workloads 4,8] [--out DIR]

For each workload the kernel takes: the Triton entry point and each Mosaic GPU variant
(``VARIANTS``: options of ``backward_kernel``), checked
against the reference with the workload's tolerance and timed the way ``benchmarks.run``
times (device time, input sets rotated so L2 is cold). Prints one table; writes
``<out>/c_mosaic_variants.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from benchmarks import run, variants_table
from jax_ops import reference
from pallas_kernels.qk_scale_softmax import pallas_mosaic_gpu as mg
from pallas_kernels.qk_scale_softmax import pallas_triton

# name -> backward_kernel options (the default first); a variant that does not fit a
# workload (shared memory) is reported as an error there. The variants measured before
# (K resident, dL in a buffer of its own, stores from registers, rows of 256 keys) are
# logged in benchmarks/results/qk_scale_softmax_mosaic_gpu.md.
VARIANTS = {
    "default": {},
}


def mosaic_fn(options, scale):
  def fn(g, q, k, p):
    b, h, sq, sk = g.shape
    bh = b * h
    kernel = mg.backward_kernel if sk == mg.SEQ_K else mg.pair_backward_kernel
    dq, dk = kernel(g.reshape(bh, sq, sk), p.reshape(bh, sq, sk), q.reshape(bh, sq, -1),
                    k.reshape(bh, sk, -1), scale=scale, **options)
    return dq.reshape(q.shape), dk.reshape(k.shape)
  return jax.jit(fn)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--workloads", default=None)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--out", default=".")
  args = parser.parse_args(argv)
  spec, idx, ceiling = variants_table.setup("qk_scale_softmax_backward", args.workloads)
  c = spec["constants"]
  scale = c["scaling"]
  triton = jax.jit(lambda *a: pallas_triton.qk_scale_softmax_backward(*a, scale))
  xla = jax.jit(lambda *a: reference.qk_scale_softmax_backward_reference(*a, scale))
  variants = args.variants.split(",")
  rows = []
  for i in idx:
    w = spec["workloads"][i]
    dims = run._c_dims(w, c)
    b, h, sq, sk, d = dims
    label = run._c_problem(False).label(w)
    why = mg.unsupported_reason(b, h, sq, sk, d, jnp.bfloat16, scale)
    if why:
      print(f"{label}: skipped ({why})", flush=True)
      continue
    sets, floor_us = run.c_sets_and_floor(w, c, i, ceiling["TBps"])
    refs = xla(*sets[0])
    fns = {"triton": triton} | {v: mosaic_fn(VARIANTS[v], scale) for v in variants}
    rows.append(variants_table.check_and_time(label, w, floor_us, fns, sets, refs,
                                              calls=args.calls))
  names = ["triton", *variants]
  variants_table.print_table(rows, names)
  with open(os.path.join(args.out, "c_mosaic_variants.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "ceiling": ceiling, "rows": rows}, f,
              indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
