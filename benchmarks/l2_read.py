"""How fast a kernel re-reads data that sits in L2: the read bandwidth of a working set of
8 MB to 512 MB, read over and over inside one launch, with loads (Pallas Triton) and with
TMA copies into shared memory (Pallas Mosaic GPU), beside the DRAM copy ceiling.

The question it answers: kernel C's and kernel A's designs that read ``g`` and ``P`` (or
``Pd``) a second time from L2 instead of DRAM (a band of rows read for its delta, then again
for ``dL``) pay for the second read in L2 bandwidth. If L2 serves reads at only about the
DRAM rate, the second read costs as much as the first and such a design cannot beat one
that reads DRAM once and writes ``dL``.

Each kernel walks the working set ``repeats`` times per call (program ``p`` of ``P`` reads
block ``(p + r * P) mod blocks`` in pass ``r``), so that one call moves about 1 GB whatever
the working set; the working set itself is the same array every call (no rotation), so
after the first pass a working set smaller than L2 is read from L2.

- ``triton``: a program loads blocks of 8192 fp32 (32 KB; 8 warps, ``.cg``: L2 only) and
  sums them, writing one partial per program.
- ``tma``: a Mosaic GPU program streams ``[128, 128]`` bf16 tiles (32 KB) through a
  4-stage TMA ring (``plgpu.emit_pipeline``) and does nothing else: the ring waits for each
  tile's copy before its step, so the copies are all the time.

Usage (on a GPU)::

    PYTHONPATH=. python3 -m benchmarks.l2_read [--sizes-mb 8,16,24,32,48,64,96,512]
        [--calls 20] [--out DIR]

Prints GB/s per working set and kernel, and the copy ceiling of the same run; writes
``<out>/l2_read.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from benchmarks.timing import copy_ceiling, device_times_us, no_gpu
from pallas_kernels._util import compiler_params, enable_load_cache_modifiers

_BLOCK = 8192         # fp32 elements per Triton block (32 KB)
_TILE = (128, 128)    # bf16 TMA tile (32 KB)
_TARGET = 1 << 30     # bytes per call


def _triton_kernel(x_ref, o_ref, *, blocks, repeats):
  p, n = pl.program_id(0), pl.num_programs(0)

  def body(r, acc):
    b = lax.rem(p + r * n, blocks)
    v = pltriton.load(x_ref.at[pl.ds(b * _BLOCK, _BLOCK)], cache_modifier=".cg")
    return acc + jnp.sum(v)
  o_ref[p] = lax.fori_loop(0, repeats * blocks // n, body, jnp.float32(0))


def triton_read(x, *, repeats, programs, interpret=False):
  """Per program, the sum of the ``repeats * blocks / programs`` blocks it read."""
  blocks = x.size // _BLOCK
  enable_load_cache_modifiers("l2_read's .cg loads")
  return pl.pallas_call(
      functools.partial(_triton_kernel, blocks=blocks, repeats=repeats),
      out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32),
      grid=(programs,), compiler_params=compiler_params(8, 1), interpret=interpret)(x)


def tma_read(x, *, repeats, programs, interpret=False):
  """The TMA ring over ``repeats * tiles / programs`` tiles per program (no output)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels import _mosaic
  rows = x.shape[0]
  tiles = rows // _TILE[0]
  steps = repeats * tiles // programs

  def body(x_gmem, o_gmem):
    p = lax.axis_index("program")

    def step(idx, tile):
      del idx, tile  # the pipeline waits for each tile's copy before this step

    plgpu.emit_pipeline(
        step, grid=(steps,), max_concurrent_steps=4,
        in_specs=[plgpu.BlockSpec(_TILE, lambda r: (lax.rem(p + r * programs, tiles), 0),
                                  transforms=_mosaic.tiled(x.dtype))])(x_gmem)
    del o_gmem

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((programs,), jnp.float32),
                      grid=(programs,), grid_names=("program",),
                      interpret=_mosaic.interpret_params(interpret))(x)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes-mb", default="8,16,24,32,40,48,64,96,512")
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--programs", type=int, default=264)
  parser.add_argument("--out", default=".")
  args = parser.parse_args(argv)
  sizes = [int(s) for s in args.sizes_mb.split(",")]
  if no_gpu("timing L2 re-reads", "nothing timed"):
    return 2
  ceiling = copy_ceiling()
  rows = []
  for mb in sizes:
    nbytes = mb << 20
    repeats = max(1, _TARGET // nbytes)
    row = {"mb": mb, "repeats": repeats}
    for name, make, shape, dtype in (
        ("triton", triton_read, (nbytes // 4,), jnp.float32),
        ("tma", tma_read, (nbytes // 2 // _TILE[1], _TILE[1]), jnp.bfloat16)):
      x = jax.random.normal(jax.random.key(mb), shape, dtype)
      n_units = x.size // (_BLOCK if name == "triton" else _TILE[0] * _TILE[1])
      programs = args.programs
      while (repeats * n_units) % programs:   # every program walks the same number of blocks
        programs -= 1
      fn = jax.jit(functools.partial(make, repeats=repeats, programs=programs))
      try:
        us = device_times_us([fn], [(x,)], calls=args.calls)[0]["median_us"]
        row[name] = {"us": us, "GBps": repeats * nbytes / us / 1e3, "programs": programs}
      except Exception as e:  # a kernel that does not build on this device: say so, go on
        row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
      print(f"{mb:5d} MB x{repeats:4d} {name:>6s}: "
            + (f"{row[name]['us']:9.1f} us  {row[name]['GBps']:7.0f} GB/s"
               if "us" in row[name] else row[name]["error"]), flush=True)
    rows.append(row)
  print(f"DRAM copy ceiling (read + write) in this run: {ceiling['TBps'] * 1e3:.0f} GB/s")
  with open(os.path.join(args.out, "l2_read.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "commit": os.environ.get("BENCH_COMMIT"), "copy_ceiling": ceiling,
               "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
