"""Launch configurations: validation, per-device tuned tables, the device that runs a call.

A tuned table is ``pallas_kernels/tuned/<device folder>/<kernel>.json`` (the folder is the
device kind in lower case with ``_`` for other characters: ``NVIDIA H200`` ->
``nvidia_h200``). It maps a row-length class to the tuned config, with
named fields and the device's compute capability, and is written by the tuner in
``benchmarks/``. A device uses its own kind's tables; a device with none uses those of the
measured device of the same compute capability whose name is closest (an H100 takes the
H200's); a device of an architecture with no tables uses heuristics (:func:`table_kind`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re


from pallas_kernels import _phase
from pallas_kernels._util import device_of, next_power_of_2

TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")


def device_dir(device_kind: str) -> str:
  """The tuned-table folder of a device kind: ``"NVIDIA H200"`` -> ``"nvidia_h200"``."""
  return re.sub(r"[^0-9a-z]+", "_", device_kind.lower()).strip("_")


def table_path(kernel: str, device_kind: str) -> str:
  return os.path.join(TUNED_DIR, device_dir(device_kind), f"{kernel}.json")


@functools.cache
def table(kernel: str, device_kind: str | None) -> dict:
  """``{class: {field: value}}`` measured for ``kernel`` on ``device_kind``; empty if none."""
  if not device_kind:
    return {}
  try:
    with open(table_path(kernel, device_kind)) as f:
      data = json.load(f)
  except FileNotFoundError:
    return {}
  return data["configs"] if data.get("device_kind") == device_kind else {}


@functools.cache
def measured_kinds() -> dict[str, str]:
  """``{device kind: compute capability}`` of the devices the package has tables for."""
  kinds = {}
  for folder in sorted(os.listdir(TUNED_DIR)) if os.path.isdir(TUNED_DIR) else ():
    path = os.path.join(TUNED_DIR, folder)
    for name in sorted(os.listdir(path)) if os.path.isdir(path) else ():
      if name.endswith(".json"):
        with open(os.path.join(path, name)) as f:
          data = json.load(f)
        if data.get("device_kind") and data.get("compute_capability"):
          kinds.setdefault(data["device_kind"], str(data["compute_capability"]))
  return kinds


def table_kind(device) -> str | None:
  """The device kind whose tuned tables serve ``device``: its own kind where the package
  has tables for it; else, of the measured kinds of the same compute capability, the one
  whose name shares the longest prefix with the device's (ties: the last in sorted order);
  else the device's own kind, which has no table (heuristics). ``None`` for no device."""
  kind = getattr(device, "device_kind", None)
  if kind is None:
    return None
  measured = measured_kinds()
  cap = getattr(device, "compute_capability", None)
  same = sorted(k for k, c in measured.items() if cap is not None and c == str(cap))
  if kind in measured or not same:
    return kind
  return max(same, key=lambda k: len(os.path.commonprefix([k, kind])))


def table_source(device) -> str:
  """Which tables serve ``device``: ``"package"`` (its own), ``"fallback: <kind>"`` (a
  measured device of the same compute capability) or ``"heuristic"``."""
  kind = table_kind(device)
  if kind is None or kind not in measured_kinds():
    return "heuristic"
  return "package" if kind == device.device_kind else f"fallback: {kind}"


def device_kind_of(*arrays, interpret: bool = False) -> str | None:
  """The device kind whose tuned tables a call uses (:func:`table_kind` of the device of
  :func:`_util.device_of`); ``None`` in interpret mode (heuristics)."""
  return None if interpret else table_kind(device_of(*arrays))


def tile_length_class(n: int, *, lo: int = 128, hi: int = 1024, align: int = 8) -> str:
  """Class of a row of ``n`` elements for the tiled kernels: the padded length clamped
  to ``[lo, hi]``, plus ``-ragged`` when ``n`` is not a multiple of ``align`` elements
  (rows then are not 16-byte aligned in bf16: Triton cannot vectorise or pipeline their
  loads, and other tiles win)."""
  key = str(min(max(next_power_of_2(n), lo), hi))
  return key if n % align == 0 else key + "-ragged"


def lookup(configs: dict, key: str):
  """The entry for ``key``; a ragged class without one takes the nearest ragged class's
  entry (ragged rows want the same kind of config at any length), else the aligned class
  of its length; ``None`` if there is nothing."""
  if key in configs or not key.endswith("-ragged"):
    return configs.get(key)
  width = int(key.split("-")[0]).bit_length()
  ragged = [k for k in configs if k.endswith("-ragged")]
  if ragged:
    return configs[min(ragged, key=lambda k: abs(int(k.split("-")[0]).bit_length() - width))]
  return configs.get(key.split("-")[0])


# TritonPassConfig.row_align: -1 automatic, 0 off, or a row-class size of pallas_kernels._phase.
ROW_ALIGN_VALUES = (-1, 0, *sorted(_phase.ROW_ALIGNS))


@dataclasses.dataclass(frozen=True)
class TritonPassConfig:
  """Tiles and Triton launch parameters of one tiled kernel (a pass of a backward).

  ``block_q`` query rows by ``block_k`` key columns per tile: powers of two >= 16 (the
  tensor-core minimum). ``num_warps`` and ``num_stages`` go to the Triton compiler.
  Kernels add their own fields in subclasses. Invalid values raise ``ValueError`` naming
  the field.
  """
  block_q: int
  block_k: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name.startswith("block_") and (not isinstance(v, int) or v < 16 or v & (v - 1)):
        raise ValueError(f"config.{f.name}: expected a power of two >= 16, got {v!r}")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"config.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps!r}")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"config.num_stages: expected an int >= 1, got {self.num_stages!r}")
    if hasattr(self, "row_align") and self.row_align not in ROW_ALIGN_VALUES:
      raise ValueError(f"config.row_align: expected one of {ROW_ALIGN_VALUES} "
                       f"(-1: automatic, 0: off), got {self.row_align!r}")

  def capped(self, seq_q: int, seq_k: int) -> "TritonPassConfig":
    """The tiles capped at the padded lengths (short sequences take smaller tiles)."""
    return dataclasses.replace(self, block_q=min(self.block_q, max(16, next_power_of_2(seq_q))),
                               block_k=min(self.block_k, max(16, next_power_of_2(seq_k))))


def with_overrides(config, **overrides):
  """``config`` (a dataclass of pass configs, maybe plus plain fields such as a scheme
  name) with each non-``None`` override applied to every pass that has that field; the
  passes re-validate (``ValueError`` naming the field)."""
  overrides = {k: v for k, v in overrides.items() if v is not None}
  if not overrides:
    return config
  changes = {}
  for f in dataclasses.fields(config):
    c = getattr(config, f.name)
    if dataclasses.is_dataclass(c):
      changes[f.name] = dataclasses.replace(
          c, **{k: v for k, v in overrides.items() if hasattr(c, k)})
  return dataclasses.replace(config, **changes)
