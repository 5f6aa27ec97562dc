"""Launch configuration of the masked softmax -> dropout backward kernel.

A :class:`Config` says how many rows of one head a program owns, how a row is cut into
power-of-two column chunks, and how the loads and the store meet the caches. The tuned table
(``tuned/<device>/masked_softmax_dropout.json``, written by ``python -m
pallas_kernels.tune``) holds one :class:`TableEntry` per row-length class
(:func:`length_class`); elsewhere :func:`heuristic_entry` stands in. :func:`default_config`
is the op's one dispatch rule.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels import _tuning
from pallas_kernels._util import next_power_of_2

KERNEL = "masked_softmax_dropout"  # the tuned table's file name
NUM_WARPS = (1, 2, 4, 8, 16, 32)
# What ``pltriton.load`` accepts (jax 0.11): cache modifiers and L2 eviction policies.
CACHE_MODIFIERS = (None, ".ca", ".cg")
EVICTION_POLICIES = (None, "evict_normal", "evict_first", "evict_last")


@dataclasses.dataclass(frozen=True)
class Config:
  """Launch configuration; invalid values raise ``ValueError`` naming the field.

  Attributes:
    block_rows: rows per program (a power of two >= 1).
    num_warps: Triton warps per program (1, 2, 4, 8, 16 or 32).
    split: cover a row whose length is not a power of two with two power-of-two column
      chunks (the largest power of two <= seq_k, then the rest padded), instead of one
      chunk padded to ``next_power_of_2(seq_k)`` (up to 2x idle lanes).
    stream_cache: cache modifier of the streamed loads (g, P, keep; each byte read once):
      ``None``, ``".cg"`` (L2 only) or ``".ca"``.
    stream_eviction: L2 eviction policy of the streamed loads (``None``: normal).
    mask_cache: cache modifier of the attention-mask load; the mask is shared by all
      heads, so ``".ca"`` may serve the other heads' programs from L1.
    mask_after_sum: load the mask after the row sums (fewer registers live during the
      reduction) instead of with the streamed loads.
    store_eviction: L2 eviction policy of the output store (``None``: normal).
    row_group: the order of the programs. 0: the heads of one (batch entry, row block) run
      together, so the mask tile they share comes from L2 after its first read. ``k >= 1``:
      ``k`` consecutive row blocks of one head run before the next head's (capped at the
      row blocks of a head), so concurrent programs read longer contiguous stretches.
  """
  block_rows: int
  num_warps: int
  split: bool = True
  stream_cache: str | None = None
  stream_eviction: str | None = "evict_first"
  mask_cache: str | None = None
  mask_after_sum: bool = False
  store_eviction: str | None = None
  row_group: int = 0

  def __post_init__(self):
    r = self.block_rows
    if not isinstance(r, int) or isinstance(r, bool) or r < 1 or r & (r - 1):
      raise ValueError(f"config.block_rows: expected a power of two >= 1, got {r!r}")
    if self.num_warps not in NUM_WARPS or isinstance(self.num_warps, bool):
      raise ValueError(
          f"config.num_warps: expected 1, 2, 4, 8, 16 or 32, got {self.num_warps!r}")
    for name in ("split", "mask_after_sum"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"config.{name}: expected a bool, got {getattr(self, name)!r}")
    for name in ("stream_cache", "mask_cache"):
      if getattr(self, name) not in CACHE_MODIFIERS:
        raise ValueError(f"config.{name}: expected one of {CACHE_MODIFIERS}, "
                         f"got {getattr(self, name)!r}")
    for name in ("stream_eviction", "store_eviction"):
      if getattr(self, name) not in EVICTION_POLICIES:
        raise ValueError(f"config.{name}: expected one of {EVICTION_POLICIES}, "
                         f"got {getattr(self, name)!r}")
    if self.stream_cache is not None and self.stream_eviction is not None:
      # ptxas refuses the pair ("Modifier '.evict_first' cannot be combined with '.cg'").
      raise ValueError(f"config.stream_cache={self.stream_cache!r} cannot be combined with "
                       f"config.stream_eviction={self.stream_eviction!r}: set "
                       "stream_eviction=None")
    k = self.row_group
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
      raise ValueError(f"config.row_group: expected an int >= 0, got {k!r}")

  @property
  def uses_cache_modifiers(self) -> bool:
    return self.stream_cache is not None or self.mask_cache is not None


# The fields of Config after the launch shape (block_rows, num_warps, split), with defaults.
VARIANT_FIELDS = {f.name: f.default for f in dataclasses.fields(Config)[3:]}


def column_chunks(seq_k: int, split: bool) -> tuple[tuple[int, int], ...]:
  """``(start, width)`` power-of-two column chunks that cover a row of ``seq_k``."""
  if not split or seq_k & (seq_k - 1) == 0:
    return ((0, next_power_of_2(seq_k)),)
  main = 1 << (seq_k.bit_length() - 1)
  return ((0, main), (main, next_power_of_2(seq_k - main)))


def config_for(seq_q: int, seq_k: int, *, target: int, num_warps: int, split: bool,
               **variant) -> Config:
  """About ``target`` elements per program: many short rows or one long one (the block
  rows are the largest power of two that fits, at least 1, at most the padded ``seq_q``).
  ``variant``: the other :class:`Config` fields."""
  width = sum(w for _, w in column_chunks(seq_k, split))
  cap = max(1, min(target // width, next_power_of_2(seq_q)))
  return Config(1 << (cap.bit_length() - 1), num_warps, split, **variant)


def length_class(seq_k: int) -> str:
  """The tuning table's key for rows of ``seq_k``: the padded length, and whether it is padded.

  Rows whose length is not a power of two are split or padded and their loads cannot be
  vectorised (odd strides), so they are tuned apart from the aligned ones.
  """
  width = next_power_of_2(seq_k)
  return str(width) if width == seq_k else f"{width}-ragged"


def runs_xla(device_kind: str | None, seq_k: int) -> bool:
  """Whether ``device_kind``'s table marks rows of ``seq_k`` keys ``"backend": "xla"`` (the
  tuner's choice of XLA's backward for that class); any dtype."""
  return _tuning.tuned_backend(KERNEL, device_kind, length_class(seq_k)) == "xla"


@dataclasses.dataclass(frozen=True)
class TableEntry:
  """One row-length class's entry of the tuned table (its JSON object has these fields;
  the :class:`Config` fields after ``split`` appear only where they are not the default).

  Attributes:
    target: elements per program to aim at (:func:`config_for` picks the block rows).
    num_warps: Triton warps per program.
    split: :attr:`Config.split`.
    variant: the other :class:`Config` fields that are not at their default, as
      ``((name, value), ...)`` in the order of the fields.
  """
  target: int
  num_warps: int
  split: bool
  variant: tuple[tuple[str, object], ...] = ()

  def __post_init__(self):
    if not isinstance(self.target, int) or isinstance(self.target, bool) or self.target < 1:
      raise ValueError(f"target: expected an int >= 1, got {self.target!r}")
    unknown = [k for k, _ in self.variant if k not in VARIANT_FIELDS]
    if unknown:
      raise ValueError(f"tuned entry: unknown fields {unknown}")
    # One spelling per entry: Config's field order, defaults left out.
    order = list(VARIANT_FIELDS)
    object.__setattr__(self, "variant", tuple(sorted(
        ((k, v) for k, v in self.variant if v != VARIANT_FIELDS[k]),
        key=lambda kv: order.index(kv[0]))))
    Config(1, self.num_warps, self.split, **dict(self.variant))  # validates the fields

  @classmethod
  def of(cls, target: int, config: Config) -> "TableEntry":
    """The entry that makes ``config`` (chosen for ``target`` elements per program)."""
    return cls(target, config.num_warps, config.split,
               tuple((k, getattr(config, k)) for k in VARIANT_FIELDS))

  @classmethod
  def from_json(cls, entry: dict) -> "TableEntry":
    entry = dict(entry)
    launch = {k: entry.pop(k) for k in ("target", "num_warps", "split")}
    return cls(**launch, variant=tuple(entry.items()))

  def to_json(self) -> dict:
    return {"target": self.target, "num_warps": self.num_warps, "split": self.split,
            **dict(self.variant)}

  def config(self, seq_q: int, seq_k: int) -> Config:
    return config_for(seq_q, seq_k, target=self.target, num_warps=self.num_warps,
                      split=self.split, **dict(self.variant))


def heuristic_entry(seq_k: int) -> TableEntry:
  """Without a table: a few thousand elements per program, more warps for long rows."""
  return TableEntry(target=4096, num_warps=4 if next_power_of_2(seq_k) <= 512 else 8,
                    split=True)


def table_entry(table: dict, seq_k: int) -> TableEntry | None:
  """The entry of ``table`` (``{class: entry JSON}``) for rows of ``seq_k`` (a ragged class
  without one takes the aligned class of its padded length); ``None`` without one."""
  entry = table.get(length_class(seq_k)) or table.get(str(next_power_of_2(seq_k)))
  return TableEntry.from_json(entry) if entry else None


def tuned_entry(seq_k: int, device_kind: str | None) -> TableEntry | None:
  """The tables' entry for rows of ``seq_k`` on ``device_kind`` (:func:`table_entry`)."""
  return table_entry(_tuning.table(KERNEL, device_kind or ""), seq_k)


def default_config(seq_q: int, seq_k: int, device_kind: str | None = None) -> Config:
  """The tuned config for this row length on this device, else the heuristic."""
  entry = tuned_entry(seq_k, device_kind) or heuristic_entry(seq_k)
  return entry.config(seq_q, seq_k)
