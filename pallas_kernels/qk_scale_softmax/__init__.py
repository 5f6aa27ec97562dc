"""The qk_scale_softmax kernels: the backward of ``softmax((Q @ K^T) * scaling)`` to ``Q`` and
``K``, and the fused forward.

``dispatch.py``: the entry points :func:`qk_scale_softmax_backward` and
:func:`qk_scale_softmax_forward` and the rule that picks their kernels (the Mosaic GPU
kernels of ``pallas_mosaic_gpu.py`` and ``forward_mosaic_gpu.py`` on a Hopper GPU where they
take the problem, the Pallas Triton kernels elsewhere); ``pallas_triton.py``: the Triton
backward's entry point, over the schemes ``two_pass.py``, ``per_head.py`` and
``dl_gemm.py``; ``forward.py``: the Triton forward; ``config.py``: the Triton launch
configurations (dataclasses, heuristic, tuned table).
"""

from pallas_kernels.qk_scale_softmax.config import (
    DL_GEMM,
    DL_GEMM_CAUSAL_FROM,
    DL_GEMM_CAUSAL_LARGE,
    DL_GEMM_DENSE_FROM,
    DL_GEMM_DENSE_LARGE,
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
    dl_gemm_tiles,
    dl_width,
    heuristic,
    length_class,
    pass_config,
    table_entry,
)
from pallas_kernels.qk_scale_softmax.dispatch import (forward_kernel_for, kernels_for,
                                                      qk_scale_softmax_backward,
                                                      qk_scale_softmax_forward)
from pallas_kernels.qk_scale_softmax.dl_gemm import dl_gemms, dl_pass
from pallas_kernels.qk_scale_softmax.forward import ForwardConfig, forward_config
from pallas_kernels.qk_scale_softmax.per_head import head_pass
from pallas_kernels.qk_scale_softmax.two_pass import col_pass, row_pass, use_phased

__all__ = [
    "qk_scale_softmax_backward",
    "qk_scale_softmax_forward",
    "kernels_for",
    "forward_kernel_for",
    "Config",
    "DlConfig",
    "PassConfig",
    "ForwardConfig",
    "forward_config",
    "SCHEMES",
    "MAX_DL_ROW",
    "MAX_DL_ELEMENTS",
    "DL_TUNED_MAX_ROW",
    "DL_GEMM",
    "DL_GEMM_DENSE_FROM",
    "DL_GEMM_CAUSAL_FROM",
    "DL_GEMM_DENSE_LARGE",
    "DL_GEMM_CAUSAL_LARGE",
    "MAX_PER_HEAD_ROW",
    "WHOLE_ROW",
    "default_config",
    "default_dl_config",
    "dl_config",
    "dl_gemm_tiles",
    "dl_width",
    "heuristic",
    "length_class",
    "pass_config",
    "table_entry",
    "row_pass",
    "col_pass",
    "head_pass",
    "dl_pass",
    "dl_gemms",
    "use_phased",
]
