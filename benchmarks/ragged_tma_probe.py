"""Can TMA stream rows whose length is not a multiple of 8 bf16? A probe for kernel A's
ragged workloads (Skv = 293, 449, 773) on Mosaic GPU (``ragged_mosaic_gpu``).

TMA needs 16-byte row strides, which a ``[N, L]`` bf16 array with odd ``L`` does not have.
Viewed as ``[N / 8, 8 * L]`` it does (``16 * L`` bytes), and row ``8 * i + s`` is columns
``s * L ... (s + 1) * L - 1`` of view row ``i``: a box ``[rows, 64]`` at
``(i0, s * L + 64 * t)`` brings keys ``64 t ... 64 t + 63`` of rows ``8 * i + s``,
``i0 <= i < i0 + rows`` (one row class), whatever ``s * L`` is. Pallas Mosaic GPU lowers
such a copy only without a tiling transform (a tiled one needs its minor start proved a
multiple of 64); a 128-byte swizzle alone is allowed, and makes each ``[8, 64]`` box one
swizzle block.

Probe kernels, each a double-buffered TMA loop over the keys, each tile read from shared
memory into registers (WGMMA layout):
- ``class_row_sums``: one program per (block of 64 class rows, class ``s``), one box
  ``[64, 64]`` per tile, rows summed (the columns past ``L``, the next row's, masked).
- ``tile_row_sums``: one program per 64 consecutive rows (from any first row), each tile
  brought in by 8 boxes ``[8, 64]``, one per class (shared-memory row ``8 s + a`` holds row
  ``r0 + 8 a + s``), rows summed; unswizzled (8-way bank conflicts) or swizzled.
- ``tile_round_trip``: ``2 * x``, every key block in by 8 boxes and out by 8 boxes at the
  same odd starts (the last block overlapping the one before), as kernel A's dS leaves.

Usage (on a GPU)::

    PYTHONPATH=. python3 -m benchmarks.ragged_tma_probe [--lengths 293,449,773,448,512]
        [--mb 400] [--calls 20]

Prints per length and kernel the time, the rate (bytes: every element read once, and for
the round trip written once) against the copy ceiling measured in the same run, and the
largest error against jnp (sums: about 1e-6 of their scale; the round trip: 0).
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
from pallas_kernels.attention_softmax_dropout_value.ragged_mosaic_gpu import (
    CLASSES, KEYS, box_tiles, class_boxes, prologue, ring_loop)

STAGES = 2       # ring slots: the next tile's copies in flight while this one is read


def _row_sums(smem, bars, fetch, tiles, length, swizzle):
  """Row sums of the ``[64, 64]`` tiles that ``fetch(t, slot)`` brings in, key tile ``t``
  at keys ``64 t ...`` (the columns past ``length``, the next row's, masked)."""
  layout = plgpu.Layout.WGMMA
  cols = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (64, KEYS), 1), layout)

  def body(t, slot, acc):
    x = plgpu.load(smem.at[slot], layout=layout, optimized=swizzle).astype(jnp.float32)
    return acc + jnp.sum(jnp.where(cols + t * KEYS < length, x, 0.0), axis=1)

  prologue(fetch, tiles, STAGES)
  zero = plgpu.layout_cast(jnp.zeros((64,), jnp.float32), layout.reduce(1))
  return ring_loop(fetch, bars, tiles, STAGES, body, zero)


def _kernel(x_ref, o_ref, smem, bars, *, length, tiles):
  """Rows ``8 i + s`` (``i0 <= i < i0 + 64``) of program ``(i0 / 64, s)``, one box per tile."""
  i0 = lax.axis_index("blk") * 64
  s = lax.axis_index("s")

  def fetch(t, slot):
    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i0, 64), pl.ds(s * length + t * KEYS, KEYS)],
                            smem.at[slot], bars.at[slot])

  o_ref[s, pl.ds(i0, 64)] = _row_sums(smem, bars, fetch, tiles, length, False)


def _tile_kernel(x_ref, o_ref, smem, bars, *, length, tiles, row0, swizzle):
  """Rows ``row0 + 64 j ... row0 + 64 j + 63`` of program ``j``, each key tile brought in by
  8 boxes of 8 rows (one per row class): shared-memory row ``8 s + a`` holds row
  ``row0 + 64 j + 8 a + s``."""
  r0 = row0 + lax.axis_index("tile") * 64

  def fetch(t, slot):
    for dst, rows, keys in class_boxes(r0, length, t * KEYS):
      plgpu.copy_gmem_to_smem(x_ref.at[rows, keys], smem.at[slot, dst], bars.at[slot])

  o_ref[lax.axis_index("tile")] = _row_sums(smem, bars, fetch, tiles, length, swizzle)


def tile_row_sums(x, *, row0: int = 0, swizzle: bool = False, interpret: bool = False):
  """``sum(x[row0:], axis=1)`` in fp32 of ``x [N, L]`` bf16 (``N`` a multiple of 8,
  ``N - row0`` of 64), in tiles of 64 consecutive rows, each key tile brought in by 8 TMA
  boxes of 8 rows (one per row class) from the ``[N / 8, 8 * L]`` view."""
  n, length = x.shape
  if n % CLASSES or (n - row0) % 64 or row0 < 0:
    raise ValueError(f"x: N={n} must be a multiple of {CLASSES} and N - row0 of 64")
  view = x.reshape(n // CLASSES, CLASSES * length)
  kernel = functools.partial(_tile_kernel, length=length, tiles=-(-length // KEYS), row0=row0,
                             swizzle=swizzle)
  n_tiles = (n - row0) // 64
  sums = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((n_tiles, 64), jnp.float32),
      # One barrier per slot: each of the 8 copies arrives on it once.
      scratch_types=[box_tiles((STAGES, 64, KEYS), x.dtype, swizzle),
                     plgpu.Barrier(num_arrivals=CLASSES, num_barriers=STAGES)],
      grid=(n_tiles,), grid_names=("tile",),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(view)
  # Program j's sum m = 8 s + a is row row0 + 64 j + 8 a + s.
  return sums.reshape(n_tiles, CLASSES, CLASSES).transpose(0, 2, 1).reshape(n - row0)


def _copy_kernel(x_ref, o_ref, smem, out_smem, bars, *, length, blocks, swizzle):
  """``2 * x`` of 64 consecutive rows: key blocks of 64 (the last at ``L - 64``, overlapping)
  in by 8 boxes each and out by 8 boxes, through registers in the WGMMA layout."""
  r0 = lax.axis_index("tile") * 64
  boxes = lambda t: class_boxes(r0, length, jnp.minimum(t * KEYS, length - KEYS))

  def fetch(t, slot):
    for dst, rows, keys in boxes(t):
      plgpu.copy_gmem_to_smem(x_ref.at[rows, keys], smem.at[slot, dst], bars.at[slot])

  def body(t, slot, carry):
    x = plgpu.load(smem.at[slot], layout=plgpu.Layout.WGMMA, optimized=swizzle)
    out = out_smem.at[slot]
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # block t - 2's stores have read it
    out[...] = x * 2
    plgpu.commit_smem()
    for s, (src, rows, keys) in enumerate(boxes(t)):
      plgpu.copy_smem_to_gmem(out.at[src], o_ref.at[rows, keys], commit_group=s == CLASSES - 1)
    return carry

  prologue(fetch, blocks, STAGES)
  ring_loop(fetch, bars, blocks, STAGES, body, 0)
  plgpu.wait_smem_to_gmem(0)


def tile_round_trip(x, *, swizzle: bool = False, interpret: bool = False):
  """``2 * x`` of ``x [N, L]`` bf16 (``N`` a multiple of 64, ``L >= 64``), every element
  loaded and stored by TMA boxes ``[8, 64]`` at the odd starts of the ``[N / 8, 8 * L]``
  view (a tile's last key block overlapping the one before: equal values stored twice)."""
  n, length = x.shape
  if n % 64 or length < KEYS:
    raise ValueError(f"x: N={n} must be a multiple of 64 and L={length} at least {KEYS}")
  view = x.reshape(n // CLASSES, CLASSES * length)
  kernel = functools.partial(_copy_kernel, length=length, blocks=-(-length // KEYS),
                             swizzle=swizzle)
  out = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct(view.shape, x.dtype),
      scratch_types=[box_tiles((STAGES, 64, KEYS), x.dtype, swizzle),
                     box_tiles((STAGES, 64, KEYS), x.dtype, swizzle),
                     plgpu.Barrier(num_arrivals=CLASSES, num_barriers=STAGES)],
      grid=(n // 64,), grid_names=("tile",),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(view)
  return out.reshape(n, length)


def class_row_sums(x, *, interpret: bool = False):
  """``sum(x, axis=1)`` in fp32 of ``x [N, L]`` bf16 (``N`` a multiple of 512), streamed by
  TMA through the ``[N / 8, 8 * L]`` view, 64 rows of one row class per program."""
  n, length = x.shape
  if n % (CLASSES * 64):
    raise ValueError(f"x: N={n} must be a multiple of {CLASSES * 64}")
  view = x.reshape(n // CLASSES, CLASSES * length)
  kernel = functools.partial(_kernel, length=length, tiles=-(-length // KEYS))
  sums = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((CLASSES, n // CLASSES), jnp.float32),
      scratch_types=[plgpu.SMEM((STAGES, 64, KEYS), x.dtype),
                     plgpu.Barrier(num_barriers=STAGES)],
      grid=(n // CLASSES // 64, CLASSES), grid_names=("blk", "s"),
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
    doubled = np.asarray(sets[0][0].astype(jnp.float32)) * 2
    variants = (
        ("sums, class boxes [64, 64]", jax.jit(class_row_sums), want, 2),
        ("sums, 8 boxes [8, 64]", jax.jit(tile_row_sums), want, 2),
        ("sums, 8 boxes, swizzled", jax.jit(functools.partial(tile_row_sums, swizzle=True)),
         want, 2),
        ("2x, 8 boxes in and out", jax.jit(tile_round_trip), doubled, 4),
        ("2x, 8 boxes, swizzled", jax.jit(functools.partial(tile_round_trip, swizzle=True)),
         doubled, 4),
    )
    for name, fn, ref, per_element in variants:
      try:
        got = np.asarray(fn(*sets[0]).astype(jnp.float32))
      except Exception as e:   # noqa: BLE001 (a probe: say what failed, go on)
        print(f"L={length} {name}: FAILED {type(e).__name__}: "
              f"{str(e).splitlines()[0][:300]}", flush=True)
        continue
      err = float(np.max(np.abs(got - ref)) / max(1.0, float(np.max(np.abs(ref)))))
      us = device_times_us([fn], sets, calls=args.calls)[0]["median_us"]
      tbps = n * length * per_element / (us * 1e6)
      print(f"L={length:5d} N={n:8d} {name:28s} {us:9.1f} us  {tbps:.3f} TB/s "
            f"({tbps / ceiling:.0%} of the copy ceiling)  max rel err {err:.1e}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
