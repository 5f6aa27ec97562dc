"""The two GEMMs of the ``"dl_gemm"`` scheme as one Pallas Mosaic GPU launch (Hopper, sm_90a).

``grad_query = dL @ K`` and ``grad_key = dL^T @ Q`` from ``dL [BH, Sq, Sk]`` (written by
:func:`.pallas_triton.dl_pass`), ``Q [BH, Sq, D]`` and ``K [BH, Sk, D]``: the same products
as :func:`.pallas_triton.dl_gemms`, with TMA copies and wgmma instead of Triton loads and
dots. A program computes one ``[128, D]`` output tile of either (the first ``Sq / 128``
programs of a head's row of the grid take ``grad_query``'s tiles, the rest ``grad_key``'s):

- one TMA producer warpgroup streams the tile's ``dL`` (``[128 rows, 64 keys]`` for
  ``grad_query``, ``[64 rows, 128 keys]`` for ``grad_key``) and the matching 64 rows of ``K``
  or ``Q`` through a ring of ``stages`` slots;
- two consumer warpgroups each accumulate 64 output rows in fp32 (``dL`` as the wgmma's A
  operand, transposed from shared memory for ``grad_key``), then round once and store through
  shared memory with TMA.

Dense calls run a persistent launch by default (:func:`_persistent_kernel`): one program per
SM walks its tiles in one pipeline, so short rows (a few steps per tile) pay no ramp per
tile.

Causal (``P_ij = 0`` for ``j > i + Sk - Sq``): a tile's loop covers only the steps that meet
the diagonal's lower side. The steps it reads across the diagonal must hold 0 there:
:func:`.pallas_triton.dl_pass` with ``causal_tile=CAUSAL_TILE`` writes them so (it writes each
row's keys up to the 128-key boundary past the diagonal of the last row of its 64-row group).

Opt-in (``DlConfig(mosaic_gemm=True)``): on the H200 the persistent launch measured 0.89-1.04x
the Triton launch's speed in the scheme, ahead only on rows of 256 keys (1.5-4%), 10% behind
at 4096 keys; one program per tile 0.72-0.88x (``benchmarks/results/qk_scale_softmax_design.log``).

Supported (:func:`unsupported_reason`): bf16 or fp16, ``D`` of 64 or 128, ``Sq`` and ``Sk``
multiples of 128, and ``Sq <= Sk`` when causal (not under ``jax_enable_x64`` then).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mosaic
from pallas_kernels._util import out_struct

f32 = jnp.float32
i32 = np.int32

TILE = 128   # output rows per program (64 per consumer warpgroup)
STEP = 64    # reduction elements per pipeline step
WGS = 2
STAGES = 4
# dl_pass's causal_tile for these GEMMs: (rows of a group, keys written past the diagonal up
# to a multiple of).
CAUSAL_TILE = (STEP, TILE)


def unsupported_reason(sq: int, sk: int, d: int, dtype, causal: bool = False) -> str | None:
  """Why :func:`dl_gemms` cannot take a problem (``None``: it can)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype)} (bfloat16 or float16 only)"
  if d not in (64, 128):
    return f"head dim {d} (64 or 128 only)"
  if sq % TILE or sk % TILE:
    return f"seq_q {sq}, seq_k {sk} (multiples of {TILE} only)"
  if causal and sq > sk:
    return f"causal with seq_q {sq} > seq_k {sk} (rows with no keys)"
  if causal and jax.config.jax_enable_x64:
    # The pipeline's step count varies per tile there; jax 0.11.2's warp-specialized pipeline
    # then mixes int32 and int64 indices under x64 (a TypeError in lax.rem).
    return "causal under jax_enable_x64"
  return None


def _products(d: int, wg):
  """The two products, each as ``(dL's block, the other operand's block, mma)``: blocks as
  ``(shape, index)`` with ``index(head, output tile, step)`` giving the block's indices, and
  ``mma(acc, dl_smem, x_smem)`` this warpgroup's wgmma (its 64 output rows)."""
  mine = pl.ds(wg * STEP, STEP)
  dq = (((None, TILE, STEP), lambda h, o, s: (h, o, s)),      # dL [128 rows, 64 keys]
        ((None, STEP, d), lambda h, o, s: (h, s, 0)),         # K [64 keys, D]
        lambda acc, a, b: plgpu.wgmma(acc, a.at[mine], b))
  dk = (((None, STEP, TILE), lambda h, o, s: (h, s, o)),      # dL [64 rows, 128 keys]
        ((None, STEP, d), lambda h, o, s: (h, s, 0)),         # Q [64 rows, D]
        lambda acc, a, b: plgpu.wgmma(acc, a.at[:, mine].T, b))   # dL^T from shared memory
  return dq, dk


def _pipeline(body, grid, specs, compute_context, stages, index, dtype):
  """The warp-specialized pipeline over ``grid`` of ``specs`` (``(shape, index)`` pairs, as
  :func:`_products` gives), ``index(block_index, *grid indices)`` mapping its steps."""
  return plgpu.emit_pipeline_warp_specialized(
      body, grid=grid, max_concurrent_steps=stages,
      memory_registers=_mosaic.MEMORY_REGISTERS, num_compute_wgs=WGS, wg_axis="wg",
      compute_context=compute_context,
      in_specs=[plgpu.BlockSpec(shape, functools.partial(index, block),
                                transforms=_mosaic.tiled(dtype))
                for shape, block in specs])


def _kernel(dl_ref, k_ref, q_ref, dq_ref, dk_ref, stage, *, q_tiles: int, seq_q: int,
            seq_k: int, causal: bool, stages: int):
  """One program per output tile (grid ``(Sq / 128 + Sk / 128, BH)``); causal tiles run only
  their steps that meet the diagonal."""
  i = lax.axis_index("tile")
  head = lax.axis_index("head")
  wg = lax.axis_index("wg")
  d = q_ref.shape[-1]
  off = seq_k - seq_q
  dq, dk = _products(d, wg)

  def run(product, out_ref, o, first, steps, operands):
    """Output tile ``o`` of ``product`` over ``steps`` steps from step ``first`` (``None``:
    0)."""
    dl_block, x_block, mma = product

    def compute_context(run_pipeline):
      def scope(acc_ref):
        run_pipeline(acc_ref)
        stage[wg] = acc_ref[...].astype(dl_ref.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage.at[wg],
                                out_ref.at[head, pl.ds(o * TILE + wg * STEP, STEP)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      pl.run_scoped(scope, plgpu.ACC((STEP, d), f32))

    def body(idx, a_smem, b_smem, acc_ref):
      del idx
      mma(acc_ref, a_smem, b_smem)
      plgpu.wgmma_wait(0)
      return acc_ref

    _pipeline(body, (steps,), (dl_block, x_block), compute_context, stages,
              lambda block, s: block(head, o, s if first is None else first + s),
              dl_ref.dtype)(*operands)

  @pl.when(i < q_tiles)
  def _dq():
    # grad_query rows [128 i, +128): keys up to the diagonal of its last row when causal.
    steps = seq_k // STEP
    if causal:
      steps = lax.min(lax.div((i + 1) * TILE + off + STEP - 1, i32(STEP)), i32(steps))
    run(dq, dq_ref, i, None, steps, (dl_ref, k_ref))

  @pl.when(i >= q_tiles)
  def _dk():
    # grad_key keys [128 j, +128): when causal, rows r >= 128 j - off only.
    j = i - q_tiles
    first, steps = i32(0), seq_q // STEP   # static steps: a dynamic count only when causal
    if causal:
      first = lax.div(lax.max(j * TILE - off, i32(0)), i32(STEP))
      steps = steps - first
    run(dk, dk_ref, j, first, steps, (dl_ref, q_ref))


def _persistent_kernel(dl_ref, k_ref, q_ref, dq_ref, dk_ref, stage, *, bh: int, seq_q: int,
                       seq_k: int, q_programs: int, k_programs: int, stages: int):
  """Dense: each program walks a list of output tiles of one kind in one pipeline (no ramp
  between tiles): programs ``[0, q_programs)`` take ``grad_query``'s ``bh * Sq / 128`` tiles
  (tile ``p + q_programs * n``), the others ``grad_key``'s. The last program of a kind may
  walk past its last tile: it redoes that tile (the same values)."""
  program = lax.axis_index("program")
  wg = lax.axis_index("wg")
  d = q_ref.shape[-1]
  dq, dk = _products(d, wg)

  def run(product, out_ref, first_tile, stride, out_tiles, steps, operands):
    dl_block, x_block, mma = product
    n_tiles = bh * out_tiles

    def tile_of(n):
      t = lax.min(first_tile + stride * n, i32(n_tiles - 1))
      return lax.div(t, i32(out_tiles)), lax.rem(t, i32(out_tiles))

    def compute_context(run_pipeline):
      run_pipeline(plgpu.layout_cast(jnp.zeros((STEP, d), f32), plgpu.Layout.WGMMA))
      plgpu.wait_smem_to_gmem(0)

    def body(idx, a_smem, b_smem, carry):
      n, s = idx

      def mm(acc_ref):
        mma(acc_ref, a_smem, b_smem)
        plgpu.wgmma_wait(0)
        return acc_ref[...]
      acc = _mosaic.restart_sum(s, pl.run_scoped(mm, plgpu.ACC((STEP, d), f32)), carry)

      @pl.when(s == steps - 1)
      def _():
        head, o = tile_of(n)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read it
        stage[wg] = acc.astype(dl_ref.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage.at[wg],
                                out_ref.at[head, pl.ds(o * TILE + wg * STEP, STEP)])
      return acc

    _pipeline(body, (-(-n_tiles // stride), steps), (dl_block, x_block), compute_context,
              stages, lambda block, n, s: block(*tile_of(n), s), dl_ref.dtype)(*operands)

  @pl.when(program < q_programs)
  def _dq():
    run(dq, dq_ref, program, q_programs, seq_q // TILE, seq_k // STEP, (dl_ref, k_ref))

  @pl.when(program >= q_programs)
  def _dk():
    run(dk, dk_ref, program - q_programs, k_programs, seq_k // TILE, seq_q // STEP,
        (dl_ref, q_ref))


def split_programs(bh: int, seq_q: int, seq_k: int, programs: int) -> tuple[int, int]:
  """Programs for ``grad_query``'s and ``grad_key``'s tiles, in proportion to their steps
  (``Sq * Sk`` each way: the same), at least 1 each and at most one per tile."""
  q_tiles, k_tiles = bh * (seq_q // TILE), bh * (seq_k // TILE)
  q_programs = max(1, min(q_tiles, round(programs * q_tiles / (q_tiles + k_tiles))))
  k_programs = max(1, min(k_tiles, programs - q_programs))
  return q_programs, k_programs


def dl_gemms(dl, q, k, *, causal: bool = False, stages: int = STAGES, programs: int | None = 0,
             interpret=False):
  """``(dL @ K, dL^T @ Q)`` (``grad_query [BH, Sq, D]``, ``grad_key [BH, Sk, D]``) from
  ``dL [BH, Sq, Sk]``, ``Q [BH, Sq, D]``, ``K [BH, Sk, D]`` (one 16-bit dtype) in one
  launch: fp32 accumulation, rounded once. ``causal``: ``dL`` is 0 above the diagonal in
  every step a tile reads (:data:`CAUSAL_TILE`), and the steps wholly above it are skipped.
  ``stages``: ring slots (32 KB each). ``programs`` (dense only): a persistent launch of
  that many programs, each walking its tiles in one pipeline (``0``: one per SM; ``None``:
  one program per output tile, as causal calls always run)."""
  bh, seq_q, seq_k = dl.shape
  d = q.shape[-1]
  reason = unsupported_reason(seq_q, seq_k, d, dl.dtype, causal)
  if reason is not None:
    raise ValueError(f"gemm_mosaic_gpu.dl_gemms: {reason}")
  q_tiles = seq_q // TILE
  if causal or programs is None:
    kernel = functools.partial(_kernel, q_tiles=q_tiles, seq_q=seq_q, seq_k=seq_k,
                               causal=causal, stages=stages)
    grid, names = (q_tiles + seq_k // TILE, bh), ("tile", "head")
  else:
    q_programs, k_programs = split_programs(bh, seq_q, seq_k, programs or _mosaic.SMS)
    kernel = functools.partial(_persistent_kernel, bh=bh, seq_q=seq_q, seq_k=seq_k,
                               q_programs=q_programs, k_programs=k_programs, stages=stages)
    grid, names = (q_programs + k_programs,), ("program",)
  like = (dl, q, k)
  out = plgpu.kernel(
      kernel,
      out_type=(out_struct(q.shape, dl.dtype, *like), out_struct(k.shape, dl.dtype, *like)),
      scratch_types=[plgpu.SMEM((WGS, STEP, d), dl.dtype, transforms=_mosaic.tiled(dl.dtype))],
      grid=grid, grid_names=names,
      num_threads=WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_mosaic.interpret_params(interpret),
  )(dl, k, q)
  return _mosaic.varying_like(out, *like)
