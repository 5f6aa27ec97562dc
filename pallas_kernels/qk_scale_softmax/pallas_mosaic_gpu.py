"""Pallas Mosaic GPU kernels (Hopper, sm_90a): the backward of ``softmax((Q @ K^T) * scaling)``
for rows of 128 or 256 keys.

Same math as :mod:`.pallas_triton` (see its docstring)::

  delta_i = sum_j g_ij * P_ij                 (fp32)
  dL_ij   = dtype(dtype(P_ij * (g_ij - delta_i)) * scaling)
  dQ      = dL @ K,     dK = dL^T @ Q         (wgmma, fp32 accumulation)

One kernel, one read of ``g`` and ``P`` (4 B per attention element in bf16, the floor). One
warpgroup issues the TMA copies of a two-stage ring; two consumer warpgroups run the math.
A step is a tile of 64 query rows of one head: ``g``, ``P`` ``[64, 128]``, its ``Q`` rows
and the head's ``K`` (32 KB; it rides in the ring, so a program walks several heads in one
pipeline with no restart between them and a launch of many short heads is one wave of
programs). Consumer warpgroup ``w`` owns keys ``[64 w, 64 w + 64)``:

- it sums each whole row (``delta``; both warpgroups do, which needs no exchange buffer);
- it writes its half of ``dL`` over its half of the ``g`` tile (both have read ``g`` then);
- once both halves are written, it computes columns ``[64 w, 64 w + 64)`` of the tile's dQ
  from the whole ``dL`` tile and ``K``, and adds its keys' ``dL^T @ Q`` to dK, an fp32
  array carried over the head's row tiles;
- dQ (each step) and dK (at a head's last tile) go out through shared memory with TMA.

Rows of 256 keys (:func:`pair_backward_kernel`): dK of 256 keys would take 128 fp32
registers a thread in each consumer, more than the 168 of three warpgroups allow without
spills (measured: half the Triton kernels' speed). So two programs share a head: program
``c`` owns keys ``[128 c, 128 c + 128)`` of dK (64 of its columns per consumer) and columns
``[64 c, 64 c + 64)`` of dQ (the first consumer, from the whole ``dL`` tile and a resident
``K[:, cols]``); both read the head's whole rows, the second read mostly from L2 since the
pair runs side by side. It measured 0.82-0.90x the Triton kernels' speed
(``benchmarks/results/qk_scale_softmax_mosaic_gpu.md``), so the entry point runs it only
when named (``implementation="mosaic_gpu"``).

Supported (:func:`unsupported_reason`): bf16 or fp16, ``D == 128``, ``seq_q % 64 == 0``,
``seq_k`` of 128 or 256, a static ``scaling``. A causal P is taken (the dense math gives the same
result; no tile is skipped). Other problems take the Triton kernels.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mosaic, validation
from pallas_kernels._util import out_struct

f32 = jnp.float32
i32 = np.int32  # index constants: int32 under x64 too (lax.div/rem need one dtype)

ROWS = 64            # query rows per step (one wgmma M)
WGS = 2              # consumer warpgroups
HEAD_DIM = 128
SEQ_K = 128         # one program walks several heads
PAIR_SEQ_K = 256    # two programs per head
STAGES = 2


def _reason(sq, sk, d, dtype, scaling_static, keys_ok: bool, keys_taken: str) -> str | None:
  """The checks every kernel here makes; ``keys_ok``: whether it takes rows of ``sk`` keys
  (``keys_taken`` says which it takes)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype)} (bfloat16 or float16 only)"
  if d != HEAD_DIM:
    return f"head dim {d} (query.shape[3]: {HEAD_DIM} only)"
  if sq % ROWS:
    return f"seq_q {sq} (query.shape[2]: a multiple of {ROWS} only)"
  if not keys_ok:
    return f"seq_k {sk} (key.shape[2]: {keys_taken} only)"
  if scaling_static is None:
    return "a traced scaling (static scales only)"
  return None


def unsupported_reason(b, h, sq, sk, d, dtype, scaling_static) -> str | None:
  """Why this kernel cannot run a problem (``None``: it can). ``scaling_static`` is the
  scale as a float, ``None`` when traced."""
  del b, h
  return _reason(sq, sk, d, dtype, scaling_static, sk in (SEQ_K, PAIR_SEQ_K),
                 f"{SEQ_K} or {PAIR_SEQ_K}")


def _round_to(x, dtype):
  """``x`` (fp32) rounded to nearest-even in ``dtype``, back in fp32."""
  return x.astype(dtype).astype(f32)


def _scaled_dl(g, p, delta, scale, dtype):
  """``dtype(dtype(P * (g - delta)) * scale)`` of a tile (``g``, ``P`` fp32, ``delta`` its
  row sums): ``dL`` rounded as the reference rounds it."""
  dl = _round_to(p * (g - lax.broadcast_in_dim(delta, g.shape, [0])), dtype)
  return (dl * scale).astype(dtype)


def _dl_over_g(g_smem, p_smem, keys, other, p_done, read_barrier, dl_barrier, *, scale):
  """One consumer warpgroup's half of a step's ``dL``, written over its half of the ``g``
  tile; returns once both halves are written.

  ``delta``: each warpgroup sums the whole row (no exchange buffer), the other warpgroup's
  half first (its values die before this half's are loaded). ``p_done`` is arrived once P
  is read; ``read_barrier`` holds the dL write until both have read ``g``; ``dl_barrier``
  until both halves are written (the GEMMs read the whole tile).
  """
  layout = plgpu.Layout.WGMMA
  dtype = g_smem.dtype
  other_sum = jnp.sum(plgpu.load(g_smem.at[:, other], layout=layout).astype(f32)
                      * plgpu.load(p_smem.at[:, other], layout=layout).astype(f32), axis=1)
  g = plgpu.load(g_smem.at[:, keys], layout=layout).astype(f32)
  p = plgpu.load(p_smem.at[:, keys], layout=layout).astype(f32)
  delta = jnp.sum(g * p, axis=1) + other_sum
  plgpu.barrier_arrive(p_done)
  plgpu.barrier_arrive(read_barrier)
  plgpu.barrier_wait(read_barrier)
  g_smem[:, keys] = _scaled_dl(g, p, delta, scale, dtype)
  plgpu.commit_smem()
  plgpu.barrier_arrive(dl_barrier)
  plgpu.barrier_wait(dl_barrier)


def _kernel(g_ref, p_ref, q_ref, k_ref, dq_ref, dk_ref, read_barrier, dl_barrier, dk_stage,
            dq_stage, *, bh, heads_per_program, tiles, sk, scale):
  program = lax.axis_index("program")
  wg = lax.axis_index("wg")
  half = sk // WGS
  keys = pl.ds(wg * half, half)                    # this warpgroup's keys
  other = pl.ds((1 - wg) * half, half)             # the other warpgroup's
  cols = pl.ds(wg * (HEAD_DIM // WGS), HEAD_DIM // WGS)   # its dQ columns
  dtype = g_ref.dtype
  wgmma_layout = plgpu.Layout.WGMMA

  def head_of(i):
    # The last program may walk past the last head: it redoes that head (same values).
    return lax.min(program * heads_per_program + i, i32(bh - 1))

  def compute_context(run_pipeline):
    # dK: an fp32 array carried over a head's steps.
    run_pipeline(plgpu.layout_cast(jnp.zeros((half, HEAD_DIM), f32), wgmma_layout))
    plgpu.wait_smem_to_gmem(0)

  def step(idx, g_smem, p_smem, q_smem, k_smem, g_done, p_done, q_done, k_done, carry):
    i, t = idx
    head = head_of(i)
    _dl_over_g(g_smem, p_smem, keys, other, p_done, read_barrier, dl_barrier, scale=scale)

    def mm(dq_acc, dk_acc):
      plgpu.wgmma(dq_acc, g_smem, k_smem.at[:, cols])         # dQ[:, cols] = dL @ K
      plgpu.wgmma(dk_acc, g_smem.at[:, keys].T, q_smem)       # dK[keys] = dL^T @ Q
      plgpu.wgmma_wait(0)
      return dq_acc[...], dk_acc[...]
    dq, dk_tile = pl.run_scoped(mm, plgpu.ACC((ROWS, HEAD_DIM // WGS), f32),
                                plgpu.ACC((half, HEAD_DIM), f32))
    plgpu.barrier_arrive(g_done)
    plgpu.barrier_arrive(q_done)
    plgpu.barrier_arrive(k_done)
    dk = _mosaic.restart_sum(t, dk_tile, carry, wgmma_layout)  # t == 0: a new head
    # Stores through shared memory with TMA (from registers they are uncoalesced writes:
    # measured 1.5x slower in all). The staging tiles are free once the previous step's
    # copies have read them.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    dq_stage[wg] = dq.astype(dtype)

    @pl.when(t == tiles - 1)
    def _():
      dk_stage[wg] = dk.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_stage.at[wg], dq_ref.at[head, pl.ds(t * ROWS, ROWS), cols])

    @pl.when(t == tiles - 1)
    def _():
      plgpu.copy_smem_to_gmem(dk_stage.at[wg], dk_ref.at[head, keys])
    return dk

  tiled = _mosaic.tiled(dtype)
  rows = lambda i, t: (head_of(i), t, 0)
  pipeline = plgpu.emit_pipeline_warp_specialized(
      step, grid=(heads_per_program, tiles), max_concurrent_steps=STAGES,
      memory_registers=_mosaic.MEMORY_REGISTERS, num_compute_wgs=WGS, wg_axis="wg",
      manual_consumed_barriers=True, compute_context=compute_context,
      in_specs=[
          plgpu.BlockSpec((None, ROWS, sk), rows, transforms=tiled),          # g
          plgpu.BlockSpec((None, ROWS, sk), rows, transforms=tiled),          # P
          plgpu.BlockSpec((None, ROWS, HEAD_DIM), rows, transforms=tiled),    # Q
          plgpu.BlockSpec((None, sk, HEAD_DIM), lambda i, t: (head_of(i), 0, 0),
                          transforms=tiled),                                  # K
      ])
  pipeline(g_ref, p_ref, q_ref, k_ref)


def heads_per_program(bh) -> int:
  """Heads a program walks: enough for one wave of programs."""
  return max(1, math.ceil(bh / _mosaic.SMS))


def backward_kernel(g, p, q, k, *, scale, interpret=False):
  """``(dQ [BH, Sq, D], dK [BH, Sk, D])`` from ``g``, ``P`` ``[BH, Sq, Sk]``, ``Q``
  ``[BH, Sq, D]``, ``K`` ``[BH, Sk, D]`` (one dtype) and a static ``scale``."""
  bh, sq, sk = g.shape
  hpp = heads_per_program(bh)
  kernel = functools.partial(_kernel, bh=bh, heads_per_program=hpp, tiles=sq // ROWS, sk=sk,
                             scale=float(scale))
  tiled = _mosaic.tiled(g.dtype)
  scratch = [plgpu.Barrier(num_arrivals=WGS), plgpu.Barrier(num_arrivals=WGS),
             plgpu.SMEM((WGS, sk // WGS, HEAD_DIM), g.dtype, transforms=tiled),
             plgpu.SMEM((WGS, ROWS, HEAD_DIM // WGS), g.dtype, transforms=tiled)]
  return _launch(kernel, scratch, math.ceil(bh / hpp), g, p, q, k, interpret=interpret)


def _launch(kernel, scratch, programs, g, p, q, k, *, interpret):
  """``(dQ, dK)`` of ``kernel`` on a 1-D grid of ``programs``, one TMA producer and
  :data:`WGS` consumer warpgroups each."""
  like = (g, p, q, k)
  out = plgpu.kernel(
      kernel,
      out_type=(out_struct(q.shape, g.dtype, *like), out_struct(k.shape, g.dtype, *like)),
      scratch_types=scratch,
      grid=(programs,), grid_names=("program",),
      num_threads=WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_mosaic.interpret_params(interpret),
  )(g, p, q, k)
  return _mosaic.varying_like(out, *like)


def _pair_kernel(g_ref, p_ref, q_ref, k_ref, dq_ref, dk_ref, k_res, k_barrier, read_barrier,
                 dl_barrier, dq_stage, *, tiles, scale):
  """Rows of 256 keys: program ``c`` of a head's pair owns keys ``[128 c, 128 c + 128)`` of
  dK and columns ``[64 c, 64 c + 64)`` of dQ; both read the head's whole rows (the second
  read mostly from L2: the two run side by side)."""
  program = lax.axis_index("program")
  c = lax.rem(program, i32(2))                     # a head's pair: programs 2h, 2h + 1
  head = lax.div(program, i32(2))
  wg = lax.axis_index("wg")
  half = PAIR_SEQ_K // 2                           # 128 keys
  keys = pl.ds(wg * half, half)                    # this warpgroup's half of dL
  other = pl.ds((1 - wg) * half, half)
  owned = pl.ds(c * half, half)                    # this program's keys of dK
  cols = pl.ds(c * (HEAD_DIM // 2), HEAD_DIM // 2)         # this program's dQ columns
  dk_cols = pl.ds(wg * (HEAD_DIM // 2), HEAD_DIM // 2)     # this warpgroup's dK columns
  dtype = g_ref.dtype

  def compute_context(run_pipeline):
    # K[:, cols] in two key halves, one copy per warpgroup.
    plgpu.copy_gmem_to_smem(k_ref.at[head, keys, cols], k_res.at[wg], k_barrier.at[wg])
    plgpu.barrier_wait(k_barrier.at[0])
    plgpu.barrier_wait(k_barrier.at[1])

    def run(dk_acc):
      run_pipeline(dk_acc)
      return dk_acc[...]
    dk = pl.run_scoped(run, plgpu.ACC((half, HEAD_DIM // 2), f32))
    plgpu.barrier_arrive(read_barrier)            # both are done with K: stage dK over it
    plgpu.barrier_wait(read_barrier)
    k_res[wg] = dk.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_res.at[wg], dk_ref.at[head, owned, dk_cols])
    plgpu.wait_smem_to_gmem(0)

  def step(idx, g_smem, p_smem, q_smem, g_done, p_done, q_done, dk_acc):
    (t,) = idx
    _dl_over_g(g_smem, p_smem, keys, other, p_done, read_barrier, dl_barrier, scale=scale)
    plgpu.wgmma(dk_acc, g_smem.at[:, owned].T, q_smem.at[:, dk_cols])   # dK[owned, dk_cols]

    @pl.when(wg == 0)
    def _():
      def mm(dq_acc):                                                 # dQ[:, cols]
        plgpu.wgmma(dq_acc, g_smem.at[:, pl.ds(0, half)], k_res.at[0])
        plgpu.wgmma(dq_acc, g_smem.at[:, pl.ds(half, half)], k_res.at[1])
        plgpu.wgmma_wait(0)
        return dq_acc[...]
      dq = pl.run_scoped(mm, plgpu.ACC((ROWS, HEAD_DIM // 2), f32))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      dq_stage[...] = dq.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(dq_stage, dq_ref.at[head, pl.ds(t * ROWS, ROWS), cols])
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(g_done)
    plgpu.barrier_arrive(q_done)
    return dk_acc

  tiled = _mosaic.tiled(dtype)
  rows = lambda t: (head, t, 0)
  pipeline = plgpu.emit_pipeline_warp_specialized(
      step, grid=(tiles,), max_concurrent_steps=STAGES,
      memory_registers=_mosaic.MEMORY_REGISTERS, num_compute_wgs=WGS, wg_axis="wg",
      manual_consumed_barriers=True, compute_context=compute_context,
      in_specs=[
          plgpu.BlockSpec((None, ROWS, PAIR_SEQ_K), rows, transforms=tiled),      # g
          plgpu.BlockSpec((None, ROWS, PAIR_SEQ_K), rows, transforms=tiled),      # P
          plgpu.BlockSpec((None, ROWS, HEAD_DIM), rows, transforms=tiled),        # Q
      ])
  pipeline(g_ref, p_ref, q_ref)


def pair_backward_kernel(g, p, q, k, *, scale, interpret=False):
  """:func:`backward_kernel` for rows of 256 keys: two programs per head."""
  bh, sq, sk = g.shape
  kernel = functools.partial(_pair_kernel, tiles=sq // ROWS, scale=float(scale))
  tiled = _mosaic.tiled(g.dtype)
  scratch = [plgpu.SMEM((2, sk // 2, HEAD_DIM // 2), g.dtype, transforms=tiled),
             plgpu.Barrier(num_barriers=WGS),
             plgpu.Barrier(num_arrivals=WGS), plgpu.Barrier(num_arrivals=WGS),
             plgpu.SMEM((ROWS, HEAD_DIM // 2), g.dtype, transforms=tiled)]
  # A head's pair side by side: programs 2h and 2h + 1.
  return _launch(kernel, scratch, 2 * bh, g, p, q, k, interpret=interpret)


def qk_scale_softmax_backward(grad_output, query, key, attn_weights, scaling, *, causal=False,
                              interpret=False):
  """Backward of ``softmax((Q @ K^T) * scaling)`` to ``Q`` and ``K``, one Mosaic GPU kernel.

  Same arguments and results as the Triton entry point
  (:func:`pallas_kernels.qk_scale_softmax.pallas_triton.qk_scale_softmax_backward`):
  ``g``, ``P`` ``[B, H, Sq, Sk]``, ``Q`` ``[B, H, Sq, D]``, ``K`` ``[B, H, Sk, D]``;
  returns ``(grad_query [B, H, Sq, D], grad_key [B, H, Sk, D])`` in the inputs' dtype.

  Raises ``ValueError`` for a problem outside :func:`unsupported_reason`'s limits, and off
  a Hopper GPU unless ``interpret`` (the Mosaic GPU interpreter, any machine).
  """
  scale = validation.check_problem_c(grad_output, query, key, attn_weights, scaling)
  b, h, sq, d = query.shape
  sk = key.shape[2]
  validation.check_causal(causal, sq, sk, every_row_has_keys=False)
  why = unsupported_reason(b, h, sq, sk, d, query.dtype, scale)
  if why:
    raise ValueError(f"qk_scale_softmax_backward (mosaic_gpu): {why}; the Triton kernels "
                     "take every shape")
  _mosaic.check_hopper("qk_scale_softmax_backward", interpret, grad_output, query, key,
                       attn_weights)
  bh = b * h
  run = backward_kernel if sk == SEQ_K else pair_backward_kernel
  dq, dk = run(grad_output.reshape(bh, sq, sk), attn_weights.reshape(bh, sq, sk),
               query.reshape(bh, sq, d), key.reshape(bh, sk, d), scale=scale,
               interpret=interpret)
  return dq.reshape(b, h, sq, d), dk.reshape(b, h, sk, d)


# --------------------------------------------------------------------------------------
# Rows of 256-1024 keys: dQ and dL in one kernel, a band's second read from L2.
# --------------------------------------------------------------------------------------
BAND_KEYS = 128      # keys per step (64 per consumer warpgroup)
BAND_STAGES = 2


def band_unsupported_reason(b, h, sq, sk, d, dtype, scaling_static) -> str | None:
  """Why :func:`band_kernel` cannot run a problem (``None``: it can)."""
  del b, h
  return _reason(sq, sk, d, dtype, scaling_static, sk % BAND_KEYS == 0,
                 f"a multiple of {BAND_KEYS}")


def _band_kernel(g_ref, p_ref, k_ref, dq_ref, dl_ref, dl_barrier, delta_x, *extra,
                 bands, programs, row_tiles, key_tiles, steps, scale, k_resident, stage_dl):
  """Step ``(i, j)`` of a program: key tile ``j`` of its band ``i`` (``g``, ``P``: the row
  sums, ``delta``) and of its band ``i - 1`` (``g``, ``P`` again, mostly from L2, and ``K``:
  ``dL`` over ``g``, stored, and ``dQ += dL @ K``). Consumer warpgroup ``w`` owns keys
  ``[64 w, 64 w + 64)`` of a step's tile and columns ``[64 w, 64 w + 64)`` of dQ. Each sums
  its keys of band ``i``'s rows; the two running sums meet in shared memory every step
  (``delta_x``, two slots by step parity), and at a band's last tile both take ``own +
  other`` (the same value in both: a sum of two)."""
  program = lax.axis_index("program")
  wg = lax.axis_index("wg")
  half = BAND_KEYS // WGS
  keys = pl.ds(wg * half, half)
  cols = pl.ds(wg * (HEAD_DIM // WGS), HEAD_DIM // WGS)
  dtype = g_ref.dtype
  layout = plgpu.Layout.WGMMA
  row_layout = layout.reduce(1)
  if stage_dl:  # dQ leaves through dl_stage too
    dl_stage, dl_free, *extra = extra
    dq_stage = dl_stage
  else:
    dq_stage, *extra = extra
  k_res = extra

  def band(i):
    i = lax.max(i, i32(0))
    if k_resident:  # one head per program, its row tiles in order (the last one twice)
      return program * row_tiles + lax.min(i, i32(row_tiles - 1))
    # A program's bands: program, program + programs, ...; past the last one it redoes the
    # last band (same values).
    return lax.min(program + i * programs, i32(bands - 1))

  def where(index, value, a, b):
    """``a`` where ``index == value``, else ``b`` (arrays in the WGMMA layout or its rows')."""
    return jnp.where(_mosaic.equals(index, value, a.shape,
                                    layout if a.ndim == 2 else row_layout), a, b)

  def compute_context(run_pipeline):
    zero_rows = plgpu.layout_cast(jnp.zeros((ROWS,), f32), row_layout)
    zero_dq = plgpu.layout_cast(jnp.zeros((ROWS, HEAD_DIM // WGS), f32), layout)
    if k_resident:  # K of the program's head: a half per warpgroup, once
      k_smem, k_barrier = k_res
      plgpu.copy_gmem_to_smem(k_ref.at[program, pl.ds(wg * BAND_KEYS, BAND_KEYS)],
                              k_smem.at[wg], k_barrier.at[wg])
      plgpu.barrier_wait(k_barrier.at[0])
      plgpu.barrier_wait(k_barrier.at[1])
    run_pipeline((zero_rows, zero_rows, zero_dq))
    plgpu.wait_smem_to_gmem(0)

  def resident_step(idx, g1, p1, g2, p2, g1_done, p1_done, g2_done, p2_done, carry):
    return step(idx, g1, p1, g2, p2, k_res[0].at[idx[1]], g1_done, p1_done, g2_done,
                p2_done, None, carry)

  def step(idx, g1, p1, g2, p2, k_smem, g1_done, p1_done, g2_done, p2_done, k_done, carry):
    i, j = idx
    delta_acc, delta_prev, dq = carry
    # Band i: this warpgroup's part of the row sums.
    part = jnp.sum(plgpu.load(g1.at[:, keys], layout=layout).astype(f32)
                   * plgpu.load(p1.at[:, keys], layout=layout).astype(f32), axis=1)
    plgpu.barrier_arrive(g1_done)
    plgpu.barrier_arrive(p1_done)
    delta_acc = where(j, 0, part, delta_acc + part)
    # stage_dl: one slot, written after dl_free (the other warpgroup has read it by then).
    slot = i32(0) if stage_dl else lax.rem(i * key_tiles + j, i32(2))
    if not stage_dl:
      delta_x[slot, wg] = delta_acc

    prev = band(i - 1)
    head, rows = lax.div(prev, i32(row_tiles)), lax.rem(prev, i32(row_tiles)) * ROWS
    if stage_dl:
      # Band i - 1: dL of this warpgroup's keys into its half of dl_stage (g2 and P2 are
      # handed back as soon as they are read), stored from there.
      g = plgpu.load(g2.at[:, keys], layout=layout).astype(f32)
      p = plgpu.load(p2.at[:, keys], layout=layout).astype(f32)
      plgpu.barrier_arrive(g2_done)
      plgpu.barrier_arrive(p2_done)
      dl = _scaled_dl(g, p, delta_prev, scale, dtype)

      # Both have read the last step's dL: it may be replaced (a band's last step waits
      # for that itself, before dQ goes out through the same tile).
      @pl.when(j > 0)
      def _():
        plgpu.barrier_wait(dl_free)
      delta_x[slot, wg] = delta_acc
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # and its store has read it
      dl_stage[wg] = dl
      plgpu.commit_smem()

      @pl.when(i > 0)
      def _():
        plgpu.copy_smem_to_gmem(dl_stage.at[wg], dl_ref.at[head, pl.ds(rows, ROWS),
                                                          pl.ds(j * BAND_KEYS + wg * half, half)])
    else:
      # Band i - 1: dL of this warpgroup's keys over g.
      @pl.when(i > 0)
      def _():
        g = plgpu.load(g2.at[:, keys], layout=layout).astype(f32)
        p = plgpu.load(p2.at[:, keys], layout=layout).astype(f32)
        g2[:, keys] = _scaled_dl(g, p, delta_prev, scale, dtype)
      plgpu.commit_smem()
      plgpu.barrier_arrive(p2_done)
    plgpu.barrier_arrive(dl_barrier)     # both halves of dL and both running sums written
    plgpu.barrier_wait(dl_barrier)
    full = delta_acc + plgpu.load(delta_x.at[slot, 1 - wg], layout=row_layout)

    if not stage_dl:
      @pl.when((i > 0) & (wg == 0))  # the whole tile (a swizzled half is not contiguous)
      def _():
        plgpu.copy_smem_to_gmem(
            g2, dl_ref.at[head, pl.ds(rows, ROWS), pl.ds(j * BAND_KEYS, BAND_KEYS)])

    def mm(acc):                       # dQ[:, cols] of band i - 1 (unused while i == 0)
      if stage_dl:
        for h in range(WGS):
          plgpu.wgmma(acc, dl_stage.at[h], k_smem.at[pl.ds(h * half, half), cols])
      else:
        plgpu.wgmma(acc, g2, k_smem.at[:, cols])
      plgpu.wgmma_wait(0)
      return acc[...]

    dq_tile = pl.run_scoped(mm, plgpu.ACC((ROWS, HEAD_DIM // WGS), f32))
    if k_done is not None:
      plgpu.barrier_arrive(k_done)
    if stage_dl:
      plgpu.barrier_arrive(dl_free)

      @pl.when(j == key_tiles - 1)
      def _():
        plgpu.barrier_wait(dl_free)
    dq = where(j, 0, dq_tile, dq + dq_tile)

    @pl.when((i > 0) & (j == key_tiles - 1))
    def _():
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      dq_stage[wg] = dq.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(dq_stage.at[wg], dq_ref.at[head, pl.ds(rows, ROWS), cols])
    if not stage_dl:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # dL's store has read g2
      plgpu.barrier_arrive(g2_done)
    delta_prev = where(j, key_tiles - 1, full, delta_prev)
    return delta_acc, delta_prev, dq

  tiled = _mosaic.tiled(dtype)

  def tile_of(i, j):
    b = band(i)
    return (lax.div(b, i32(row_tiles)), lax.rem(b, i32(row_tiles)), j)

  this = lambda i, j: tile_of(i, j)
  last = lambda i, j: tile_of(i - 1, j)
  specs = [plgpu.BlockSpec((None, ROWS, BAND_KEYS), this, transforms=tiled),    # g, band i
           plgpu.BlockSpec((None, ROWS, BAND_KEYS), this, transforms=tiled),    # P, band i
           plgpu.BlockSpec((None, ROWS, BAND_KEYS), last, transforms=tiled),    # g, band i-1
           plgpu.BlockSpec((None, ROWS, BAND_KEYS), last, transforms=tiled)]    # P, band i-1
  if not k_resident:
    specs.append(plgpu.BlockSpec((None, BAND_KEYS, HEAD_DIM),
                                 lambda i, j: (tile_of(i - 1, j)[0], j, 0), transforms=tiled))
  pipeline = plgpu.emit_pipeline_warp_specialized(
      resident_step if k_resident else step, grid=(steps + 1, key_tiles),
      max_concurrent_steps=BAND_STAGES,
      memory_registers=_mosaic.MEMORY_REGISTERS, num_compute_wgs=WGS, wg_axis="wg",
      manual_consumed_barriers=True, compute_context=compute_context, in_specs=specs)
  pipeline(g_ref, p_ref, g_ref, p_ref, *(() if k_resident else (k_ref,)))


def band_kernel(g, p, k, *, scale, programs=None, k_resident=False, stage_dl=False,
                interpret=False):
  """``(dQ [BH, Sq, D], dL [BH, Sq, Sk])`` from ``g``, ``P`` ``[BH, Sq, Sk]`` and ``K``
  ``[BH, Sk, D]`` (one 16-bit dtype), a static ``scale``: ``dL`` rounded as the reference
  rounds it, ``dQ = dL @ K`` (fp32 accumulation). ``g`` and ``P`` are read from DRAM once
  and a second time one band later, mostly from L2 (a band: 64 rows of one head; about
  ``programs * 64 * Sk * 4`` bytes between the two reads). ``k_resident`` (rows of 256 keys
  only): one program per head, its ``K`` loaded once into shared memory instead of a ``K``
  tile riding in every step's ring slot. ``stage_dl``: ``dL`` goes to a staging tile of its
  own (each warpgroup stores its half), so ``g`` and ``P`` of band ``i - 1`` go back to the
  ring as soon as they are read, instead of after ``dL``'s store has read them."""
  bh, sq, sk = g.shape
  row_tiles = sq // ROWS
  bands = bh * row_tiles
  if k_resident and sk != WGS * BAND_KEYS:
    raise ValueError(f"band_kernel: k_resident takes rows of {WGS * BAND_KEYS} keys, got {sk}")
  programs = bh if k_resident else min(bands, programs or _mosaic.SMS)
  steps = row_tiles if k_resident else -(-bands // programs)
  kernel = functools.partial(_band_kernel, bands=bands, programs=programs,
                             row_tiles=row_tiles, key_tiles=sk // BAND_KEYS, steps=steps,
                             scale=float(scale), k_resident=k_resident, stage_dl=stage_dl)
  tiled = _mosaic.tiled(g.dtype)
  # dL's (and dQ's) staging tile, or dQ's alone.
  staged = ([plgpu.SMEM((WGS, ROWS, BAND_KEYS // WGS), g.dtype, transforms=tiled),
             plgpu.Barrier(num_arrivals=WGS)] if stage_dl else
            [plgpu.SMEM((WGS, ROWS, HEAD_DIM // WGS), g.dtype, transforms=tiled)])
  resident = ([plgpu.SMEM((WGS, BAND_KEYS, HEAD_DIM), g.dtype, transforms=tiled),
               plgpu.Barrier(num_barriers=WGS)] if k_resident else [])
  like = (g, p, k)
  out = plgpu.kernel(
      kernel,
      out_type=(out_struct((bh, sq, HEAD_DIM), g.dtype, *like),
                out_struct((bh, sq, sk), g.dtype, *like)),
      scratch_types=[plgpu.Barrier(num_arrivals=WGS),
                     plgpu.SMEM((1 if stage_dl else 2, WGS, ROWS), f32), *staged, *resident],
      grid=(programs,), grid_names=("program",),
      num_threads=WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_mosaic.interpret_params(interpret),
  )(g, p, k)
  return _mosaic.varying_like(out, *like)


# grad_key's Triton GEMM after the band kernel: tiles of 128 keys, steps of 64 query rows
# (the dK half of the dL + GEMM scheme's one launch, pallas_triton.DL_GEMM transposed).
BAND_DK_GEMM = (64, 128, 8, 3)


def band_backward(g, p, q, k, *, scale, programs=None, k_resident=False, stage_dl=False,
                  dk_gemm=BAND_DK_GEMM, interpret=False):
  """``(dQ, dK)`` on ``[BH, ...]`` views: :func:`band_kernel` (``dQ`` and ``dL``), then
  ``dK = dL^T @ Q`` as a Triton GEMM (tiles ``dk_gemm``: block_q/block_k/num_warps/
  num_stages as :class:`.config.PassConfig`; ``None``: XLA's GEMM). 8 B per attention
  element from DRAM in bf16 (``g`` and ``P`` read, ``dL`` written and read once) against the
  ``dL`` + GEMM scheme's 10."""
  from pallas_kernels.qk_scale_softmax import pallas_triton
  from pallas_kernels.qk_scale_softmax.config import PassConfig
  dq, dl = band_kernel(g, p, k, scale=scale, programs=programs, k_resident=k_resident,
                       stage_dl=stage_dl, interpret=interpret)
  if dk_gemm is None:
    dk = jnp.einsum("bqk,bqd->bkd", dl, q, preferred_element_type=f32).astype(k.dtype)
  else:
    dk = pallas_triton.dl_matmul(dl, q, transpose=True, cfg=PassConfig(*dk_gemm),
                                 interpret=interpret)
  return dq, dk
