"""Streaming rate of rows whose length is not a multiple of 8 elements (H200 measurement).

Usage (on a GPU)::

    PYTHONPATH=. python3 -m benchmarks.ragged_stream

A Pallas copy kernel (``out = 2 * x``, bf16, 2 B read + 2 B written per element, about
430 MB) over ``[N, L]`` arrays, with tiles of consecutive rows (``rows``: for odd ``L``
the rows are not 16-byte aligned and the loads are scalar) against tiles of row classes
(``classes``: every ``align``-th row, started ``phase`` elements early, as the
phase-aligned kernels do; see ``pallas_kernels._phase``). Prints time and bytes per
second per variant (bytes: every element read once, plus the elements written; the class
copy skips the rows' few end elements outside whole 16-byte vectors, which the kernels
store with scalar stores). ``benchmarks/results/attention_ragged_rows.log`` holds runs of
its first version (which counted 4 B per element for both).
"""

from __future__ import annotations

import functools
import sys

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from benchmarks.timing import device_times_us, no_gpu
from pallas_kernels import _phase
from pallas_kernels._util import compiler_params, pallas_call


def _rows_kernel(x_ref, o_ref, *, n, row_len, block_q, block_k):
  r0 = pl.program_id(0) * block_q
  row_ok = r0 + jnp.arange(block_q) < n

  def body(j, carry):
    mask = row_ok[:, None] & (j * block_k + jnp.arange(block_k) < row_len)[None, :]
    idx = (pl.ds(r0, block_q), pl.ds(j * block_k, block_k))
    pltriton.store(o_ref.at[idx], pltriton.load(x_ref.at[idx], mask=mask, other=0.0) * 2,
                   mask=mask)
    return carry

  lax.fori_loop(0, pl.cdiv(row_len, block_k), body, 0)


def _classes_kernel(x_ref, o_ref, *, n, row_len, block_q, block_k, align):
  cls, first, rows = _phase.class_rows(pl.program_id(0), align, block_q)
  row_ok = rows < n
  ph = _phase.phase(cls, row_len, align)
  base = _phase.aligned_base(first, row_len, ph, align)

  def body(j, carry):
    _, _, load, vector = _phase.tile_masks(j, row_len, block_k, ph)
    offs = _phase.tile_offsets(base, row_len, block_q, j * block_k, block_k, align)
    x = pltriton.load(x_ref.at[offs], mask=row_ok[:, None] & load[None, :], other=0.0)
    # The copy's rate only: the rows' few end elements outside whole vectors are skipped.
    pltriton.store(o_ref.at[offs], x * 2, mask=row_ok[:, None] & vector[None, :])
    return carry

  lax.fori_loop(0, _phase.num_tiles(row_len, block_k, ph), body, 0)


def copy_fn(kind, n, row_len, block_q, block_k, num_warps, num_stages, align=8,
            interpret=False):
  """A jitted ``2 * x`` of an ``[n, row_len]`` array by the ``kind`` of tiles ("rows" or
  "classes"; the latter's output is flat and skips the rows' end elements outside whole
  16-byte vectors)."""
  params = compiler_params(num_warps, num_stages)
  if kind == "rows":
    kernel = functools.partial(_rows_kernel, n=n, row_len=row_len, block_q=block_q,
                               block_k=block_k)
    return jax.jit(lambda x: pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((n, row_len), x.dtype),
        grid=(pl.cdiv(n, block_q),), compiler_params=params, interpret=interpret)(x))
  kernel = functools.partial(_classes_kernel, n=n, row_len=row_len, block_q=block_q,
                             block_k=block_k, align=align)
  return jax.jit(lambda x: pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((n * row_len,), x.dtype),
      grid=(_phase.num_programs(n, align, block_q),), compiler_params=params,
      interpret=interpret)(x.reshape(-1)))


def main() -> int:
  if no_gpu("this measurement"):
    return 2
  elements = 8 * 80 * 373 * 449  # the P of A's (8, 373, 449) workload
  for row_len in (512, 449, 773, 293):
    n = elements // row_len
    sets = [(jax.random.normal(jax.random.key(i), (n, row_len), jnp.bfloat16),)
            for i in range(4)]
    variants = []
    for tiles in ((64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 2)):
      variants.append((("rows", *tiles), copy_fn("rows", n, row_len, *tiles)))
      for align in _phase.ROW_ALIGNS[::-1]:
        variants.append((("classes", align, *tiles),
                         copy_fn("classes", n, row_len, *tiles, align=align)))
    times = device_times_us([fn for _, fn in variants], sets, calls=8, warmup=1)
    starts = np.arange(n, dtype=np.int64) * row_len  # elements in whole vectors per row:
    a = _phase.ALIGN
    whole = np.maximum((starts + row_len) // a * a - (starts + a - 1) // a * a, 0).sum()
    for (label, _), t in zip(variants, times):
      written = n * row_len if label[0] == "rows" else int(whole)
      tbps = 2 * (n * row_len + written) / t["median_us"] / 1e6
      print(f"L={row_len} {label} {t['median_us']:.1f} us {tbps:.2f} TB/s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
