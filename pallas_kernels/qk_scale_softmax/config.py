"""Launch configurations of the qk_scale_softmax backward: dataclasses, heuristic, tuned table.

A :class:`Config` names a scheme and the :class:`PassConfig` of each of its kernels. The
tuned table ``pallas_kernels/tuned/<device>/qk_scale_softmax.json`` maps a row-length class
(:func:`length_class`) to one entry per class::

  {"scheme": "per_head",
   "row":  {"block_q": 64, "block_k": 256, "num_warps": 8, "num_stages": 2},
   "col":  {"block_q": 32, "block_k": 64, "num_warps": 4, "num_stages": 3},
   "head": {"block_q": 64, "block_k": "row", "num_warps": 8, "num_stages": 2}}

``row`` / ``col`` configure the ``"two_pass"`` scheme's row and column kernels, ``head`` the
``"per_head"`` kernel (present where the table has that scheme). ``"block_k": "row"``
(:data:`WHOLE_ROW`) asks for a whole row as one tile. :func:`pass_config` turns an entry
into a :class:`PassConfig` for a shape, :func:`table_entry` a :class:`PassConfig` into an
entry. A ``dl_gemm`` entry may add ``dl`` and ``causal_dl`` (:func:`dl_config`). How the
table was chosen: ``docs/qk_scale_softmax.md``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import _tuning
from pallas_kernels._util import next_power_of_2

KERNEL = "qk_scale_softmax"  # the tuned table's file name

SCHEMES = ("two_pass", "per_head", "dl_gemm")

# The "dl_gemm" scheme holds whole (padded) rows in registers: rows of at most this many keys,
# at most MAX_DL_ELEMENTS elements per program; the tuned table takes it for rows of at most
# DL_TUNED_MAX_ROW keys (the lengths tuned).
MAX_DL_ROW = 1 << 14
MAX_DL_ELEMENTS = 1 << 16
DL_TUNED_MAX_ROW = 4096

WHOLE_ROW = "row"  # a table entry's block_k: the whole (padded) row is one key tile
# A whole-row tile is tuned for short rows only; a longer row that borrows such an entry
# (``_tuning.lookup``) takes this many keys per tile instead of a tile too large for registers.
MAX_WHOLE_ROW = 512
LONG_ROW_BLOCK_K = 128
# The per_head kernel keeps a whole row and grad_key ([Sk, D] fp32) in registers.
MAX_PER_HEAD_ROW = 512
# The tuned tables' per_head entries: rows of at most this many (padded) keys.
PER_HEAD_TUNED_MAX_ROW = 256


@dataclasses.dataclass(frozen=True)
class PassConfig(_tuning.TritonPassConfig):
  """Tiles and Triton launch parameters of one kernel (tiles: powers of two >= 16).

  ``row_align`` (row kernel, dense): rows of ``Sk % 8 != 0`` keys take aligned tiles of
  every ``row_align``-th row (the phase-aligned row kernel): 8, 16, 32 or 64;
  -1 = ``_phase.choose``; 0 = off (tiles of consecutive rows, scalar loads).
  """
  row_align: int = -1


@dataclasses.dataclass(frozen=True)
class Config:
  """How the backward runs: a ``scheme`` and the configs of its kernels.

  * ``"two_pass"``: ``row`` is the delta + grad_query kernel, ``col`` the grad_key kernel.
  * ``"per_head"``: one kernel, one program per head (``col.block_q`` query rows per step,
    whole rows as one tile; ``row`` unused). Rows of at most :data:`MAX_PER_HEAD_ROW` keys.
  * ``"dl_gemm"``: the kernel writing ``dL`` (``dl``, :class:`DlConfig`; ``None``:
    :func:`default_dl_config`), then the two GEMMs in one launch (tiles ``dl.gemm``);
    ``row`` and ``col`` unused. Rows of at most :data:`MAX_DL_ROW` keys, 16-bit inputs,
    ``D <= 128``.
  """
  row: PassConfig
  col: PassConfig
  scheme: str = "two_pass"
  dl: "DlConfig | None" = None

  def __post_init__(self):
    if self.scheme not in SCHEMES:
      raise ValueError(f"config.scheme: expected one of {SCHEMES}, got {self.scheme!r}")
    for name in ("row", "col"):
      if not isinstance(getattr(self, name), PassConfig):
        raise TypeError(f"config.{name}: expected a PassConfig, got "
                         f"{type(getattr(self, name)).__name__}")
    if self.dl is not None and not isinstance(self.dl, DlConfig):
      raise TypeError(f"config.dl: expected a DlConfig or None, got {type(self.dl).__name__}")


# The dl_gemm scheme's GEMM launch (both GEMMs' tiles), and the tiles that a table's
# ``dl_gemm`` entry takes where both lengths are at least DL_GEMM_DENSE_FROM (dense) or
# DL_GEMM_CAUSAL_FROM (causal) (:func:`dl_gemm_tiles`).
DL_GEMM = PassConfig(128, 64, 8, 3)
DL_GEMM_DENSE_FROM, DL_GEMM_CAUSAL_FROM = 1024, 2048
DL_GEMM_DENSE_LARGE = PassConfig(256, 64, 8, 4)
DL_GEMM_CAUSAL_LARGE = PassConfig(128, 64, 8, 5)


def dl_gemm_tiles(seq_q: int, seq_k: int, causal: bool) -> PassConfig:
  """The GEMM launch's tiles for a ``[seq_q, seq_k]`` problem: :data:`DL_GEMM`, or from
  :data:`DL_GEMM_DENSE_FROM` rows and keys on 256-row tiles on 4 stages (dense), from
  :data:`DL_GEMM_CAUSAL_FROM` on :data:`DL_GEMM`'s tiles on 5 stages (causal, whose ``dL``
  kernel writes up to the tiles' boundary past the diagonal). Both ask for 192 KiB of
  shared memory: Hopper's tables only."""
  if min(seq_q, seq_k) < (DL_GEMM_CAUSAL_FROM if causal else DL_GEMM_DENSE_FROM):
    return DL_GEMM
  return DL_GEMM_CAUSAL_LARGE if causal else DL_GEMM_DENSE_LARGE


@dataclasses.dataclass(frozen=True)
class DlConfig:
  """The ``"dl_gemm"`` scheme: its ``dL`` kernel takes ``rows`` whole rows per program (a
  power of two >= 1; the padded row sits in registers) on ``num_warps`` warps (1-16, a power
  of two); ``gemm`` holds the tiles of the one launch that computes ``dQ = dL @ K`` and
  ``dK = dL^T @ Q`` (``block_q`` output rows of either, steps of ``block_k``). ``phased``:
  dense rows of ``Sk % 8 != 0`` keys are read and written as row classes on 16-byte aligned
  tiles (``pallas_kernels._phase``: ``rows`` rows 8 apart per program, the row held from up
  to 7 keys early) instead of with scalar accesses; the same ``dL``, bit for bit."""
  rows: int = 1
  num_warps: int = 8
  gemm: PassConfig = DL_GEMM
  phased: bool = False

  def __post_init__(self):
    if not isinstance(self.phased, bool):
      raise ValueError(f"config.dl.phased: expected a bool, got {self.phased!r}")
    if not isinstance(self.gemm, PassConfig):
      raise TypeError(f"config.dl.gemm: expected a PassConfig, got {type(self.gemm).__name__}")
    for name, top in (("rows", 1 << 12), ("num_warps", 16)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v > top or v & (v - 1):
        raise ValueError(f"config.dl.{name}: expected a power of two in [1, {top}], got {v!r}")


def dl_width(seq_k: int) -> int:
  """The padded row length the ``"dl_gemm"`` scheme's ``dL`` kernel holds (a power of two
  >= 16)."""
  return max(16, next_power_of_2(seq_k))


def default_dl_config(seq_k: int) -> DlConfig:
  """About 4096 elements per program (whole rows), on 8 warps (16 for rows of 8192 keys or
  more)."""
  width = dl_width(seq_k)
  return DlConfig(rows=max(1, 4096 // width), num_warps=16 if width >= 8192 else 8)


# The most elements of a dL program per warp that a table entry may ask for; an entry that
# asks for more at some row length gives that length :func:`default_dl_config` instead (more
# per warp spills the row's registers).
DL_MAX_PER_WARP = 2048


def dl_config(entry: dict | None, seq_k: int, seq_q: int | None = None,
              causal: bool = False) -> DlConfig:
  """A table entry's ``dl`` field (``{"rows": r, "num_warps": w, "phased": bool}``, each
  optional: the default's; ``None``: the default) as a :class:`DlConfig` for rows of
  ``seq_k`` keys. ``rows`` is capped so that a program holds at most 8192 elements, and an
  entry whose program would hold more than :data:`DL_MAX_PER_WARP` elements per warp at
  this length takes the default. ``seq_q`` given, the GEMM tiles are
  :func:`dl_gemm_tiles`' (else :data:`DL_GEMM`)."""
  default = default_dl_config(seq_k)
  if seq_q is not None:
    default = dataclasses.replace(default, gemm=dl_gemm_tiles(seq_q, seq_k, causal))
  if entry is None:
    return default
  width = dl_width(seq_k)
  rows = max(1, min(int(entry.get("rows", default.rows)), (1 << 13) // width))
  warps = int(entry.get("num_warps", default.num_warps))
  if rows * width > DL_MAX_PER_WARP * warps:
    rows, warps = default.rows, default.num_warps
  return DlConfig(rows=rows, num_warps=warps, gemm=default.gemm,
                  phased=bool(entry.get("phased", False)))


def length_class(seq_k: int) -> str:
  """The tuning table's key for rows of ``seq_k`` keys (see ``_tuning.tile_length_class``)."""
  return _tuning.tile_length_class(seq_k)


def runs_xla(device_kind: str | None, seq_k: int, head_dim: int, dtype, causal: bool) -> bool:
  """Whether ``device_kind``'s table marks rows of ``seq_k`` keys ``"backend": "xla"`` (the
  tuner's choice of XLA's backward for that class): dense 16-bit problems with ``head_dim <= 128``,
  the ones the tuner times, only."""
  if causal or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16) or head_dim > 128:
    return False
  return _tuning.tuned_backend(KERNEL, device_kind, length_class(seq_k)) == "xla"

def heuristic(seq_q: int, seq_k: int, head_dim: int, *, row: bool) -> PassConfig:
  """Untuned tiles and launch parameters for the row (``row=True``) or column kernel.

  Base tiles are ``block_q=64`` x ``block_k=128``, capped by the padded sequence lengths and
  kept >= 16 (the tensor-core minimum). The row kernel deviates in two ways:

  * ``Sk <= 256``: the whole row is one tile (``block_k`` = padded Sk; ``block_q=32``, or
    64 when ``Sk <= 128``), so its two passes fuse and ``g``/``P`` are read once.
  * ``Sk > 256``: ``block_q=32``, halving each program's row footprint (``32*Sk*4`` B) so
    that pass 2's re-read of the row is more likely to hit L2.
  """
  d_pad = next_power_of_2(max(head_dim, 16))
  pq = max(16, next_power_of_2(seq_q))
  pk = max(16, next_power_of_2(seq_k))
  block_q = min(32 if row and pk > 128 else 64, pq)
  block_k = min(256 if row and pk <= 256 else 128, pk)
  tile = block_q * block_k
  num_warps = 8 if tile >= 8192 or (d_pad >= 128 and tile >= 4096) else 4
  if row and block_k >= pk:
    num_stages = 1  # one-tile rows: the loop runs once, there is nothing to pipeline
  else:
    num_stages = 2 if d_pad >= 128 or tile >= 8192 else 3
  return PassConfig(block_q, block_k, num_warps, num_stages)


def pass_config(entry: dict, seq_q: int, seq_k: int) -> PassConfig:
  """The :class:`PassConfig` of a table entry (``{"block_q": ..., "block_k": int |
  WHOLE_ROW, "num_warps": ..., "num_stages": ..., ["row_align"]}``) for rows
  of ``seq_k`` keys: tiles capped at the padded lengths; a whole-row ``block_k`` is the
  padded ``Sk`` (:data:`LONG_ROW_BLOCK_K` for rows longer than :data:`MAX_WHOLE_ROW`)."""
  fields = dict(entry)
  if fields["block_k"] == WHOLE_ROW:
    pk = max(16, next_power_of_2(seq_k))
    fields["block_k"] = pk if pk <= MAX_WHOLE_ROW else LONG_ROW_BLOCK_K
  return PassConfig(**fields).capped(seq_q, seq_k)


def table_entry(config: PassConfig, *, whole_row: bool = False) -> dict:
  """A table entry for ``config``: its four launch fields (``block_k`` = :data:`WHOLE_ROW`
  with ``whole_row``) plus each other field that differs from its default."""
  entry = {}
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if f.name in ("block_q", "block_k", "num_warps", "num_stages") or value != f.default:
      entry[f.name] = value
  if whole_row:
    entry["block_k"] = WHOLE_ROW
  return entry


def default_config(seq_q: int, seq_k: int, head_dim: int, dtype, device_kind=None,
                   schemes=SCHEMES, *, causal: bool = False) -> Config:
  """The tuned config (bf16/fp16, D <= 128, on the device kind it was tuned on), else the
  heuristic's ``"two_pass"`` config.

  ``device_kind``: the kind of the device that runs the call (``None``: the heuristic). The
  table's scheme is used if it is in ``schemes`` (``per_head`` only for rows of at most
  :data:`PER_HEAD_TUNED_MAX_ROW` keys, ``dl_gemm`` only for rows of at most
  :data:`DL_TUNED_MAX_ROW` keys; where ``dl_gemm`` is not taken, the class's ``per_head``
  entry if it has one), else its ``two_pass`` entry. A ``dl_gemm`` entry carries its
  :class:`DlConfig` as ``dl`` (:func:`dl_config`; absent: :func:`default_dl_config`), and may
  carry another for causal calls as ``causal_dl``.
  """
  tuned = _tuning.lookup(_tuning.table(KERNEL, device_kind or ""), length_class(seq_k))
  if not tuned or jnp.dtype(dtype).itemsize > 2 or next_power_of_2(head_dim) > 128:
    return Config(heuristic(seq_q, seq_k, head_dim, row=True),
                  heuristic(seq_q, seq_k, head_dim, row=False))
  pk = max(16, next_power_of_2(seq_k))
  scheme = tuned.get("scheme", "two_pass")
  if scheme == "dl_gemm" and (pk > DL_TUNED_MAX_ROW or scheme not in schemes):
    scheme = "per_head"  # where the class has a per_head entry, else two_pass below
  if (scheme == "per_head" and scheme in schemes and "head" in tuned
      and pk <= PER_HEAD_TUNED_MAX_ROW):
    head = pass_config(tuned["head"], seq_q, seq_k)
    return Config(head, head, "per_head")
  row, col = pass_config(tuned["row"], seq_q, seq_k), pass_config(tuned["col"], seq_q, seq_k)
  if scheme == "dl_gemm":
    dl = tuned["causal_dl"] if causal and "causal_dl" in tuned else tuned.get("dl")
    return Config(row, col, "dl_gemm", dl_config(dl, seq_k, seq_q, causal))
  return Config(row, col)
