"""The backward of ``softmax((Q @ K^T) * scaling)`` to ``Q`` and ``K``: Pallas Triton kernels.

``dispatch.py``: the entry point :func:`qk_scale_softmax_backward` (the Mosaic GPU kernel of
``pallas_mosaic_gpu.py`` on a Hopper GPU where it takes the problem, the Pallas Triton
kernels of ``pallas_triton.py`` elsewhere); ``config.py``: the Triton launch configurations
(dataclasses, heuristic, tuned table).
"""

from pallas_kernels.qk_scale_softmax.config import (
    DL_GEMM,
    DL_TUNED_MAX_ROW,
    MAX_DL_ELEMENTS,
    MAX_DL_ROW,
    MAX_PER_HEAD_ROW,
    SCHEMES,
    WHOLE_ROW,
    Config,
    DlConfig,
    PassConfig,
    default_config,
    default_dl_config,
    dl_config,
    dl_width,
    heuristic,
    length_class,
    pass_config,
    table_entry,
)
from pallas_kernels.qk_scale_softmax.dispatch import kernels_for, qk_scale_softmax_backward
from pallas_kernels.qk_scale_softmax.pallas_triton import (
    col_pass,
    dl_gemm,
    dl_gemms,
    dl_pass,
    head_pass,
    row_pass,
    use_phased,
)

__all__ = [
    "qk_scale_softmax_backward",
    "kernels_for",
    "Config",
    "DlConfig",
    "PassConfig",
    "SCHEMES",
    "MAX_DL_ROW",
    "MAX_DL_ELEMENTS",
    "DL_TUNED_MAX_ROW",
    "DL_GEMM",
    "MAX_PER_HEAD_ROW",
    "WHOLE_ROW",
    "default_config",
    "default_dl_config",
    "dl_config",
    "dl_width",
    "heuristic",
    "length_class",
    "pass_config",
    "table_entry",
    "row_pass",
    "col_pass",
    "head_pass",
    "dl_pass",
    "dl_gemm",
    "dl_gemms",
    "use_phased",
]
