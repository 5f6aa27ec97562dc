"""Masked softmax -> dropout (fp32): Pallas Triton row kernels.

``pallas_triton.py``: the backward entry point ``masked_softmax_dropout_backward`` and the
op's backward from the scores; ``forward.py``: the fused forward; ``config.py``: the launch
configuration, the tuned table and the heuristic.
"""

from pallas_kernels.masked_softmax_dropout.config import (
    Config,
    TableEntry,
    column_chunks,
    config_for,
    default_config,
    heuristic_entry,
    length_class,
    table_entry,
    tuned_entry,
)
from pallas_kernels.masked_softmax_dropout.pallas_triton import masked_softmax_dropout_backward

__all__ = [
    "Config",
    "TableEntry",
    "column_chunks",
    "config_for",
    "default_config",
    "heuristic_entry",
    "length_class",
    "masked_softmax_dropout_backward",
    "table_entry",
    "tuned_entry",
]
