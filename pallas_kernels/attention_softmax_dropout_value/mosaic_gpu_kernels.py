"""Pallas Mosaic GPU kernels (Hopper, sm_90a) of the softmax -> dropout -> GQA P·V backward.

Both kernels run over the rows of one kv group, ``G * seq_q`` rows that share V (the query
heads of a group are consecutive in P, so ``P[b, h]`` for the group's heads is one
``[G * seq_q, seq_k]`` slab). In each, one warpgroup issues the TMA copies of a multi-stage
ring and two consume it with wgmma, so the GEMMs overlap the streams.

1. :func:`delta_pass` (rows): ``2 * 64`` rows per item, their dO resident in shared memory,
   streamed over the keys in V and Pd tiles: ``dPd = dO @ V^T`` and
   ``delta = rowsum(dPd * Pd)``. At most one program per SM, each looping over items.
2. :func:`ds_dv_pass` (keys): a program owns ``2 * 64`` keys (64 per consumer warpgroup,
   their V resident) and streams P, Pd, dO and delta tiles over the group's rows:
   ``dPd = dO @ V^T`` and ``dV += Pd^T @ dO`` (two wgmmas in flight),
   ``dS = P * (dPd * keep / (1 - p) - delta)`` written through shared memory with TMA.
   Its modes: rows of one key block compute delta themselves; rows of two key blocks run as
   a cluster of two programs exchanging their parts of delta with ``st.async`` at every step;
   from the seeds, the kernel draws keep again and rebuilds Pd from P (no Pd read); given
   row scales, it reads the unnormalized softmax E and makes ``P = E * scale`` first.

Precondition: ``Pd == bf16(P * keep / (1 - p))`` bit for bit, as every forward makes it.
Then ``delta = rowsum(dW * P) = rowsum(dPd * Pd)``, and since ``P > 0`` wherever it
matters, ``keep == (Pd != 0)``: the kernels never read a bool keep mask (not a TMA operand).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _dropout, _mosaic
from pallas_kernels._util import dropout_scale, out_struct

f32 = jnp.float32
i32 = np.int32  # index constants: int32 under x64 too (lax.div/rem need one dtype)

ROWS = 64          # rows per consumer warpgroup (one wgmma M)
KEYS = 64          # keys per consumer warpgroup in the dS/dV kernel
WGS = 2            # consumer warpgroups per program
SMS = _mosaic.SMS
MEMORY_REGISTERS = _mosaic.MEMORY_REGISTERS
_tiled = _mosaic.tiled
_varying_like = _mosaic.varying_like
_interpret_params = _mosaic.interpret_params


def _release(*consumed):
  """Hands ring slots back to the TMA producer after a consumer's generic loads from them:
  ``fence.proxy.async`` (``plgpu.commit_smem``) orders those loads before the producer's
  async-proxy refill, then the slots' barriers are arrived on."""
  plgpu.commit_smem()
  for barrier in consumed:
    if barrier is not None:
      plgpu.barrier_arrive(barrier)


# --------------------------------------------------------------------------------------
# Kernel 1: delta = rowsum(dPd * Pd).
# --------------------------------------------------------------------------------------
def _delta_kernel(do_ref, pd_ref, v_ref, delta_ref, do_smem, delta_smem, barrier, *,
                  kvh_count, g, sq, d, block_k, stages, programs, tiles, n_items):
  """Item ``t`` (of ``n_items``) is row tile ``t % tiles`` (``2 * ROWS`` rows) of kv group
  ``t // tiles``; program ``p`` takes items ``p, p + programs, ...`` in one pipeline over
  ``(its items, key steps)``, each warpgroup loading the next item's dO while it streams
  this one's keys."""
  rows = ROWS
  pid = lax.axis_index("p")
  wg = lax.axis_index("wg")
  # Static when every program has one item (the grid covers the items); else >= 1.
  count = 1 if programs == n_items else lax.div(n_items - pid + i32(programs - 1),
                                                  i32(programs))
  steps = pd_ref.shape[1] // block_k

  def item(i):
    return pid + i * programs

  def load_do(i):
    t = item(i)
    bk = lax.div(t, i32(tiles))
    row0 = lax.rem(t, i32(tiles)) * (WGS * rows) + wg * rows
    b, kvh = lax.div(bk, i32(kvh_count)), lax.rem(bk, i32(kvh_count))
    buf = lax.rem(i, i32(do_smem.shape[0]))
    plgpu.copy_gmem_to_smem(
        do_ref.at[b, pl.ds(lax.rem(row0, i32(sq)), rows), kvh * g + lax.div(row0, i32(sq))],
        do_smem.at[buf, wg], barrier.at[buf * WGS + wg])

  def compute_context(run_pipeline):
    load_do(i32(0))
    # The zero only types the carry: restart_sum takes each item's first part as is.
    run_pipeline(plgpu.layout_cast(jnp.zeros((rows,), f32), plgpu.Layout.WGMMA.reduce(1)))
    plgpu.wait_smem_to_gmem(0)

  def step(idx, v_smem, pd_smem, v_consumed, pd_consumed, delta):
    i, j = idx
    buf = lax.rem(i, i32(do_smem.shape[0]))

    @pl.when(j == 0)
    def _():
      plgpu.barrier_wait(barrier.at[buf * WGS + wg])    # this item's dO is in
      if not isinstance(count, int):
        # The next item's dO goes into the buffer of item i - 1, whose last wgmmas every
        # warp of the warpgroup has waited for: the commit_smem of that item's delta write
        # (below) is a warpgroup barrier after them.
        @pl.when(i + 1 < count)
        def _():
          load_do(i + 1)

    def mm(acc):
      plgpu.wgmma(acc, do_smem.at[buf, wg], v_smem.T)
      return acc[...]
    dpd = pl.run_scoped(mm, plgpu.ACC((rows, block_k), f32))
    plgpu.barrier_arrive(v_consumed)
    pd = plgpu.load(pd_smem.at[pl.ds(wg * rows, rows)], layout=plgpu.Layout.WGMMA)
    _release(pd_consumed)
    delta = _mosaic.restart_sum(j, jnp.sum(dpd * pd.astype(f32), axis=1), delta,
                                plgpu.Layout.WGMMA.reduce(1))

    @pl.when(j == steps - 1)
    def _():
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last item's delta is out
      delta_smem[wg] = delta
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(delta_smem.at[wg],
                              delta_ref.at[pl.ds(item(i) * (WGS * rows) + wg * rows, rows)])
    return delta

  dtype = do_ref.dtype
  pipeline = plgpu.emit_pipeline_warp_specialized(
      step, grid=(count, steps), max_concurrent_steps=stages,
      memory_registers=MEMORY_REGISTERS, num_compute_wgs=WGS, wg_axis="wg",
      manual_consumed_barriers=True, compute_context=compute_context,
      in_specs=[   # V as [B * KVH * seq_k, D], Pd as [B * KVH * G * seq_q, seq_k]
          plgpu.BlockSpec((block_k, d), lambda i, j: (lax.div(item(i), i32(tiles)) * steps + j, 0),
                          transforms=_tiled(dtype)),
          plgpu.BlockSpec((WGS * rows, block_k), lambda i, j: (item(i), j),
                          transforms=_tiled(dtype)),
      ])
  pipeline(v_ref, pd_ref)


def delta_pass(do, pd_groups, v, *, block_k=128, stages=2, programs=SMS, interpret=False):
  """``delta [B, KVH, G * seq_q]`` (fp32) of the rows of ``pd_groups [B, KVH, G * seq_q, seq_k]``.

  An item is ``2 * ROWS`` rows (``seq_q`` and ``G * seq_q / 2`` multiples of ``ROWS``) with
  their dO resident, streamed ``block_k`` keys per step. At most ``programs`` programs (one
  per SM), each taking every ``programs``-th item in one pipeline: no partial last wave, and
  the next item's dO loads while this one streams (one program per item under x64).
  """
  b, sq, h, d = do.shape
  _, kvh, n_rows, skv = pd_groups.shape
  g = h // kvh
  if sq % ROWS or n_rows % (WGS * ROWS) or skv % block_k:
    raise ValueError(f"delta_pass: {ROWS} must divide seq_q ({sq}), {WGS * ROWS} must divide "
                     f"G * seq_q ({n_rows}), and block_k={block_k} must divide seq_k ({skv})")
  tiles = n_rows // (WGS * ROWS)
  n_items = b * kvh * tiles
  programs = min(n_items, programs)
  if jax.config.jax_enable_x64:
    # jax 0.11.2's warp-specialized pipeline on a traced grid (the looping programs' item
    # counts) fails to trace under x64 (lax.rem of its int32 step and an int64 slot
    # count): one program per item there.
    programs = n_items
  kernel = functools.partial(_delta_kernel, kvh_count=kvh, g=g, sq=sq, d=d, block_k=block_k,
                             stages=stages, programs=programs, tiles=tiles, n_items=n_items)
  like = (do, pd_groups, v)   # outputs vary over the inputs' shard_map axes (check_vma)
  buffers = 1 if programs == n_items else 2     # dO of this item and of the next
  out = plgpu.kernel(
      kernel,
      out_type=out_struct((b * kvh * n_rows,), f32, *like),
      scratch_types=[
          plgpu.SMEM((buffers, WGS, ROWS, d), do.dtype, transforms=_tiled(do.dtype)),
          plgpu.SMEM((WGS, ROWS), f32),
          plgpu.Barrier(num_barriers=buffers * WGS),
      ],
      grid=(programs,), grid_names=("p",),
      num_threads=WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_interpret_params(interpret),
  )(do, pd_groups.reshape(b * kvh * n_rows, skv), v.reshape(b * kvh * skv, d))
  return _varying_like(out.reshape(b, kvh, n_rows), *like)


# --------------------------------------------------------------------------------------
# Kernel 2: dS and dV.
# --------------------------------------------------------------------------------------
def _drawn_keep(seeds_ref, t, b, kvh, key0, keep_hash):
  """The keep mask of row tile ``t`` of kv group ``(b, kvh)`` at this warpgroup's keys
  ``[key0, key0 + 64)``, ``[64, 64]`` bool in the WGMMA layout, drawn as
  ``jax_ops.dropout_keep_mask`` draws it (:mod:`pallas_kernels._dropout`): one hash per
  pair of columns, computed on a ``[64, 32]`` array in :data:`_mosaic.PAIR_LAYOUT` and split
  into its two 16-bit halves in each thread's registers. ``seeds_ref``:
  ``[k0, k1, threshold, 0]`` uint32 in global memory, read as scalars. ``keep_hash``:
  ``(num_heads, G, seq_q, seq_k, interpret)``."""
  num_heads, g, sq, skv, interpret = keep_hash
  u32 = jnp.uint32
  row0 = t * ROWS                                  # first row of the tile in the group
  head = b * num_heads + lax.div(row0, i32(sq)) + kvh * g      # n: index over [B, H]
  q0 = lax.rem(row0, i32(sq))
  k0, k1, threshold = seeds_ref[0], seeds_ref[1], seeds_ref[2]
  shape = (ROWS, KEYS // 2)
  rows = _mosaic.pair_iota(shape, 0) + q0
  pairs = _mosaic.pair_iota(shape, 1) + lax.div(key0, i32(2))
  h = _dropout.pair_hash32(k0, k1, head.astype(u32), rows.astype(u32), pairs.astype(u32), skv)
  return _mosaic.pair_halves(h, interpret=interpret) >= threshold


def _ds_dv_kernel(do_ref, p_ref, pd_ref, *refs, kvh_count, g, sq, d, keep_scale, stages,
                  split, fused_delta, keep_hash=None, scaled=False, cluster=0, interpret=False):
  rebuild = keep_hash is not None or scaled   # Pd made in the kernel, none read
  xg_ref = None
  if cluster:   # the exchange's slots and barriers; in the interpreter, global memory
    *refs, mbar, xchg_barrier = refs
    refs, xchg_smem = refs[:-(WGS + 1)], refs[-(WGS + 1):]
    if interpret:
      v_ref, ds_ref, dv_ref, xg_ref, v_smem, ds_smem, barrier = refs
    else:
      v_ref, ds_ref, dv_ref, v_smem, ds_smem, barrier = refs
    delta_ref = None
  elif fused_delta:   # rows of one key block: delta from the two warpgroups' halves
    v_ref, ds_ref, dv_ref, v_smem, ds_smem, barrier, xchg_smem, xchg_barrier = refs
    delta_ref = None
  elif rebuild:   # Pd rebuilt from P (keep drawn again from the seeds pd_ref holds)
    if scaled:
      delta_ref, scale_ref, v_ref, ds_ref, dv_ref, v_smem, ds_smem, barrier, pd_stage = refs
    else:
      delta_ref, v_ref, ds_ref, dv_ref, v_smem, ds_smem, barrier, pd_stage = refs
  else:
    delta_ref, v_ref, ds_ref, dv_ref, v_smem, ds_smem, barrier = refs
  bk = lax.axis_index("bk")
  kb = lax.axis_index("keys")
  share = lax.axis_index("split")
  wg = lax.axis_index("wg")
  b = lax.div(bk, i32(kvh_count))
  kvh = lax.rem(bk, i32(kvh_count))
  key0 = kb * (WGS * KEYS) + wg * KEYS         # first key of this warpgroup
  q_tiles = sq // ROWS
  share_tiles = g * q_tiles // split           # row tiles of this program
  tile0 = share * share_tiles
  dtype = do_ref.dtype   # of dS and of the Pd operand (P's may differ: row_scale's fp16 E)
  wg_keys = pl.ds(wg * KEYS, KEYS)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  own_v = v_smem.at[wg]

  def store_ds(ds, t, ds_slot):
    """dS of row tile ``t`` through this warpgroup's shared-memory slot ``ds_slot``, free
    once at most one of its earlier stores is still reading."""
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    ds_slot[...] = ds.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        ds_slot, ds_ref.at[b, kvh, pl.ds(t * ROWS, ROWS), pl.ds(key0, KEYS)])

  def finish(step, p, dw):
    """Cluster mode: dS of the program's step ``step`` from its delta (the exchange)."""
    delta = _exchange_delta(xchg_smem, mbar, xchg_barrier, xg_ref, step, (bk, share),
                            cluster=cluster, interpret=interpret)
    store_ds(p * (dw - lax.broadcast_in_dim(delta, (ROWS, KEYS), [0])), tile0 + step,
             ds_smem.at[wg, lax.rem(step, i32(2))])

  def compute_context(run_pipeline):
    plgpu.copy_gmem_to_smem(v_ref.at[b, kvh, pl.ds(key0, KEYS)], own_v, barrier.at[wg])
    plgpu.barrier_wait(barrier.at[wg])

    def run(dv_acc):
      if cluster:   # the last step's dS, whose delta no later step finishes
        zero = plgpu.layout_cast(jnp.zeros((ROWS, KEYS), f32), plgpu.Layout.WGMMA)
        _, p_last, dw_last = run_pipeline((dv_acc, zero, zero))
        finish(share_tiles - 1, p_last, dw_last)
      else:
        run_pipeline(dv_acc)
      if rebuild:   # the last step's dV GEMM is still in flight
        plgpu.wgmma_wait(0)
      return dv_acc[...]
    dv = pl.run_scoped(run, plgpu.ACC((KEYS, d), f32))
    if split == 1:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # this warpgroup's dS slots are free
      own_v[...] = dv.astype(v_smem.dtype)                # V is no longer read
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(own_v, dv_ref.at[b, kvh, pl.ds(key0, KEYS)])
    else:   # an fp32 partial, stored from registers
      dv_ref.at[share, b, kvh, pl.ds(key0, KEYS)][...] = dv
    plgpu.wait_smem_to_gmem(0)

  def step(idx, *args):
    (t,) = idx
    local = t
    t = tile0 + t
    dv_acc = args[-1]
    if cluster:   # (dV, and the previous step's P and dW, whose dS this step finishes)
      dv_acc, p_prev, dw_prev = dv_acc
    if fused_delta:
      p_smem, pd_smem, do_smem, p_consumed, pd_consumed, do_consumed = args[:-1]
      delta_consumed = None
    elif rebuild:   # no second stream: its barrier arrivals are skipped
      scale_smem = scale_consumed = None
      if scaled:
        (p_smem, do_smem, delta_smem, scale_smem,
         p_consumed, do_consumed, delta_consumed, scale_consumed) = args[:-1]
      else:
        p_smem, do_smem, delta_smem, p_consumed, do_consumed, delta_consumed = args[:-1]
      pd_smem = pd_consumed = None
    else:
      (p_smem, pd_smem, do_smem, delta_smem,
       p_consumed, pd_consumed, do_consumed, delta_consumed) = args[:-1]

    if rebuild:
      # P (times its row's scale, when the forward left it unnormalized); keep drawn again
      # from the seeds; Pd = round(P * keep / (1 - p)) (the precondition) into one of this
      # warpgroup's two staging tiles, the dV GEMM's operand. The step does not wait for
      # its dV GEMM: the next step's wait for its dPd GEMM (wgmma groups complete in order)
      # covers it, and only then are this step's ring slots (dO is the GEMM's operand)
      # released (the pipeline's delay_release=1).
      stage = pd_stage.at[wg, lax.rem(local, i32(2))]
      def mm(acc):
        plgpu.wgmma(acc, do_smem, v_smem.at[wg].T)                    # dPd [rows, keys]
        p32 = plgpu.load(p_smem.at[:, wg_keys], layout=plgpu.Layout.WGMMA).astype(f32)
        if scaled:
          row_scale = plgpu.load(scale_smem.at[wg], layout=row_layout)
          p32 = p32 * lax.broadcast_in_dim(row_scale, (ROWS, KEYS), [0])
        if keep_hash is None:
          kept = None
          stage[...] = p32.astype(dtype)
        else:
          kept = _drawn_keep(pd_ref, t, b, kvh, key0, keep_hash)
          stage[...] = jnp.where(kept, p32 * keep_scale, 0.0).astype(dtype)
        plgpu.commit_smem()
        plgpu.wgmma(dv_acc, stage.T, do_smem)                         # dV [keys, d]
        return plgpu.wgmma_accumulator_load(acc, wait_n=1), p32, kept
      dpd, p, kept = pl.run_scoped(mm, plgpu.ACC((ROWS, KEYS), f32))

      @pl.when(local > 0)   # the previous step's dV GEMM is done: release its slots
      def _():
        _release(p_consumed, do_consumed, delta_consumed, scale_consumed)
      dw = dpd if kept is None else jnp.where(kept, dpd * keep_scale, 0.0)
    else:
      def mm(acc):
        plgpu.wgmma(acc, do_smem, v_smem.at[wg].T)                    # dPd [rows, keys]
        plgpu.wgmma(dv_acc, pd_smem.at[:, wg_keys].T, do_smem)        # dV [keys, d]
        return plgpu.wgmma_accumulator_load(acc, wait_n=1)
      dpd = pl.run_scoped(mm, plgpu.ACC((ROWS, KEYS), f32))
      p = plgpu.load(p_smem.at[:, wg_keys], layout=plgpu.Layout.WGMMA).astype(f32)
      if keep_scale is not None or cluster:
        pd = plgpu.load(pd_smem.at[:, wg_keys], layout=plgpu.Layout.WGMMA)
      if cluster:   # this warpgroup's part of delta = rowsum(dPd * Pd), as the delta kernel
        part = jnp.sum(dpd * pd.astype(f32), axis=1)
      dw = dpd if keep_scale is None else jnp.where(pd != 0, dpd * keep_scale, 0.0)
      _release(p_consumed)
    slot = lax.rem(t, i32(2))
    if cluster:
      # The previous step's delta (its parts had this step's GEMMs and loads to arrive),
      # read before this step's part is published (so two slots suffice), then its dS.
      @pl.when(local > 0)
      def _previous():
        finish(local - 1, p_prev, dw_prev)
      _exchange_publish(part, xchg_smem, mbar, xchg_barrier, xg_ref, local, kb, wg,
                        (bk, share), cluster=cluster, interpret=interpret)
      plgpu.wgmma_wait(0)                                             # dV read Pd and dO
      plgpu.barrier_arrive(pd_consumed)
      plgpu.barrier_arrive(do_consumed)
      return dv_acc, p, dw
    if fused_delta:
      # delta = rowsum(dW * P) as the spec writes it: this warpgroup's 64 keys, then the
      # other's through shared memory (two slots: a warpgroup is at most one step ahead).
      xchg_smem[slot, wg] = jnp.sum(dw * p, axis=1)
      plgpu.barrier_arrive(xchg_barrier)
      plgpu.barrier_wait(xchg_barrier)
      delta = (plgpu.load(xchg_smem.at[slot, 0], layout=row_layout)
               + plgpu.load(xchg_smem.at[slot, 1], layout=row_layout))
    else:
      delta = plgpu.load(delta_smem, layout=row_layout)
      if not rebuild:
        _release(delta_consumed)
    ds = p * (dw - lax.broadcast_in_dim(delta, (ROWS, KEYS), [0]))
    if not rebuild:
      plgpu.wgmma_wait(0)                                             # dV read Pd and dO
      plgpu.barrier_arrive(pd_consumed)
      plgpu.barrier_arrive(do_consumed)
    store_ds(ds, t, ds_smem.at[wg, slot])
    return dv_acc

  tiled = _tiled(dtype)
  delay = {"delay_release": 1} if rebuild else {}

  def head_tile(t):
    """Step ``t``'s row block and query head (of the key head's ``g``), and head_dim 0."""
    row, head = lax.rem(tile0 + t, i32(q_tiles)), kvh * g + lax.div(tile0 + t, i32(q_tiles))
    return row, head, 0

  def scale_tile(t):
    row, head, _ = head_tile(t)
    return head, kb, row

  in_specs = [
      plgpu.BlockSpec((ROWS, WGS * KEYS), lambda t: (tile0 + t, kb), transforms=tiled,
                      **delay),
      plgpu.BlockSpec((ROWS, WGS * KEYS), lambda t: (tile0 + t, kb), transforms=tiled),
      plgpu.BlockSpec((ROWS, None, d), head_tile, transforms=tiled, **delay),
  ]
  operands = [p_ref.at[b, kvh], None if rebuild else pd_ref.at[b, kvh], do_ref.at[b]]
  if rebuild:   # P, dO and delta (and the row scales): nothing streamed for Pd or keep
    del in_specs[1], operands[1]
  if not fused_delta:
    in_specs.append(plgpu.BlockSpec((ROWS,), lambda t: (tile0 + t,), **delay))
    operands.append(delta_ref.at[b, kvh])
  if scaled:   # the scales of the row tile's head for this program's two 64-key chunks
    in_specs.append(plgpu.BlockSpec((None, WGS, ROWS), scale_tile, **delay))
    operands.append(scale_ref.at[b])
  pipeline = plgpu.emit_pipeline_warp_specialized(
      step, grid=(share_tiles,), max_concurrent_steps=stages,
      memory_registers=MEMORY_REGISTERS, num_compute_wgs=WGS, wg_axis="wg",
      manual_consumed_barriers=True, compute_context=compute_context, in_specs=in_specs)
  own_mbarriers = cluster and not interpret
  if own_mbarriers:
    # The exchange's mbarriers, initialized before any program of the cluster arrives on
    # them (every thread of the cluster synchronizes).
    @pl.when(wg == 0)
    def _init():
      _mosaic.cluster_barriers_init(mbar, count=WGS * cluster)
    _mosaic.cluster_sync()
  pipeline(*operands)
  if own_mbarriers:
    # No program leaves while a peer may still write into its shared memory.
    _mosaic.cluster_sync()


def _exchange_publish(part, xchg_smem, mbar, xchg_barrier, xg_ref, step, kb, wg, program, *,
                      cluster, interpret):
  """Cluster mode: this warpgroup's part of delta for its program's step ``step``, given to
  the ``cluster`` programs of the row (one per key block); :func:`_exchange_delta` reads
  them back one step later. The warpgroup writes its part into its own staging ref
  (``xchg_smem[wg]``, ``[64]``), synchronizes, and sends it with ``st.async`` into slot
  ``step % 2`` of every program's receiving ref (``xchg_smem[WGS]``: ``[2, cluster, WGS,
  64]``; :func:`_mosaic.cluster_send_rows`). The writes complete on the receiving program's
  mbarrier of the slot by transaction count, so they are visible to the threads whose wait
  sees the phase complete. Two slots: every warpgroup reads step ``s``'s parts before it
  publishes step ``s + 1``, so a program that publishes step ``s + 2`` into the slot (after
  it has waited for all of step ``s + 1``'s parts) finds every warpgroup done with it.

  The interpreter (no shared memory across a cluster, no ``st.async``) takes the same steps
  through ``xg_ref`` in global memory (one slab per cluster, ``program``) and the cluster
  barrier ``xchg_barrier``."""
  slot = lax.rem(step, i32(2))
  if interpret:
    xg_ref.at[program + (slot, kb, wg)][...] = part
    plgpu.barrier_arrive(xchg_barrier)
    return
  for w in range(WGS):
    @pl.when(wg == w)
    def _stage():
      xchg_smem[w][...] = part
  plgpu.commit_smem()   # a warpgroup barrier: every thread's writes before the sends
  for s in range(2):
    for w in range(WGS):
      @pl.when((slot == s) & (wg == w))
      def _send():
        offset, stride = _receive_place(s, w, cluster)
        _mosaic.cluster_send_rows(xchg_smem[w], xchg_smem[WGS], mbar, slot=s,
                                  offset=offset, stride=stride, cluster=cluster)


def _receive_place(slot: int, wg: int, cluster: int) -> tuple[int, int]:
  """``(offset, stride)``: where warpgroup ``wg``'s part of slot ``slot`` lands in a receiving
  ref ``[2, cluster, WGS, 64]`` (row-major, the index :func:`_exchange_delta` reads,
  ``[slot, rank, wg]``): element ``offset + rank * stride`` for the sender of rank ``rank``."""
  return (slot * cluster * WGS + wg) * ROWS, WGS * ROWS


def _exchange_delta(xchg_smem, mbar, xchg_barrier, xg_ref, step, program, *, cluster,
                    interpret):
  """Cluster mode: ``delta`` of the program's step ``step``: waits for the ``WGS * cluster``
  parts of the step (:func:`_exchange_publish`) on its slot's mbarrier (phase parity
  ``step // 2 % 2``), then adds them from its own shared memory in the same order in every
  program (the same delta in all)."""
  slot = lax.rem(step, i32(2))

  def total(part):   # sum of part(c, w) over the programs c and their warpgroups w, in order
    parts = [part(c, w) for c in range(cluster) for w in range(WGS)]
    return sum(parts[1:], parts[0])

  if interpret:
    plgpu.barrier_wait(xchg_barrier)
    return total(lambda c, w: xg_ref[program + (slot, c, w)])
  phase = lax.rem(step, i32(4))   # slot and parity of the slot's phase
  for q in range(4):
    @pl.when(phase == q)
    def _wait():
      _mosaic.cluster_barrier_wait(mbar, q % 2, q // 2)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  read = lambda s: total(lambda c, w: plgpu.load(xchg_smem[WGS].at[s, c, w],
                                                 layout=row_layout))
  return lax.cond(slot == 0, lambda: read(0), lambda: read(1))


def _clusters_one_group_at_a_time(do, p_groups, pd_groups, v, *, rate, stages, interpret):
  """The cluster launch under the Mosaic GPU interpreter, whose clusters stop (wait
  forever) in a grid of more than one kv group, with split programs or with rings of more
  than two slots: one launch per kv group, unsplit, two slots; the same math."""
  b, kvh = p_groups.shape[:2]
  g = do.shape[2] // kvh
  ds, dv = [], []
  for i in range(b):
    parts = [ds_dv_pass(do[i:i + 1, :, k * g:(k + 1) * g], p_groups[i:i + 1, k:k + 1],
                        pd_groups[i:i + 1, k:k + 1], None, v[i:i + 1, k:k + 1], rate=rate,
                        stages=stages, split=1, interpret=interpret) for k in range(kvh)]
    ds.append(jnp.concatenate([p[0] for p in parts], axis=1))
    dv.append(jnp.concatenate([p[1] for p in parts], axis=1))
  return jnp.concatenate(ds, axis=0), jnp.concatenate(dv, axis=0)


def ds_dv_pass(do, p_groups, pd_groups, delta, v, *, rate, stages=2, split=1,
               keep_seeds=None, row_scale=None, interpret=False):
  """``(dS [B, KVH, G * seq_q, seq_k], dV [B, KVH, seq_k, D])`` from the group slabs of P
  and Pd, ``delta [B, KVH, G * seq_q]`` and V.

  ``delta=None`` (``seq_k`` of 128 or 256): the kernel computes it; at 128 keys (one key
  block) as ``rowsum(dW * P)``; at 256 keys the two programs of a row's key blocks run as a
  cluster and walk its row tiles together, each computing its keys' part of
  ``rowsum(dPd * Pd)`` and sending it to the other at every step: P and Pd read once, dS
  written once (6 B per element), one launch.
  ``keep_seeds`` (``[k0, k1, threshold, 0]`` uint32; with a delta and a rate > 0): keep
  drawn again in the kernel, as ``jax_ops.dropout_keep_mask`` draws it, and Pd rebuilt from
  P (``pd_groups`` unused): 4 B per element, nothing read for keep; each step's dV GEMM is
  waited for in the next step, so ``stages >= 3``.
  ``row_scale`` (``[B, H, seq_k / 64, seq_q]`` fp32; with a delta): ``p_groups`` holds the
  unnormalized ``E`` of :func:`..forward.attention_softmax_dropout_value_forward_unnormalized`
  and ``P = E * row_scale[..., k // 64, q]`` in fp32; Pd is rebuilt from it (``pd_groups`` unused), as with
  ``keep_seeds`` (which it may go with), so ``stages >= 3``.
  ``split`` programs share each key block's rows (``G * seq_q / 64`` a multiple of it);
  above 1 each adds an fp32 partial dV, summed here.
  """
  b, sq, h, d = do.shape
  _, kvh, rows, skv = p_groups.shape
  g = h // kvh
  if (rows // ROWS) % split:
    raise ValueError(f"split={split} must divide the {rows // ROWS} row tiles")
  fused_delta = delta is None
  blocks = skv // (WGS * KEYS)
  if fused_delta and skv not in (WGS * KEYS, 2 * WGS * KEYS):
    raise ValueError(f"delta=None needs seq_k == {WGS * KEYS} or {2 * WGS * KEYS}, got {skv}")
  cluster = fused_delta and blocks == 2
  if keep_seeds is not None and (fused_delta or rate == 0 or stages < 3):
    raise ValueError("keep_seeds goes with a delta, a rate > 0 and stages >= 3")
  if row_scale is not None and (fused_delta or stages < 3 or (rate != 0 and keep_seeds is None)):
    raise ValueError("row_scale goes with a delta, stages >= 3 and, for a rate > 0, keep_seeds")
  rebuild = keep_seeds is not None or row_scale is not None
  if cluster and interpret and (b * kvh > 1 or split > 1 or stages > 2):
    return _clusters_one_group_at_a_time(do, p_groups, pd_groups, v, rate=rate,
                                         stages=min(stages, 2), interpret=interpret)
  keep_hash = None if keep_seeds is None else (h, g, sq, skv, bool(interpret))
  keep_scale = None if rate == 0 else dropout_scale(rate)   # the forward's fp32 factor
  kernel = functools.partial(_ds_dv_kernel, kvh_count=kvh, g=g, sq=sq, d=d,
                             keep_scale=keep_scale, stages=stages, split=split,
                             fused_delta=fused_delta, keep_hash=keep_hash,
                             scaled=row_scale is not None,
                             cluster=blocks if cluster else 0, interpret=bool(interpret))
  dtype = do.dtype
  like = tuple(x for x in (do, p_groups, pd_groups, delta, keep_seeds, row_scale, v)
               if x is not None)
  dv_type = (out_struct((b, kvh, skv, d), v.dtype, *like) if split == 1
             else out_struct((split, b, kvh, skv, d), f32, *like))
  scratch = [
      plgpu.SMEM((WGS, KEYS, d), v.dtype, transforms=_tiled(v.dtype)),
      plgpu.SMEM((WGS, 2, ROWS, KEYS), dtype, transforms=_tiled(dtype)),
      plgpu.Barrier(num_barriers=WGS),
  ]
  if cluster:
    scratch += [plgpu.SMEM((ROWS,), f32) for _ in range(WGS)]   # staging
    scratch += [plgpu.SMEM((2, blocks, WGS, ROWS), f32),        # receiving
                plgpu.SMEM((4,), jnp.uint32),                   # two 64-bit mbarriers
                plgpu.ClusterBarrier(collective_axes=("keys",), num_arrivals=WGS)]
  elif fused_delta:
    scratch += [plgpu.SMEM((2, WGS, ROWS), f32), plgpu.Barrier(num_arrivals=WGS)]
  if rebuild:
    scratch.append(plgpu.SMEM((WGS, 2, ROWS, KEYS), dtype, transforms=_tiled(dtype)))
  second = keep_seeds if keep_seeds is not None else pd_groups
  operands = ([do, p_groups, second] + ([] if fused_delta else [delta])
              + ([] if row_scale is None else [row_scale]) + [v])
  out_type = (out_struct((b, kvh, rows, skv), dtype, *like), dv_type)
  if cluster:   # one cluster per row slab and share: its programs are the key blocks
    launch = dict(grid=(b * kvh, split), grid_names=("bk", "split"), cluster=(blocks,),
                  cluster_names=("keys",))
    if interpret:   # the exchange's stand-in for the cluster's shared memory
      out_type += (jax.ShapeDtypeStruct((b * kvh, split, 2, blocks, WGS, ROWS), f32),)
  else:
    launch = dict(grid=(b * kvh, blocks, split), grid_names=("bk", "keys", "split"))
  ds, dv, *_ = plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=scratch,
      **launch,
      num_threads=WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_interpret_params(interpret),
  )(*operands)
  ds, dv = _varying_like((ds, dv), *like)
  if split > 1:
    dv = jnp.sum(dv, axis=0).astype(v.dtype)
  return ds, dv
