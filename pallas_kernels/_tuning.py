"""Launch-configuration tables measured on a GPU (``pallas_kernels/tuned/<kernel>.json``).

A table holds the device kind it was measured on and, per row-length class, the config
that was fastest there (written by ``benchmarks/tune.py`` and
``benchmarks/tune_attention.py``). Kernels use a table only on that device kind.
"""

from __future__ import annotations

import functools
import json
import os

from pallas_kernels import _phase
from pallas_kernels._util import next_power_of_2

TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")


def table_path(kernel: str) -> str:
  return os.path.join(TUNED_DIR, f"{kernel}.json")


@functools.cache
def table(kernel: str, device_kind: str) -> dict:
  """``{class: config}`` measured for ``kernel`` on ``device_kind``; empty if none."""
  try:
    with open(table_path(kernel)) as f:
      data = json.load(f)
  except FileNotFoundError:
    return {}
  return data["configs"] if data.get("device_kind") == device_kind else {}


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


# PassConfig.row_align: -1 automatic, 0 off, or a row-class size of pallas_kernels._phase.
ROW_ALIGN_VALUES = (-1, 0, *sorted(_phase.ROW_ALIGNS))


def with_overrides(config, **overrides):
  """``config`` (a NamedTuple of per-pass NamedTuples, maybe plus plain fields) with each
  non-``None`` override applied to every pass, and every pass checked: ``block_*`` fields
  powers of two >= 16, ``num_warps`` and ``num_stages`` >= 1, ``row_align`` one of
  ``ROW_ALIGN_VALUES``. Raises ``ValueError`` naming the field."""
  overrides = {k: v for k, v in overrides.items() if v is not None}
  passes = []
  for name, c in zip(config._fields, config):
    if not hasattr(c, "_replace"):  # a non-pass field (a scheme name, say): kept as is
      passes.append(c)
      continue
    c = c._replace(**overrides)
    c = type(c)(*(bool(v) if f == "prefetch" else int(v) for f, v in zip(c._fields, c)))
    for field, v in zip(c._fields, c):
      if field.startswith("block_") and (v < 16 or v & (v - 1)):
        raise ValueError(f"config.{name}.{field}: expected a power of two >= 16, got {v}")
      if field == "row_align" and v not in ROW_ALIGN_VALUES:
        raise ValueError(f"config.{name}.row_align: expected one of {ROW_ALIGN_VALUES} "
                         f"(-1: automatic, 0: off), got {v}")
    if c.num_warps < 1 or c.num_stages < 1:
      raise ValueError(f"config.{name}: num_warps and num_stages must be >= 1, got {c}")
    passes.append(c)
  return type(config)(*passes)
