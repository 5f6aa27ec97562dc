"""Masked softmax -> dropout backward (fp32): a Pallas Triton row kernel.

``masked_softmax_dropout_backward`` is the entry point (``pallas_triton.py``); its launch
configuration, the tuned table's entries and the default for a device are in ``config.py``.
``forward.py`` has the fused forward (masked fill, softmax and dropout in one kernel, the mask
drawn in the kernel); it and ``pallas_triton.masked_softmax_dropout_backward_from_scores`` (P
recomputed from the scores, the mask redrawn from the key) are op B's Triton path
(``jax_ops.ops.masked_softmax_dropout``), and ``masked_softmax_dropout_backward_from_key`` (P read) its
``"key"`` residual policy's.
"""

from pallas_kernels.masked_softmax_dropout.config import (
    Config,
    TableEntry,
    column_chunks,
    config_for,
    default_config,
    heuristic_entry,
    length_class,
    tuned_entry,
    warp_rows_warps,
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
    "tuned_entry",
    "warp_rows_warps",
]
