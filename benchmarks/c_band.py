"""Kernel C's band scheme (a Mosaic GPU kernel writing ``dQ`` and ``dL``, the second read of
each band of ``g`` and ``P`` from L2, then ``dK = dL^T @ Q``) against the entry point, on
the benchmark workloads whose rows it takes (``Sk`` a multiple of 128), in one run.

Usage (on a Hopper GPU)::

    PYTHONPATH=. python3 -m benchmarks.c_band [--workloads 1,2,3] [--programs 132,66]
        [--calls 20] [--out DIR] [--breakdown]

Variants: ``band`` (the band kernel on ``--programs`` programs, the first value; dK by the
Triton GEMM), ``band:P`` (other program counts), ``band_staged`` (``stage_dl``: dL through a
staging tile of its own); with ``--all`` also ``band_xla`` (dK by XLA's GEMM) and
``band_kres`` (rows of 256 keys: ``k_resident``). Every
variant is checked against the reference with the workload's tolerance and timed as
``benchmarks.run`` times (device time, all kernels of a call, input sets rotated so L2 is
cold). Prints one table; writes ``<out>/c_band.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import jax

from benchmarks import run, timing, variants_table
from benchmarks.timing import no_gpu
from jax_ops import reference
from pallas_kernels import qk_scale_softmax as qks
from pallas_kernels.qk_scale_softmax import pallas_mosaic_gpu as mg


def band_fn(scale, dims, *, programs=None, dk_gemm=mg.BAND_DK_GEMM, k_resident=False,
            stage_dl=False):
  """The band scheme on ``[B, H, ...]`` arrays (the entry point's signature, minus scale)."""
  b, h, sq, sk, d = dims

  def fn(g, q, k, p):
    dq, dk = mg.band_backward(g.reshape(b * h, sq, sk), p.reshape(b * h, sq, sk),
                              q.reshape(b * h, sq, d), k.reshape(b * h, sk, d), scale=scale,
                              programs=programs, dk_gemm=dk_gemm, k_resident=k_resident,
                              stage_dl=stage_dl)
    return dq.reshape(q.shape), dk.reshape(k.shape)
  return jax.jit(fn)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--workloads", default=None)
  parser.add_argument("--programs", default="132",
                      help="program counts of the band kernel (comma-separated; the first "
                           "is 'band')")
  parser.add_argument("--all", action="store_true",
                      help="also band_xla and band_kres")
  parser.add_argument("--breakdown", action="store_true",
                      help="also print band_staged's time per kernel")
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--out", default=".")
  args = parser.parse_args(argv)
  programs = [int(x) for x in args.programs.split(",")]
  if no_gpu("timing kernel C's band scheme", "nothing timed"):
    return 2
  spec, idx, ceiling = variants_table.setup("qk_scale_softmax_backward", args.workloads)
  c = spec["constants"]
  scale = c["scaling"]
  entry = jax.jit(lambda *a: qks.qk_scale_softmax_backward(*a, scale))
  xla = jax.jit(lambda *a: reference.qk_scale_softmax_backward_reference(*a, scale))
  rows_out, names = [], ["entry"]
  for i in idx:
    w = spec["workloads"][i]
    dims = run._c_dims(w, c)
    b, h, sq, sk, d = dims
    if mg.band_unsupported_reason(b, h, sq, sk, d, "bfloat16", scale):
      continue
    label = run._c_problem(False).label(w)
    sets, floor_us = run.c_sets_and_floor(w, c, i, ceiling["TBps"])
    refs = xla(*sets[0])
    fns = {"entry": entry, "band": band_fn(scale, dims, programs=programs[0])}
    for n in programs[1:]:
      fns[f"band:{n}"] = band_fn(scale, dims, programs=n)
    fns["band_staged"] = band_fn(scale, dims, programs=programs[0], stage_dl=True)
    if args.all:
      fns["band_xla"] = band_fn(scale, dims, programs=programs[0], dk_gemm=None)
      if sk == mg.WGS * mg.BAND_KEYS:
        fns["band_kres"] = band_fn(scale, dims, k_resident=True)
    names = list(dict.fromkeys(names + list(fns)))
    row = variants_table.check_and_time(label, w, floor_us, fns, sets, refs, calls=args.calls)
    row["kernels"] = qks.kernels_for(*sets[0], scale)
    if args.breakdown:
      try:
        row["breakdown:band"] = timing.kernel_breakdown_us(fns["band_staged"], sets, calls=10)
        print(f"  {label} band per kernel: " + ", ".join(
            f"{k['kernel']} {k['median_us']:.1f} us x{k['launches']:g}"
            for k in row["breakdown:band"]), flush=True)
      except Exception as e:  # noqa: BLE001 - not split into calls, or did not run: go on
        print(f"  {label} band per kernel: not split ({e})", flush=True)
    rows_out.append(row)
  variants_table.print_table(rows_out, names)
  with open(os.path.join(args.out, "c_band.json"), "w") as f:
    json.dump({"date": datetime.date.today().isoformat(),
               "device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "commit": run._commit(), "ceiling": ceiling, "rows": rows_out}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
