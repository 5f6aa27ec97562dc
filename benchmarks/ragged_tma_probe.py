"""Can TMA stream rows whose length is not a multiple of 8 bf16? A probe for kernel A's
ragged workloads (Skv = 293, 449, 773) on Mosaic GPU.

TMA needs 16-byte row strides, which a ``[N, L]`` bf16 array with odd ``L`` does not have.
Viewed as ``[N / 8, 8 * L]`` it does (``16 * L`` bytes), and row ``8 * i + s`` is columns
``s * L ... (s + 1) * L - 1`` of view row ``i``: a box ``[rows, 64]`` at
``(i0, s * L + 64 * t)`` brings keys ``64 t ... 64 t + 63`` of rows ``8 * i + s``,
``i0 <= i < i0 + rows`` (one row class), whatever ``s * L`` is. Pallas Mosaic GPU lowers
such a copy only without swizzling: a swizzled one needs its minor start proved a multiple
of 64. So the tiles are unswizzled, fit for element-wise work (P in kernel A), not for a
wgmma operand (Pd, which kernel A can rebuild from P, as its ``keep_seeds`` mode does).

Two probe kernels, each a double-buffered TMA loop over the keys, each tile read from
shared memory into registers (WGMMA layout) and summed per row (the columns past ``L``, the
next row's, masked), the row sums stored from registers; bytes: every element read once.
``class_row_sums``: one program per (block of 64 class rows, class ``s``), one box
``[64, 64]`` per tile. ``tile_row_sums``: one program per 64 consecutive rows (from any
first row), each tile brought in by 8 boxes ``[8, 64]``, one per class, so that shared-memory
row ``8 s + a`` holds row ``r0 + 8 a + s``: the layout a kernel A tile of consecutive rows
would have (dO and delta loaded in the same order), at 8 times the TMA copies.

Usage (on a GPU)::

    PYTHONPATH=. python3 -m benchmarks.ragged_tma_probe [--lengths 293,449,773,448,512]
        [--mb 400] [--calls 20]

Prints per length the time, the read rate against the copy ceiling measured in the same
run, and the largest error against a jnp row sum (which must be ~1e-6 of the sums' scale).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.timing import copy_ceiling, device_times_us, no_gpu

CLASSES = 8      # rows per 16 bytes of a bf16 row of odd length
KEYS = 64        # keys per tile


def _kernel(x_ref, o_ref, smem, bars, *, length, rows, tiles):
  blk = lax.axis_index("blk")
  s = lax.axis_index("s")
  i0 = blk * rows
  start = s * length            # the class's first key in a view row

  def fetch(t, slot):
    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i0, rows), pl.ds(start + t * KEYS, KEYS)],
                            smem.at[slot], bars.at[slot])

  fetch(0, 0)
  layout = plgpu.Layout.WGMMA
  cols = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (rows, KEYS), 1), layout)

  def body(t, acc):
    slot = lax.rem(t, 2)

    @pl.when(t + 1 < tiles)
    def _():
      plgpu.commit_smem()       # this warpgroup's reads of the other slot are done
      fetch(t + 1, 1 - slot)

    plgpu.barrier_wait(bars.at[slot])
    x = plgpu.load(smem.at[slot], layout=layout, optimized=False).astype(jnp.float32)
    x = jnp.where(cols + t * KEYS < length, x, 0.0)
    return acc + jnp.sum(x, axis=1)

  zero = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), layout.reduce(1))
  o_ref[s, pl.ds(i0, rows)] = lax.fori_loop(0, tiles, body, zero)


def _tile_kernel(x_ref, o_ref, smem, bars, *, length, tiles, row0):
  """Rows ``row0 + 64 j ... row0 + 64 j + 63`` of program ``j``, each key tile brought in by
  8 boxes of 8 rows (one per row class): shared-memory row ``8 s + a`` holds row
  ``row0 + 64 j + 8 a + s``."""
  r0 = row0 + lax.axis_index("tile") * 64

  def fetch(t, slot):
    for s in range(CLASSES):
      r = r0 + s
      plgpu.copy_gmem_to_smem(
          x_ref.at[pl.ds(lax.div(r, CLASSES), CLASSES),
                   pl.ds(lax.rem(r, CLASSES) * length + t * KEYS, KEYS)],
          smem.at[slot, pl.ds(s * CLASSES, CLASSES)], bars.at[slot])

  fetch(0, 0)
  layout = plgpu.Layout.WGMMA
  cols = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (64, KEYS), 1), layout)

  def body(t, acc):
    slot = lax.rem(t, 2)

    @pl.when(t + 1 < tiles)
    def _():
      plgpu.commit_smem()
      fetch(t + 1, 1 - slot)

    plgpu.barrier_wait(bars.at[slot])
    x = plgpu.load(smem.at[slot], layout=layout, optimized=False).astype(jnp.float32)
    x = jnp.where(cols + t * KEYS < length, x, 0.0)
    return acc + jnp.sum(x, axis=1)

  zero = plgpu.layout_cast(jnp.zeros((64,), jnp.float32), layout.reduce(1))
  o_ref[lax.axis_index("tile")] = lax.fori_loop(0, tiles, body, zero)


def tile_row_sums(x, *, row0: int = 0, interpret: bool = False):
  """``sum(x[row0:], axis=1)`` in fp32 of ``x [N, L]`` bf16 (``N`` a multiple of 8,
  ``N - row0`` of 64), in tiles of 64 consecutive rows, each key tile brought in by 8 TMA
  boxes of 8 rows (one per row class) from the ``[N / 8, 8 * L]`` view."""
  n, length = x.shape
  if n % CLASSES or (n - row0) % 64 or row0 < 0:
    raise ValueError(f"x: N={n} must be a multiple of {CLASSES} and N - row0 of 64")
  view = x.reshape(n // CLASSES, CLASSES * length)
  kernel = functools.partial(_tile_kernel, length=length, tiles=-(-length // KEYS), row0=row0)
  n_tiles = (n - row0) // 64
  sums = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((n_tiles, 64), jnp.float32),
      # One barrier per slot: each of the 8 copies arrives on it once.
      scratch_types=[plgpu.SMEM((2, 64, KEYS), x.dtype),
                     plgpu.Barrier(num_arrivals=CLASSES, num_barriers=2)],
      grid=(n_tiles,), grid_names=("tile",),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(view)
  # Program j's sum m = 8 s + a is row row0 + 64 j + 8 a + s.
  return sums.reshape(n_tiles, CLASSES, CLASSES).transpose(0, 2, 1).reshape(n - row0)


def class_row_sums(x, *, rows: int = 64, interpret: bool = False):
  """``sum(x, axis=1)`` in fp32 of ``x [N, L]`` bf16 (``N`` a multiple of ``8 * rows``),
  streamed by TMA through the ``[N / 8, 8 * L]`` view, one row class per program."""
  n, length = x.shape
  if n % (CLASSES * rows):
    raise ValueError(f"x: N={n} must be a multiple of {CLASSES * rows}")
  view = x.reshape(n // CLASSES, CLASSES * length)
  kernel = functools.partial(_kernel, length=length, rows=rows, tiles=-(-length // KEYS))
  sums = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((CLASSES, n // CLASSES), jnp.float32),
      scratch_types=[plgpu.SMEM((2, rows, KEYS), x.dtype), plgpu.Barrier(num_barriers=2)],
      grid=(n // CLASSES // rows, CLASSES), grid_names=("blk", "s"),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(view)
  return sums.T.reshape(n)      # row 8 * i + s is sums[s, i]


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--lengths", default="293,449,773,448,512")
  parser.add_argument("--mb", type=int, default=400)
  parser.add_argument("--calls", type=int, default=20)
  args = parser.parse_args(argv)
  if no_gpu("streaming ragged rows through TMA", "nothing timed"):
    return 2
  ceiling = copy_ceiling()["TBps"]
  print(f"copy ceiling {ceiling:.3f} TB/s", flush=True)
  for length in (int(v) for v in args.lengths.split(",")):
    block = CLASSES * 64
    n = max(block, (args.mb << 20) // (2 * length) // block * block)
    keys = jax.random.split(jax.random.key(length), 3)
    sets = [(jax.random.normal(k, (n, length), jnp.bfloat16),) for k in keys]
    want = np.asarray(jnp.sum(sets[0][0].astype(jnp.float32), axis=1))
    for name, fn in (("class boxes [64, 64]", jax.jit(class_row_sums)),
                     ("row tiles, 8 boxes [8, 64]", jax.jit(tile_row_sums))):
      try:
        got = np.asarray(fn(*sets[0]))
      except Exception as e:   # noqa: BLE001 (a probe: say what failed, go on)
        print(f"L={length} {name}: FAILED {type(e).__name__}: "
              f"{str(e).splitlines()[0][:300]}", flush=True)
        continue
      err = float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))
      us = device_times_us([fn], sets, calls=args.calls)[0]["median_us"]
      tbps = n * length * 2 / (us * 1e6)
      print(f"L={length:5d} N={n:8d} {name:28s} {us:9.1f} us  {tbps:.3f} TB/s "
            f"({tbps / ceiling:.0%} of the copy ceiling)  max rel err {err:.1e}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
