"""Times kernel B's load/store variants against its default config on the 16 workloads.

Usage (on a GPU; about 2-3 minutes on an H200)::

    PYTHONPATH=. python3 -m benchmarks.b_variants [--calls 10] [--json OUT.json] [--workloads 0,3]
    PYTHONPATH=. python3 -m benchmarks.b_variants --dry-run   # any host: builds every variant
        for the 16 workloads, checks them on tiny shapes in interpret mode; no timing

The question: a public Triton row kernel (one program per row, the whole row in registers,
g/P/keep loaded with ``cache_modifier=".cg"``, the output stored evict-first, the head-shared
mask loaded with ``".ca"`` after the row sum, a few heads per program on short rows) is
faster than ours on 14 of the 16 workloads. For each workload this times, in one profiler
trace with rotated inputs (``benchmarks.timing.device_times_us``), the default config (the
tuned table's) and variants built from the new ``Config`` fields:

* on our tiling (the default's block rows, warps and split): ``.cg`` streamed loads, the
  mask with ``.ca`` (with the streams or after the sum), an evict-first store, and mixes;
* the public-like design (``split=False``, ``.cg`` streams without an eviction hint, ``.ca``
  mask after the sum, evict-first store) at 1 row per program with half, the public
  heuristic's and twice the warps (4 below rows of 2048, 8 below 4096, else 16), at 2 rows,
  with 2 and 4 heads per program on rows of <= 512, and with split columns on ragged rows.

Each variant is checked against the reference with the workload's tolerance (the spec's
acceptance: >= 99% of elements within ``atol + rtol * |ref|``, no NaN/Inf); the floor is the
problem's minimum bytes over the copy bandwidth measured in the same run
(``benchmarks.timing.copy_ceiling``). Prints one row per workload (floor, then time and
fraction of the floor per variant, and the best variant), then per variant the geomean
fraction of the floor and on how many workloads it beats the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax

from benchmarks import run as bench
from benchmarks.timing import compile_all, copy_ceiling, device_times_us, no_gpu
from jax_ops import reference
from pallas_kernels import masked_softmax_dropout as msd
from pallas_kernels._util import next_power_of_2

# The public-like design's load/store fields (with block_rows, num_warps, heads_per_program).
PUBLIC = dict(split=False, stream_cache=".cg", stream_eviction=None, mask_cache=".ca",
              mask_after_sum=True, store_eviction="evict_first")

# Column order of the table; a variant that does not apply to a workload is left blank.
NAMES = ["default", "cg", "cg+ca", "cg+ca_after", "st_ef", "cg+st_ef", "cg_noev+st_ef",
         "pub_r1_w/2", "pub_r1_w", "pub_r1_2w", "pub_r2_w", "pub_h2_w", "pub_h4_w",
         "pub_split_w"]


def public_warps(seq_k: int) -> int:
  """The public row kernel's warps for a row padded to ``next_power_of_2(seq_k)``."""
  width = next_power_of_2(seq_k)
  return 4 if width < 2048 else 8 if width < 4096 else 16


# The second set: the order of the programs (Config.row_group) and 32 warps on long rows.
ORDER_NAMES = ["default", "rg1", "rg8", "rg64", "rows", "pub_r1_w", "pub_rows_w",
               "pub_rows_2w", "pub_rg8_w", "rows_32w", "pub_rows_32w"]
ALL = 1 << 30  # a row group capped at every row block of a head: rows fastest


def order_variants(seq_q: int, seq_k: int, default: msd.Config) -> dict[str, msd.Config]:
  """The program-order configs for rows of ``seq_k``: the default's tiling with one head's
  row blocks in groups of 1 (the default's order, on a 1-D grid), 8, 64 or all of them,
  and the public-like design (1 row per program) in the default order, rows fastest and in
  groups of 8; on rows of >= 2048, 32 warps."""
  r = dataclasses.replace
  w = public_warps(seq_k)
  out = {"default": default, "rg1": r(default, row_group=1), "rg8": r(default, row_group=8),
         "rg64": r(default, row_group=64), "rows": r(default, row_group=ALL),
         "pub_r1_w": msd.Config(1, w, **PUBLIC),
         "pub_rows_w": msd.Config(1, w, row_group=ALL, **PUBLIC),
         "pub_rows_2w": msd.Config(1, min(32, 2 * w), row_group=ALL, **PUBLIC),
         "pub_rg8_w": msd.Config(1, w, row_group=8, **PUBLIC)}
  if next_power_of_2(seq_k) >= 2048:
    out["rows_32w"] = r(default, num_warps=32, row_group=ALL)
    out["pub_rows_32w"] = msd.Config(1, 32, row_group=ALL, **PUBLIC)
  assert set(out) <= set(ORDER_NAMES), set(out) - set(ORDER_NAMES)
  return out


# The third set: a loop over row blocks per program with the next block's loads prefetched.
LOOP_NAMES = ["default", "rows", "loop2", "loop4", "loop8", "loop16", "loop4_2w", "loop8_2w",
              "loop4_w/2", "loop4_1r", "loop4_1r_ca"]


def loop_variants(seq_q: int, seq_k: int, default: msd.Config) -> dict[str, msd.Config]:
  """The row-block loop (``blocks_per_program``) on the default's tiling at 2-16 blocks per
  program, at twice and half the warps, and at one row per block (``_ca``: with the public
  design's loads), against the default and rows fastest."""
  r = lambda c, **kw: dataclasses.replace(c, **{"row_group": 0, **kw})  # the loop's order
  w = default.num_warps
  out = {"default": default, "rows": r(default, row_group=ALL)}
  for n in (2, 4, 8, 16):
    out[f"loop{n}"] = r(default, blocks_per_program=n)
  if w < 32:
    out["loop4_2w"] = r(default, blocks_per_program=4, num_warps=2 * w)
    out["loop8_2w"] = r(default, blocks_per_program=8, num_warps=2 * w)
  if w > 1:
    out["loop4_w/2"] = r(default, blocks_per_program=4, num_warps=w // 2)
  if default.block_rows > 1:
    out["loop4_1r"] = r(default, block_rows=1, blocks_per_program=4 * default.block_rows)
  out["loop4_1r_ca"] = msd.Config(1, public_warps(seq_k), blocks_per_program=4, **PUBLIC)
  assert set(out) <= set(LOOP_NAMES), set(out) - set(LOOP_NAMES)
  return out


# The fourth set: two passes over column chunks per row (Config.chunk).
TWO_PASS_NAMES = ["default", "rows", "tp256_1w", "tp512_1w", "tp512_2w", "tp1024_2w",
                  "tp1024_4w", "tp2048_8w", "tp1024_4w_noev", "tp512_2w_rows", "tp1024_4w_2r"]


def two_pass_variants(seq_q: int, seq_k: int, default: msd.Config) -> dict[str, msd.Config]:
  """One row per program, walked twice in chunks of 256-2048 columns at 8 or 16 elements
  per thread, the first pass evict-last (``_noev``: no hint), in the default order
  (``_rows``: rows fastest; ``_2r``: two rows per program); only chunks narrower than the
  padded row."""
  r = dataclasses.replace
  width = next_power_of_2(seq_k)
  out = {"default": default, "rows": r(default, row_group=ALL)}
  tp = lambda chunk, warps, **kw: msd.Config(
      kw.pop("rows", 1), warps, False, chunk=chunk, stream_eviction=kw.pop("ev", "evict_last"),
      store_eviction="evict_first", **kw)
  for name, chunk, warps, kw in [("tp256_1w", 256, 1, {}), ("tp512_1w", 512, 1, {}),
                                 ("tp512_2w", 512, 2, {}), ("tp1024_2w", 1024, 2, {}),
                                 ("tp1024_4w", 1024, 4, {}), ("tp2048_8w", 2048, 8, {}),
                                 ("tp1024_4w_noev", 1024, 4, {"ev": None}),
                                 ("tp512_2w_rows", 512, 2, {"row_group": ALL}),
                                 ("tp1024_4w_2r", 1024, 4, {"rows": 2})]:
    if chunk < width:
      out[name] = tp(chunk, warps, **kw)
  assert set(out) <= set(TWO_PASS_NAMES), set(out) - set(TWO_PASS_NAMES)
  return out


# The fifth set: the row-block loop left to Triton's pipeliner (num_stages), no prefetch.
PIPELINE_NAMES = ["default", "loop2", "loop4_s2", "loop4_s3", "loop8_s2", "loop8_s3",
                  "loop4_pf_s2"]


def pipeline_variants(seq_q: int, seq_k: int, default: msd.Config) -> dict[str, msd.Config]:
  """``blocks_per_program`` 4 and 8 without the prefetch at 2 and 3 pipeline stages, the
  prefetching loop at 2 stages, against the default and the prefetching loop of 2."""
  r = lambda c, **kw: dataclasses.replace(c, row_group=0, **kw)  # the loop's order
  out = {"default": default, "loop2": r(default, blocks_per_program=2)}
  for n in (4, 8):
    for st in (2, 3):
      out[f"loop{n}_s{st}"] = r(default, blocks_per_program=n, prefetch=False, num_stages=st)
  out["loop4_pf_s2"] = r(default, blocks_per_program=4, num_stages=2)
  assert set(out) <= set(PIPELINE_NAMES), set(out) - set(PIPELINE_NAMES)
  return out


# The sixth set: launches that need no shared memory (every row inside one warp). XLA sets
# CU_FUNC_CACHE_PREFER_SHARED on each kernel it launches with dynamic shared memory, which
# leaves about 23 KB of L1 for the loads in flight on an H200; a kernel without any keeps
# the driver's carveout. Triton reduces across warps through shared memory, so these are
# one warp per program (rows of <= 128 fp32 fit one warp at any count).
SMEM0_NAMES = ["default", "1w", "pub_1w", "pub_2r_1w", "pub_4r_1w", "pub_split_1w",
               "pub_1w_rows", "tp512_1w", "tp1024_1w", "tp2048_1w", "r8_8w"]


def smem0_variants(seq_q: int, seq_k: int, default: msd.Config) -> dict[str, msd.Config]:
  """The default's tiling on one warp (where it holds <= 2048 elements), the public-like
  design on one warp at 1, 2 and 4 rows per program (rows fastest: ``_rows``; split columns
  on ragged rows), rows of >= 2048 walked twice in chunks of 512-2048 columns on one warp,
  and rows of <= 128 at 8 rows on 8 warps (a row per warp)."""
  r = dataclasses.replace
  width = next_power_of_2(seq_k)
  out = {"default": default}
  if default.block_rows * sum(w for _, w in msd.column_chunks(seq_k, default.split)) <= 2048:
    out["1w"] = r(default, num_warps=1)
  if width <= 2048:
    out["pub_1w"] = msd.Config(1, 1, **PUBLIC)
    out["pub_1w_rows"] = msd.Config(1, 1, row_group=ALL, **PUBLIC)
    if seq_k & (seq_k - 1):
      out["pub_split_1w"] = msd.Config(1, 1, **{**PUBLIC, "split": True})
  if width <= 1024 and seq_q > 1:
    out["pub_2r_1w"] = msd.Config(2, 1, **PUBLIC)
  if width <= 512 and seq_q > 3:
    out["pub_4r_1w"] = msd.Config(4, 1, **PUBLIC)
  if width >= 2048:
    for chunk in (512, 1024, 2048):
      if chunk < width:
        out[f"tp{chunk}_1w"] = msd.Config(1, 1, False, chunk=chunk,
                                          stream_eviction="evict_last",
                                          store_eviction="evict_first")
  if width <= 128:
    out["r8_8w"] = msd.Config(8, 8, **PUBLIC)
  assert set(out) <= set(SMEM0_NAMES), set(out) - set(SMEM0_NAMES)
  return out


# The seventh set: one row per program on one warp per 128 columns, the warps' partial row
# sums meeting through a small global buffer instead of shared memory (Config.warp_rows), so
# that a multi-warp row needs no shared memory and keeps the driver's carveout.
WARP_ROWS_NAMES = ["default", "wr", "wr_pub", "wr_cg", "wr_ef_ld"]


def warp_rows_variants(seq_q: int, seq_k: int, default: msd.Config) -> dict[str, msd.Config]:
  """``warp_rows`` with the default's load hints (where they apply), with the public loads
  (g, P, keep ``.cg``; the mask ``.ca`` after the sum; an evict-first store), with ``.cg``
  streams and the mask loaded first, and with evict-first loads and store."""
  del seq_q
  w = msd.warp_rows_warps(seq_k)
  wr = dict(block_rows=1, num_warps=w, split=False, warp_rows=True)
  hints = {k: getattr(default, k) for k in ("stream_cache", "stream_eviction", "mask_cache",
                                            "mask_eviction", "mask_after_sum",
                                            "store_eviction")}
  out = {"default": default, "wr": msd.Config(**wr, **hints),
         "wr_pub": msd.Config(**{**wr, **PUBLIC}),
         "wr_cg": msd.Config(**wr, stream_cache=".cg", stream_eviction=None,
                             store_eviction="evict_first"),
         "wr_ef_ld": msd.Config(**wr, store_eviction="evict_first")}
  assert set(out) <= set(WARP_ROWS_NAMES), set(out) - set(WARP_ROWS_NAMES)
  return out


# The eighth set: the latency-bound workloads (floors of 1.6-4.2 us). warp_rows on two warps
# with evict-first streams and the mask loaded with them measured 2.9 against the default's
# 3.5 us at (2, 4, 256) (fb79d82); which of its parts does that: the streams' hint, the
# mask's place, or the two warps?
LATENCY_NAMES = ["default", "ef", "mf", "ef_mf", "1w_ef_mf", "2w_ef_mf", "wr_ef_mf",
                 "2r_2w_ef_mf"]


def latency_variants(seq_q: int, seq_k: int, default: msd.Config) -> dict[str, msd.Config]:
  """The default with evict-first streams (no cache modifier), with the mask loaded with the
  streams, and both; one row on one and on two warps (the row kernel, a cross-warp sum in
  shared memory) and on ``warp_rows`` warps with both; two rows on two warps with both."""
  r = dataclasses.replace
  ef = dict(stream_cache=None, stream_eviction="evict_first")
  mf = dict(mask_cache=None, mask_after_sum=False)
  plain = dict(block_rows=1, split=False, store_eviction="evict_first", **ef, **mf)
  out = {"default": default, "ef": r(default, **ef), "mf": r(default, **mf),
         "ef_mf": r(default, **ef, **mf), "1w_ef_mf": msd.Config(num_warps=1, **plain),
         "2w_ef_mf": msd.Config(num_warps=2, **plain),
         "wr_ef_mf": msd.Config(num_warps=msd.warp_rows_warps(seq_k), warp_rows=True,
                                **plain)}
  if seq_q > 1:
    out["2r_2w_ef_mf"] = msd.Config(num_warps=2, **{**plain, "block_rows": 2})
  assert set(out) <= set(LATENCY_NAMES), set(out) - set(LATENCY_NAMES)
  return out


def variants(seq_q: int, seq_k: int, default: msd.Config) -> dict[str, msd.Config]:
  """The configs to time for rows of ``seq_k`` (``default``: the tuned config), by name."""
  r = dataclasses.replace
  out = {
      "default": default,
      "cg": r(default, stream_cache=".cg", stream_eviction=None),
      "cg+ca": r(default, stream_cache=".cg", stream_eviction=None, mask_cache=".ca"),
      "cg+ca_after": r(default, stream_cache=".cg", stream_eviction=None, mask_cache=".ca",
                       mask_after_sum=True),
      "st_ef": r(default, store_eviction="evict_first"),
      "cg+st_ef": r(default, stream_cache=".cg", stream_eviction=None,
                    store_eviction="evict_first"),
      "cg_noev+st_ef": r(default, stream_cache=".cg", stream_eviction=None,
                         store_eviction="evict_first"),
  }
  w = public_warps(seq_k)
  out["pub_r1_w/2"] = msd.Config(1, max(1, w // 2), **PUBLIC)
  out["pub_r1_w"] = msd.Config(1, w, **PUBLIC)
  out["pub_r1_2w"] = msd.Config(1, min(16, 2 * w), **PUBLIC)
  if seq_q > 1:
    out["pub_r2_w"] = msd.Config(2, w, **PUBLIC)
  if next_power_of_2(seq_k) <= 512:
    out["pub_h2_w"] = msd.Config(1, w, heads_per_program=2, **PUBLIC)
    out["pub_h4_w"] = msd.Config(1, w, heads_per_program=4, **PUBLIC)
  if seq_k & (seq_k - 1):
    out["pub_split_w"] = msd.Config(1, w, **{**PUBLIC, "split": True})
  assert set(out) <= set(NAMES), set(out) - set(NAMES)
  return out


def _label(c: msd.Config) -> str:
  """A short spelling of a config for the legend."""
  extra = [f"{f.name}={getattr(c, f.name)!r}" for f in dataclasses.fields(c)[3:]
           if getattr(c, f.name) != f.default]
  return f"{c.block_rows}r/{c.num_warps}w/{'split' if c.split else 'pad'}" + (
      " " + " ".join(extra) if extra else "")


def _backward(config, p):
  return lambda g, probs, m, keep: msd.masked_softmax_dropout_backward(
      g, probs, m, keep, p, config=config)


def _input_sets(w, index, count):
  make = lambda i: bench.PROBLEM_B.make_inputs(w, {}, jax.random.key(9000 + 100 * index + i))
  first = make(0)
  set_bytes = sum(x.size * x.dtype.itemsize for x in first)
  n_sets = int(min(count, max(2, math.ceil(bench._ROTATE_BYTES / set_bytes))))
  return [first] + [make(i) for i in range(1, n_sets)]


SETS = {"loads": (variants, NAMES), "order": (order_variants, ORDER_NAMES),
        "loop": (loop_variants, LOOP_NAMES), "two_pass": (two_pass_variants, TWO_PASS_NAMES),
        "pipeline": (pipeline_variants, PIPELINE_NAMES),
        "smem0": (smem0_variants, SMEM0_NAMES),
        "warp_rows": (warp_rows_variants, WARP_ROWS_NAMES),
        "latency": (latency_variants, LATENCY_NAMES)}


def run_workload(index, w, ceiling_tbps, calls, device_kind, make=variants):
  s, p = w["seq_len"], w["p_dropout"]
  default = msd.default_config(s, s, device_kind)
  named = make(s, s, default)
  configs = list(dict.fromkeys(named.values()))  # identical configs compile and time once
  sets = _input_sets(w, index, calls + 2)
  compiled = compile_all([_backward(c, p) for c in configs], sets[0])
  ref = jax.jit(lambda *a: reference.masked_softmax_dropout_backward_reference(*a, p))(*sets[0])
  checks = {}
  for c, exe in zip(configs, compiled):
    if exe is not None:
      checks[c] = bench.check(exe(*sets[0]), ref, w["atol"], w["rtol"])
  del ref
  ok = [(c, exe) for c, exe in zip(configs, compiled) if exe is not None]
  times = device_times_us([exe for _, exe in ok], sets, calls=calls, warmup=2)
  by_config = {c: t["median_us"] for (c, _), t in zip(ok, times)}
  floor_us = bench._b_floor(w, {}) / (ceiling_tbps * 1e6)
  del sets
  return make_row(w, floor_us, named, by_config, checks)


def make_row(w, floor_us, named, by_config, checks) -> dict:
  """One workload's results: per variant name its config, time, fraction of the floor and
  check (``by_config``/``checks`` lack the configs that did not compile), and the best."""
  row = {"workload": bench.PROBLEM_B.label(w), **w, "floor_us": floor_us, "variants": {}}
  for name, c in named.items():
    entry = {"config": dataclasses.asdict(c), "label": _label(c)}
    if c in by_config:
      entry.update(us=by_config[c], frac_floor=floor_us / by_config[c], check=checks[c],
                   passed=checks[c]["ok"])
    else:
      entry.update(us=None, passed=False)  # did not compile
    row["variants"][name] = entry
  passed = {n: v for n, v in row["variants"].items() if v["passed"]}
  row["best"] = min(passed, key=lambda n: passed[n]["us"]) if passed else None
  return row


def _cell(v) -> str:
  if v is None:
    return ""
  if v["us"] is None:
    return "no-compile"
  mark = "" if v["passed"] else "!FAIL"
  return f"{v['us']:.1f}/{v['frac_floor']:.0%}{mark}"


def print_table(rows, order=NAMES):
  names = [n for n in order if any(n in r["variants"] for r in rows)]
  width = max(10, *(len(n) for n in names))
  head = f"{'workload':>22} {'floor us':>8} " + " ".join(f"{n:>{width}}" for n in names)
  print("\ntime us / fraction of the floor per variant (!FAIL: misses the tolerance)")
  print(head + "  best (vs default)")
  for r in rows:
    cells = " ".join(f"{_cell(r['variants'].get(n)):>{width}}" for n in names)
    best = r["best"]
    gain = ""
    if best and r["variants"]["default"]["us"]:
      gain = f" ({r['variants']['default']['us'] / r['variants'][best]['us']:.2f}x)"
    print(f"{r['workload']:>22} {r['floor_us']:8.1f} {cells}  {best}{gain}")
  print("\nper variant: geomean fraction of the floor over the workloads it ran and passed; "
        "workloads faster than the default")
  for n in names:
    fr = [r["variants"][n]["frac_floor"] for r in rows
          if n in r["variants"] and r["variants"][n]["passed"]]
    wins = sum(1 for r in rows if n in r["variants"] and r["variants"][n]["passed"]
               and r["variants"]["default"]["us"] and
               r["variants"][n]["us"] < r["variants"]["default"]["us"])
    ran = sum(1 for r in rows if n in r["variants"])
    gm = bench.geomean(fr) if fr else float("nan")
    print(f"  {n:>{width}}: {gm:6.1%} over {len(fr)}/{ran}; faster than default on {wins}")
  print("\nconfigs per workload:")
  for r in rows:
    print(f"  {r['workload']}: " + "; ".join(f"{n}={v['label']}" for n, v in r["variants"].items()))


def dry_run(make=variants, order=NAMES) -> int:
  """No GPU: every variant of every workload is built; the variants of a few tiny shapes run
  in interpret mode against the reference (the workload tolerance, 1e-5)."""
  with open(os.path.join(bench.HERE, "workloads.json")) as f:
    workloads = json.load(f)["masked_softmax_dropout_backward"]["workloads"]
  total = 0
  for w in workloads:
    s = w["seq_len"]
    total += len(make(s, s, msd.default_config(s, s, "NVIDIA H200")))
  print(f"{len(workloads)} workloads, {total} (workload, variant) pairs built")
  failures, rows = 0, []
  for (b, h, s), p in [((2, 3, 7), 0.1), ((1, 2, 128), 0.0), ((2, 3, 131), 0.15)]:
    w = {"batch_size": b, "n_heads": h, "seq_len": s, "p_dropout": p, "atol": 1e-5,
         "rtol": 1e-5}
    args = bench.PROBLEM_B.make_inputs(w, {}, jax.random.key(s))
    ref = reference.masked_softmax_dropout_backward_reference(*args, p)
    named = make(s, s, msd.default_config(s, s, "NVIDIA H200"))
    checks = {}
    for name, c in named.items():
      out = msd.masked_softmax_dropout_backward(*args, p, config=c, interpret=True)
      checks[c] = bench.check(out, ref, w["atol"], w["rtol"])
      failures += not checks[c]["ok"]
      print(f"  ({b}, {h}, {s}, {p}) {name:>14} {'ok' if checks[c]['ok'] else 'FAIL'} "
            f"{checks[c]['within']:.4%}  {_label(c)}", flush=True)
    # The table with made-up times, to check the report itself.
    fake = {c: 1.0 + i for i, c in enumerate(checks)}
    rows.append(make_row(w, 0.5, named, fake, checks))
  print_table(rows, order)
  print("\ndry run (times above are made up):",
        "all variants match the reference" if not failures else f"{failures} FAIL")
  return 1 if failures else 0


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=10)
  parser.add_argument("--workloads", default=None, help="comma-separated indices (default: all)")
  parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
  parser.add_argument("--set", choices=sorted(SETS), default="loads",
                      help="loads: cache hints and the public-like tiling; order: the order "
                           "of the programs (row_group) and 32 warps; loop: row blocks walked "
                           "in a loop with a prefetch (blocks_per_program); two_pass: rows "
                           "walked twice in column chunks (chunk); pipeline: the loop with "
                           "Triton's pipeliner (num_stages); smem0: one warp per row, so "
                           "no shared memory; warp_rows: one row per program on one warp "
                           "per 128 columns, partial sums through global memory; latency: the "
                           "latency-bound workloads' loads and warps")
  parser.add_argument("--dry-run", action="store_true",
                      help="no GPU: build the variants, check them on tiny shapes (interpret)")
  args = parser.parse_args(argv)
  make, order = SETS[args.set]
  if args.dry_run:
    return dry_run(make, order)
  if no_gpu("timing", "use --dry-run here"):
    return 2
  start = time.time()
  with open(os.path.join(bench.HERE, "workloads.json")) as f:
    workloads = json.load(f)["masked_softmax_dropout_backward"]["workloads"]
  indices = ([int(i) for i in args.workloads.split(",")] if args.workloads
             else range(len(workloads)))
  device_kind = jax.devices()[0].device_kind
  ceiling = copy_ceiling()
  print(f"{device_kind}, jax {jax.__version__}, commit {bench._commit()}; copy ceiling "
        f"{ceiling['TBps']:.3f} TB/s ({ceiling['method']})", flush=True)
  rows = []
  for i in indices:
    row = run_workload(i, workloads[i], ceiling["TBps"], args.calls, device_kind, make)
    rows.append(row)
    v = row["variants"]
    print(f"  {row['workload']:>22}: floor {row['floor_us']:.1f} us, default "
          f"{_cell(v['default'])}, best {row['best']} {_cell(v.get(row['best']))} "
          f"[{time.time() - start:.0f} s]", flush=True)
  print_table(rows, order)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": device_kind, "jax": jax.__version__, "commit": bench._commit(),
                 "ceiling": ceiling, "calls": args.calls, "rows": rows}, f, indent=1)
  print(f"\n{time.time() - start:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
