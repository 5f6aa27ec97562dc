"""The backward of ``softmax((Q @ K^T) * scaling)`` to ``Q`` and ``K``: Pallas Triton kernels.

``config.py``: the launch configurations (dataclasses, heuristic, tuned table);
``pallas_triton.py``: the kernels, their passes and the entry point.
"""

from pallas_kernels.qk_scale_softmax.config import (
    SCHEMES,
    WHOLE_ROW,
    Config,
    PassConfig,
    default_config,
    heuristic,
    length_class,
    pass_config,
    table_entry,
)
from pallas_kernels.qk_scale_softmax.pallas_triton import (
    col_pass,
    head_pass,
    qk_scale_softmax_backward,
    row_pass,
    use_phased,
)

__all__ = [
    "qk_scale_softmax_backward",
    "Config",
    "PassConfig",
    "SCHEMES",
    "WHOLE_ROW",
    "default_config",
    "heuristic",
    "length_class",
    "pass_config",
    "table_entry",
    "row_pass",
    "col_pass",
    "head_pass",
    "use_phased",
]
