"""Launch configurations: validation, per-device tuned tables, the device that runs a call.

A tuned table maps a row-length class to the tuned config, with named fields, and records
the device kind, its compute capability and the jax version it was measured with. It is
written by ``python -m pallas_kernels.tune``. Two places hold tables:

* the user cache, ``<cache>/<jax version>/<device folder>/<kernel>.json`` (:func:`cache_dir`:
  ``$PALLAS_KERNELS_CACHE_DIR``, else ``$XDG_CACHE_HOME/pallas_kernels``, else
  ``~/.cache/pallas_kernels``), read only by the same jax version on the same device kind;
* the package, ``pallas_kernels/tuned/<device folder>/<kernel>.json``.

The device folder is the device kind in lower case with ``_`` for other characters
(``NVIDIA H200`` -> ``nvidia_h200``). Per kernel, a device reads one package table: its own
kind's, else that of the nearest measured kind of its compute capability that has one (a
device with tables of its own for some kernels takes another's for the rest), with its
user-cache classes (this jax) ahead of that table's. A device of an unmeasured kind reads as
the nearest measured kind of its compute capability (:func:`table_kind`); a device of an
architecture with no tables uses heuristics. A class's entry may say ``"backend": "xla"``, where the
tuner's comparison chose XLA's backward over the kernels: ``implementation=None`` of the op
then runs XLA (:func:`tuned_backend`); the kernels still read the entry's config.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp

from pallas_kernels import _phase
from pallas_kernels._util import device_of, next_power_of_2

TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
CACHE_ENV = "PALLAS_KERNELS_CACHE_DIR"
# What a class's "backend" may name: the kernels (the default, not written) or XLA.
BACKENDS = ("pallas", "xla")


def device_dir(device_kind: str) -> str:
  """The tuned-table folder of a device kind: ``"NVIDIA H200"`` -> ``"nvidia_h200"``."""
  return re.sub(r"[^0-9a-z]+", "_", device_kind.lower()).strip("_")


def table_path(kernel: str, device_kind: str) -> str:
  """The package's table of ``kernel`` for ``device_kind``."""
  return os.path.join(TUNED_DIR, device_dir(device_kind), f"{kernel}.json")


def cache_dir() -> str:
  """The user cache's folder: ``$PALLAS_KERNELS_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/pallas_kernels``, else ``~/.cache/pallas_kernels``."""
  if os.environ.get(CACHE_ENV):
    return os.path.expanduser(os.environ[CACHE_ENV])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "pallas_kernels")


def user_table_path(kernel: str, device_kind: str, jax_version: str | None = None) -> str:
  """The user cache's table of ``kernel`` for ``device_kind`` and ``jax_version`` (default:
  this process's jax)."""
  return os.path.join(cache_dir(), jax_version or jax.__version__, device_dir(device_kind),
                      f"{kernel}.json")


def clear_caches() -> None:
  """Forgets the tables read so far (after a table was written)."""
  _raw_table.cache_clear()
  _user_kinds.cache_clear()
  measured_kinds.cache_clear()


def _read(path: str, device_kind: str, jax_version: str | None = None) -> dict:
  """The configs of the table at ``path`` if it records ``device_kind`` (and, where given,
  ``jax_version``); else ``{}``."""
  try:
    with open(path) as f:
      data = json.load(f)
  except (FileNotFoundError, NotADirectoryError):
    return {}
  if data.get("device_kind") != device_kind:
    return {}
  if jax_version is not None and data.get("jax") != jax_version:
    return {}
  return dict(data.get("configs", {}))


@functools.cache
def _user_kinds(folder: str, jax_version: str) -> dict[str, str | None]:
  """``{device kind: compute capability}`` of the user cache's tables of ``jax_version``."""
  kinds = {}
  root = os.path.join(folder, jax_version)
  for sub in sorted(os.listdir(root)) if os.path.isdir(root) else ():
    path = os.path.join(root, sub)
    for name in sorted(os.listdir(path)) if os.path.isdir(path) else ():
      if not name.endswith(".json"):
        continue
      try:
        with open(os.path.join(path, name)) as f:
          data = json.load(f)
      except (OSError, ValueError):
        continue
      if data.get("device_kind") and data.get("jax") == jax_version:
        cap = data.get("compute_capability")
        kinds.setdefault(data["device_kind"], str(cap) if cap else None)
  return kinds


def user_kinds() -> dict[str, str | None]:
  """``{device kind: compute capability}`` of the user cache's tables for this jax."""
  return _user_kinds(cache_dir(), jax.__version__)


def _layers(kernel: str, device_kind: str) -> list[tuple[str, str, dict]]:
  """``(source, kind, configs)`` of the tables of ``kernel`` that serve ``device_kind``,
  first the one read first: its user cache's (this jax), then one package table: its own
  kind's, else that of the nearest measured kind of its compute capability that has one
  (:func:`_same_architecture`)."""
  out = []
  user = _read(user_table_path(kernel, device_kind), device_kind, jax.__version__)
  if user:
    out.append(("user cache", device_kind, user))
  cap = measured_kinds().get(device_kind) or user_kinds().get(device_kind)
  for kind in [device_kind, *_same_architecture(device_kind, cap)]:
    package = _read(table_path(kernel, kind), kind)
    if package:
      out.append(("package", kind, package))
      break
  return out


@functools.cache
def _raw_table(kernel: str, device_kind: str, folder: str, tuned_dir: str) -> dict:
  configs = {}
  for _, _, layer in reversed(_layers(kernel, device_kind)):  # the user's classes last
    configs.update(layer)
  return configs


def _raw(kernel: str, device_kind: str | None) -> dict:
  if not device_kind:
    return {}
  return _raw_table(kernel, device_kind, cache_dir(), TUNED_DIR)


def table(kernel: str, device_kind: str | None) -> dict:
  """``{class: {field: value}}`` of ``kernel``'s kernel configs on ``device_kind``; empty if
  none. The user cache's classes (this jax, this kind) come ahead of one package table's:
  the kind's own, else that of the nearest measured kind of its compute capability that has
  a table of ``kernel`` (:func:`_layers`). The entries' ``backend`` field is left out
  (:func:`tuned_backend` reads it)."""
  return {k: {f: v for f, v in e.items() if f != "backend"} if isinstance(e, dict) else e
          for k, e in _raw(kernel, device_kind).items()}


table.cache_clear = clear_caches  # the tables are cached: ``table.cache_clear()`` forgets them


def tuned_backend(kernel: str, device_kind: str | None, key: str) -> str:
  """``"xla"`` where ``kernel``'s table on ``device_kind`` says so for class ``key`` (that
  class exactly: no other class's entry stands in), else ``"pallas"``."""
  entry = _raw(kernel, device_kind).get(key)
  return entry.get("backend", "pallas") if isinstance(entry, dict) else "pallas"


def forward_entry(kernel: str, device_kind: str | None, key: str, dtype,
                  head_dim: int) -> dict | None:
  """The ``"fwd"`` entry (a fused forward kernel's launch fields) of class ``key`` in
  ``kernel``'s table on ``device_kind``, for the problems the tuner times it on (16-bit
  inputs, ``head_dim <= 128``); else ``None``."""
  fields = (lookup(table(kernel, device_kind or ""), key) or {}).get("fwd")
  if (isinstance(fields, dict) and jnp.dtype(dtype).itemsize == 2
      and next_power_of_2(head_dim) <= 128):
    return fields
  return None


@functools.cache
def _measured_kinds(tuned_dir: str) -> dict[str, str]:
  kinds = {}
  for folder in sorted(os.listdir(tuned_dir)) if os.path.isdir(tuned_dir) else ():
    path = os.path.join(tuned_dir, folder)
    for name in sorted(os.listdir(path)) if os.path.isdir(path) else ():
      if name.endswith(".json"):
        with open(os.path.join(path, name)) as f:
          data = json.load(f)
        if data.get("device_kind") and data.get("compute_capability"):
          kinds.setdefault(data["device_kind"], str(data["compute_capability"]))
  return kinds


def measured_kinds() -> dict[str, str]:
  """``{device kind: compute capability}`` of the devices the package has tables for."""
  return _measured_kinds(TUNED_DIR)


measured_kinds.cache_clear = _measured_kinds.cache_clear


def _same_architecture(kind: str, cap) -> list[str]:
  """The measured kinds of compute capability ``cap`` other than ``kind``, the name that
  shares the longest prefix with ``kind`` first (ties: in sorted order)."""
  same = [k for k, c in measured_kinds().items()
          if cap is not None and c == str(cap) and k != kind]
  return sorted(same, key=lambda k: (-len(os.path.commonprefix([k, kind])), k))


def _package_kind(kind: str, cap) -> str | None:
  """The kind whose package tables serve ``kind`` (of compute capability ``cap``): itself
  where the package has tables for it; else the nearest measured kind of the same compute
  capability (:func:`_same_architecture`); else ``None``."""
  if kind in measured_kinds():
    return kind
  return next(iter(_same_architecture(kind, cap)), None)


def table_kind(device) -> str | None:
  """The device kind whose tuned tables serve ``device``: its own kind where the package or
  the user cache has tables for it; else the nearest measured kind of the same compute
  capability (:func:`_same_architecture`); else the device's own kind, which has no table
  (heuristics). ``None`` for no device."""
  kind = getattr(device, "device_kind", None)
  if kind is None:
    return None
  if kind in user_kinds():
    return kind
  return _package_kind(kind, getattr(device, "compute_capability", None)) or kind


def table_source(device, kernel: str | None = None) -> str:
  """Which tables serve ``device``: ``"user cache"`` (the user cache has tables of its kind
  for this jax, ahead of the package's), ``"package"`` (its own), ``"fallback: <kind>"`` (a
  measured device of the same compute capability) or ``"heuristic"``. With ``kernel``: the
  table of that kernel read first (:func:`_layers`)."""
  kind = getattr(device, "device_kind", None)
  if kind is None:
    return "heuristic"
  if kernel is not None:
    layers = _layers(kernel, table_kind(device))
    if not layers:
      return "heuristic"
    source, served, _ = layers[0]
    return source if served == kind else f"fallback: {served}"
  if kind in user_kinds():
    return "user cache"
  served = table_kind(device)
  if served not in measured_kinds():
    return "heuristic"
  return "package" if served == kind else f"fallback: {served}"


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
