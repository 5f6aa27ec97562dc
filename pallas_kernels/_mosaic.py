"""Helpers shared by the Pallas Mosaic GPU kernels (Hopper, sm_90a)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._util import device_of, is_hopper

SWIZZLE = 128          # bytes: 64 16-bit elements per swizzled row
MEMORY_REGISTERS = 40  # registers per thread of the TMA producer warpgroup
SMS = 132              # streaming multiprocessors of an H100 / H200 SXM: where none is known


def sm_count(interpret, *arrays) -> int:
  """The streaming multiprocessors of the GPU the arrays' call runs on, which sizes the
  persistent grids: its ``core_count``; :data:`SMS` where unknown (the interpreter, a
  device without one)."""
  if not interpret:
    count = getattr(device_of(*arrays), "core_count", None)
    if isinstance(count, int) and count > 0:
      return count
  return SMS


def tiled(dtype):
  """Tiling + 128-byte swizzle transforms of a 16-bit tile whose minor dim is a multiple of 64."""
  elems = SWIZZLE // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(SWIZZLE))


def varying_like(out, *like):
  """``out`` marked as varying over the ``shard_map`` axes that ``like`` vary over:
  ``plgpu.kernel`` drops that part of its output types, and a custom VJP inside
  ``shard_map(check_vma=True)`` needs it."""
  axes = frozenset()
  for x in like:
    mat = getattr(jax.typeof(x), "mat", None)
    if mat is not None:
      axes |= mat.varying
  def mark(y):
    mat = getattr(jax.typeof(y), "mat", None)
    missing = tuple(sorted(axes - (mat.varying if mat is not None else frozenset())))
    return lax.pcast(y, missing, to="varying") if missing else y
  return jax.tree.map(mark, out)


def equals(index, value, shape, layout):
  """``index == value`` (scalars) as a bool array of ``shape`` in ``layout``, for
  ``jnp.where`` on arrays in that layout (Mosaic GPU selects need a predicate array of the
  operands' shape)."""
  zero = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)
  one = jnp.where(index == value, jnp.float32(1), jnp.float32(0))   # f32 under x64 too
  return zero + one > 0.5


def restart_sum(step, part, carry, layout=plgpu.Layout.WGMMA):
  """``part`` at ``step == 0`` (a new output tile), else ``carry + part``: a sum carried over
  a pipeline's steps. A select, not ``carry * 0``: a NaN or Inf of the last tile must not
  reach this one."""
  return jnp.where(equals(step, 0, part.shape, layout), part, carry + part)


def interpret_params(interpret):
  """``plgpu.kernel``'s ``interpret``: the Mosaic GPU interpreter for ``True``."""
  if interpret is True:
    return plgpu.InterpretGPUParams()
  return interpret or None


def _asm(ptx: str, *args, constraints: str) -> None:
  """Inline PTX with side effects that also clobbers memory (the compiler moves no memory
  access across it)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm
  llvm.inline_asm(ir.Type.parse("!llvm.void"), list(args), ptx,
                  ",".join(filter(None, [constraints, "~{memory}"])), has_side_effects=True)


def _barrier_ptr(ref, index: int):
  """The shared-memory address (a 32-bit ``ptr<3>``) of mbarrier ``index`` of ``ref``, a
  ``uint32`` ref holding 64-bit mbarriers (two words each)."""
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import utils as mu
  return mu.getelementptr(mu.memref_ptr(ref), [2 * index], ir.IntegerType.get_signless(32))


def cluster_sync() -> None:
  """``barrier.cluster.arrive`` (release) then ``barrier.cluster.wait`` (acquire) by every
  thread that runs it: every thread of every program of the cluster must run it (at the
  top level of a kernel, outside a warp-specialized pipeline)."""

  @plgpu.inline_mgpu()
  def sync(ctx):
    del ctx
    _asm("barrier.cluster.arrive;\nbarrier.cluster.wait;", constraints="")

  sync()


def cluster_barriers_init(ref, count: int) -> None:
  """Initializes the 64-bit mbarriers of ``ref`` (a ``uint32`` shared-memory ref of
  ``2 * n`` words) for ``count`` arrivals per phase, from one thread of the warpgroup, and
  releases the initialization to the cluster (``fence.mbarrier_init.release.cluster``). The
  caller then synchronizes the cluster (:func:`cluster_sync`) before any program arrives on
  them."""
  n = ref.shape[0] // 2

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def init(ctx, smem):
    del ctx
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils as mu
    i32 = ir.IntegerType.get_signless(32)
    first = arith.cmpi(arith.CmpIPredicate.eq,
                       arith.remui(mu.thread_idx(), mu.c(128, i32)), mu.c(0, i32))
    for k in range(n):
      _asm("@$0 mbarrier.init.shared::cta.b64 [$1], $2;", first, _barrier_ptr(smem, k),
           mu.c(count, i32), constraints="b,r,r")
    _asm("@$0 fence.mbarrier_init.release.cluster;", first, constraints="b")

  init(ref)


def cluster_barrier_wait(ref, index: int, parity: int) -> None:
  """Waits, with acquire semantics at CTA scope, for the phase of parity ``parity`` (0 or 1)
  of mbarrier ``index`` of ``ref`` to complete (the writes of :func:`cluster_send_rows`
  complete on it by transaction count)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def wait(ctx, smem):
    del ctx
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import utils as mu
    _asm("{\n .reg .pred done;\n"
         " WAIT:\n"
         " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [$0], $1;\n"
         " @!done bra.uni WAIT;\n}",
         _barrier_ptr(smem, index), mu.c(parity, ir.IntegerType.get_signless(32)),
         constraints="r,r")

  wait(ref)


def cluster_send_rows(src, dst, bars, *, slot: int, offset: int, stride: int,
                      cluster: int) -> None:
  """Sends the 64 fp32 of ``src`` (a ``[64]`` shared-memory ref the warpgroup has written and
  synchronized, ``plgpu.commit_smem``) to every program of the cluster (ranks 0 to
  ``cluster - 1``, the cluster being one axis of ``cluster`` programs) with
  ``st.async``: into ``dst`` (a ``[..., 64]`` fp32 ref, the same in every program) at the
  element offset ``offset + rank * stride``, ``rank`` this program's rank in the cluster. The
  writes complete on the receiver's mbarrier ``slot`` of ``bars`` (as
  :func:`cluster_barriers_init` lays them out) by transaction count, after one arrival of the
  warpgroup that expects their 256 bytes: a receiver whose wait sees the phase complete sees
  them, with no release at cluster scope on the way. Threads 0-63 of the warpgroup send one
  element each; thread 0 arrives."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 3)
  def send(ctx, src_ref, dst_ref, bar_ref):
    del ctx
    from jax.experimental.mosaic.gpu import utils as mu
    lines = [
        "{", " .reg .pred has, first;", " .reg .b32 lane, rank, off, a, d, rd, rb, v;",
        " mov.u32 lane, %tid.x;", " and.b32 lane, lane, 127;",
        " setp.lt.u32 has, lane, 64;", " setp.eq.u32 first, lane, 0;",
        " mov.u32 rank, %cluster_ctarank;", " shl.b32 off, lane, 2;",
        " add.u32 a, $0, off;", " @has ld.shared.b32 v, [a];",
        f" mad.lo.u32 d, rank, {4 * stride}, $1;", f" add.u32 d, d, {4 * offset};",
        " add.u32 d, d, off;"]
    for c in range(cluster):
      lines += [f" mapa.shared::cluster.u32 rd, d, {c};",
                f" mapa.shared::cluster.u32 rb, $2, {c};",
                " @first mbarrier.arrive.expect_tx.shared::cluster.b64 _, [rb], 256;",
                " @has st.async.shared::cluster.mbarrier::complete_tx::bytes.b32"
                " [rd], v, [rb];"]
    _asm("\n".join(lines + ["}"]), mu.memref_ptr(src_ref), mu.memref_ptr(dst_ref),
         _barrier_ptr(bar_ref, slot), constraints="r,r,r")

  send(src, dst, bars)


def check_hopper(entry_point: str, interpret, *arrays) -> None:
  """Raises a clear ``ValueError`` when a Mosaic GPU kernel would compile off a Hopper GPU
  (wgmma is sm_90a-only); under ``interpret`` any machine runs the Mosaic GPU interpreter."""
  if interpret:
    return
  device = device_of(*arrays)
  if not is_hopper(device):
    raise ValueError(
        f"{entry_point} (mosaic_gpu): the kernels compile only for a Hopper GPU (sm_90a), and "
        f"the arrays are on {device.device_kind!r}; pass interpret=True to run them in the "
        "Mosaic GPU interpreter")


# --------------------------------------------------------------------------------------
# One hash per pair of columns in the WGMMA register layout.
# --------------------------------------------------------------------------------------
def _pair_layout():
  """The layout of a ``[64, N / 2]`` array whose element ``(r, j)`` sits in the thread and
  register that hold columns ``2 j`` and ``2 j + 1`` of row ``r`` of a ``[64, N]`` array in
  the WGMMA layout: that layout (tiles ``(64, 8), (16, 8), (8, 8)``, two adjacent columns per
  register) with every column tile halved and one element per register. The two layouts
  have the same register array, register for register."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  return plgpu.Layout.TILED(fa.Tiling(((64, 4), (16, 4), (8, 4), (1,))), warp_dims=(-7,),
                            lane_dims=(-3, -2), vector_dim=-1)


PAIR_LAYOUT = _pair_layout()


def pair_iota(shape, dimension):
  """``plgpu.broadcasted_iota`` (int32) of a ``[64, N / 2]`` array in :data:`PAIR_LAYOUT`."""
  return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=PAIR_LAYOUT)


def pair_halves(h, *, interpret: bool):
  """``[64, N]`` uint32 in the WGMMA layout from ``h`` ``[64, N / 2]`` uint32 in
  :data:`PAIR_LAYOUT`: columns ``2 j`` and ``2 j + 1`` are the low and high 16 bits of
  ``h[:, j]``. Compiled, each thread splits its own registers (no data moves between
  threads); in the interpreter (which has no ``inline_mgpu``, and no layouts) the same
  values by a stack and a reshape."""
  rows, half = h.shape
  if interpret:
    return jnp.stack([h & jnp.uint32(0xFFFF), h >> jnp.uint32(16)], axis=-1).reshape(rows, 2 * half)

  @plgpu.inline_mgpu(arg_types=(PAIR_LAYOUT,),
                     return_type=plgpu.ShapeDtypeStruct((rows, 2 * half), jnp.uint32,
                                                        layout=plgpu.Layout.WGMMA))
  def split(ctx, h):
    del ctx
    import numpy as np
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu.utils import c
    i32 = ir.IntegerType.get_signless(32)
    pair_type = ir.VectorType.get((2,), i32)
    low = c(0xFFFF, i32)
    sixteen = c(16, i32)
    out = np.empty(h.registers.shape, dtype=object)
    for idx, reg in np.ndenumerate(h.registers):
      word = vector.extract(reg, [], [0])
      out[idx] = vector.from_elements(
          pair_type, [arith.andi(word, low), arith.shrui(word, sixteen)])
    return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=False)

  return split(h)
