"""Tile helpers shared by the Pallas Triton kernels: masks, masked loads and stores, int32
loops and head-dim slices. Every index is int32, under x64 too."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._util import next_power_of_2

i32 = np.int32


def both(a, b):
  """``a & b`` where either side may be ``None`` (meaning "all true")."""
  if a is None:
    return b
  if b is None:
    return a
  return a & b


def outer(rows, cols):
  """2D mask from optional row / column masks (``None`` = all valid)."""
  r = None if rows is None else rows[:, None]
  c = None if cols is None else cols[None, :]
  return both(r, c)


def tail_mask(start, size: int, n: int):
  """``start + [0, size) < n`` (a tile's valid rows / columns), ``None`` when every tile
  is full (``n % size == 0``)."""
  return None if n % size == 0 else (start + jnp.arange(size, dtype=jnp.int32)) < n


def dim_mask(d_pad: int, head_dim: int):
  """The valid columns of a head-dim tile padded to ``d_pad``; ``None`` if none is padding."""
  return None if d_pad == head_dim else jnp.arange(d_pad, dtype=jnp.int32) < head_dim


def padded_head_dim(head_dim: int) -> int:
  """The head dim padded to a power of two of at least 16 (a tensor-core tile's width)."""
  return next_power_of_2(max(head_dim, 16))


def ds(start, size: int):
  """``pl.ds(start, size)`` for a tile that may reach past the end of its dim (its loads and
  stores are masked). jax >= 0.12 rejects a slice whose start is a static int and whose end
  passes the ref's, so a static start becomes a traced int32 scalar (the kernel's jaxpr holds
  the same literal start, so the lowering is unchanged). int32 like the traced indices beside
  it: under x64 an int64 start would mix index types in the interpreter's ``dynamic_slice``."""
  if isinstance(start, (int, np.integer)):
    start = jnp.asarray(start, jnp.int32)
  return pl.ds(start, size)


def head_dims(d_pad: int):
  """The ``[0, d_pad)`` slice of the head dim (see ``ds``), inside a kernel body."""
  return ds(0, d_pad)


def fori_loop(lower, upper, body, init):
  """``lax.fori_loop`` whose body gets an int32 index: over static bounds the loop counts in
  the default int type, int64 under x64 (then cast; a no-op without)."""
  def int32_body(j, carry):
    return body(j if j.dtype == jnp.int32 else j.astype(jnp.int32), carry)
  return lax.fori_loop(lower, upper, int32_body, init)


def load(ref, mask, other=0.0, **kwargs):
  """``pltriton.load`` of ``ref``, ``other`` outside ``mask`` unless ``mask`` is ``None``."""
  fill = {} if mask is None else {"mask": mask, "other": other}
  return pltriton.load(ref, **fill, **kwargs)


def store(ref, value, mask):
  """``pltriton.store`` of ``value``, masked unless ``mask`` is ``None``."""
  pltriton.store(ref, value, **({} if mask is None else {"mask": mask}))
