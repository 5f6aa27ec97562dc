"""Pallas Mosaic GPU kernel (Hopper, sm_90a): the backward of ``softmax((Q @ K^T) * scaling)``
for rows of 128 keys.

Same math as the Triton kernels (:mod:`.pallas_triton`)::

  delta_i = sum_j g_ij * P_ij                 (fp32)
  dL_ij   = dtype(dtype(P_ij * (g_ij - delta_i)) * scaling)
  dQ      = dL @ K,     dK = dL^T @ Q         (wgmma, fp32 accumulation)

or, with ``renormalize=True``, ``dL`` from P corrected to sum to 1 and rounded once
(:mod:`._common`).

One read of ``g`` and ``P`` (4 B per attention element in bf16, the floor). One warpgroup
issues the TMA copies of a two-stage ring; two consumer warpgroups run the math. A step is
a tile of 64 query rows of one head: ``g``, ``P`` ``[64, 128]``, its ``Q`` rows and the
head's ``K`` (32 KB; it rides in the ring, so a program walks several heads in one pipeline
with no restart between them and a launch of many short heads is one wave of programs).
Consumer warpgroup ``w`` owns keys ``[64 w, 64 w + 64)``:

- it sums each whole row (``delta``, or the four sums of the renormalized form; both
  warpgroups do, which needs no exchange buffer);
- it writes its half of ``dL`` over its half of the ``g`` tile (both have read ``g`` then);
- once both halves are written, it computes columns ``[64 w, 64 w + 64)`` of the tile's dQ
  from the whole ``dL`` tile and ``K``, and adds its keys' ``dL^T @ Q`` to dK, an fp32
  array carried over the head's row tiles;
- dQ (each step) and dK (at a head's last tile) go out through shared memory with TMA.

Supported (:func:`unsupported_reason`): bf16 or fp16, ``D == 128``, ``seq_q % 64 == 0``,
``seq_k == 128``, a static ``scaling``. A causal P is taken (the dense math gives the same
result; no tile is skipped).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mosaic, validation
from pallas_kernels._util import out_struct
from pallas_kernels.qk_scale_softmax import _common as cm

f32 = jnp.float32
i32 = np.int32  # index constants: int32 under x64 too (lax.div/rem need one dtype)

ROWS = 64            # query rows per step (one wgmma M)
WGS = 2              # consumer warpgroups
HEAD_DIM = 128
SEQ_K = 128         # keys per row
STAGES = 2


def unsupported_reason(b, h, sq, sk, d, dtype, scaling_static) -> str | None:
  """Why this kernel cannot run a problem (``None``: it can). ``scaling_static`` is the
  scale as a float, ``None`` when traced."""
  del b, h
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype)} (bfloat16 or float16 only)"
  if d != HEAD_DIM:
    return f"head dim {d} (query.shape[3]: {HEAD_DIM} only)"
  if sq % ROWS:
    return f"seq_q {sq} (query.shape[2]: a multiple of {ROWS} only)"
  if sk != SEQ_K:
    return f"seq_k {sk} (key.shape[2]: {SEQ_K} only)"
  if scaling_static is None:
    return "a traced scaling (static scales only)"
  return None


def _dl_over_g(g_smem, p_smem, keys, other, p_done, read_barrier, dl_barrier, *, scale,
               renormalize):
  """One consumer warpgroup's half of a step's ``dL``, written over its half of the ``g``
  tile; returns once both halves are written.

  The row sums (``_common.row_sums``): each warpgroup sums the whole row (no exchange
  buffer), the other warpgroup's half first (its values die before this half's are
  loaded). ``p_done`` is arrived once P is read; ``read_barrier`` holds the dL write until
  both have read ``g``; ``dl_barrier`` until both halves are written (the GEMMs read the
  whole tile).
  """
  layout = plgpu.Layout.WGMMA
  dtype = g_smem.dtype
  other_sums = cm.row_sums(plgpu.load(g_smem.at[:, other], layout=layout),
                          plgpu.load(p_smem.at[:, other], layout=layout), renormalize)
  g = plgpu.load(g_smem.at[:, keys], layout=layout).astype(f32)
  p = plgpu.load(p_smem.at[:, keys], layout=layout).astype(f32)
  stats = cm.row_stats(cm.add_sums(cm.row_sums(g, p, renormalize), other_sums))
  plgpu.barrier_arrive(p_done)
  plgpu.barrier_arrive(read_barrier)
  plgpu.barrier_wait(read_barrier)
  g_smem[:, keys] = cm.dl_tile(
      g, p, stats, scale, dtype, broadcast=lambda v: lax.broadcast_in_dim(v, g.shape, [0]),
      rounding=lambda x, dt: x.astype(dt).astype(f32))
  plgpu.commit_smem()
  plgpu.barrier_arrive(dl_barrier)
  plgpu.barrier_wait(dl_barrier)


def _kernel(g_ref, p_ref, q_ref, k_ref, dq_ref, dk_ref, read_barrier, dl_barrier, dk_stage,
            dq_stage, *, bh, heads_per_program, tiles, sk, scale, renormalize):
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
    _dl_over_g(g_smem, p_smem, keys, other, p_done, read_barrier, dl_barrier, scale=scale,
               renormalize=renormalize)

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
    # Stores go through shared memory with TMA (from registers they would be uncoalesced
    # writes). The staging tiles are free once the previous step's copies have read them.
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


def heads_per_program(bh, sms=None) -> int:
  """Heads a program walks: enough for one wave of programs on ``sms`` SMs
  (``None``: :data:`pallas_kernels._mosaic.SMS`)."""
  return max(1, math.ceil(bh / (_mosaic.SMS if sms is None else sms)))


def backward_kernel(g, p, q, k, *, scale, renormalize=False, interpret=False):
  """``(dQ [BH, Sq, D], dK [BH, Sk, D])`` from ``g``, ``P`` ``[BH, Sq, Sk]``, ``Q``
  ``[BH, Sq, D]``, ``K`` ``[BH, Sk, D]`` (one dtype) and a static ``scale``; ``renormalize``:
  the form of ``dL`` (:mod:`._common`)."""
  bh, sq, sk = g.shape
  hpp = heads_per_program(bh, _mosaic.sm_count(interpret, g, p, q, k))
  kernel = functools.partial(_kernel, bh=bh, heads_per_program=hpp, tiles=sq // ROWS, sk=sk,
                             scale=float(scale), renormalize=bool(renormalize))
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


def qk_scale_softmax_backward(grad_output, query, key, attn_weights, scaling, *, causal=False,
                              renormalize=False, interpret=False):
  """Backward of ``softmax((Q @ K^T) * scaling)`` to ``Q`` and ``K``, one Mosaic GPU kernel.

  Same arguments and results as the Triton entry point
  (:func:`pallas_kernels.qk_scale_softmax.pallas_triton.qk_scale_softmax_backward`):
  ``g``, ``P`` ``[B, H, Sq, Sk]``, ``Q`` ``[B, H, Sq, D]``, ``K`` ``[B, H, Sk, D]``, and
  ``renormalize`` (the form of ``dL``);
  returns ``(grad_query [B, H, Sq, D], grad_key [B, H, Sk, D])`` in the inputs' dtype.

  Raises ``ValueError`` for a problem outside :func:`unsupported_reason`'s limits, and off
  a Hopper GPU unless ``interpret`` (the Mosaic GPU interpreter, any machine).
  """
  scale = validation.check_qk_scale_softmax(grad_output, query, key, attn_weights, scaling)
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
  dq, dk = backward_kernel(grad_output.reshape(bh, sq, sk), attn_weights.reshape(bh, sq, sk),
               query.reshape(bh, sq, d), key.reshape(bh, sk, d), scale=scale,
               renormalize=renormalize, interpret=interpret)
  return dq.reshape(b, h, sq, d), dk.reshape(b, h, sk, d)
