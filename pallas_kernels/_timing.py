"""Device-time measurement with the JAX profiler, and the copy-bandwidth ceiling.

The tuner (``python -m pallas_kernels.tune``), ``python -m pallas_kernels.check`` and the
scripts in ``benchmarks/`` share it. Each call's time is the sum of the durations of every
GPU kernel (and memset or memcpy) it launched, read from the profiler's trace of the
``/device:GPU:0`` plane's stream lines; the reported figure is the median over calls. Calls are
separated by a host sync and a short sleep, so the trace splits into calls at
idle gaps. Callers rotate several input sets so no call finds its inputs in L2.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._util import compiler_params, pallas_call


def no_gpu(what: str, hint: str | None = None) -> bool:
  """Whether this host lacks the CUDA GPU that ``what`` needs; if so, says it on stderr
  (with ``hint``, what to do instead). A script's ``main`` then returns 2."""
  backend = jax.default_backend()
  if backend == "gpu":
    return False
  print(f"{what} needs a CUDA GPU (jax.default_backend() is {backend!r})"
        + (f"; {hint}" if hint else ""), file=sys.stderr)
  return True


def compile_all(fns, args, *, workers: int = 8):
  """Ahead-of-time compiles of ``jax.jit(fn)`` for ``args``, several at once (compiling
  Triton kernels is host-bound and releases the GIL). A candidate that fails to compile
  (too much shared memory, say) is ``None``; its error is printed."""
  def one(fn):
    try:
      return jax.jit(fn).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - a failed candidate is skipped, not fatal
      print(f"  compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
      return None
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(one, fns))


_GAP_NS = 100_000  # idle time that separates two calls on the device


def _device_events(trace_dir, names=False):
  """``(start_ns, duration_ns)`` of every kernel on the GPU's stream lines, sorted; with
  ``names``, ``(start_ns, duration_ns, kernel name)``."""
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not paths:
    raise RuntimeError(f"no profiler trace written under {trace_dir}")
  profile = jax.profiler.ProfileData.from_file(max(paths, key=os.path.getmtime))
  events = []
  for plane in profile.planes:
    if plane.name != "/device:GPU:0":
      continue
    if os.environ.get("BENCH_DEBUG"):
      print("trace lines:", [(l.name, sum(1 for _ in l.events)) for l in plane.lines])
    for line in plane.lines:
      # Stream lines hold the kernels; other lines ("XLA Ops", ...) summarise them again.
      if not line.name.startswith("Stream"):
        continue
      events.extend((e.start_ns, e.duration_ns, e.name) if names else
                    (e.start_ns, e.duration_ns) for e in line.events)
  return sorted(events)


def _split(events, gap_ns):
  """Groups of events (``(start, duration, ...)`` tuples, sorted by start) separated by idle
  gaps longer than ``gap_ns``."""
  groups, last_end = [], None
  for event in events:
    start, dur = event[0], event[1]
    if last_end is None or start - last_end > gap_ns:
      groups.append([])
    groups[-1].append(event)
    last_end = start + dur if last_end is None else max(last_end, start + dur)
  return groups


_FN_GAP_S = 0.05  # host sleep between two functions' calls: splits the trace per function


def _traced_events(fns, arg_sets, calls, warmup, names=False):
  """The device events (:func:`_device_events`) of ``calls`` calls of each of ``fns``, one
  function after the other in one profiler trace, after ``warmup`` untraced calls each."""
  for fn in fns:
    for i in range(warmup):
      jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    try:
      for fn in fns:
        time.sleep(_FN_GAP_S)
        for i in range(calls):
          jax.block_until_ready(fn(*arg_sets[(i + warmup) % len(arg_sets)]))
          time.sleep(0.0005)
    finally:
      jax.profiler.stop_trace()
    return _device_events(trace_dir, names=names)


def device_times_us(fns, arg_sets, *, calls: int = 30, warmup: int = 3) -> list[dict]:
  """Median device time of each ``fn(*arg_sets[i % len(arg_sets)])``, in microseconds.

  All functions run inside one profiler trace, one after the other, ``calls``
  calls each. The trace splits into functions at long idle gaps and into calls
  at short ones; if a function's calls cannot be told apart, its figure is the
  mean over its calls and ``split_ok`` is False.
  """
  events = _traced_events(fns, arg_sets, calls, warmup)
  segments = _split(events, int(_FN_GAP_S * 1e9 / 2))
  if len(segments) != len(fns):
    raise RuntimeError(f"trace split into {len(segments)} segments for {len(fns)} functions")
  results = []
  for segment in segments:
    per_call = [sum(d for _, d in g) / 1e3 for g in _split(segment, _GAP_NS)]
    if len(per_call) == calls:
      results.append({"median_us": statistics.median(per_call),
                      "kernels_per_call": sorted(len(g) for g in _split(segment, _GAP_NS))[calls // 2],
                      "split_ok": True})
    else:
      results.append({"median_us": sum(per_call) / calls, "kernels_per_call": -1,
                      "split_ok": False})
  return results


def kernel_breakdown_us(fn, arg_sets, *, calls: int = 20, warmup: int = 3) -> list[dict]:
  """Where a call's device time goes: per kernel name, the median over calls of its summed
  duration in a call (us) and its launches per call, largest first (calls told apart at
  idle gaps, as :func:`device_times_us` does)."""
  groups = _split(_traced_events([fn], arg_sets, calls, warmup, names=True), _GAP_NS)
  if len(groups) != calls:
    raise RuntimeError(f"the trace split into {len(groups)} calls, not {calls}")
  names = sorted({n for g in groups for _, _, n in g})
  rows = []
  for name in names:
    per_call = [sum(d for _, d, n in g if n == name) / 1e3 for g in groups]
    count = [sum(1 for _, _, n in g if n == name) for g in groups]
    rows.append({"kernel": name, "median_us": statistics.median(per_call),
                 "launches": statistics.median(count)})
  return sorted(rows, key=lambda r: -r["median_us"])


def device_time_us(fn, arg_sets, *, calls: int = 30, warmup: int = 3) -> dict:
  """``device_times_us`` for a single function."""
  return device_times_us([fn], arg_sets, calls=calls, warmup=warmup)[0]


def _copy_kernel(x_ref, o_ref, *, block):
  i = pl.program_id(0)
  v = pltriton.load(x_ref.at[pl.ds(i * block, block)])
  pltriton.store(o_ref.at[pl.ds(i * block, block)], v)


def copy_fns(n: int, *, block: int, num_warps: int):
  """Jitted copies of ``n`` fp32 elements (``n`` a multiple of ``block``): XLA's ``x * 2``
  and a Pallas copy kernel of ``block`` elements per program."""
  pallas_copy = jax.jit(lambda x: pallas_call(
      lambda a, o: _copy_kernel(a, o, block=block),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(n // block,),
      compiler_params=compiler_params(num_warps, 1))(x))
  return {"xla_scale": jax.jit(lambda x: x * 2.0), "pallas_copy": pallas_copy}


def copy_ceiling(nbytes: int = 2 << 30) -> dict:
  """Device-to-device copy bandwidth (bytes read + written per second), the
  fastest of: a Pallas copy kernel, XLA's copy, and PyTorch's memcpy if installed."""
  n = nbytes // 4
  block = 16384
  n -= n % block
  xs = [jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(2)]
  moved = 2 * n * 4
  results = {}
  fns = copy_fns(n, block=block, num_warps=8)
  for name in ("pallas_copy", "xla_scale"):
    results[name] = moved / device_time_us(fns[name], [(x,) for x in xs],
                                           calls=10)["median_us"] / 1e6
  try:
    import torch  # the GPU image has it; it is no dependency of the project
    if torch.cuda.is_available():
      a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
      b = torch.empty_like(a)
      times = []
      for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
      results["torch_memcpy"] = 2 * nbytes / statistics.median(times[3:]) / 1e6
      del a, b
  except ImportError:
    pass
  best = max(results, key=results.get)
  return {"TBps": results[best], "method": best, "all_TBps": results}
