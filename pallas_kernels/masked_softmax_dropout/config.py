"""Launch configuration of the masked softmax -> dropout backward kernel.

A :class:`Config` says how many rows of one head a program owns and how a row is cut into
power-of-two column chunks. The tuned table (``tuned/<device>/masked_softmax_dropout.json``,
written by ``benchmarks/tune.py``) holds, per row-length class (:func:`length_class`), a
:class:`TableEntry`: the elements per program to aim at, the warps, and whether to split
ragged rows; :meth:`TableEntry.config` turns it into the config for a given ``seq_q``.
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

  The fields below choose how the loads and the store meet the caches, and how work is
  grouped; their defaults are the design the tuned table was measured with.

    stream_cache: cache modifier of the streamed loads (g, P, keep; each byte read once):
      ``None`` (default caching) or ``".cg"`` (L2 only, bypassing L1); ``".ca"`` (all
      levels) is accepted too.
    stream_eviction: L2 eviction policy of the streamed loads: ``"evict_first"`` (default),
      ``"evict_last"``, ``"evict_normal"`` or ``None`` (normal).
    mask_cache: cache modifier of the attention-mask load (``None``, ``".ca"``, ``".cg"``);
      the mask is shared by all heads, so ``".ca"`` may serve the other heads' programs
      from L1.
    mask_eviction: L2 eviction policy of the mask load (``None``: normal).
    mask_after_sum: load the mask after the row sums (two round trips to memory, fewer
      registers live during the reduction) instead of with the streamed loads.
    store_eviction: L2 eviction policy of the output store (``None``: normal;
      ``"evict_first"``: streaming).
    heads_per_program: heads of one (batch entry, row block) per program (the grid's first
      axis is then ``cdiv(H, heads_per_program)``; it is capped at H). The mask tile is
      loaded once per program and used for all its heads.
    row_group: the order of the programs. 0 (default): the heads of one (batch entry, row
      block) run together, so the mask tile they share is read from memory once and from
      L2 by the others. ``k >= 1``: ``k`` consecutive row blocks of one head run before
      the next head's, so concurrent programs read longer contiguous stretches of each
      tensor and the mask tile is reused after ``k`` row blocks (capped at the row blocks
      of a head: then each head's rows run in order, as in a plain one-row-per-program
      launch).
    blocks_per_program: row blocks (of ``block_rows`` rows) one program walks in a loop, in
      the default order (``row_group`` 0). The next block's loads are issued before this
      block's row sums and stores, so that memory stays busy while a block is reduced and
      written (a prefetch in registers: about twice the registers per block).
    chunk: 0 (default): every row whole in registers. A power of two: the rows are walked
      twice in column chunks of this width, once to reduce the row sums and once, reading
      the chunks again from the caches, to write; the streamed loads' hints
      (``stream_cache``, ``stream_eviction``) apply to the first pass, the second reads
      evict-first. Fewer registers per program, so more programs per SM.
    prefetch: with ``blocks_per_program > 1``, issue the next block's loads before this
      block's update (default); False leaves the loop plain, for Triton's pipeliner
      (``num_stages``) to overlap.
    num_stages: Triton's pipelining depth for the kernel's loops (the kernel entry point's
      ``num_stages`` overrides it when given).
    pair_hash: where the kernel draws the keep mask from the key (``_from_key``,
      ``_from_scores``), one hash per pair of columns (both 16-bit halves, interleaved by a
      join and a reshape) instead of one per element: the same mask bit for bit. Off by
      default: on the H200 it made the backward from the scores 9% slower at S=1024 and 4%
      faster at S=4096 (``benchmarks/results/runs/b_forward_b44b81d.log``; S=1024 at the
      heuristic launch, before the tuned table had a 1024 entry).
    warp_rows: one row per program on ``next_power_of_2(seq_k) / 128`` warps
      (:func:`warp_rows_warps`: 1-32, rows of 4096 keys at most; ``num_warps`` must be that),
      each warp owning 128 columns of the row, so that every reduction stays inside a warp.
      The warps' partial row sums meet through a small global buffer (``[rows, 32]`` fp32,
      written, then read back after a barrier) instead of shared memory: the launch uses
      no shared memory at all, and XLA then leaves the L1 / shared-memory split to the
      driver (with shared memory it asks for the largest split, which leaves about 23 KB of
      L1 for the loads in flight on an H200; ``masked_softmax_dropout_design.log``). Needs
      ``block_rows=1``, one head per program, the default order and no chunks; the
      backward from the scores, and arrays of ``2**31`` elements or more, take the row
      kernel at the same warps instead. Off by default: on the H200 it measured slower
      than the tuned table on 15 of the 16 workloads (936-995 against 926 us at
      (4, 4, 4096); ``masked_softmax_dropout_design.log``).
  """
  block_rows: int
  num_warps: int
  split: bool = True
  stream_cache: str | None = None
  stream_eviction: str | None = "evict_first"
  mask_cache: str | None = None
  mask_eviction: str | None = None
  mask_after_sum: bool = False
  store_eviction: str | None = None
  heads_per_program: int = 1
  row_group: int = 0
  blocks_per_program: int = 1
  chunk: int = 0
  prefetch: bool = True
  num_stages: int = 1
  pair_hash: bool = False
  warp_rows: bool = False

  def __post_init__(self):
    r = self.block_rows
    if not isinstance(r, int) or isinstance(r, bool) or r < 1 or r & (r - 1):
      raise ValueError(f"config.block_rows: expected a power of two >= 1, got {r!r}")
    if self.num_warps not in NUM_WARPS or isinstance(self.num_warps, bool):
      raise ValueError(
          f"config.num_warps: expected 1, 2, 4, 8, 16 or 32, got {self.num_warps!r}")
    for name in ("split", "mask_after_sum", "prefetch", "pair_hash", "warp_rows"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"config.{name}: expected a bool, got {getattr(self, name)!r}")
    for name in ("stream_cache", "mask_cache"):
      if getattr(self, name) not in CACHE_MODIFIERS:
        raise ValueError(f"config.{name}: expected one of {CACHE_MODIFIERS}, "
                         f"got {getattr(self, name)!r}")
    for name in ("stream_eviction", "mask_eviction", "store_eviction"):
      if getattr(self, name) not in EVICTION_POLICIES:
        raise ValueError(f"config.{name}: expected one of {EVICTION_POLICIES}, "
                         f"got {getattr(self, name)!r}")
    for cache, evict in (("stream_cache", "stream_eviction"), ("mask_cache", "mask_eviction")):
      if getattr(self, cache) is not None and getattr(self, evict) is not None:
        # ptxas refuses the pair ("Modifier '.evict_first' cannot be combined with '.cg'").
        raise ValueError(f"config.{cache}={getattr(self, cache)!r} cannot be combined with "
                         f"config.{evict}={getattr(self, evict)!r}: set {evict}=None")
    for name, least in (("heads_per_program", 1), ("row_group", 0), ("blocks_per_program", 1),
                        ("num_stages", 1)):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise ValueError(f"config.{name}: expected an int >= {least}, got {v!r}")
    n, k = self.blocks_per_program, self.row_group
    if n > 1 and k:
      raise ValueError(f"config.blocks_per_program={n} needs config.row_group=0 (the default "
                       f"order), got row_group={k}")
    w = self.chunk
    if not isinstance(w, int) or isinstance(w, bool) or w < 0 or w & (w - 1):
      raise ValueError(f"config.chunk: expected 0 or a power of two, got {w!r}")
    if w and n > 1:
      raise ValueError(f"config.chunk={w} cannot be combined with "
                       f"config.blocks_per_program={n}")

    if self.warp_rows:
      wrong = [f"{name}={getattr(self, name)!r}" for name, want in
               (("block_rows", 1), ("heads_per_program", 1), ("row_group", 0),
                ("blocks_per_program", 1), ("chunk", 0)) if getattr(self, name) != want]
      if wrong:
        raise ValueError(f"config.warp_rows needs one row of one head per program in the "
                         f"default order without chunks (block_rows=1, heads_per_program=1, "
                         f"row_group=0, blocks_per_program=1, chunk=0), got {', '.join(wrong)}")

  @property
  def uses_cache_modifiers(self) -> bool:
    return self.stream_cache is not None or self.mask_cache is not None


# The fields of Config after the launch shape (block_rows, num_warps, split), with defaults.
VARIANT_FIELDS = {f.name: f.default for f in dataclasses.fields(Config)[3:]}


# Columns per warp of a ``warp_rows`` program: 4 elements per thread, so that the fp32 tiles
# and the 1-byte masks take the same register layout (one 128-column segment per warp).
SEGMENT = 128
MAX_WARP_ROWS = 32  # warps per program: rows of up to 4096 keys


def warp_rows_warps(seq_k: int) -> int:
  """The warps of a ``warp_rows`` program for rows of ``seq_k`` keys: one per 128 columns
  of the padded row (1 for rows of <= 128 keys)."""
  return max(1, next_power_of_2(seq_k) // SEGMENT)


def column_chunks(seq_k: int, split: bool) -> tuple[tuple[int, int], ...]:
  """``(start, width)`` power-of-two column chunks that cover a row of ``seq_k``."""
  if not split or seq_k & (seq_k - 1) == 0:
    return ((0, next_power_of_2(seq_k)),)
  main = 1 << (seq_k.bit_length() - 1)
  return ((0, main), (main, next_power_of_2(seq_k - main)))


def config_for(seq_q: int, seq_k: int, *, target: int, num_warps: int, split: bool,
               **variant) -> Config:
  """About ``target`` elements per program: many short rows or one long one (the block
  rows are the largest power of two that fits, at least 1, at most the padded ``seq_q``;
  with ``heads_per_program`` heads in a program, each takes its share). ``variant``: the
  other :class:`Config` fields."""
  width = sum(w for _, w in column_chunks(seq_k, split))
  width *= variant.get("heads_per_program", 1)
  cap = max(1, min(target // width, next_power_of_2(seq_q)))
  return Config(1 << (cap.bit_length() - 1), num_warps, split, **variant)


def length_class(seq_k: int) -> str:
  """The tuning table's key for rows of ``seq_k``: the padded length, and whether it is padded.

  Rows whose length is not a power of two are split or padded and their loads cannot be
  vectorised (odd strides), so they are tuned apart from the aligned ones.
  """
  width = next_power_of_2(seq_k)
  return str(width) if width == seq_k else f"{width}-ragged"


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


def tuned_entry(seq_k: int, device_kind: str | None) -> TableEntry | None:
  """The table's entry for rows of ``seq_k`` on ``device_kind`` (a ragged class without
  one takes the aligned class of its padded length); ``None`` without one."""
  table = _tuning.table(KERNEL, device_kind or "")
  entry = table.get(length_class(seq_k)) or table.get(str(next_power_of_2(seq_k)))
  return TableEntry.from_json(entry) if entry else None


def default_config(seq_q: int, seq_k: int, device_kind: str | None = None) -> Config:
  """The tuned config for this row length on this device, else the heuristic."""
  entry = tuned_entry(seq_k, device_kind) or heuristic_entry(seq_k)
  return entry.config(seq_q, seq_k)
