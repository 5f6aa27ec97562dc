"""Kernel B's backward as a plain Triton row kernel (``triton.jit`` on torch tensors) against
the library's Pallas kernel, on the 16 workloads: does the Pallas-Triton toolchain cost
bandwidth relative to plain Triton on the same design?

Usage (on a GPU with torch and triton installed)::

    PYTHONPATH=. python3 -m benchmarks.b_triton_row [--calls 30] [--out DIR]
        [--warps auto,4,8,16]        # the Triton kernel at the heuristic's and these warps
        [--only "4,4,4096;2,4,256"]  # B,H,S triples (';'-separated, or the flag repeated)
        [--max-sets 32]              # input sets rotated per workload, at most
        [--carveout 100]             # the Triton kernel's shared-memory carveout, percent

The math, fp32: ``gd = g * keep / (1 - p)`` (``gd = g`` when p == 0; keep is then not
read), ``s = rowsum(P * gd)`` over all columns, ``out = where(mask, P * (gd - s), 0)``.

The Triton kernel: one program per row (grid ``B * H * S``), the whole row in registers
(``BLOCK = next_power_of_2(S)``, lanes past S masked), the row's base offset in int64;
g, P (and keep, read as uint8, when p > 0) loaded ``.cg``; the head-shared mask row
(``b * S + q``) loaded ``.ca`` after the row sum; the output stored evict-first. Warps
("auto"): 16 for rows of >= 4096 lanes, 8 for >= 2048, 4 for >= 512, else 2.

Inputs: g ~ N(0, 1), P = softmax of N(0, 1) over the last axis, mask = U > 0.1, keep = U > p,
drawn with ``jax.random`` and shared with torch through DLPack (no copy); the input sets
(``benchmarks.run.input_sets``: together >= 256 MB, 2 to ``--max-sets``; at most two sets,
under 10 GB, on the largest workload) are rotated so L2 is cold, the same sets for both.
The Pallas kernel (``pallas_triton.masked_softmax_dropout_backward``, its default config)
is timed with the JAX profiler (``benchmarks.timing.device_times_us``, median device time);
the Triton kernel with torch CUDA events, one pair per call (median; each call queued
behind a short GPU sleep so the host's launch time is not counted) and, as a cross-check
with the Pallas kernel's method, with the profiler too (``prof``; ``None`` if its trace
does not hold torch's kernels). 5 warm-up calls each. The floor is the problem's minimum
bytes (``benchmarks.run._b_floor``) over the copy bandwidth measured in the same run
(``benchmarks.timing.copy_ceiling``). The Triton outputs must match the Pallas kernel's
(``allclose``, atol = rtol = 1e-5). For rows of 4096 the compiled kernels' PTX (and SASS,
where this triton gives it, else the cubin) are written to ``<out>/b_row_<S>_<warps>.*``.
Writes ``<out>/b_triton_row.json``; exits 1 if an output does not match, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import run as bench
from benchmarks.timing import compile_all, copy_ceiling, device_times_us, no_gpu
from pallas_kernels._util import next_power_of_2
from pallas_kernels.masked_softmax_dropout import default_config, pallas_triton

# Imported by _import_gpu_libs (main, on a GPU host): the module imports without them.
torch = triton = tl = None

WARMUP = 5
ATOL = RTOL = 1e-5
ASM_SEQ = 4096        # rows whose kernels' PTX/SASS are written
SLEEP_CYCLES = 500_000  # GPU sleep (~0.25 ms) queued before each timed call


def _import_gpu_libs():
  global torch, triton, tl
  import torch
  import triton
  import triton.language as tl


def _row_kernel(g_ptr, p_ptr, mask_ptr, keep_ptr, out_ptr, scale, num_heads, seq,
                BLOCK: tl.constexpr, DROPOUT: tl.constexpr):
  """One row of ``out = where(mask, P * (gd - rowsum(P * gd)), 0)``; row ``r`` is
  ``((b * H + h) * S + q)``. ``tl`` is a global set by :func:`_import_gpu_libs`."""
  r = tl.program_id(0)
  q = r % seq
  b = r // (num_heads * seq)
  cols = tl.arange(0, BLOCK)
  valid = cols < seq
  base = r.to(tl.int64) * seq
  g = tl.load(g_ptr + base + cols, mask=valid, other=0.0, cache_modifier=".cg")
  probs = tl.load(p_ptr + base + cols, mask=valid, other=0.0, cache_modifier=".cg")
  if DROPOUT:
    keep = tl.load(keep_ptr + base + cols, mask=valid, other=0, cache_modifier=".cg")
    gd = tl.where(keep != 0, g * scale, 0.0)
  else:
    gd = g
  s = tl.sum(probs * gd, axis=0)
  mask_base = (b * seq + q).to(tl.int64) * seq
  attend = tl.load(mask_ptr + mask_base + cols, mask=valid, other=0, cache_modifier=".ca")
  out = tl.where(attend != 0, probs * (gd - s), 0.0)
  tl.store(out_ptr + base + cols, out, mask=valid, eviction_policy="evict_first")


_JITTED = []


def _kernel():
  if not _JITTED:
    _JITTED.append(triton.jit(_row_kernel))
  return _JITTED[0]


def auto_warps(block: int) -> int:
  """The Triton kernel's default warps for a row of ``block`` lanes (a power of two)."""
  return 16 if block >= 4096 else 8 if block >= 2048 else 4 if block >= 512 else 2


def _warps(label: str, block: int) -> int:
  """The warps of a ``--warps`` entry ("auto" or a number) for rows of ``block`` lanes."""
  return auto_warps(block) if label == "auto" else int(label)


def _launch(dims, p, t, out, num_warps):
  """``t``: the torch views ``(g, P, mask_u8[, keep_u8])``; returns the CompiledKernel
  (recent triton) or whatever the launch returns."""
  b, h, s = dims
  g, probs, mask = t[:3]
  keep = t[3] if p > 0 else g  # a placeholder pointer, never read when p == 0
  return _kernel()[(b * h * s,)](
      g, probs, mask, keep, out, 1.0 / (1.0 - p) if p > 0 else 1.0, h, s,
      BLOCK=triton.next_power_of_2(s), DROPOUT=p > 0, num_warps=num_warps)


def _torch_view(x):
  """A torch tensor on ``x``'s buffer (DLPack); a bool array as uint8."""
  if x.dtype == jnp.bool_:
    try:
      return torch.from_dlpack(x).view(torch.uint8)
    except (RuntimeError, TypeError, BufferError):  # a torch without bool DLPack: a copy
      return torch.from_dlpack(x.astype(jnp.uint8))
  return torch.from_dlpack(x)


def _make_inputs(w):
  """``key -> (g, P, mask[, keep])`` for workload ``w`` (keep only when p > 0)."""
  b, h, s, p = w["batch_size"], w["n_heads"], w["seq_len"], w["p_dropout"]

  def make(key):
    k = jax.random.split(key, 4)
    g = jax.random.normal(k[0], (b, h, s, s), jnp.float32)
    probs = jax.nn.softmax(jax.random.normal(k[1], (b, h, s, s), jnp.float32), axis=-1)
    mask = jax.random.uniform(k[2], (b, 1, s, s)) > 0.1
    if p > 0:
      return g, probs, mask, jax.random.uniform(k[3], (b, h, s, s)) > p
    return g, probs, mask
  return jax.jit(make)


def _event_times_us(launch, sets, outs, calls):
  """Median over ``calls`` of one launch's CUDA-event time (a pair per call), rotating the
  input sets after ``WARMUP`` calls; each call waits behind a GPU sleep, so the host's
  launch overhead falls inside the sleep, not between the events."""
  sleep = getattr(torch.cuda, "_sleep", None)
  for i in range(WARMUP):
    launch(sets[i % len(sets)], outs[i % len(sets)])
  torch.cuda.synchronize()
  times = []
  for i in range(WARMUP, WARMUP + calls):
    j = i % len(sets)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if sleep is not None:
      sleep(SLEEP_CYCLES)
    start.record()
    launch(sets[j], outs[j])
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) * 1e3)
  return statistics.median(times)


def _write_asm(compiled, out_dir, seq, warps):
  """The kernel's PTX and SASS (else its cubin) as ``b_row_<S>_<warps>.*``; the paths."""
  asm = getattr(compiled, "asm", None)
  if asm is None:
    return []
  stem = os.path.join(out_dir, f"b_row_{seq}_{warps}")
  written = []
  ptx = asm.get("ptx")
  if ptx:
    with open(stem + ".ptx", "w") as f:
      f.write(ptx)
    written.append(stem + ".ptx")
  sass = None
  try:
    sass = asm["sass"]  # recent triton: disassembled on first access (nvdisasm)
  except Exception:  # noqa: BLE001 - no SASS from this triton or toolkit
    try:
      from triton.tools.disasm import get_sass
      sass = get_sass(asm["cubin"]) if asm.get("cubin") else None
    except Exception:  # noqa: BLE001
      sass = None
  if sass:
    with open(stem + ".sass", "w") as f:
      f.write(sass if isinstance(sass, str) else sass.decode())
    written.append(stem + ".sass")
  elif asm.get("cubin"):
    with open(stem + ".cubin", "wb") as f:
      f.write(asm["cubin"])
    written.append(stem + ".cubin")
  return written


# CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (cuda.h's CUfunction_attribute).
_CARVEOUT_ATTRIBUTE = 9


def _set_carveout(compiled, percent):
  """Sets the Triton kernel's preferred shared-memory carveout (percent of the unified
  L1 / shared memory; 100 = the largest shared memory, hence the smallest L1) through the
  driver API; returns the value set. XLA's launches of the Pallas kernels ran with the
  largest shared-memory configuration (ncu: 233 KB, against 135 KB for this kernel)."""
  import ctypes
  init = getattr(compiled, "_init_handles", None)
  if init is not None:
    init()
  cuda = ctypes.CDLL("libcuda.so.1")
  rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(compiled.function),
                               ctypes.c_int(_CARVEOUT_ATTRIBUTE), ctypes.c_int(percent))
  if rc != 0:
    raise RuntimeError(f"cuFuncSetAttribute(carveout={percent}) returned {rc}")
  return percent


def _cell(us, floor_us):
  return f"{us:.1f}/{floor_us / us:.0%}" if us else "-"


def run_workload(index, w, ceiling_tbps, args, warp_labels):
  b, h, s, p = w["batch_size"], w["n_heads"], w["seq_len"], w["p_dropout"]
  dims = (b, h, s)
  floor_us = bench._b_floor(w, {}) / (ceiling_tbps * 1e6)
  sets = bench.input_sets(_make_inputs(w), index, args.max_sets)
  jax.block_until_ready(sets)
  row = {"workload": bench.PROBLEM_B.label(w), **w, "floor_bytes": bench._b_floor(w, {}),
         "floor_us": floor_us, "n_sets": len(sets),
         "pallas": {"config": dataclasses.asdict(
             default_config(s, s, jax.devices()[0].device_kind))},
         "triton": {}}

  # The Pallas kernel: its default config, the JAX profiler.
  fn = lambda g, probs, mask, *keep: pallas_triton.masked_softmax_dropout_backward(
      g, probs, mask, keep[0] if keep else None, p)
  exe = compile_all([fn], sets[0], workers=1)[0]
  ref = None
  if exe is not None:
    t = device_times_us([exe], sets, calls=args.calls, warmup=WARMUP)[0]
    row["pallas"].update(us=t["median_us"], frac_floor=floor_us / t["median_us"],
                         split_ok=t["split_ok"], kernels_per_call=t["kernels_per_call"])
    ref = jax.block_until_ready(exe(*sets[0]))
  else:
    row["pallas"].update(us=None, frac_floor=None)

  # The Triton kernel on the same buffers, one output per input set.
  tsets = [tuple(_torch_view(x) for x in xs) for xs in sets]
  outs = [torch.empty_like(ts[0]) for ts in tsets]
  ref_t = _torch_view(ref) if ref is not None else None
  block = next_power_of_2(s)
  for warps in dict.fromkeys(_warps(label, block) for label in warp_labels):
    entry = {"num_warps": warps}
    try:
      compiled = _launch(dims, p, tsets[0], outs[0], warps)
      torch.cuda.synchronize()
      if args.carveout is not None:
        entry["carveout"] = _set_carveout(compiled, args.carveout)
    except Exception as e:  # noqa: BLE001 - a launch that fails is reported, not fatal
      print(f"  triton {warps} warps failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
      row["triton"][str(warps)] = {**entry, "us": None, "error": str(e)[:500]}
      continue
    entry["n_regs"] = getattr(compiled, "n_regs", None)
    entry["n_spills"] = getattr(compiled, "n_spills", None)
    if ref_t is not None:
      diff = (outs[0] - ref_t).abs()
      entry["max_err"] = float(diff.max())
      entry["allclose"] = bool(torch.allclose(outs[0], ref_t, atol=ATOL, rtol=RTOL))
      del diff
    if s == ASM_SEQ:
      entry["asm_files"] = _write_asm(compiled, args.out, s, warps)
    launch = lambda ts, out, warps=warps: _launch(dims, p, ts, out, warps)
    entry["us"] = _event_times_us(launch, tsets, outs, args.calls)
    entry["frac_floor"] = floor_us / entry["us"]
    # The Pallas kernel's method (the profiler's kernel time) on the same launches.
    try:
      sets_out = [(ts, out) for ts, out in zip(tsets, outs)]
      synced = lambda ts, out: (launch(ts, out), torch.cuda.synchronize())[1]
      prof = device_times_us([synced], sets_out, calls=args.calls, warmup=WARMUP)[0]
      entry["prof_us"] = prof["median_us"] if prof["split_ok"] else None
    except Exception as e:  # noqa: BLE001 - the trace may not hold torch's kernels
      entry["prof_us"] = None
      entry["prof_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    row["triton"][str(warps)] = entry
  row["auto_warps"] = auto_warps(block)
  checked = [e for e in row["triton"].values() if "allclose" in e]
  row["max_err"] = max((e["max_err"] for e in checked), default=None)
  row["passed"] = (ref is not None and len(checked) == len(row["triton"])
                   and all(e["allclose"] for e in checked))
  del sets, tsets, outs, ref, ref_t
  torch.cuda.empty_cache()
  return row


def _fmt(x, spec):
  return "?" if x is None else format(x, spec)


def print_table(rows, warp_labels):
  print("\ntime us / fraction of the floor; Triton: events (prof: the profiler), "
        "regs/spills per thread")
  cols = [f"triton({label})" for label in warp_labels]
  print(f"{'workload':>22} {'floor us':>8} {'pallas us/%':>12} "
        + " ".join(f"{c:>34}" for c in cols) + f" {'max err':>8}")
  for r in rows:
    cells = []
    for label in warp_labels:
      warps = r["auto_warps"] if label == "auto" else int(label)
      e = r["triton"].get(str(warps), {})
      if not e.get("us"):
        cells.append(f"{'failed':>34}")
        continue
      prof = f"{e['prof_us']:.1f}" if e.get("prof_us") else "?"
      cell = (f"w{warps} {_cell(e['us'], r['floor_us'])} prof {prof} "
              f"{_fmt(e.get('n_regs'), 'd')}/{_fmt(e.get('n_spills'), 'd')}")
      cells.append(f"{cell:>34}")
    mark = "" if r["passed"] else " FAIL"
    print(f"{r['workload']:>22} {r['floor_us']:8.1f} "
          f"{_cell(r['pallas'].get('us'), r['floor_us']):>12} " + " ".join(cells)
          + f" {_fmt(r['max_err'], '.1e'):>8}{mark}")
  for label in warp_labels:
    pairs = []
    for r in rows:
      e = r["triton"].get(str(r["auto_warps"] if label == "auto" else int(label)), {})
      if e.get("us") and r["pallas"].get("us"):
        pairs.append(r["pallas"]["us"] / e["us"])
    if pairs:
      print(f"  triton({label}): geomean pallas time / triton time {bench.geomean(pairs):.3f} "
            f"over {len(pairs)} workloads")


def _selected(workloads, only):
  """Indices of the workloads named by ``--only`` (B,H,S triples), else all."""
  if not only:
    return list(range(len(workloads)))
  triples = [tuple(int(x) for x in t.split(",")) for arg in only for t in arg.split(";")
             if t.strip()]
  for t in triples:
    if len(t) != 3:
      raise SystemExit(f"--only: expected B,H,S triples, got {t}")
  dims = lambda w: (w["batch_size"], w["n_heads"], w["seq_len"])
  missing = [t for t in triples if not any(dims(w) == t for w in workloads)]
  if missing:
    raise SystemExit(f"--only: no workload {missing}")
  return [i for i, w in enumerate(workloads) if dims(w) in triples]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--out", default=".")
  parser.add_argument("--warps", default="auto",
                      help="comma-separated warps of the Triton kernel; auto: the heuristic's")
  parser.add_argument("--only", action="append", default=None,
                      help="B,H,S triples, ';'-separated (or the flag repeated)")
  parser.add_argument("--carveout", type=int, default=None,
                      help="the Triton kernel's preferred shared-memory carveout, percent")
  parser.add_argument("--max-sets", type=int, default=32,
                      help="input sets rotated per workload, at most (together >= 256 MB)")
  args = parser.parse_args(argv)
  warp_labels = list(dict.fromkeys(x.strip() for x in args.warps.split(",") if x.strip()))
  for label in warp_labels:
    if label != "auto" and not (label.isdigit() and int(label) in (1, 2, 4, 8, 16, 32)):
      parser.error(f"--warps: {label!r} is neither auto nor a power of two <= 32")
  # Torch and JAX share the GPU: JAX must not take 75% of it at its first use (no_gpu).
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if no_gpu("timing the Triton row kernel against the Pallas kernel", "nothing timed"):
    return 2
  _import_gpu_libs()
  os.makedirs(args.out, exist_ok=True)
  start = time.time()
  with open(os.path.join(bench.HERE, "workloads.json")) as f:
    workloads = json.load(f)["masked_softmax_dropout_backward"]["workloads"]
  indices = _selected(workloads, args.only)
  device_kind = jax.devices()[0].device_kind
  ceiling = copy_ceiling()
  print(f"{device_kind}, jax {jax.__version__}, triton {triton.__version__}, torch "
        f"{torch.__version__}, commit {bench._commit()}; copy ceiling {ceiling['TBps']:.3f} "
        f"TB/s ({ceiling['method']})", flush=True)
  rows = []
  for i in indices:
    row = run_workload(i, workloads[i], ceiling["TBps"], args, warp_labels)
    rows.append(row)
    tr = ", ".join(f"w{k} {_cell(e.get('us'), row['floor_us'])}"
                   for k, e in row["triton"].items())
    print(f"  {row['workload']:>22}: floor {row['floor_us']:.1f} us, pallas "
          f"{_cell(row['pallas'].get('us'), row['floor_us'])}, triton {tr}, max err "
          f"{_fmt(row['max_err'], '.1e')}{'' if row['passed'] else ' FAIL'} "
          f"[{time.time() - start:.0f} s]", flush=True)
  print_table(rows, warp_labels)
  with open(os.path.join(args.out, "b_triton_row.json"), "w") as f:
    json.dump({"device": device_kind, "jax": jax.__version__, "triton": triton.__version__,
               "torch": torch.__version__, "commit": bench._commit(), "ceiling": ceiling,
               "calls": args.calls, "warmup": WARMUP, "warps": warp_labels,
               "atol": ATOL, "rtol": RTOL, "rows": rows}, f, indent=1)
  print(f"\n{time.time() - start:.0f} s")
  return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
