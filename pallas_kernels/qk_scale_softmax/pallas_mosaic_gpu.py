"""Pallas Mosaic GPU kernel (Hopper, sm_90a): the backward of ``softmax((Q @ K^T) * scaling)``
for rows of 128 or 256 keys.

Same math as :mod:`.pallas_triton` (see its docstring)::

  delta_i = sum_j g_ij * P_ij                 (fp32)
  dL_ij   = dtype(dtype(P_ij * (g_ij - delta_i)) * scaling)
  dQ      = dL @ K,     dK = dL^T @ Q         (wgmma, fp32 accumulation)

One kernel, one read of ``g`` and ``P`` (4 B per attention element in bf16, the floor). One
warpgroup issues the TMA copies of a two-stage ring; two consumer warpgroups run the math.
A step is a tile of 64 query rows of one head, all its keys (``g``, ``P`` ``[64, Sk]``) and
its ``Q`` rows. Consumer warpgroup ``w`` owns keys ``[w * Sk/2, (w + 1) * Sk/2)``:

- it sums each whole row (``delta``; both warpgroups do, which needs no exchange buffer);
- it writes its half of ``dL`` over its half of the ``g`` tile (``g`` is read by then);
- once both halves are written, it computes columns ``[64 w, 64 w + 64)`` of the tile's dQ
  from the whole ``dL`` tile and ``K`` (``dL @ K[:, cols]``), and accumulates its keys'
  ``dK += dL[:, keys]^T @ Q`` in registers over the head's row tiles.

``seq_k == 128``: ``K`` (32 KB) rides in the ring with each step, and a program walks
several heads in one pipeline (no restart between heads: launches of many short heads run
as one wave of programs). ``seq_k == 256``: ``K`` (64 KB) stays in shared memory and a
program owns one head (the ring and ``K`` fill the 227 KB).

Supported (:func:`unsupported_reason`): bf16 or fp16, ``D == 128``, ``seq_q % 64 == 0``,
``seq_k`` 128 or 256, a static ``scaling``. A causal P is taken (the dense math gives the
same result; no tile is skipped). Other problems take the Triton kernels.
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
from pallas_kernels._util import device_of, is_hopper, out_struct

f32 = jnp.float32
i32 = np.int32  # index constants: int32 under x64 too (lax.div/rem need one dtype)

ROWS = 64            # query rows per step (one wgmma M)
WGS = 2              # consumer warpgroups
HEAD_DIM = 128
SEQ_K = (128, 256)
STREAM_K_MAX = 128   # K rides in the ring up to this many keys
STAGES = 2
DL_IN_PLACE = True


def unsupported_reason(b, h, sq, sk, d, dtype, scaling_static) -> str | None:
  """Why this kernel cannot run a problem (``None``: it can). ``scaling_static`` is the
  scale as a float, ``None`` when traced."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype)} (bfloat16 or float16 only)"
  if d != HEAD_DIM:
    return f"head dim {d} ({HEAD_DIM} only)"
  if sq % ROWS:
    return f"seq_q {sq} (a multiple of {ROWS} only)"
  if sk not in SEQ_K:
    return f"seq_k {sk} ({' or '.join(map(str, SEQ_K))} only)"
  if scaling_static is None:
    return "a traced scaling (static scales only)"
  return None


def _round_to(x, dtype):
  """``x`` (fp32) rounded to nearest-even in ``dtype``, back in fp32."""
  return x.astype(dtype).astype(f32)


def _kernel(g_ref, p_ref, q_ref, k_ref, dq_ref, dk_ref, *scratch, bh, heads_per_program,
            tiles, sk, scale, stream_k, dl_in_place):
  scratch = list(scratch)
  dl_buffer = None if dl_in_place else scratch.pop()
  if stream_k:
    read_barrier, dl_barrier = scratch
    k_res = None
  else:
    k_res, k_barrier, read_barrier, dl_barrier = scratch
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
    if stream_k:   # dK: an fp32 array carried over a head's steps
      run_pipeline(plgpu.layout_cast(jnp.zeros((half, HEAD_DIM), f32), wgmma_layout))
      return
    # One head: dK accumulates in a wgmma accumulator over the pipeline.
    plgpu.copy_gmem_to_smem(k_ref.at[head_of(0), keys], k_res.at[keys], k_barrier.at[wg])
    plgpu.barrier_wait(k_barrier.at[0])
    plgpu.barrier_wait(k_barrier.at[1])

    def run(dk_acc):
      run_pipeline(dk_acc)
      return dk_acc[...]
    dk = pl.run_scoped(run, plgpu.ACC((half, HEAD_DIM), f32))
    dk_ref.at[head_of(0), keys][...] = dk.astype(dtype)

  def step(idx, *args):
    i, t = idx
    carry = args[-1]
    if stream_k:
      g_smem, p_smem, q_smem, k_smem, g_done, p_done, q_done, k_done = args[:-1]
    else:
      g_smem, p_smem, q_smem, g_done, p_done, q_done = args[:-1]
      k_smem, k_done = k_res, None
    head = head_of(i)
    # A buffer of its own: two slots (a warpgroup writes slot s % 2 again at step s + 2,
    # after the other passed step s + 1's dL barrier, after its step-s GEMMs).
    dl_smem = None if dl_buffer is None else dl_buffer.at[lax.rem(i * tiles + t, i32(2))]

    # delta: each warpgroup sums the whole row, the other warpgroup's half first (its
    # values die before this half's are loaded: at 256 keys dK holds 128 registers).
    other_sum = jnp.sum(plgpu.load(g_smem.at[:, other], layout=wgmma_layout).astype(f32)
                        * plgpu.load(p_smem.at[:, other], layout=wgmma_layout).astype(f32),
                        axis=1)
    g = plgpu.load(g_smem.at[:, keys], layout=wgmma_layout)
    p = plgpu.load(p_smem.at[:, keys], layout=wgmma_layout)
    delta = jnp.sum(g.astype(f32) * p.astype(f32), axis=1) + other_sum
    plgpu.barrier_arrive(p_done)
    if dl_smem is not None:
      plgpu.barrier_arrive(g_done)
    else:   # dL overwrites g: both warpgroups must have read it
      plgpu.barrier_arrive(read_barrier)
      plgpu.barrier_wait(read_barrier)
      dl_smem = g_smem
    dl = _round_to(p.astype(f32) * (g.astype(f32) - lax.broadcast_in_dim(delta, g.shape, [0])),
                   dtype)
    dl_smem[:, keys] = (dl * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.barrier_arrive(dl_barrier)              # both halves of dL are written
    plgpu.barrier_wait(dl_barrier)

    def mm(dq_acc, *dk_tile):
      dk_acc = dk_tile[0] if stream_k else carry
      plgpu.wgmma(dq_acc, dl_smem, k_smem.at[:, cols])         # dQ[:, cols] = dL @ K
      plgpu.wgmma(dk_acc, dl_smem.at[:, keys].T, q_smem)       # dK[keys] += dL^T @ Q
      plgpu.wgmma_wait(0)
      return (dq_acc[...], dk_acc[...]) if stream_k else (dq_acc[...], None)
    accs = [plgpu.ACC((ROWS, HEAD_DIM // WGS), f32)]
    if stream_k:
      accs.append(plgpu.ACC((half, HEAD_DIM), f32))
    dq, dk_tile = pl.run_scoped(mm, *accs)
    if dl_buffer is None:
      plgpu.barrier_arrive(g_done)
    plgpu.barrier_arrive(q_done)
    if stream_k:
      plgpu.barrier_arrive(k_done)
    dq_ref.at[head, pl.ds(t * ROWS, ROWS), cols][...] = dq.astype(dtype)
    if not stream_k:
      return carry
    dk = carry * jnp.where(t == 0, 0.0, 1.0).astype(f32) + dk_tile   # t == 0: a new head

    @pl.when(t == tiles - 1)
    def _():
      dk_ref.at[head, keys][...] = dk.astype(dtype)
    return dk

  tiled = _mosaic.tiled(dtype)
  in_specs = [
      plgpu.BlockSpec((None, ROWS, sk), lambda i, t: (head_of(i), t, 0), transforms=tiled),
      plgpu.BlockSpec((None, ROWS, sk), lambda i, t: (head_of(i), t, 0), transforms=tiled),
      plgpu.BlockSpec((None, ROWS, HEAD_DIM), lambda i, t: (head_of(i), t, 0),
                      transforms=tiled),
  ]
  operands = [g_ref, p_ref, q_ref]
  if stream_k:
    in_specs.append(plgpu.BlockSpec((None, sk, HEAD_DIM), lambda i, t: (head_of(i), 0, 0),
                                    transforms=tiled))
    operands.append(k_ref)
  pipeline = plgpu.emit_pipeline_warp_specialized(
      step, grid=(heads_per_program, tiles), max_concurrent_steps=STAGES,
      memory_registers=_mosaic.MEMORY_REGISTERS, num_compute_wgs=WGS, wg_axis="wg",
      manual_consumed_barriers=True, compute_context=compute_context, in_specs=in_specs)
  pipeline(*operands)


def heads_per_program(bh, sk, stream_k=None) -> int:
  """Heads a program walks: one with ``K`` resident; else enough for one wave of programs."""
  if not (sk <= STREAM_K_MAX if stream_k is None else stream_k):
    return 1
  return max(1, math.ceil(bh / _mosaic.SMS))


def backward_kernel(g, p, q, k, *, scale, stream_k=None, dl_in_place=None, interpret=False):
  """``(dQ [BH, Sq, D], dK [BH, Sk, D])`` from ``g``, ``P`` ``[BH, Sq, Sk]``, ``Q``
  ``[BH, Sq, D]``, ``K`` ``[BH, Sk, D]`` (one dtype) and a static ``scale``.

  ``stream_k``: ``K`` rides in the ring (several heads per program) rather than staying
  resident (one head per program); ``dl_in_place``: ``dL`` overwrites ``g`` in shared memory
  rather than a buffer of its own. Default: both where they fit (``seq_k <= 128``; in place
  always: measured in ``benchmarks/results/qk_scale_softmax_mosaic_gpu.md``).
  """
  bh, sq, sk = g.shape
  stream_k = sk <= STREAM_K_MAX if stream_k is None else stream_k
  dl_in_place = DL_IN_PLACE if dl_in_place is None else dl_in_place
  hpp = heads_per_program(bh, sk, stream_k)
  kernel = functools.partial(_kernel, bh=bh, heads_per_program=hpp, tiles=sq // ROWS, sk=sk,
                             scale=float(scale), stream_k=stream_k, dl_in_place=dl_in_place)
  dtype = g.dtype
  like = (g, p, q, k)
  scratch = [plgpu.Barrier(num_arrivals=WGS), plgpu.Barrier(num_arrivals=WGS)]
  if not stream_k:
    scratch = [plgpu.SMEM((sk, HEAD_DIM), dtype, transforms=_mosaic.tiled(dtype)),
               plgpu.Barrier(num_barriers=WGS)] + scratch
  if not dl_in_place:
    scratch.append(plgpu.SMEM((2, ROWS, sk), dtype, transforms=_mosaic.tiled(dtype)))
  out = plgpu.kernel(
      kernel,
      out_type=(out_struct(q.shape, dtype, *like), out_struct(k.shape, dtype, *like)),
      scratch_types=scratch,
      grid=(math.ceil(bh / hpp),), grid_names=("program",),
      num_threads=WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_mosaic.interpret_params(interpret),
  )(g, p, q, k)
  return _mosaic.varying_like(out, *like)


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
  if not interpret:
    device = device_of(grad_output, query, key, attn_weights)
    if not is_hopper(device):
      raise ValueError(
          "qk_scale_softmax_backward (mosaic_gpu): the kernel compiles only for a Hopper "
          f"GPU (sm_90a), and the arrays are on {device.device_kind!r}; pass interpret=True "
          "to run it in the Mosaic GPU interpreter")
  bh = b * h
  dq, dk = backward_kernel(grad_output.reshape(bh, sq, sk), attn_weights.reshape(bh, sq, sk),
                           query.reshape(bh, sq, d), key.reshape(bh, sk, d), scale=scale,
                           interpret=interpret)
  return dq.reshape(b, h, sq, d), dk.reshape(b, h, sk, d)
