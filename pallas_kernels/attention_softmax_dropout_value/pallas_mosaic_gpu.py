"""Pallas Mosaic GPU kernels (Hopper, sm_90a): the backward of softmax -> dropout -> GQA P·V.

Same math as :mod:`.pallas_triton` (see its docstring); the kernels here are built from TMA
copies, wgmma and warp specialization: in each kernel one warpgroup issues the TMA copies
of a multi-stage ring and two warpgroups consume it with wgmma, so the GEMMs overlap the
streams.

Two kernels, both over the rows of one kv group, ``G * seq_q`` rows that share V (the
query heads of a group are consecutive in P, so ``P[b, h]`` for the group's heads is one
``[G * seq_q, seq_k]`` slab):

1. :func:`_delta_kernel` (rows): a row tile is ``2 * 64`` or ``2 * 128`` rows (per consumer
   warpgroup, with their dO resident in shared memory), streamed over the keys in V and Pd
   tiles: ``dPd = dO @ V^T`` (wgmma) and ``delta = rowsum(dPd * Pd)``. One program per
   tile, or (``Config.delta_persistent``, which :func:`default_config` turns on) at most
   one per SM, each looping over tiles.
2. :func:`_ds_dv_kernel` (keys): a program owns ``2 * 64`` keys (64 per consumer
   warpgroup, with their V resident) and streams P, Pd, dO and delta tiles over the
   group's rows: ``dPd = dO @ V^T`` and ``dV += Pd^T @ dO`` (two wgmmas in flight),
   ``dS = P * (dPd * keep / (1 - p) - delta)`` written through shared memory with TMA.
   dV is summed over the G heads in the program's registers.

Precondition (as the problem statement allows): ``Pd == bf16(P * keep / (1 - p))`` bit for
bit, as every forward makes it. Then ``delta = rowsum(dW * P)`` is computed as
``rowsum(dPd * Pd)``, and since ``P > 0`` wherever it matters, ``keep == (Pd != 0)``:
where ``P == 0`` the gradient ``P * (...)`` is 0 whatever keep says. The kernels never
read ``keep``: a ``bool`` array cannot be a TMA operand (Mosaic GPU types it ``i1``),
and converting it to ``uint8`` first is one more full pass over HBM. They stream
``2 + 2 + 2 + 2 = 8`` bytes per attention element (Pd twice, P once, dS once); at
``seq_k == 128`` the dS-dV kernel computes delta itself and there is no delta kernel (6 B);
at ``seq_k == 256`` too (``Config.mirror_delta``: each program reads Pd's whole rows, 8 B in one
launch). ``Config.cluster_delta`` runs rows of 256-1024 keys in one launch at 6 B per
element: the programs of a row's key blocks form a cluster and exchange their parts of
delta through shared memory at every step (the default at 256 keys, with
``cluster_exchange="async_store"``; measured slower at 512-1024).
``Config.keep_bits`` (off: measured slower) has the delta kernel write keep as bits and the
dS-dV kernel rebuild Pd from P and them (6.25 B).

Supported (:func:`unsupported_reason` says why not otherwise): bf16 or fp16, ``D`` of 64
or 128, ``seq_q % 64 == 0``, ``seq_k % 128 == 0``, ``(G * seq_q) % 128 == 0`` (not
needed at ``seq_k`` of 128 or 256), a static dropout rate, no causal mask. Other problems
take the Triton kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _dropout, _mosaic, validation
from pallas_kernels._util import dropout_scale, out_struct

f32 = jnp.float32
i32 = np.int32  # index constants: int32 under x64 too (lax.div/rem need one dtype)

ROWS = 64          # rows per consumer warpgroup (one wgmma M)
KEYS = 64          # keys per consumer warpgroup in the dS/dV kernel
WGS = 2            # consumer warpgroups per program
MAX_CLUSTER = 8    # programs per cluster (the portable limit): rows of up to 1024 keys
MEMORY_REGISTERS = _mosaic.MEMORY_REGISTERS
_tiled = _mosaic.tiled
_varying_like = _mosaic.varying_like
_interpret_params = _mosaic.interpret_params


def tile_reason(dtype, d, sq) -> str | None:
  """What of a problem's dtype, head dim and ``seq_q`` no Mosaic GPU kernel of op A takes
  (their 16-bit swizzled tiles of 64 rows; ``None``: all take them)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype)} (bfloat16 or float16 only)"
  if d not in (64, 128):
    return f"head dim {d} (64 or 128 only)"
  if sq % ROWS:
    return f"seq_q {sq} (a multiple of {ROWS} only)"
  return None


def unsupported_reason(b, h, kvh, sq, skv, d, dtype, p_static, causal) -> str | None:
  """Why these kernels cannot run a problem (``None``: they can). ``p_static`` is the
  dropout rate as a float, ``None`` when traced."""
  why = tile_reason(dtype, d, sq)
  if why:
    return why
  if skv % (WGS * KEYS):
    return f"seq_k {skv} (a multiple of {WGS * KEYS} only)"
  g = h // kvh
  if skv not in (WGS * KEYS, 2 * WGS * KEYS) and (g * sq) % (WGS * ROWS):
    # the delta kernel's row blocks (rows of 128 or 256 keys need no delta kernel)
    return (f"G * seq_q = {g * sq} (a multiple of {WGS * ROWS} only, unless seq_k is "
            f"{WGS * KEYS} or {2 * WGS * KEYS})")
  if p_static is None:
    return "a traced dropout rate (static rates only)"
  if causal:
    return "a causal mask"
  return None


# --------------------------------------------------------------------------------------
# Kernel 1: delta = rowsum(dPd * Pd).
# --------------------------------------------------------------------------------------
def _keep_words(pd, block_k):
  """The keep bits of a ``[rows, block_k]`` Pd tile (``Pd != 0``) as ``block_k / 32`` int32
  row vectors: bit ``c % 32`` of word ``c // 32`` is column ``c``. Made with row sums of
  distinct powers of two (a sum of distinct bits is their OR), so any register layout works."""
  col = plgpu.broadcasted_iota(jnp.int32, pd.shape, 1, layout=plgpu.Layout.WGMMA)
  one = jnp.ones(pd.shape, jnp.int32)
  bits = jnp.where(pd != 0, lax.shift_left(one, col & i32(31)), i32(0))
  word = lax.shift_right_logical(col, i32(5))
  # dtype: under x64 a sum of int32 would be int64.
  return [jnp.sum(jnp.where(word == i32(q), bits, i32(0)), axis=1, dtype=jnp.int32)
          for q in range(block_k // 32)]


def _fence(proxy_fence: bool):
  """With ``proxy_fence``: ``fence.proxy.async`` (``plgpu.commit_smem``) after a consumer's
  generic loads from a ring slot, before it hands the slot back to the TMA producer
  (:attr:`Config.proxy_fence`)."""
  if proxy_fence:
    plgpu.commit_smem()


def _delta_kernel(do_ref, pd_ref, v_ref, delta_ref, *refs, kvh_count, g, sq, skv, d, rows,
                  block_k, stages, write_keep, proxy_fence=True, programs, tiles, n_items):
  """Item ``t`` (of ``n_items``) is row tile ``t % tiles`` (``2 * rows`` rows) of kv group
  ``t // tiles``; program ``p`` takes items ``p, p + programs, ...`` in one pipeline over
  ``(its items, key steps)``, each warpgroup loading the next item's dO while it streams
  this one's keys."""
  if write_keep:
    keep_ref, do_smem, delta_smem, barrier, keep_smem = refs
  else:
    do_smem, delta_smem, barrier = refs
  pid = lax.axis_index("p")
  wg = lax.axis_index("wg")
  # Static when every program has one item (the grid covers the items); else >= 1.
  count = 1 if programs == n_items else lax.div(n_items - pid + i32(programs - 1),
                                                  i32(programs))
  steps = skv // block_k
  words = block_k // 32

  def item(i):
    return pid + i * programs

  def place(i):
    """(b, kvh, this warpgroup's first row in the group) of the program's ``i``-th item."""
    t = item(i)
    bk = lax.div(t, i32(tiles))
    row0 = lax.rem(t, i32(tiles)) * (WGS * rows) + wg * rows
    return lax.div(bk, i32(kvh_count)), lax.rem(bk, i32(kvh_count)), row0

  def load_do(i):
    b, kvh, row0 = place(i)
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
    _fence(proxy_fence)
    plgpu.barrier_arrive(pd_consumed)
    if write_keep:   # keep bits of this tile -> [B, KVH, seq_k / 32, G * seq_q]
      b, kvh, row0 = place(i)
      slot = lax.rem(i * steps + j, i32(2))   # steps may be odd
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)               # the slot is free
      for q, w in enumerate(_keep_words(pd, block_k)):
        keep_smem[wg, slot, q] = w
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          keep_smem.at[wg, slot],
          keep_ref.at[b, kvh, pl.ds(j * words, words), pl.ds(row0, rows)])
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


def delta_pass(do, pd_groups, v, *, rows=64, block_k=64, stages=4, write_keep=False,
               proxy_fence=True, programs=None, interpret=False):
  """``delta [B, KVH, G * seq_q]`` (fp32) of the rows of ``pd_groups [B, KVH, G * seq_q, seq_k]``;
  with ``write_keep``, ``(delta, keep_bits [B, KVH, seq_k / 32, G * seq_q] int32)``: bit
  ``k % 32`` of word ``k // 32`` of a row is ``Pd[row, k] != 0``.

  An item is ``2 * rows`` rows (``rows`` = 64 or 128 per warpgroup; ``seq_q`` and
  ``G * seq_q / 2`` multiples of it) with their dO resident, streamed ``block_k`` keys per
  step. One program per item (``programs=None``, and always under x64), or ``programs`` of
  them (at most one per item), each taking every ``programs``-th item in one pipeline: with
  one per SM there is no partial last wave, and the next item's dO loads while this one
  streams.
  """
  b, sq, h, d = do.shape
  _, kvh, n_rows, skv = pd_groups.shape
  g = h // kvh
  if sq % rows or n_rows % (WGS * rows) or skv % block_k:
    raise ValueError(f"delta_pass: rows={rows} must divide seq_q ({sq}), {WGS} * rows must "
                     f"divide G * seq_q ({n_rows}), and block_k={block_k} must divide seq_k "
                     f"({skv})")
  tiles = n_rows // (WGS * rows)
  n_items = b * kvh * tiles
  programs = n_items if programs is None else min(n_items, programs)
  if jax.config.jax_enable_x64:
    # jax 0.11.2's warp-specialized pipeline on a traced grid (the looping programs' item
    # counts) fails to trace under x64 (lax.rem of its int32 step and an int64 slot
    # count): one program per item there.
    programs = n_items
  kernel = functools.partial(_delta_kernel, kvh_count=kvh, g=g, sq=sq, skv=skv, d=d,
                             rows=rows, block_k=block_k, stages=stages, write_keep=write_keep,
                             proxy_fence=proxy_fence, programs=programs, tiles=tiles,
                             n_items=n_items)
  like = (do, pd_groups, v)   # outputs vary over the inputs' shard_map axes (check_vma)
  out_type = out_struct((b * kvh * n_rows,), f32, *like)
  buffers = 1 if programs == n_items else 2     # dO of this item and of the next
  scratch = [
      plgpu.SMEM((buffers, WGS, rows, d), do.dtype, transforms=_tiled(do.dtype)),
      plgpu.SMEM((WGS, rows), f32),
      plgpu.Barrier(num_barriers=buffers * WGS),
  ]
  if write_keep:
    out_type = (out_type, out_struct((b, kvh, skv // 32, n_rows), jnp.int32, *like))
    scratch.append(plgpu.SMEM((WGS, 2, block_k // 32, rows), jnp.int32))
  out = plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=scratch,
      grid=(programs,), grid_names=("p",),
      num_threads=WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_interpret_params(interpret),
  )(do, pd_groups.reshape(b * kvh * n_rows, skv), v.reshape(b * kvh * skv, d))
  if write_keep:
    out = (out[0].reshape(b, kvh, n_rows), out[1])
  else:
    out = out.reshape(b, kvh, n_rows)
  return _varying_like(out, *like)


# --------------------------------------------------------------------------------------
# Kernel 2: dS and dV.
# --------------------------------------------------------------------------------------
def _drawn_keep(seeds_ref, t, b, kvh, key0, keep_hash):
  """The keep mask of row tile ``t`` of kv group ``(b, kvh)`` at this warpgroup's keys
  ``[key0, key0 + 64)``, ``[64, 64]`` bool in the WGMMA layout, drawn as
  ``jax_ops.dropout_keep_mask`` draws it (:mod:`pallas_kernels._dropout`). ``seeds_ref``:
  ``[k0, k1, threshold, 0]`` uint32 in global memory, read as scalars (a TMA copy of them
  would need a 128-byte aligned destination per warpgroup). ``keep_hash``: ``(num_heads, G,
  seq_q, seq_k, hash)``, ``hash`` one of

  - ``"pairs"``: one hash per pair of columns, computed on a ``[64, 32]`` array in
    :data:`pallas_kernels._mosaic.PAIR_LAYOUT` and split into its two 16-bit halves in each
    thread's registers (:func:`pallas_kernels._mosaic.pair_halves`);
  - ``"pairs_interpret"``: the same for the interpreter (halves by a stack and a reshape);
  - ``"element"``: one hash per element (the element's half of its pair's hash), twice the
    integer work.
  """
  num_heads, g, sq, skv, how = keep_hash
  u32 = jnp.uint32
  row0 = t * ROWS                                  # first row of the tile in the group
  head = b * num_heads + lax.div(row0, i32(sq)) + kvh * g      # n: index over [B, H]
  q0 = lax.rem(row0, i32(sq))
  k0, k1, threshold = seeds_ref[0], seeds_ref[1], seeds_ref[2]
  if how == "element":
    layout = plgpu.Layout.WGMMA
    rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, KEYS), 0, layout=layout) + q0
    cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, KEYS), 1, layout=layout) + key0
    u = _dropout.bits16(k0, k1, head.astype(u32), rows.astype(u32), cols.astype(u32), skv)
  else:
    shape = (ROWS, KEYS // 2)
    rows = _mosaic.pair_iota(shape, 0) + q0
    pairs = _mosaic.pair_iota(shape, 1) + lax.div(key0, i32(2))
    h = _dropout.pair_hash32(k0, k1, head.astype(u32), rows.astype(u32), pairs.astype(u32),
                             skv)
    u = _mosaic.pair_halves(h, interpret=how == "pairs_interpret")
  return u >= threshold


def _ds_dv_kernel(do_ref, p_ref, pd_ref, *refs, kvh_count, g, sq, d, keep_scale, stages,
                  split, fused_delta, keep_bits, keep_hash=None, delay_dv=False,
                  mirror=False, cluster=0, exchange="mbarrier", proxy_fence=True,
                  interpret=False):
  xg_ref = None
  if cluster:   # the exchange's slots and barriers; in the interpreter, global memory
    *refs, mbar, xchg_barrier = refs
    slot_refs = 2 * WGS if exchange == "mbarrier" else WGS + 1
    refs, xchg_smem = refs[:-slot_refs], refs[-slot_refs:]
    if interpret:
      v_ref, ds_ref, dv_ref, xg_ref, v_smem, ds_smem, barrier = refs
    else:
      v_ref, ds_ref, dv_ref, v_smem, ds_smem, barrier = refs
    delta_ref = None
  elif fused_delta:   # rows of one key block: delta from the two warpgroups' halves
    v_ref, ds_ref, dv_ref, v_smem, ds_smem, barrier, xchg_smem, xchg_barrier = refs
    delta_ref = None
  elif keep_hash is not None:   # keep drawn again from the seeds (pd_ref holds them)
    delta_ref, v_ref, ds_ref, dv_ref, v_smem, ds_smem, barrier, pd_stage = refs
  elif keep_bits:   # pd_ref holds the keep bits; Pd is rebuilt from P into pd_stage
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
  dtype = p_ref.dtype
  wg_keys = pl.ds(wg * KEYS, KEYS)
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  # mirror: rows of two key blocks; this warpgroup's V of both blocks resident (keys
  # blk * 128 + wg * 64 ...), its own block's slot the dV output's.
  own_v = v_smem.at[wg, kb] if mirror else v_smem.at[wg]

  def store_ds(ds, t, ds_slot, pending=1):
    """dS of row tile ``t`` through this warpgroup's shared-memory slot ``ds_slot``, free
    once at most ``pending`` of its earlier stores are still reading."""
    plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
    ds_slot[...] = ds.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        ds_slot, ds_ref.at[b, kvh, pl.ds(t * ROWS, ROWS), pl.ds(key0, KEYS)])

  def finish(step, p, dw):
    """Cluster mode: dS of the program's step ``step`` from its delta (the exchange)."""
    delta = _exchange_delta(xchg_smem, mbar, xchg_barrier, xg_ref, step, (bk, share),
                            cluster=cluster, exchange=exchange, interpret=interpret)
    store_ds(p * (dw - lax.broadcast_in_dim(delta, (ROWS, KEYS), [0])), tile0 + step,
             ds_smem.at[wg, lax.rem(step, i32(2))])

  def compute_context(run_pipeline):
    if mirror:
      for blk in range(2):
        plgpu.copy_gmem_to_smem(v_ref.at[b, kvh, pl.ds(blk * WGS * KEYS + wg * KEYS, KEYS)],
                                v_smem.at[wg, blk], barrier.at[2 * wg + blk])
      for blk in range(2):
        plgpu.barrier_wait(barrier.at[2 * wg + blk])
    else:
      plgpu.copy_gmem_to_smem(v_ref.at[b, kvh, pl.ds(key0, KEYS)], v_smem.at[wg],
                              barrier.at[wg])
      plgpu.barrier_wait(barrier.at[wg])

    def run(dv_acc):
      if cluster:   # the last step's dS, whose delta no later step finishes
        zero = plgpu.layout_cast(jnp.zeros((ROWS, KEYS), f32), plgpu.Layout.WGMMA)
        _, p_last, dw_last = run_pipeline((dv_acc, zero, zero))
        finish(share_tiles - 1, p_last, dw_last)
      else:
        run_pipeline(dv_acc)
      if delay_dv:   # the last step's dV GEMM is still in flight
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
    elif keep_hash is not None:   # no second stream: its barrier arrivals are skipped
      p_smem, do_smem, delta_smem, p_consumed, do_consumed, delta_consumed = args[:-1]
      pd_smem = pd_consumed = None
    else:
      (p_smem, pd_smem, do_smem, delta_smem,
       p_consumed, pd_consumed, do_consumed, delta_consumed) = args[:-1]

    if keep_bits or keep_hash is not None:
      # keep from the bits (or drawn again from the seeds); Pd = round(P * keep / (1 - p))
      # (the precondition) into this warpgroup's staging tile, the dV GEMM's operand. With
      # delay_dv the tile alternates between two slots and the step does not wait for its
      # dV GEMM: the next step's wait for its dPd GEMM (wgmma groups complete in order)
      # covers it, and only then are this step's ring slots (dO is the GEMM's operand)
      # released (the pipeline's delay_release=1: the barriers a step gets are the previous
      # step's).
      stage = pd_stage.at[wg, lax.rem(local, i32(2))] if delay_dv else pd_stage.at[wg]
      def mm(acc):
        plgpu.wgmma(acc, do_smem, v_smem.at[wg].T)                    # dPd [rows, keys]
        p16 = plgpu.load(p_smem.at[:, wg_keys], layout=plgpu.Layout.WGMMA)
        if keep_hash is not None:
          kept = _drawn_keep(pd_ref, t, b, kvh, key0, keep_hash)
        else:
          col = plgpu.broadcasted_iota(jnp.int32, (ROWS, KEYS), 1, layout=plgpu.Layout.WGMMA)
          lo, hi = (lax.broadcast_in_dim(
              plgpu.load(pd_smem.at[WGS * wg + q], layout=row_layout), (ROWS, KEYS), [0])
              for q in range(2))
          word = jnp.where(col < i32(32), lo, hi)
          kept = (lax.shift_right_logical(word, col & i32(31)) & i32(1)) != i32(0)
        p32 = p16.astype(f32)
        stage[...] = jnp.where(kept, p32 * keep_scale, 0.0).astype(dtype)
        plgpu.commit_smem()
        plgpu.wgmma(dv_acc, stage.T, do_smem)                         # dV [keys, d]
        return plgpu.wgmma_accumulator_load(acc, wait_n=1), p32, kept
      dpd, p, kept = pl.run_scoped(mm, plgpu.ACC((ROWS, KEYS), f32))
      if delay_dv:   # the previous step's dV GEMM is done: release its slots
        @pl.when(local > 0)
        def _release():
          _fence(proxy_fence)
          for consumed in (p_consumed, pd_consumed, do_consumed, delta_consumed):
            if consumed is not None:
              plgpu.barrier_arrive(consumed)
      dw = jnp.where(kept, dpd * keep_scale, 0.0)
    elif mirror:
      # dPd of this warpgroup's keys in both key blocks (the other program's too, for the
      # rows' delta), dV of its own; Pd streamed as whole rows.
      own = pl.ds(kb * (WGS * KEYS) + wg * KEYS, KEYS)
      def mm(acc0, acc1):
        plgpu.wgmma(acc0, do_smem, v_smem.at[wg, 0].T)
        plgpu.wgmma(acc1, do_smem, v_smem.at[wg, 1].T)
        plgpu.wgmma(dv_acc, pd_smem.at[:, own].T, do_smem)
        return (plgpu.wgmma_accumulator_load(acc0, wait_n=1),
                plgpu.wgmma_accumulator_load(acc1, wait_n=1))
      dpd0, dpd1 = pl.run_scoped(mm, plgpu.ACC((ROWS, KEYS), f32), plgpu.ACC((ROWS, KEYS), f32))
      pd0, pd1 = (plgpu.load(pd_smem.at[:, pl.ds(blk * WGS * KEYS + wg * KEYS, KEYS)],
                             layout=plgpu.Layout.WGMMA).astype(f32) for blk in range(2))
      halves = (jnp.sum(dpd0 * pd0, axis=1), jnp.sum(dpd1 * pd1, axis=1))
      # This program's own block (a cond on the program id: no per-element select).
      dpd, pd = lax.cond(kb == 0, lambda: (dpd0, pd0), lambda: (dpd1, pd1))
      p = plgpu.load(p_smem.at[:, wg_keys], layout=plgpu.Layout.WGMMA).astype(f32)
      dw = dpd if keep_scale is None else jnp.where(pd != 0, dpd * keep_scale, 0.0)
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
      if keep_scale is None:       # p == 0: no dropout
        dw = dpd
      else:
        dw = jnp.where(pd != 0, dpd * keep_scale, 0.0)
    if not delay_dv:
      _fence(proxy_fence)
      plgpu.barrier_arrive(p_consumed)
    slot = lax.rem(t, i32(2))
    if cluster:
      # The previous step's delta (its parts had this step's GEMMs and loads to arrive),
      # read before this step's part is published (so two slots suffice), then its dS.
      @pl.when(local > 0)
      def _previous():
        finish(local - 1, p_prev, dw_prev)
      _exchange_publish(part, xchg_smem, mbar, xchg_barrier, xg_ref, local, kb, wg,
                        (bk, share), cluster=cluster, exchange=exchange, interpret=interpret)
      plgpu.wgmma_wait(0)                                             # dV read Pd and dO
      plgpu.barrier_arrive(pd_consumed)
      plgpu.barrier_arrive(do_consumed)
      return dv_acc, p, dw
    if mirror:
      # delta = rowsum(dPd * Pd) over the 256 keys (as the delta kernel takes it): each
      # warpgroup's two 64-key sums, exchanged, in the same order in both programs.
      for blk in range(2):
        xchg_smem[slot, wg, blk] = halves[blk]
      plgpu.barrier_arrive(xchg_barrier)
      plgpu.barrier_wait(xchg_barrier)
      x = lambda w, blk: plgpu.load(xchg_smem.at[slot, w, blk], layout=row_layout)
      delta = (x(0, 0) + x(1, 0)) + (x(0, 1) + x(1, 1))
    elif fused_delta:
      # delta = rowsum(dW * P) as the spec writes it: this warpgroup's 64 keys, then the
      # other's through shared memory (two slots: a warpgroup is at most one step ahead).
      xchg_smem[slot, wg] = jnp.sum(dw * p, axis=1)
      plgpu.barrier_arrive(xchg_barrier)
      plgpu.barrier_wait(xchg_barrier)
      delta = (plgpu.load(xchg_smem.at[slot, 0], layout=row_layout)
               + plgpu.load(xchg_smem.at[slot, 1], layout=row_layout))
    else:
      delta = plgpu.load(delta_smem, layout=row_layout)
      if not delay_dv:
        _fence(proxy_fence)
        plgpu.barrier_arrive(delta_consumed)
    ds = p * (dw - lax.broadcast_in_dim(delta, (ROWS, KEYS), [0]))
    if not delay_dv:
      plgpu.wgmma_wait(0)                                             # dV read Pd and dO
      if pd_consumed is not None:
        plgpu.barrier_arrive(pd_consumed)
      plgpu.barrier_arrive(do_consumed)
    if mirror:   # one dS slot per warpgroup (shared memory): the last store has read it
      store_ds(ds, t, ds_smem.at[wg], pending=0)
    else:
      store_ds(ds, t, ds_smem.at[wg, slot])
    return dv_acc

  tiled = _tiled(dtype)
  delay = {"delay_release": 1} if delay_dv else {}
  head_tile = lambda t: (lax.rem(tile0 + t, i32(q_tiles)), kvh * g + lax.div(tile0 + t, i32(q_tiles)), 0)
  second = (plgpu.BlockSpec((WGS * KEYS // 32, ROWS), lambda t: (kb, tile0 + t), **delay)
            if keep_bits else
            plgpu.BlockSpec((ROWS, 2 * WGS * KEYS), lambda t: (tile0 + t, 0), transforms=tiled)
            if mirror else
            plgpu.BlockSpec((ROWS, WGS * KEYS), lambda t: (tile0 + t, kb), transforms=tiled))
  in_specs = [
      plgpu.BlockSpec((ROWS, WGS * KEYS), lambda t: (tile0 + t, kb), transforms=tiled,
                      **delay),
      second,
      plgpu.BlockSpec((ROWS, None, d), head_tile, transforms=tiled, **delay),
  ]
  operands = [p_ref.at[b, kvh], pd_ref.at[b, kvh] if keep_hash is None else None,
              do_ref.at[b]]
  if keep_hash is not None:   # P, dO (and delta): nothing streamed for keep
    del in_specs[1], operands[1]
  if not fused_delta:
    in_specs.append(plgpu.BlockSpec((ROWS,), lambda t: (tile0 + t,), **delay))
    operands.append(delta_ref.at[b, kvh])
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
    # No program leaves while a peer may still read its shared memory (the last step's
    # parts).
    _mosaic.cluster_sync()


EXCHANGES = ("mbarrier", "async_store")   # Config.cluster_exchange


def _exchange_publish(part, xchg_smem, mbar, xchg_barrier, xg_ref, step, kb, wg, program, *,
                      cluster, exchange, interpret):
  """Cluster mode: this warpgroup's part of delta for its program's step ``step``, given to
  the ``cluster`` programs of the row (one per key block); :func:`_exchange_delta` reads
  them back one step later. Two slots: every warpgroup reads step ``s``'s parts before it
  publishes step ``s + 1``, so a program that publishes step ``s + 2`` into the slot (after
  it has waited for all of step ``s + 1``'s parts) finds every warpgroup done with it; and
  no phase of a slot's mbarrier completes before every warpgroup has waited for the one
  before.

  ``exchange="mbarrier"``: the warpgroup writes its part into slot ``step % 2`` of its own
  program's shared memory (``xchg_smem``: ``2 * WGS`` refs of ``[64]``, slot-major; one ref
  per part, as jax 0.11.2 lowers a peer's ref only at offset 0), synchronizes, and arrives,
  with release semantics at cluster scope, on that slot's mbarrier (``mbar``, two 64-bit
  words each) in every program of the cluster; the readers load the parts from the peers.

  ``exchange="async_store"``: the warpgroup writes its part into its own staging ref
  (``xchg_smem[wg]``, ``[64]``), synchronizes, and sends it with ``st.async`` into slot
  ``step % 2`` of every program's receiving ref (``xchg_smem[WGS]``: ``[2, cluster, WGS,
  64]``; :func:`_mosaic.cluster_send_rows`). The writes complete on the receiving program's
  mbarrier of the slot by transaction count, so they are visible to the threads whose wait
  sees the phase complete, with no release at cluster scope on the way. A program reads
  only its own shared memory, and it waits for every write into it (slot reuse: as above).

  The interpreter (no shared memory across a cluster, no ``st.async``) takes the
  same steps through ``xg_ref`` in global memory (one slab per cluster, ``program``) and the
  cluster barrier ``xchg_barrier`` (whose compiled arrivals have release semantics at CTA
  scope only; the compiled kernels do not use it)."""
  slot = lax.rem(step, i32(2))
  if interpret:
    xg_ref.at[program + (slot, kb, wg)][...] = part
    plgpu.barrier_arrive(xchg_barrier)
    return
  if exchange == "async_store":
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
    return
  for s in range(2):
    for w in range(WGS):
      @pl.when((slot == s) & (wg == w))
      def _write():
        xchg_smem[s * WGS + w][...] = part
  plgpu.commit_smem()   # a warpgroup barrier: all its threads' parts before its arrivals
  for s in range(2):
    @pl.when(slot == s)
    def _arrive():
      _mosaic.cluster_barrier_arrive(mbar, s, cluster)


def _receive_place(slot: int, wg: int, cluster: int) -> tuple[int, int]:
  """``(offset, stride)``: where the ``async_store`` exchange puts warpgroup ``wg``'s part of
  slot ``slot`` in a receiving ref ``[2, cluster, WGS, 64]`` (row-major, the index
  :func:`_exchange_delta` reads, ``[slot, rank, wg]``): element ``offset + rank * stride``
  for the sender of cluster rank ``rank``."""
  return (slot * cluster * WGS + wg) * ROWS, WGS * ROWS


def _exchange_delta(xchg_smem, mbar, xchg_barrier, xg_ref, step, program, *, cluster,
                    exchange, interpret):
  """Cluster mode: ``delta`` of the program's step ``step``: waits for the ``WGS * cluster``
  parts of the step (:func:`_exchange_publish`) on its slot's mbarrier, then adds them in
  the same order in every program (the same delta in all). ``"mbarrier"``: a wait with
  acquire semantics at cluster scope (phase parity ``step // 2 % 2``), then loads from the
  peers' shared memory; ``"async_store"``: the same wait with acquire semantics at CTA scope
  (the writes complete on the mbarrier), then loads from its own."""
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
      _mosaic.cluster_barrier_wait(mbar, q % 2, q // 2,
                                   scope="cta" if exchange == "async_store" else "cluster")
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  if exchange == "async_store":
    read = lambda s: total(lambda c, w: plgpu.load(xchg_smem[WGS].at[s, c, w],
                                                   layout=row_layout))
  else:
    read = lambda s: total(lambda c, w: plgpu.load(
        plgpu.cluster_ref(xchg_smem[s * WGS + w], {"keys": c}), layout=row_layout))
  return lax.cond(slot == 0, lambda: read(0), lambda: read(1))


def ds_dv_pass(do, p_groups, pd_groups, delta, v, *, rate, stages=3, split=1,
               keep_bits=None, keep_seeds=None, pair_hash=True, delay_dv=True,
               cluster=False, cluster_exchange="mbarrier", proxy_fence=True,
               interpret=False):
  """``(dS [B, KVH, G * seq_q, seq_k], dV [B, KVH, seq_k, D])`` from the group slabs of P
  and Pd, ``delta [B, KVH, G * seq_q]`` and V.

  ``keep_bits`` (from ``delta_pass(..., write_keep=True)``, a rate > 0): read instead of Pd
  (``pd_groups`` is then unused), which is rebuilt from P: 4.125 B per element instead of 6.
  ``keep_seeds`` (``[k0, k1, threshold, 0]`` uint32, :func:`keep_seeds_of`; a rate > 0):
  keep drawn again in the kernel, as ``jax_ops.dropout_keep_mask`` draws it, and Pd rebuilt
  from P: 4 B per element, nothing read for keep. ``pair_hash``: one hash per pair of
  columns (split in registers) rather than one per element; the same bits. ``delay_dv``
  (with ``keep_seeds``): each step's dV GEMM is waited for in the next step
  (two staging tiles of Pd, the ring's slots released a step later); only with
  ``stages >= 3``, which keeps two steps in flight.

  ``delta=None`` (``seq_k`` of 128 or 256): the kernel computes it; at ``seq_k == 128`` (one
  key block) as ``rowsum(dW * P)``; at ``seq_k == 256`` (two key blocks, "mirror") each
  program streams Pd's whole rows, computes dPd of both blocks and delta as
  ``rowsum(dPd * Pd)`` (as the delta kernel does), and writes its own block's dS: 8 B per
  element in one launch (``keep_seeds`` / ``keep_bits`` go with a delta; ``delay_dv``, with
  ``keep_seeds`` only).
  ``cluster`` (with ``delta=None``, ``seq_k`` of 256 to 1024 keys): the programs of a row's
  ``seq_k / 128`` key blocks run as one cluster and walk its row tiles together; each
  computes its keys' part of ``rowsum(dPd * Pd)`` and they exchange the parts through their
  shared memory at every step (:func:`_exchange_publish`; ``cluster_exchange`` picks how,
  one of :data:`EXCHANGES`): P and Pd read once, dS written once (6 B per element), one
  launch.
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
  if cluster and not (fused_delta and skv % (WGS * KEYS) == 0 and 2 <= blocks <= MAX_CLUSTER):
    raise ValueError(f"cluster=True needs delta=None and seq_k a multiple of {WGS * KEYS} "
                     f"in [{2 * WGS * KEYS}, {MAX_CLUSTER * WGS * KEYS}], got {skv}")
  if cluster_exchange not in EXCHANGES:
    raise ValueError(f"cluster_exchange: expected one of {EXCHANGES}, got {cluster_exchange!r}")
  if fused_delta and not cluster and skv not in (WGS * KEYS, 2 * WGS * KEYS):
    raise ValueError(f"delta=None needs seq_k == {WGS * KEYS} or {2 * WGS * KEYS} (or "
                     f"cluster=True), got {skv}")
  mirror = fused_delta and not cluster and skv == 2 * WGS * KEYS
  if (keep_bits is not None or keep_seeds is not None) and (fused_delta or rate == 0):
    raise ValueError("keep_bits and keep_seeds go with a delta and a rate > 0")
  if keep_bits is not None and keep_seeds is not None:
    raise ValueError("keep_bits or keep_seeds, not both")
  how = ("element" if not pair_hash else "pairs_interpret" if interpret else "pairs")
  keep_hash = None if keep_seeds is None else (h, g, sq, skv, how)
  keep_scale = None if rate == 0 else dropout_scale(rate)   # the forward's fp32 factor
  rebuild = keep_bits is not None or keep_seeds is not None   # Pd rebuilt from P
  # A slot held a step longer leaves a 2-slot ring one step of prefetch: measured 1.5x
  # slower than not delaying (benchmarks/a_hash_cost.py), so the delay needs 3 slots.
  # Keep from the seeds only: the bits mode hung in the interpreter at 3 slots (see Config).
  delay_dv = delay_dv and keep_seeds is not None and stages >= 3
  kernel = functools.partial(_ds_dv_kernel, kvh_count=kvh, g=g, sq=sq, d=d,
                             keep_scale=keep_scale, stages=stages, split=split,
                             proxy_fence=proxy_fence,
                             fused_delta=fused_delta, keep_bits=keep_bits is not None,
                             keep_hash=keep_hash, delay_dv=delay_dv, mirror=mirror,
                             cluster=blocks if cluster else 0, exchange=cluster_exchange,
                             interpret=bool(interpret))
  dtype = p_groups.dtype
  like = tuple(x for x in (do, p_groups, pd_groups, delta, keep_bits, keep_seeds, v)
               if x is not None)
  dv_type = (out_struct((b, kvh, skv, d), v.dtype, *like) if split == 1
             else out_struct((split, b, kvh, skv, d), f32, *like))
  scratch = [
      plgpu.SMEM((WGS, 2, KEYS, d) if mirror else (WGS, KEYS, d), v.dtype,
                 transforms=_tiled(v.dtype)),
      plgpu.SMEM((WGS, ROWS, KEYS) if mirror else (WGS, 2, ROWS, KEYS), dtype,
                 transforms=_tiled(dtype)),
      plgpu.Barrier(num_barriers=2 * WGS if mirror else WGS),
  ]
  if cluster and cluster_exchange == "async_store":
    scratch += [plgpu.SMEM((ROWS,), f32) for _ in range(WGS)]   # staging
    scratch.append(plgpu.SMEM((2, blocks, WGS, ROWS), f32))      # receiving
  elif cluster:
    scratch += [plgpu.SMEM((ROWS,), f32) for _ in range(2 * WGS)]
  if cluster:
    scratch += [plgpu.SMEM((4,), jnp.uint32),   # two 64-bit mbarriers
                plgpu.ClusterBarrier(collective_axes=("keys",), num_arrivals=WGS)]
  elif fused_delta:
    scratch += [plgpu.SMEM((2, WGS, 2, ROWS) if mirror else (2, WGS, ROWS), f32),
                plgpu.Barrier(num_arrivals=WGS)]
  if rebuild:
    scratch.append(plgpu.SMEM((WGS, 2, ROWS, KEYS) if delay_dv else (WGS, ROWS, KEYS), dtype,
                              transforms=_tiled(dtype)))
  second = (keep_seeds if keep_seeds is not None
            else pd_groups if keep_bits is None else keep_bits)
  operands = [do, p_groups, second] + ([] if fused_delta else [delta]) + [v]
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


# --------------------------------------------------------------------------------------
# Config and entry point.
# --------------------------------------------------------------------------------------
SMS = _mosaic.SMS


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles and pipeline depths of the two kernels.

  ``delta_rows``: rows per consumer warpgroup of the delta kernel (64 or 128; 128 halves
  the V tiles it streams per row). ``delta_block_k``: keys per step (64 or 128).
  ``delta_stages`` / ``stages``: TMA ring depth of the delta / dS-dV kernel (2 to 8).
  Not every combination fits the 227 KB of shared memory (at D = 128: 128-key delta steps
  need ``delta_rows=64`` and 2 stages, the dS-dV kernel at most 3 stages); the Mosaic GPU
  compiler refuses the others with the bytes they need.
  ``split``: programs sharing each key block's rows in the dS-dV kernel (an int >= 1 or
  ``"auto"``: enough for one wave on launches of under half a wave).
  ``mirror_delta``: rows of 256 keys in one kernel, no delta kernel (``ds_dv_pass`` with
  ``delta=None``: each of a row tile's two programs reads Pd's whole rows and computes delta
  itself), where it fits: without ``keep_bits`` and, at D = 128, with ``stages=2`` (its
  ring slots hold whole rows); else the delta kernel. Rows whose ``G * seq_q`` is not a
  multiple of 128 take it whatever this says (the delta kernel cannot), and a config it does
  not fit raises there.
  ``keep_bits``: the delta kernel writes keep as bits and the dS-dV kernel rebuilds Pd from P
  and them instead of reading Pd (rates > 0, ``seq_k > 128``): 6.25 B per element, not 8;
  measured slower on the H200 (``benchmarks/results/attention_softmax_dropout_value_mosaic_gpu.md``).
  ``proxy_fence``: a ``fence.proxy.async`` (``plgpu.commit_smem``) after each consumer step's
  generic loads from its ring slots (P, Pd, delta), before it hands them back to the TMA
  producer, which overwrites them through the async proxy. Without it the Mosaic GPU
  interpreter's race detector reports those loads racing with the refill (its TMA writes
  are ordered after generic reads only through such a fence); CUTLASS-style pipelines
  release the slot with the mbarrier arrival alone, and the compiled kernels have matched
  the reference on every H200 run without it. On by default: measured on the H200 at
  9ca4af2 (``benchmarks/results/runs/a_mosaic_fence_9ca4af2.log``) within -0.5% to +0.8% of
  the unfenced kernels' time on six workloads.
  ``pair_hash``: where the dS-dV kernel draws keep from the key's seeds
  (:func:`backward_from_output`), one hash per pair of columns split in registers, not one
  per element (the same bits, half the integer work).
  ``delay_dv`` / ``rebuild_stages``: where the dS-dV kernel rebuilds Pd from P (keep from
  the seeds or from bits), each step's dV GEMM is waited for in the next step, not its own
  (``ds_dv_pass(delay_dv=...)``); with keep from the seeds the ring has ``rebuild_stages``
  slots (2 to 8). The bits mode keeps ``stages``: at 3 slots it hung in the Mosaic GPU
  interpreter on a ``(1, 4, 2, 128, 256, 64)`` problem (delayed or not; 2 kv heads, 4 row
  tiles), which is not understood yet.
  ``cluster_delta``: rows of 256 to 1024 keys (2 to 8 key blocks, :data:`MAX_CLUSTER`) in one
  kernel, no delta kernel (``ds_dv_pass(cluster=True)``): the programs of a row's key blocks
  run as one cluster and exchange their parts of delta through shared memory at every step,
  6 B per element (without ``keep_bits``; it takes precedence over ``mirror_delta``).
  :func:`default_config` turns it on at 256 keys with the ``"async_store"`` exchange: on
  the H200, 1.19-1.30x the speed of the mirror kernel (48.5 / 84.8 / 90.9 us against
  57.7 / 108.5 / 111.6 us on the three 256-key workloads). At 512 and 1024 keys it measured
  0.48-0.73x (the clustered launch is slower there even without the exchange;
  ``benchmarks/results/attention_softmax_dropout_value_mosaic_gpu.md``, runs 9 and 10).
  ``delta_persistent``: the delta kernel on at most one program per SM, each looping over
  every ``SMS``-th row tile in one pipeline (:func:`delta_pass` ``programs``), not one
  program per tile; with ``delta_rows=64`` only (it holds two dO tiles per warpgroup: at 128
  rows and D = 128 they do not fit beside the ring).
  :func:`default_config` turns it on (64 rows, 128-key steps, 2 stages): the delta kernel
  19.0 us against 24.9 at (1, 512, 512), 425 against 454 at (32, 512, 512) on the H200.
  ``cluster_exchange``: how the parts travel (:func:`_exchange_publish`): ``"mbarrier"``
  (each program reads its peers' shared memory after an mbarrier with release/acquire at
  cluster scope; 0.98-1.03x the mirror kernel at 256 keys) or ``"async_store"``
  (``st.async`` into the peers' shared memory, completing on their mbarriers by
  transaction count).
  """
  delta_rows: int = 128
  delta_block_k: int = 64
  delta_stages: int = 3
  stages: int = 2
  split: int | str = "auto"
  mirror_delta: bool = True
  keep_bits: bool = False
  proxy_fence: bool = True
  pair_hash: bool = True
  delay_dv: bool = True
  rebuild_stages: int = 3
  cluster_delta: bool = False
  cluster_exchange: str = "mbarrier"
  delta_persistent: bool = False

  def __post_init__(self):
    for name, allowed in (("delta_rows", (64, 128)), ("delta_block_k", (64, 128))):
      if getattr(self, name) not in allowed:
        raise ValueError(f"config.{name}: expected one of {allowed}, got {getattr(self, name)!r}")
    for name in ("delta_stages", "stages", "rebuild_stages"):
      # At least 2: with one slot the Mosaic GPU interpreter's race detector flags the
      # ring (the pipeline refills the slot that a consumer warpgroup still reads).
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or not 2 <= v <= 8:
        raise ValueError(f"config.{name}: expected an int in [2, 8], got {v!r}")
    if self.split != "auto" and (isinstance(self.split, bool) or not isinstance(self.split, int)
                                 or self.split < 1):
      raise ValueError(f"config.split: expected 'auto' or an int >= 1, got {self.split!r}")
    if self.delta_persistent and self.delta_rows != 64:
      raise ValueError(f"config.delta_persistent needs delta_rows=64, got {self.delta_rows}")
    if self.cluster_exchange not in EXCHANGES:
      raise ValueError(f"config.cluster_exchange: expected one of {EXCHANGES}, got "
                       f"{self.cluster_exchange!r}")
    for name in ("keep_bits", "proxy_fence", "pair_hash", "delay_dv", "mirror_delta",
                 "cluster_delta", "delta_persistent"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"config.{name}: expected a bool, got {getattr(self, name)!r}")


def default_config(b, h, kvh, sq, skv, d) -> Config:
  """The config measured best on the H200 (``benchmarks/results/attention_softmax_dropout_value_mosaic_gpu.md``):
  rows of 256 keys in one clustered launch exchanging delta with ``st.async``; rows of 512
  keys and more: the delta kernel on at most one program per SM (``delta_persistent``), 64
  rows per warpgroup and 128 keys per step. (Rows of 128 keys run no delta kernel.)"""
  del b, h, kvh, sq, d   # one config per row length so far
  if skv == 2 * WGS * KEYS:
    return Config(cluster_delta=True, cluster_exchange="async_store")
  return Config(delta_rows=64, delta_block_k=128, delta_stages=2, delta_persistent=True)


def resolve_split(split, b, kvh, skv, row_tiles) -> int:
  """``split`` of a launch: ``"auto"`` doubles it while the programs fill at most half the
  SMs and each share keeps >= 4 row tiles."""
  if split != "auto":
    if row_tiles % split:
      raise ValueError(f"config.split={split} must divide the {row_tiles} row tiles of a "
                       f"kv group (G * seq_q / {ROWS})")
    return split
  programs = b * kvh * (skv // (WGS * KEYS))
  split = 1
  while (2 * programs * split <= SMS and row_tiles % (2 * split) == 0
         and row_tiles // (2 * split) >= 4):
    split *= 2
  return split


def checked_rate(args, *, causal, interpret, reason, kernels, hint="") -> float:
  """The static dropout rate of an entry point's ``args`` (dO, P, Pd, V, keep, rate), after
  checking them, the problem against ``reason`` (an ``unsupported_reason``; ``ValueError``
  naming ``kernels`` and why, then ``hint``) and the device (:func:`_mosaic.check_hopper`)."""
  p = validation.check_problem_a(*args)
  _, attn_weights, _, value_states = args[:4]
  b, h, sq, skv = attn_weights.shape
  validation.check_causal(causal, sq, skv, every_row_has_keys=False)
  kvh, d = value_states.shape[1], value_states.shape[3]
  why = reason(b, h, kvh, sq, skv, d, attn_weights.dtype, p, causal)
  if why:
    raise ValueError(f"attention_softmax_dropout_value_backward ({kernels}): {why}{hint}")
  _mosaic.check_hopper("attention_softmax_dropout_value_backward", interpret, *args[:4])
  return p


def attention_softmax_dropout_value_backward(
    grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
    attention_dropout, *, config: Config | None = None, causal=False, interpret=False):
  """Backward of ``O = transpose(dropout(P) @ V)`` with GQA, as two Mosaic GPU kernels.

  Same arguments and results as the Triton entry point
  (:func:`pallas_kernels.attention_softmax_dropout_value.pallas_triton.attention_softmax_dropout_value_backward`):
  dO ``[B, seq_q, H, D]``; P, Pd, keep ``[B, H, seq_q, seq_k]``; V ``[B, KVH, seq_k, D]``;
  returns ``(grad_attn_scores [B, H, seq_q, seq_k], grad_value_states [B, KVH, seq_k, D])``.
  ``dropout_mask`` is checked but not read (see the module docstring's precondition).

  Raises ``ValueError`` for a problem outside :func:`unsupported_reason`'s limits, and off
  a Hopper GPU unless ``interpret`` (the Mosaic GPU interpreter, any machine).
  ``config``: :class:`Config` (default :func:`default_config`).
  """
  p = checked_rate((grad_attn_output, attn_weights, attn_weights_dropped, value_states,
                    dropout_mask, attention_dropout), causal=causal, interpret=interpret,
                   reason=unsupported_reason, kernels="mosaic_gpu",
                   hint="; the Triton kernels take every shape")
  b, h, sq, skv = attn_weights.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  if config is not None and not isinstance(config, Config):
    raise TypeError(f"config: expected a pallas_mosaic_gpu.Config, got {type(config).__name__}")
  config = config or default_config(b, h, kvh, sq, skv, d)
  return _backward(grad_attn_output, attn_weights, attn_weights_dropped, value_states,
                   rate=p, config=config, interpret=interpret)


def _backward(grad_attn_output, attn_weights, attn_weights_dropped, value_states, *, rate,
              config, interpret):
  b, h, sq, skv = attn_weights.shape
  kvh = value_states.shape[1]
  g = h // kvh
  groups = lambda x: x.reshape(b, kvh, g * sq, skv)
  pd_groups = groups(attn_weights_dropped)
  keep_bits = None
  rows_fit = (g * sq) % (WGS * ROWS) == 0        # the delta kernel's row blocks
  bits = config.keep_bits and rate != 0
  # The one-kernel mode's ring slots hold Pd's whole rows: 64 KB each at D = 128, so with
  # its resident V it fits 2 slots only.
  mirror_fits = config.stages == 2 or value_states.shape[3] <= 64
  if skv == 2 * WGS * KEYS and not rows_fit and (bits or not mirror_fits):
    raise ValueError(
        f"G * seq_q = {g * sq} (not a multiple of {WGS * ROWS}) at seq_k = {skv} takes the "
        "one-kernel mode only: it needs config.keep_bits=False and, at D = 128, "
        f"config.stages=2 (got keep_bits={config.keep_bits}, stages={config.stages})")
  cluster = (config.cluster_delta and not bits
             and 2 * WGS * KEYS <= skv <= MAX_CLUSTER * WGS * KEYS)
  if cluster or skv == WGS * KEYS or (skv == 2 * WGS * KEYS and not bits and mirror_fits
                                      and (config.mirror_delta or not rows_fit)):
    delta = None            # the dS-dV kernel (or its cluster) computes delta itself
  else:
    rows = config.delta_rows
    if sq % rows or (g * sq) % (WGS * rows):
      rows = ROWS
    write_keep = config.keep_bits and rate != 0
    delta = delta_pass(grad_attn_output, pd_groups, value_states, rows=rows,
                       block_k=config.delta_block_k, stages=config.delta_stages,
                       write_keep=write_keep, proxy_fence=config.proxy_fence,
                       programs=SMS if config.delta_persistent else None,
                       interpret=interpret)
    if write_keep:
      delta, keep_bits = delta
  split = resolve_split(config.split, b, kvh, skv, g * sq // ROWS)
  ds, dv = ds_dv_pass(grad_attn_output, groups(attn_weights), pd_groups, delta, value_states,
                      rate=rate, stages=config.stages, split=split, keep_bits=keep_bits,
                      delay_dv=config.delay_dv, cluster=cluster,
                      cluster_exchange=config.cluster_exchange,
                      proxy_fence=config.proxy_fence, interpret=interpret)
  return ds.reshape(b, h, sq, skv), dv


def keep_bits_of(keep, num_kv_heads):
  """The keep mask ``[B, H, seq_q, seq_k]`` (bool) as the dS-dV kernel's words,
  ``[B, KVH, seq_k / 32, G * seq_q]`` int32: bit ``k % 32`` of word ``k // 32`` of a row
  is ``keep[row, k]`` (the layout :func:`delta_pass` writes with ``write_keep``)."""
  b, h, sq, skv = keep.shape
  g = h // num_kv_heads
  words = keep.reshape(b, num_kv_heads, g * sq, skv // 32, 32).astype(jnp.uint32)
  packed = jnp.sum(words << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
  return lax.bitcast_convert_type(jnp.swapaxes(packed, 2, 3), jnp.int32)


def keep_seeds_of(dropout_rng, rate):
  """``[k0, k1, threshold, 0]`` uint32: what the dS-dV kernel draws keep from
  (``ds_dv_pass(keep_seeds=...)``), the mask of ``jax_ops.dropout_keep_mask(dropout_rng,
  rate, ...)`` (``rate`` a float)."""
  if dropout_rng is None:
    raise ValueError("dropout_rng: the keep seeds need a PRNG key")
  return jnp.concatenate([_dropout.seeds(dropout_rng, rate), jnp.zeros((1,), jnp.uint32)])


def backward_from_output(grad_attn_output, attn_weights, value_states, dropout_mask,
                         attention_dropout, attn_output_f32, *, keep_bits=None,
                         keep_seeds=None, config: Config | None = None, interpret=False):
  """:func:`attention_softmax_dropout_value_backward` given the forward's fp32 output O
  ``[B, seq_q, H, D]`` instead of Pd: ``delta = rowsum(dO * O)`` (no delta kernel) and the
  dS-dV kernel rebuilding Pd from P and the keep mask, which it draws again from the key's
  seeds (``keep_seeds``: it reads P, 2 B, and writes dS, 2 B, per element) or reads as bits
  (``Config.keep_bits``' mode, 1/8 B more), against the Pd path's 8 B over two kernels. For
  a forward that writes no Pd (op A's Mosaic GPU backend's ``"fused_output"`` policy). Rows
  of more than 128 keys.

  ``keep_bits``: ``[B, KVH, seq_k / 32, G * seq_q]`` int32 (``forward.bits_shape``, the layout
  of :func:`keep_bits_of`), as the fused forward writes them; ``dropout_mask`` is then checked
  but not read (a ``jax.ShapeDtypeStruct`` will do). Without them the bool mask is packed
  here (an XLA pass over it). ``keep_seeds`` (:func:`keep_seeds_of` of the forward's key and
  rate): keep drawn again in the kernel, nothing read for it (``dropout_mask`` checked, not
  read). Returns ``(grad_attn_scores, grad_value_states)``.
  """
  from pallas_kernels.attention_softmax_dropout_value.pallas_triton import delta_from_output
  p = validation.check_problem_a(grad_attn_output, attn_weights, attn_weights,
                                 value_states, dropout_mask, attention_dropout)
  b, h, sq, skv = attn_weights.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  why = unsupported_reason(b, h, kvh, sq, skv, d, attn_weights.dtype, p, False)
  if why is None and skv == WGS * KEYS:
    why = f"seq_k {skv} (from the output: more than {WGS * KEYS} keys only)"
  if why:
    raise ValueError(f"attention_softmax_dropout_value backward_from_output (mosaic_gpu): "
                     f"{why}")
  validation.check_array("attn_output_f32", attn_output_f32, ("B", "Sq", "H", "D"),
                         (b, sq, h, d), dtypes=(jnp.float32,))
  g = h // kvh
  if keep_bits is not None:
    validation.check_array("keep_bits", keep_bits, ("B", "KVH", "Skv/32", "G*Sq"),
                           (b, kvh, skv // 32, g * sq), dtypes=(jnp.int32,))
  if keep_seeds is not None:
    validation.check_array("keep_seeds", keep_seeds, ("4",), (4,), dtypes=(jnp.uint32,))
    if keep_bits is not None:
      raise ValueError("keep_bits or keep_seeds, not both")
  _mosaic.check_hopper("attention_softmax_dropout_value backward_from_output", interpret,
                       grad_attn_output, attn_weights, value_states)
  config = config or default_config(b, h, kvh, sq, skv, d)
  groups = lambda x: x.reshape(b, kvh, g * sq, skv)
  delta = delta_from_output(grad_attn_output, attn_output_f32).reshape(b, kvh, g * sq)
  if p == 0:
    bits = keep_seeds = None
  elif keep_seeds is not None:
    bits = None
  else:
    bits = keep_bits if keep_bits is not None else keep_bits_of(dropout_mask, kvh)
  split = resolve_split(config.split, b, kvh, skv, g * sq // ROWS)
  p_groups = groups(attn_weights)
  ds, dv = ds_dv_pass(grad_attn_output, p_groups, p_groups, delta, value_states, rate=p,
                      stages=config.rebuild_stages if keep_seeds is not None else config.stages,
                      split=split,
                      keep_bits=bits, delay_dv=config.delay_dv,
                      keep_seeds=keep_seeds, pair_hash=config.pair_hash,
                      proxy_fence=config.proxy_fence, interpret=interpret)
  return ds.reshape(b, h, sq, skv), dv
