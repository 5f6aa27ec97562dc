"""Backward of softmax -> dropout -> GQA value matmul (``attention_softmax_dropout_value``).

Entry points: :func:`attention_softmax_dropout_value_backward` (from P, Pd and keep;
:mod:`.dispatch` runs the Mosaic GPU kernels of :mod:`.pallas_mosaic_gpu` on a Hopper GPU
where they take the problem, else the Pallas Triton kernels of :mod:`.pallas_triton`) and
:func:`attention_softmax_dropout_value_backward_from_delta` (Triton, one kernel, from P,
keep and the row sums ``delta``, :func:`delta_from_output`; :mod:`.pallas_triton_from_delta`). The op's fused forward:
:mod:`.forward`. Triton launch configurations: :mod:`.config`.
"""

from pallas_kernels.attention_softmax_dropout_value.config import (
    Config,
    PassConfig,
    default_config,
    default_from_delta_config,
    group_heads,
    heuristic,
    length_class,
    use_phased,
)
from pallas_kernels.attention_softmax_dropout_value.dispatch import (
    attention_softmax_dropout_value_backward,
    kernels_for,
)
from pallas_kernels.attention_softmax_dropout_value.pallas_triton import ds_pass, dv_pass
from pallas_kernels.attention_softmax_dropout_value.pallas_triton_from_delta import (
    attention_softmax_dropout_value_backward_from_delta,
    delta_from_output,
    ds_dv_pass,
)

__all__ = [
    "attention_softmax_dropout_value_backward",
    "attention_softmax_dropout_value_backward_from_delta",
    "kernels_for",
    "delta_from_output",
    "Config",
    "PassConfig",
    "default_config",
    "default_from_delta_config",
    "heuristic",
    "length_class",
    "group_heads",
    "use_phased",
    "dv_pass",
    "ds_pass",
    "ds_dv_pass",
]
