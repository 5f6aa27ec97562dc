"""Helpers shared by the Pallas Mosaic GPU kernels (Hopper, sm_90a)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._util import device_of, is_hopper

SWIZZLE = 128          # bytes: 64 16-bit elements per swizzled row
MEMORY_REGISTERS = 40  # registers per thread of the TMA producer warpgroup
SMS = 132              # streaming multiprocessors of an H100 / H200 SXM


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


def interpret_params(interpret):
  """``plgpu.kernel``'s ``interpret``: the Mosaic GPU interpreter for ``True``."""
  if interpret is True:
    return plgpu.InterpretGPUParams()
  return interpret or None


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
