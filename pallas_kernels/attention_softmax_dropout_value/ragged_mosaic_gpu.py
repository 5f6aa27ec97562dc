"""Kernel A's backward for rows of any length of at least 64 keys, with a Mosaic GPU dS pass
(Hopper): built for the rows TMA cannot take whole (``seq_k`` = 293, 449, 773 in the
benchmark), opt-in (the entry point's dispatch does not pick it).

TMA copies need row strides that are multiples of 16 bytes, which P ``[R, seq_k]`` (bf16,
``R = B * H * seq_q`` rows) lacks when ``seq_k % 8 != 0``. Its ``[R / 8, 8 * seq_k]`` view has
them: view row ``i`` is rows ``8 i ... 8 i + 7``, row ``8 i + s`` at columns ``s * seq_k ...``.
So a tile of 64 consecutive rows ``r0 ...`` and 64 keys is 8 boxes ``[8, 64]`` of
the view, one per row class ``s = (r0 + s') % 8``; in shared memory, row ``8 s' + a`` holds row
``r0 + 8 a + s'``. dS leaves the same way. Pallas Mosaic GPU lowers a copy at such an odd
minor start only without a tiling transform: the boxes' tiles are 128-byte swizzled (each
``[8, 64]`` box one 1024-byte swizzle block, so reading them in the WGMMA layout has no bank
conflicts; ``swizzle=False``: plain rows, 8-way conflicts) and used element-wise, never as
a wgmma operand. dO and V (wgmma operands, tiled: their copies must start at whole tiles of
8 rows) and delta are gathered beforehand, dO and delta in that row order, one ``[64, D]``
and one ``[64]`` block per tile, V one ``[64, D]`` block per key block.

Edges overlap instead of being masked, since TMA stores clip only at an array's end: the
last key block starts at ``seq_k - 64`` and a share's last row tile ends at the share's end,
so every box lies inside its rows. Overlapped dS values are computed twice, equal, and
written twice.

This module's kernel is the dS pass: one warpgroup per program owns 64 keys of a kv group
(V resident) and walks a share of the group's rows, ``dPd = dO @ V^T`` on wgmma, ``dS = P *
(dPd * [Pd != 0] / (1 - p) - delta)``, with the next tile's copies in flight; optionally
(``with_dv``) also ``dV += Pd^T @ dO``, Pd staged again swizzled for the wgmma. Before it, a
first pass reads Pd for delta: this module's delta kernel (``first_pass="mosaic"``: per row
tile, dO resident, ``rowsum(dO @ V^T * Pd)`` over the key blocks, written in the dS pass's
tile order; dV then in the dS pass), the Triton kernels' (``"triton"``:
``pallas_triton.dv_pass``, which also makes dV, with the GQA sum) or XLA's ``rowsum(dO * (Pd
@ V))`` (``"xla"``, which writes the fp32 product first). Bytes per attention element: Pd
(2) in the first pass; P, Pd and dS (6) in the dS pass; and the dO gather (about 4 B per dO
element).

Not yet compiled on a GPU: ``benchmarks/ragged_tma_probe.py`` first checks that the hardware
takes these copies and at what rate (``attention_softmax_dropout_value_mosaic_gpu.md``).
Supported (:func:`unsupported_reason`): bf16 or fp16, ``D`` of 64 or 128, ``seq_k >= 64``,
``G * seq_q >= 64``, ``B * H * seq_q`` a multiple of 8, a static dropout rate, no causal
mask.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mosaic, _tuning
from pallas_kernels._util import dropout_scale, out_struct
from pallas_kernels.attention_softmax_dropout_value import config as triton_config
from pallas_kernels.attention_softmax_dropout_value import pallas_mosaic_gpu, pallas_triton

f32 = jnp.float32
CLASSES = 8     # rows per 16 bytes of a 16-bit row of odd length: one box per class
ROWS = 64       # rows per tile (one wgmma M)
KEYS = 64       # keys per program (V resident)


def unsupported_reason(b, h, kvh, sq, skv, d, dtype, p_static, causal) -> str | None:
  """Why this backward cannot run a problem (``None``: it can)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype)} (bfloat16 or float16 only)"
  if d not in (64, 128):
    return f"head dim {d} (64 or 128 only)"
  if skv < KEYS:
    return f"seq_k {skv} (at least {KEYS})"
  if (h // kvh) * sq < ROWS:
    return f"G * seq_q = {(h // kvh) * sq} (at least {ROWS})"
  if (b * h * sq) % CLASSES:
    return f"B * H * seq_q = {b * h * sq} (a multiple of {CLASSES} only)"
  if p_static is None:
    return "a traced dropout rate (static rates only)"
  if causal:
    return "a causal mask"
  return None


def tile_rows(slab_rows, split, tiles):
  """``[split, tiles, 64]`` int32: row ``m`` of tile ``t`` of share ``c`` of a kv group, as
  the kernel holds it in shared memory (``8 s + a`` is the tile's row ``8 a + s``), counted
  from the group's first row. The share is rows ``[c0, c1)``; its last tile ends at ``c1``."""
  c = jnp.arange(split)[:, None, None]
  c0, c1 = c * slab_rows // split, (c + 1) * slab_rows // split
  t = jnp.arange(tiles)[None, :, None]
  m = jnp.arange(ROWS)[None, None, :]
  return _tile_start(c0, c1, t) + CLASSES * (m % CLASSES) + m // CLASSES


def _tile_start(c0, c1, t):
  """The first row of tile ``t`` of the share ``[c0, c1)`` of a group's rows: every 64 rows
  from ``c0``, the last tile ending at ``c1`` (overlapping the one before)."""
  return jnp.minimum(c0 + t * ROWS, c1 - ROWS)


def _share_rows(slab_rows, split):
  """``(c0, c1)``: the rows of this program's share (grid axis ``"share"``) of its group."""
  share = lax.axis_index("share")
  return lax.div(share * slab_rows, split), lax.div((share + 1) * slab_rows, split)


def class_boxes(r0, skv, k0):
  """``(dst, rows, keys)`` of the 8 class boxes of rows ``r0 ... r0 + 63`` and keys ``k0 ...``
  in the ``[R / 8, 8 * skv]`` view: box ``s`` is rows ``r0 + s + 8 a`` (``a < 8``; view rows
  ``rows``, columns ``keys``), shared-memory rows ``dst = 8 s ... 8 s + 7``."""
  for s in range(CLASSES):
    r = r0 + s
    yield (pl.ds(s * CLASSES, CLASSES), pl.ds(lax.div(r, CLASSES), CLASSES),
           pl.ds(lax.rem(r, CLASSES) * skv + k0, KEYS))


def prologue(fetch, steps, stages):
  """The copies of a ring's first ``stages - 1`` steps (:func:`ring_loop`)."""
  for i in range(min(stages - 1, steps)):
    fetch(i, i)


def ring_loop(fetch, bars, steps, stages, body, init):
  """``lax.fori_loop`` over ``steps`` steps whose copies (``fetch(step, slot)``, arriving on
  ``bars.at[slot]``) run ``stages - 1`` steps ahead in a ring of ``stages`` slots, after
  :func:`prologue`: step ``i`` refills the slot that step ``i - 1`` read (its reads fenced
  first: their wgmmas were waited for), waits for its own slot, and returns
  ``body(i, slot, carry)``."""

  def step(i, carry):
    slot = lax.rem(i, stages)
    ahead = i + stages - 1

    @pl.when(ahead < steps)
    def _():
      plgpu.commit_smem()
      fetch(ahead, lax.rem(ahead, stages))

    plgpu.barrier_wait(bars.at[slot])
    return body(i, slot, carry)

  return lax.fori_loop(0, steps, step, init)


def _ds_kernel(*refs, skv, slab_rows, split, tiles, stages, keep_scale, with_dv, swizzle):
  has_pd = keep_scale is not None       # no dropout: Pd (== P) is not read
  refs = list(refs)
  take = lambda present=True: refs.pop(0) if present else None   # in :func:`_ds_call`'s order
  p_ref, pd_ref, do_ref, delta_ref, v_ref = take(), take(has_pd), take(), take(), take()
  ds_ref, dv_ref = take(), take(with_dv)
  (v_smem, p_smem, pd_smem, do_smem, delta_smem, ds_smem, bars, v_bar, pd_stage) = (
      take(), take(), take(has_pd), take(), take(), take(), take(), take(), take(with_dv))
  slab = lax.axis_index("slab")
  share = lax.axis_index("share")
  k0 = jnp.minimum(lax.axis_index("kb") * KEYS, skv - KEYS)    # the last block overlaps
  c0, c1 = _share_rows(slab_rows, split)
  plgpu.copy_gmem_to_smem(v_ref.at[slab, lax.axis_index("kb")], v_smem, v_bar)
  boxes = lambda t: class_boxes(slab * slab_rows + _tile_start(c0, c1, t), skv, k0)

  def fetch(t, slot):
    for dst, rows, keys in boxes(t):
      plgpu.copy_gmem_to_smem(p_ref.at[rows, keys], p_smem.at[slot, dst], bars.at[slot])
      if has_pd:
        plgpu.copy_gmem_to_smem(pd_ref.at[rows, keys], pd_smem.at[slot, dst], bars.at[slot])
    # dO and delta of the tile's rows, already in its shared-memory row order
    plgpu.copy_gmem_to_smem(do_ref.at[slab, share, t], do_smem.at[slot], bars.at[slot])
    plgpu.copy_gmem_to_smem(delta_ref.at[slab, share, t], delta_smem.at[slot], bars.at[slot])

  prologue(fetch, tiles, stages)
  plgpu.barrier_wait(v_bar)
  layout = plgpu.Layout.WGMMA

  def body(t, slot, carry, dv_acc=None):
    def mm(acc):
      plgpu.wgmma(acc, do_smem.at[slot], v_smem.T)                  # dPd [rows, keys]
      p = plgpu.load(p_smem.at[slot], layout=layout, optimized=swizzle)
      pd = (plgpu.load(pd_smem.at[slot], layout=layout, optimized=swizzle) if has_pd
            else None)
      delta = plgpu.load(delta_smem.at[slot], layout=layout.reduce(1))
      return acc[...], p, pd, delta

    dpd, p, pd, delta = pl.run_scoped(mm, plgpu.ACC((ROWS, KEYS), f32))
    if with_dv:
      # dV += Pd^T @ dO, Pd staged swizzled (a wgmma operand), without the rows that the
      # share's overlapping last tile shares with the one before (counted once). Row m of
      # the tile in shared memory is its row 8 (m % 8) + m // 8.
      m = plgpu.broadcasted_iota(jnp.int32, (ROWS, KEYS), 0, layout=layout)
      repeated = c0 + t * ROWS - _tile_start(c0, c1, t)
      once = CLASSES * (m % CLASSES) + m // CLASSES >= repeated
      pd_stage[...] = jnp.where(once, p if pd is None else pd, 0).astype(pd_stage.dtype)
      plgpu.commit_smem()
      plgpu.wgmma(dv_acc, pd_stage.T, do_smem.at[slot])              # in flight with dS
    dw = dpd if pd is None else jnp.where(pd != 0, dpd * keep_scale, 0.0)
    ds = p.astype(f32) * (dw - lax.broadcast_in_dim(delta, (ROWS, KEYS), [0]))
    out = ds_smem.at[lax.rem(t, 2)]
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # step t - 2's stores have read it
    out[...] = ds.astype(out.dtype)
    plgpu.commit_smem()
    for s, (src, rows, keys) in enumerate(boxes(t)):
      plgpu.copy_smem_to_gmem(out.at[src], ds_ref.at[rows, keys],
                              commit_group=s == CLASSES - 1)
    if with_dv:
      plgpu.wgmma_wait(0)   # dV has read the stage and the dO slot
    return carry

  if with_dv:
    def run(dv_acc):
      ring_loop(fetch, bars, tiles, stages, functools.partial(body, dv_acc=dv_acc), 0)
      return dv_acc[...]
    dv_ref.at[share, slab, lax.axis_index("kb")][...] = pl.run_scoped(
        run, plgpu.ACC((KEYS, dv_ref.shape[-1]), f32))
  else:
    ring_loop(fetch, bars, tiles, stages, body, 0)
  plgpu.wait_smem_to_gmem(0)


def _delta_kernel(pd_ref, do_ref, v_ref, delta_ref, do_smem, v_smem, pd_smem, bars, do_bars, *,
                  skv, slab_rows, split, tiles, n_kb, stages, swizzle):
  """delta of a share's row tiles: per tile (dO resident) the key blocks in turn, ``rowsum(dO
  @ V^T * Pd)`` over the keys (the last block's keys that the one before covered, masked),
  written per tile in its shared-memory row order (what the dS pass reads)."""
  slab = lax.axis_index("slab")
  share = lax.axis_index("share")
  c0, c1 = _share_rows(slab_rows, split)
  steps = tiles * n_kb

  def fetch(i, slot):
    t, kb = lax.div(i, n_kb), lax.rem(i, n_kb)

    @pl.when(kb == 0)   # a new tile: its dO (the buffer's last reader finished a tile ago)
    def _():
      plgpu.copy_gmem_to_smem(do_ref.at[slab, share, t], do_smem.at[lax.rem(t, 2)],
                              do_bars.at[lax.rem(t, 2)])

    plgpu.copy_gmem_to_smem(v_ref.at[slab, kb], v_smem.at[slot], bars.at[slot])
    for dst, rows, keys in class_boxes(slab * slab_rows + _tile_start(c0, c1, t), skv,
                                       jnp.minimum(kb * KEYS, skv - KEYS)):
      plgpu.copy_gmem_to_smem(pd_ref.at[rows, keys], pd_smem.at[slot, dst], bars.at[slot])

  prologue(fetch, steps, stages)
  layout = plgpu.Layout.WGMMA
  col = plgpu.broadcasted_iota(jnp.int32, (ROWS, KEYS), 1, layout=layout)
  # The last key block starts at skv - 64: its keys below (n_kb - 1) * 64 were counted.
  counted = (n_kb - 1) * KEYS - (skv - KEYS)

  def body(i, slot, delta):
    t, kb = lax.div(i, n_kb), lax.rem(i, n_kb)

    @pl.when(kb == 0)
    def _():
      plgpu.barrier_wait(do_bars.at[lax.rem(t, 2)])

    def mm(acc):
      plgpu.wgmma(acc, do_smem.at[lax.rem(t, 2)], v_smem.at[slot].T)   # dPd [rows, keys]
      pd = plgpu.load(pd_smem.at[slot], layout=layout, optimized=swizzle)
      return acc[...], pd

    dpd, pd = pl.run_scoped(mm, plgpu.ACC((ROWS, KEYS), f32))
    new = (kb < n_kb - 1) | (col >= counted)
    part = jnp.sum(jnp.where(new, dpd * pd.astype(f32), 0.0), axis=1)
    delta = _mosaic.restart_sum(kb, part, delta, layout=layout.reduce(1))

    @pl.when(kb == n_kb - 1)
    def _():
      delta_ref.at[slab, share, t][...] = delta

    return delta

  zero = plgpu.layout_cast(jnp.zeros((ROWS,), f32), layout.reduce(1))
  ring_loop(fetch, bars, steps, stages, body, zero)


def auto_split(programs: int, slab_rows: int) -> int:
  """Shares of a kv group's rows: enough programs for two per SM, each share at least one
  tile."""
  return max(1, min(slab_rows // ROWS, -(-2 * _mosaic.SMS // programs)))


@dataclasses.dataclass(frozen=True)
class _Plan:
  """A problem's shape and how its rows and keys are cut: ``split`` shares of each kv group's
  ``slab_rows`` rows, ``tiles`` tiles of 64 rows per share, ``n_kb`` key blocks of 64."""
  b: int
  h: int
  kvh: int
  sq: int
  skv: int
  d: int
  split: int
  tiles: int
  n_kb: int

  @property
  def slab_rows(self):
    return (self.h // self.kvh) * self.sq

  @property
  def rows(self):
    return self.b * self.h * self.sq


def _plan(attn_weights, value_states, rate, split, stages) -> _Plan:
  b, h, sq, skv = attn_weights.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  why = unsupported_reason(b, h, kvh, sq, skv, d, attn_weights.dtype, rate, False)
  if why:
    raise ValueError(f"ragged_mosaic_gpu: {why}")
  if isinstance(stages, bool) or not isinstance(stages, int) or not 2 <= stages <= 4:
    raise ValueError(f"stages: expected an int in [2, 4], got {stages!r}")
  slab_rows, n_kb = (h // kvh) * sq, pl.cdiv(skv, KEYS)
  split = auto_split(b * kvh * n_kb, slab_rows) if split is None else split
  if (isinstance(split, bool) or not isinstance(split, int)
      or not 1 <= split <= slab_rows // ROWS):
    raise ValueError(f"split: expected an int in [1, {slab_rows // ROWS}] (shares of "
                     f"G * seq_q = {slab_rows} rows, each at least {ROWS}), got {split!r}")
  return _Plan(b, h, kvh, sq, skv, d, split, pl.cdiv(pl.cdiv(slab_rows, split), ROWS), n_kb)


def box_tiles(shape, dtype, swizzle):
  """Shared memory for tiles brought in (or sent out) as class boxes ``[8, 64]``: with
  ``swizzle``, 128-byte swizzled (each box one 1024-byte swizzle block, so the WGMMA-layout
  reads and writes are free of bank conflicts; a swizzle without tiling puts no condition on
  a copy's start column), else plain rows of 128 bytes (8-way bank conflicts)."""
  return plgpu.SMEM(shape, dtype,
                    transforms=(plgpu.SwizzleTransform(_mosaic.SWIZZLE),) if swizzle else ())


def _row_view(x, plan):
  """``[B, H, seq_q, seq_k]`` as ``[R / 8, 8 * seq_k]``: 16-byte row strides."""
  return x.reshape(plan.rows // CLASSES, CLASSES * plan.skv)


def _tile_order(plan):
  """``[B * KVH, split, tiles, 64]`` int32: P's row (``(b * H + h) * seq_q + q``) of each
  row of each tile, in the tile's shared-memory order (an overlapping last tile's rows
  twice)."""
  slabs = jnp.arange(plan.b * plan.kvh)[:, None, None, None]
  return slabs * plan.slab_rows + tile_rows(plan.slab_rows, plan.split, plan.tiles)


def _gathered(plan, grad_attn_output, value_states):
  """dO per tile (``[B * KVH, split, tiles, 64, D]``, in the tile's row order) and V per key
  block (``[B * KVH, n_kb, 64, D]``): each one aligned box for the kernels."""
  r = _tile_order(plan)
  bh, q = r // plan.sq, r % plan.sq
  do_tiles = grad_attn_output[bh // plan.h, q, bh % plan.h]
  k0 = jnp.minimum(jnp.arange(plan.n_kb) * KEYS, plan.skv - KEYS)[:, None] + jnp.arange(KEYS)
  v_blocks = value_states.reshape(plan.b * plan.kvh, plan.skv, plan.d)[:, k0]
  return do_tiles, v_blocks


def _delta_call(plan, pd_view, do_tiles, v_blocks, *, stages, swizzle, like, interpret):
  """delta per tile, ``[B * KVH, split, tiles, 64]`` fp32 (:func:`_delta_kernel`)."""
  dtype = pd_view.dtype
  stages = min(stages, plan.n_kb + 1)   # a tile's dO buffer is refilled two tiles on
  kernel = functools.partial(_delta_kernel, skv=plan.skv, slab_rows=plan.slab_rows,
                             split=plan.split, tiles=plan.tiles, n_kb=plan.n_kb, stages=stages,
                             swizzle=swizzle)
  tiled = _mosaic.tiled(dtype)
  return plgpu.kernel(
      kernel,
      out_type=out_struct((plan.b * plan.kvh, plan.split, plan.tiles, ROWS), f32, *like),
      scratch_types=[
          plgpu.SMEM((2, ROWS, plan.d), dtype, transforms=tiled),        # dO, per tile
          plgpu.SMEM((stages, KEYS, plan.d), dtype, transforms=tiled),   # V, per step
          box_tiles((stages, ROWS, KEYS), dtype, swizzle),              # Pd
          plgpu.Barrier(num_arrivals=1 + CLASSES, num_barriers=stages),  # V and Pd's boxes
          plgpu.Barrier(num_barriers=2),
      ],
      grid=(plan.b * plan.kvh, plan.split), grid_names=("slab", "share"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_mosaic.interpret_params(interpret),
  )(pd_view, do_tiles, v_blocks)


def _ds_call(plan, p_view, pd_view, do_tiles, delta_tiles, v_blocks, *, rate, with_dv,
             stages, swizzle, like, interpret):
  """dS in the view's layout, and with ``with_dv`` the fp32 dV per (share, group, key
  block) (:func:`_ds_kernel`)."""
  dtype = p_view.dtype
  has_pd = rate != 0
  kernel = functools.partial(
      _ds_kernel, skv=plan.skv, slab_rows=plan.slab_rows, split=plan.split, tiles=plan.tiles,
      stages=stages, keep_scale=dropout_scale(rate) if has_pd else None, with_dv=with_dv,
      swizzle=swizzle)
  operands = [p_view] + ([pd_view] if has_pd else []) + [do_tiles, delta_tiles, v_blocks]
  arrivals = CLASSES * (1 + has_pd) + 2        # a tile's copies: P's (and Pd's) boxes, dO, delta
  out_type = out_struct(p_view.shape, dtype, *like)
  if with_dv:   # per share, group and key block: fp32 [64 keys, D]
    out_type = (out_type, out_struct((plan.split, plan.b * plan.kvh, plan.n_kb, KEYS, plan.d),
                                     f32, *like))
  tiled = _mosaic.tiled(dtype)
  boxed = box_tiles((stages, ROWS, KEYS), dtype, swizzle)
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=[
          plgpu.SMEM((KEYS, plan.d), dtype, transforms=tiled),            # V
          boxed,                                                           # P
          *([boxed] if has_pd else []),                                    # Pd
          plgpu.SMEM((stages, ROWS, plan.d), dtype, transforms=tiled),    # dO
          plgpu.SMEM((stages, ROWS), f32),                                 # delta
          box_tiles((2, ROWS, KEYS), dtype, swizzle),                     # dS
          plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),       # one per ring slot
          plgpu.Barrier(),
          *([plgpu.SMEM((ROWS, KEYS), dtype, transforms=tiled)] if with_dv else []),  # Pd
      ],
      grid=(plan.b * plan.kvh, plan.n_kb, plan.split), grid_names=("slab", "kb", "share"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_mosaic.interpret_params(interpret),
  )(*operands)


def _assembled(plan, ds, dv, dtype):
  """``(dS [B, H, seq_q, seq_k], dV [B, KVH, seq_k, D])`` from the kernel's outputs: dV's
  shares summed, the last key block's keys past the one before it only."""
  ds = ds.reshape(plan.b, plan.h, plan.sq, plan.skv)
  if dv is None:
    return ds
  dv = jnp.sum(dv, axis=0)
  n, keys = plan.n_kb, plan.b * plan.kvh
  last = dv[:, -1, (n - 1) * KEYS - (plan.skv - KEYS):]
  dv = jnp.concatenate([dv[:, :-1].reshape(keys, (n - 1) * KEYS, plan.d), last], axis=1)
  return ds, dv.reshape(plan.b, plan.kvh, plan.skv, plan.d).astype(dtype)


def ds_pass(grad_attn_output, attn_weights, attn_weights_dropped, value_states, delta, *,
            rate, with_dv=False, stages=2, split=None, swizzle=True, interpret=False):
  """``dS [B, H, seq_q, seq_k]`` from dO ``[B, seq_q, H, D]``, P and Pd, V ``[B, KVH, seq_k,
  D]`` and ``delta [B, H, seq_q]`` fp32 (``rowsum(dPd * Pd)``); ``rate`` a float (at 0, Pd is
  not read). ``with_dv``: ``(dS, dV [B, KVH, seq_k, D])``, dV summed in the kernel too (each
  program its keys over its share of the group's rows, the shares' fp32 sums added here).
  ``split``: shares of each kv group's rows (default :func:`auto_split`). ``swizzle``: the
  class boxes' tiles 128-byte swizzled in shared memory (:func:`box_tiles`)."""
  plan = _plan(attn_weights, value_states, rate, split, stages)
  like = (grad_attn_output, attn_weights, attn_weights_dropped, value_states, delta)
  do_tiles, v_blocks = _gathered(plan, grad_attn_output, value_states)
  delta_tiles = delta.astype(f32).reshape(plan.rows)[_tile_order(plan)]
  out = _ds_call(plan, _row_view(attn_weights, plan),
                 _row_view(attn_weights_dropped, plan) if rate != 0 else None, do_tiles,
                 delta_tiles, v_blocks, rate=rate, with_dv=with_dv, stages=stages,
                 swizzle=swizzle, like=like, interpret=interpret)
  ds, dv = out if with_dv else (out, None)
  return _mosaic.varying_like(_assembled(plan, ds, dv, value_states.dtype), *like)


def delta_pass(grad_attn_output, attn_weights_dropped, value_states, *, stages=2, split=None,
               swizzle=True, interpret=False):
  """``delta [B, H, seq_q]`` fp32, ``rowsum((dO @ V^T) * Pd)``, by :func:`_delta_kernel`
  (Pd read once through the row view)."""
  plan = _plan(attn_weights_dropped, value_states, 0.0, split, stages)
  like = (grad_attn_output, attn_weights_dropped, value_states)
  do_tiles, v_blocks = _gathered(plan, grad_attn_output, value_states)
  tiles = _delta_call(plan, _row_view(attn_weights_dropped, plan), do_tiles, v_blocks,
                      stages=stages, swizzle=swizzle, like=like, interpret=interpret)
  # Rows that an overlapping tile repeats get the same value from both tiles.
  delta = jnp.zeros((plan.rows,), f32).at[_tile_order(plan)].set(tiles)
  return _mosaic.varying_like(delta.reshape(plan.b, plan.h, plan.sq), *like)


FIRST_PASSES = ("triton", "xla", "mosaic")


def attention_softmax_dropout_value_backward(
    grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
    attention_dropout, *, first_pass="mosaic", stages=2, split=None, swizzle=True,
    causal=False, interpret=False):
  """The kernel entry point's backward (same arguments and results as
  :func:`pallas_kernels.attention_softmax_dropout_value_backward`) with this module's Mosaic
  GPU dS pass. ``first_pass``, what reads Pd for delta before it: ``"mosaic"`` (default),
  this module's delta kernel (:func:`_delta_kernel`), dV in the dS pass; ``"triton"``, the
  Triton kernels' first pass (which also makes dV); ``"xla"``, ``rowsum(dO * (Pd @ V))`` by
  XLA (the fp32 product), dV in the dS pass. ``stages`` (2-4, ring slots), ``split`` (shares
  of a kv group's rows) and ``swizzle``: as :func:`ds_pass` takes them. ``dropout_mask`` is checked, not read
  (``keep == (Pd != 0)``, the precondition). Raises ``ValueError`` for a problem outside
  :func:`unsupported_reason`, and off a Hopper GPU unless ``interpret`` (then the passes run
  in their interpreters)."""
  p = pallas_mosaic_gpu.checked_rate(
      (grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
       attention_dropout), causal=causal, interpret=interpret, reason=unsupported_reason,
      kernels="ragged mosaic_gpu")
  if first_pass not in FIRST_PASSES:
    raise ValueError(f"first_pass: expected one of {FIRST_PASSES}, got {first_pass!r}")
  if first_pass == "mosaic":   # both kernels here, sharing the gathered dO and V
    plan = _plan(attn_weights, value_states, p, split, stages)
    like = (grad_attn_output, attn_weights, attn_weights_dropped, value_states)
    do_tiles, v_blocks = _gathered(plan, grad_attn_output, value_states)
    pd_view = _row_view(attn_weights_dropped, plan)
    delta_tiles = _delta_call(plan, pd_view, do_tiles, v_blocks, stages=stages,
                              swizzle=swizzle, like=like, interpret=interpret)
    ds, dv = _ds_call(plan, _row_view(attn_weights, plan), pd_view if p != 0 else None,
                      do_tiles, delta_tiles, v_blocks, rate=p, with_dv=True, stages=stages,
                      swizzle=swizzle, like=like, interpret=interpret)
    return _mosaic.varying_like(_assembled(plan, ds, dv, value_states.dtype), *like)
  if first_pass == "xla":
    b, h, sq, skv = attn_weights.shape
    kvh, d = value_states.shape[1], value_states.shape[3]
    g = h // kvh
    out = jnp.einsum("bkgqs,bksd->bqkgd", attn_weights_dropped.reshape(b, kvh, g, sq, skv),
                     value_states, preferred_element_type=f32)
    delta = pallas_triton.delta_from_output(grad_attn_output, out.reshape(b, sq, h, d))
    return ds_pass(grad_attn_output, attn_weights, attn_weights_dropped, value_states, delta,
                   rate=p, with_dv=True, stages=stages, split=split, swizzle=swizzle,
                   interpret=interpret)
  dv, delta = triton_first_pass(grad_attn_output, attn_weights_dropped, value_states,
                                interpret=interpret)
  ds = ds_pass(grad_attn_output, attn_weights, attn_weights_dropped, value_states, delta,
               rate=p, stages=stages, split=split, swizzle=swizzle, interpret=interpret)
  return ds, dv


def triton_first_pass(grad_attn_output, attn_weights_dropped, value_states, *,
                      interpret=False):
  """``(dV [B, KVH, seq_k, D], delta [B, H, seq_q])`` from the Triton kernels' first pass
  (``pallas_triton.dv_pass`` with its config for the arrays' device, delta's partial row
  sums added here): ``first_pass="triton"``."""
  b, h, sq, skv = attn_weights_dropped.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  cfg = triton_config.default_config(
      b, h, kvh, sq, skv, d, attn_weights_dropped.dtype,
      _tuning.device_kind_of(grad_attn_output, attn_weights_dropped, value_states,
                             interpret=interpret))
  dv, dpart = pallas_triton.dv_pass(
      grad_attn_output, attn_weights_dropped.reshape(b * h, sq, skv),
      value_states.reshape(b * kvh, skv, d), num_heads=h, cfg=cfg.dv,
      interpret=bool(interpret), partials=True)
  return dv.reshape(b, kvh, skv, d), jnp.sum(dpart, axis=1).reshape(b, h, sq)
