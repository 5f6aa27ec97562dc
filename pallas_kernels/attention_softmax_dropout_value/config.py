"""Launch configurations of the Triton kernels of the attention softmax-dropout-value backward.

A config names the tiles and launch parameters of each pass (:class:`PassConfig`, one per
pass in :class:`Config`). :func:`default_config` takes the table measured on the device
kind that runs the call (``pallas_kernels/tuned/<device>/attention_softmax_dropout_value.json``,
keyed by :func:`length_class`), else :func:`heuristic`. Table entries are JSON objects
with the fields' names (:meth:`Config.from_json`, :meth:`Config.to_json`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import _phase, _tuning
from pallas_kernels._util import next_power_of_2

KERNEL = "attention_softmax_dropout_value"  # the tuned table's name

# Programs wanted in flight for the dV pass (2 per SM of an H100/H200 with 132 SMs):
# launches with fewer kv blocks split each block's loop over programs (``split="auto"``).
TARGET_PROGRAMS = 264

AUTO = "auto"  # PassConfig.split: chosen per launch (auto_split_for_launch)


@dataclasses.dataclass(frozen=True)
class PassConfig(_tuning.TritonPassConfig):
  """Tiles and Triton launch parameters of one pass (tiles: powers of two >= 16).

  ``split`` (dV pass and the kernel from delta): programs that share one kv block's loop
  over the group's rows, each adding an fp32 partial dV (for launches with too few kv
  blocks to fill the GPU): an int >= 1, or ``"auto"`` (:func:`auto_split_for_launch`).
  ``heads`` (dS pass only): query heads of one kv group per program, so each V tile is
  loaded once for all of them (the largest divisor of G that is <= ``heads``).
  ``row_align`` (dS pass only): rows of ``seq_k % 8 != 0`` keys take aligned tiles of every
  ``row_align``-th row of a kv group (8, 16, 32 or 64, at most ``block_k``; ``heads`` is
  then unused); -1: ``_phase.choose``; 0: off (tiles of consecutive rows, scalar loads).
  Used only where rows span more than one kv tile.
  """
  split: int | str = AUTO
  heads: int = 1
  row_align: int = -1

  def __post_init__(self):
    super().__post_init__()
    if self.split != AUTO and (isinstance(self.split, bool) or not isinstance(self.split, int)
                               or self.split < 1):
      raise ValueError(f"config.split: expected {AUTO!r} or an int >= 1, got {self.split!r}")
    if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads < 1:
      raise ValueError(f"config.heads: expected an int >= 1, got {self.heads!r}")

  @classmethod
  def from_json(cls, entry: dict) -> "PassConfig":
    """A pass config from a tuned-table entry ``{"block_q": 64, "block_k": 128, ...}``
    (fields left out take their defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(entry) - names)
    if unknown:
      raise ValueError(f"config: unknown fields {unknown}; expected some of {sorted(names)}")
    return cls(**entry)

  def to_json(self) -> dict:
    """The table entry: the tile and launch fields, and the others that differ from their
    defaults."""
    base = {f.name for f in dataclasses.fields(_tuning.TritonPassConfig)}
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name in base or getattr(self, f.name) != f.default}


@dataclasses.dataclass(frozen=True)
class Config:
  """``dv``: the dV pass (and delta's partial row sums); ``ds``: the dS pass."""
  dv: PassConfig
  ds: PassConfig

  def __post_init__(self):
    for name in ("dv", "ds"):
      if not isinstance(getattr(self, name), PassConfig):
        raise TypeError(f"config.{name}: expected a PassConfig, got "
                        f"{type(getattr(self, name)).__name__}")

  @classmethod
  def from_json(cls, entry: dict) -> "Config":
    """A config from a tuned-table entry ``{"dv": {...}, "ds": {...}}``."""
    return cls(PassConfig.from_json(entry["dv"]), PassConfig.from_json(entry["ds"]))

  def to_json(self) -> dict:
    return {"dv": self.dv.to_json(), "ds": self.ds.to_json()}


def length_class(seq_k: int) -> str:
  """The tuned table's key for rows of ``seq_k`` keys (``_tuning.tile_length_class``)."""
  return _tuning.tile_length_class(seq_k)


def runs_xla(device_kind: str | None, seq_k: int, head_dim: int, dtype) -> bool:
  """Whether ``device_kind``'s table marks rows of ``seq_k`` keys ``"backend": "xla"`` (the
  tuner's choice of XLA's backward for that class): 16-bit problems with ``head_dim <= 128``, the
  ones the tuner times, only."""
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16) or head_dim > 128:
    return False
  return _tuning.tuned_backend(KERNEL, device_kind, length_class(seq_k)) == "xla"


def heuristic(seq_q, seq_k, head_dim, itemsize) -> Config:
  """Untuned defaults: 64 x 64 tiles (fp32 with D > 64: 32 query rows), 4-8 warps; both
  passes take the same tiles."""
  d_pad = next_power_of_2(max(head_dim, 16))
  cap_q = max(16, next_power_of_2(seq_q))
  cap_k = max(16, next_power_of_2(seq_k))
  block_q = min(32 if itemsize >= 4 and d_pad >= 128 else 64, cap_q)
  block_k = min(128 if d_pad <= 64 else 64, cap_k)
  num_warps = 4 if max(block_q, block_k) * d_pad <= 64 * 128 else 8
  num_stages = 2 if d_pad >= 128 else 3
  cfg = PassConfig(block_q, block_k, num_warps, num_stages)
  return Config(cfg, cfg)


def default_config(batch, num_heads, num_kv_heads, seq_q, seq_k, head_dim, dtype,
                   device_kind=None) -> Config:
  """The tuned config (bf16/fp16, D <= 128, on the device kind it was tuned on), else
  :func:`heuristic`. Tuned tiles are capped at the padded lengths, so short sequences get
  smaller tiles."""
  itemsize = jnp.dtype(dtype).itemsize
  tuned = _tuning.lookup(_tuning.table(KERNEL, device_kind or ""), length_class(seq_k))
  if not tuned or itemsize > 2 or next_power_of_2(head_dim) > 128:
    return heuristic(seq_q, seq_k, head_dim, itemsize)
  cfg = Config.from_json(tuned)
  return Config(cfg.dv.capped(seq_q, seq_k), cfg.ds.capped(seq_q, seq_k))


def default_from_delta_config(seq_q, seq_k, head_dim, dtype) -> PassConfig:
  """The kernel from delta: ``block_q`` 64, ``block_k`` ``min(64, max(16,
  next_power_of_2(seq_k)))``, 4 warps, 3 stages for 16-bit inputs; the heuristic for fp32."""
  if jnp.dtype(dtype).itemsize > 2:
    return heuristic(seq_q, seq_k, head_dim, jnp.dtype(dtype).itemsize).dv
  return PassConfig(64, min(64, max(16, next_power_of_2(seq_k))), 4, 3)


def auto_split_for_launch(programs: int, steps: int) -> int:
  """Programs per kv block for a launch of ``programs`` programs of ``steps`` loop steps:
  doubles while the launch stays within ``TARGET_PROGRAMS`` programs and each share keeps
  at least 2 steps of its loop."""
  split = 1
  while programs * split * 2 <= TARGET_PROGRAMS and steps >= split * 4:
    split *= 2
  return split


def resolve_split(cfg: PassConfig, programs: int, steps: int) -> int:
  """``cfg.split``, with ``"auto"`` resolved for the launch (:func:`auto_split_for_launch`)."""
  return auto_split_for_launch(programs, steps) if cfg.split == AUTO else cfg.split


def group_heads(groups: int, wanted: int) -> int:
  """The dS pass's heads per program: the largest divisor of ``groups`` <= ``wanted``."""
  return max(n for n in range(1, max(1, min(wanted, groups)) + 1) if groups % n == 0)


def use_phased(cfg: PassConfig, batch, num_heads, seq_q, seq_k, head_dim, *sizes) -> bool:
  """Whether the dS pass takes row-class tiles (``_ds_kernel_phased``): ``cfg.row_align``
  is not 0, rows are not 16-byte aligned (``seq_k % 8 != 0``), a row spans more than one
  kv tile (one-tile rows keep the exact in-tile delta) and the flat views (of ``sizes``
  elements, plus P and dO) fit int32 offsets."""
  return _phase.applies(cfg.row_align, seq_k, cfg.block_k, batch * num_heads * seq_q * seq_k,
                        batch * seq_q * num_heads * head_dim, *sizes)
