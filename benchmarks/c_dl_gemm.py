"""Kernel C's ``"dl_gemm"`` scheme (a kernel writing dL, then the two GEMMs) against the
entry point's default kernels, on the benchmark workloads, in one run.

Usage (on a GPU)::

    PYTHONPATH=. python3 -m benchmarks.c_dl_gemm [--workloads 0,1] [--dl 1/8,2/8,1/16]
        [--gemm 128/64/8/3:64/128/8/3] [--fused 128/64/8/3] [--mosaic 4,2] [--causal]
        [--calls 20]
        [--out DIR] [--breakdown dl,...]

``--dl``: ``rows/num_warps`` of the dL kernel (:class:`DlConfig`) per variant, ``/pad``
appended for ``pad_rows=True`` (ragged rows: ``dL`` padded to a multiple of 8 keys),
``/classes`` for ``DlConfig.classes`` (causal rows in classes of halving lengths), ``/xla``
for XLA's GEMMs, ``/phased`` for ``phased=True`` (ragged rows on aligned row classes);
``dl`` alone is :func:`default_dl_config`. ``--gemm``: the default dL kernel, then the
Triton GEMMs of :func:`pallas_triton.dl_matmul` (dQ's and dK's tiles) as two launches.
``--fused``: the tiles of the default's one GEMM launch (:func:`pallas_triton.dl_gemms`).
``--mosaic``: the table's dL kernel, then the GEMMs as one Mosaic GPU launch
(:func:`gemm_mosaic_gpu.dl_gemms`), ``stages[/tile|/programs]`` per variant (aligned
workloads only).
Every variant is checked against the reference with the workload's tolerance and timed as
``benchmarks.run`` times (device time, all kernels of a call, input sets rotated so L2 is
cold). Prints one table; writes ``<out>/c_dl_gemm.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os

import jax

from benchmarks import run, timing, variants_table
from benchmarks.timing import no_gpu
from jax_ops import reference
from pallas_kernels import qk_scale_softmax as qks
from pallas_kernels.qk_scale_softmax import gemm_mosaic_gpu, pallas_triton


def dl_fn(dl, scale, dims, causal=False):
  """The entry point with the dL + GEMM scheme (``dl``: a DlConfig or ``None``)."""
  _, _, sq, sk, d = dims
  base = qks.default_config(sq, sk, d, "bfloat16")
  config = qks.Config(base.row, base.col, "dl_gemm", dl)
  return jax.jit(lambda *a: pallas_triton.qk_scale_softmax_backward(*a, scale, causal=causal,
                                                                    config=config))


def gemm_fn(gemm, scale, dims, causal=False):
  """The dL kernel (its default config) then :func:`pallas_triton.dl_matmul`'s Triton GEMMs
  with ``gemm = (dq PassConfig, dk PassConfig)``."""
  b, h, sq, sk, d = dims
  dl = qks.default_dl_config(sk)
  s = jax.numpy.full((1,), scale, jax.numpy.float32)

  def fn(g, q, k, p):
    dq, dk = pallas_triton.dl_gemm(s, g.reshape(b * h, sq, sk), p.reshape(b * h, sq, sk),
                                   q.reshape(b * h, sq, d), k.reshape(b * h, sk, d),
                                   causal=causal, cfg=dl, interpret=False, gemm=gemm)
    return dq.reshape(q.shape), dk.reshape(k.shape)
  return jax.jit(fn)


def mosaic_fn(item, scale, dims, causal=False):
  """The entry's dL kernel (its table config on this GPU) then the two GEMMs as one Mosaic
  GPU launch (:func:`gemm_mosaic_gpu.dl_gemms`); ``item``: ``"stages"`` (persistent, one
  program per SM), ``"stages/tile"`` (one program per tile) or ``"stages/P"`` (``P``
  persistent programs). ``None`` where that launch does not take the problem."""
  stages, _, how = item.partition("/")
  stages = int(stages)
  programs = None if how == "tile" else int(how or 0)
  b, h, sq, sk, d = dims
  if gemm_mosaic_gpu.unsupported_reason(sq, sk, d, jax.numpy.bfloat16, causal):
    return None
  base = qks.default_config(sq, sk, d, "bfloat16", jax.devices()[0].device_kind)
  dl_cfg = base.dl if base.scheme == "dl_gemm" else qks.default_dl_config(sk)
  s = jax.numpy.full((1,), scale, jax.numpy.float32)
  tile = gemm_mosaic_gpu.CAUSAL_TILE if causal else None

  def fn(g, q, k, p):
    dl = pallas_triton.dl_pass(s, g.reshape(b * h, sq, sk), p.reshape(b * h, sq, sk),
                               causal=causal, cfg=dl_cfg, interpret=False, causal_tile=tile)
    dq, dk = gemm_mosaic_gpu.dl_gemms(dl, q.reshape(b * h, sq, d), k.reshape(b * h, sk, d),
                                      causal=causal, stages=stages, programs=programs)
    return dq.reshape(q.shape), dk.reshape(k.shape)
  return jax.jit(fn)


def parse_fused(text: str) -> dict:
  """``"128/64/8/3,..."`` (the one GEMM launch's ``block_q/block_k/warps/stages``) ->
  ``{"fused:<item>": PassConfig}`` (each run with the default dL kernel rows and warps)."""
  out = {}
  for item in (text.split(",") if text else []):
    out[f"fused:{item}"] = qks.PassConfig(*map(int, item.split("/")))
  return out


def parse_gemms(text: str) -> dict:
  """``"128/64/8/3:64/128/8/3,..."`` (dQ tiles ``block_q/block_k/warps/stages``, then dK's)
  -> ``{"tg:<item>": (PassConfig, PassConfig)}``."""
  out = {}
  for item in (text.split(",") if text else []):
    dq, dk = (qks.PassConfig(*map(int, part.split("/"))) for part in item.split(":"))
    out[f"tg:{item}"] = (dq, dk)
  return out


def parse_dls(text: str) -> dict:
  """``"1/8,2/4/pad"`` -> ``{"dl": None, "dl:1/8": DlConfig(1, 8), "dl:2/4/pad":
  DlConfig(2, 4, pad_rows=True)}`` (``"dl"``: the default, always first; ``/phased``: the
  row-class dL kernel, ``DlConfig.phased``)."""
  dls = {"dl": None}
  for item in (text.split(",") if text else []):
    parts = item.split("/")
    if len(parts) < 2 or not set(parts[2:]) <= {"pad", "xla", "phased", "classes"}:
      raise ValueError(f"--dl: expected rows/num_warps[/pad][/xla][/phased][/classes], "
                       f"got {item!r}")
    rows, warps, rest = parts[0], parts[1], parts[2:]
    dls[f"dl:{item}"] = qks.DlConfig(int(rows), int(warps), pad_rows="pad" in rest,
                                     gemm=None if "xla" in rest else qks.DL_GEMM,
                                     phased="phased" in rest, classes="classes" in rest)
  return dls


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--workloads", default=None)
  parser.add_argument("--dl", default="")
  parser.add_argument("--gemm", default="",
                      help="Triton GEMM variants: dq_cfg:dk_cfg,... each block_q/block_k/"
                           "num_warps/num_stages")
  parser.add_argument("--fused", default="",
                      help="tiles of the one GEMM launch (dl_gemms): block_q/block_k/"
                           "num_warps/num_stages,...")
  parser.add_argument("--mosaic", default="",
                      help="the Mosaic GPU GEMM launch after the table's dL kernel: "
                           "stages[/tile|/programs],...")
  parser.add_argument("--causal", action="store_true",
                      help="a causal P, on the square workloads (c_dl_gemm_causal.json)")
  parser.add_argument("--breakdown", default="",
                      help="variant names (comma-separated) whose time per kernel is printed")
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--out", default=".")
  args = parser.parse_args(argv)
  dls = parse_dls(args.dl)
  gemms = parse_gemms(args.gemm)
  fused = parse_fused(args.fused)
  mosaic = [x for x in args.mosaic.split(",") if x]
  if no_gpu("timing kernel C's dL + GEMM scheme", "nothing timed"):
    return 2
  spec, idx, ceiling = variants_table.setup("qk_scale_softmax_backward", args.workloads)
  c = spec["constants"]
  scale = c["scaling"]
  causal = args.causal
  entry = jax.jit(lambda *a: qks.qk_scale_softmax_backward(*a, scale, causal=causal))
  xla = jax.jit(lambda *a: reference.qk_scale_softmax_backward_reference(*a, scale))
  rows_out = []
  for i in idx:
    w = spec["workloads"][i]
    dims = run._c_dims(w, c)
    if causal and dims[2] != dims[3]:
      continue
    label = run._c_problem(causal).label(w)
    sets, floor_us = run.c_sets_and_floor(w, c, i, ceiling["TBps"], causal=causal)
    refs = xla(*sets[0])
    fns = ({"entry": entry} | {n: dl_fn(d, scale, dims, causal) for n, d in dls.items()}
           | {n: gemm_fn(gm, scale, dims, causal) for n, gm in gemms.items()}
           | {n: dl_fn(dataclasses.replace(qks.default_dl_config(dims[3]), gemm=t), scale,
                       dims, causal) for n, t in fused.items()})
    for st in mosaic:
      fn = mosaic_fn(st, scale, dims, causal)
      if fn is not None:
        fns[f"mgpu:{st}"] = fn
    row = variants_table.check_and_time(label, w, floor_us, fns, sets, refs, calls=args.calls)
    row["kernels"] = qks.kernels_for(*sets[0], scale, causal=causal)
    for name in filter(None, args.breakdown.split(",")):
      if name in fns:
        try:
          row[f"breakdown:{name}"] = timing.kernel_breakdown_us(fns[name], sets, calls=10)
        except RuntimeError as e:  # the trace did not split into the calls: say so, go on
          print(f"  {label} {name} per kernel: not split ({e})", flush=True)
          continue
        print(f"  {label} {name} per kernel: " + ", ".join(
            f"{k['kernel']} {k['median_us']:.1f} us x{k['launches']:g}"
            for k in row[f"breakdown:{name}"]), flush=True)
    rows_out.append(row)
  variants_table.print_table(rows_out, ["entry", *dls, *gemms, *fused,
                                        *(f"mgpu:{st}" for st in mosaic)])
  name = "c_dl_gemm_causal.json" if causal else "c_dl_gemm.json"
  with open(os.path.join(args.out, name), "w") as f:
    json.dump({"date": datetime.date.today().isoformat(),
               "device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "commit": run._commit(), "causal": causal, "ceiling": ceiling,
               "rows": rows_out}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
