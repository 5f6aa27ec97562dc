"""The kernel entry point of the attention softmax-dropout-value backward: it picks the
Mosaic GPU kernels (:mod:`.pallas_mosaic_gpu`) on a Hopper GPU for the problems they take,
and the Triton kernels (:mod:`.pallas_triton`) everywhere else."""

from __future__ import annotations

from pallas_kernels import validation
from pallas_kernels._util import device_of, is_hopper
from pallas_kernels.attention_softmax_dropout_value import pallas_mosaic_gpu, pallas_triton

MOSAIC_GPU = "mosaic_gpu"
TRITON = "triton"
IMPLEMENTATIONS = (MOSAIC_GPU, TRITON)


def kernels_for(grad_attn_output, attn_weights, attn_weights_dropped, value_states,
                dropout_mask, attention_dropout, *, causal=False, interpret=False) -> str:
  """``"mosaic_gpu"`` or ``"triton"``: the kernels that ``implementation=None`` runs.

  The Mosaic GPU kernels on a Hopper GPU (they are measured faster there on every problem
  they take: ``benchmarks/results/attention_softmax_dropout_value.md``) when
  :func:`pallas_mosaic_gpu.unsupported_reason` allows the problem; the Triton kernels
  otherwise, and always under ``interpret=True`` (the portable path; name
  ``"mosaic_gpu"`` to run the Mosaic GPU interpreter).
  """
  p = validation.check_problem_a(grad_attn_output, attn_weights, attn_weights_dropped,
                                 value_states, dropout_mask, attention_dropout)
  if interpret:
    return TRITON
  if not is_hopper(device_of(grad_attn_output, attn_weights, value_states)):
    return TRITON
  b, h, sq, skv = attn_weights.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  why = pallas_mosaic_gpu.unsupported_reason(b, h, kvh, sq, skv, d, attn_weights.dtype, p,
                                             causal)
  return TRITON if why else MOSAIC_GPU


def attention_softmax_dropout_value_backward(
    grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
    attention_dropout, *, implementation: str | None = None, config=None, causal=False,
    interpret=False, **triton_options):
  """Backward of ``O = transpose(dropout(P) @ V)`` with GQA (problem A's kernel entry point).

  Args:
    grad_attn_output: dO ``[B, seq_q, H, D]``.
    attn_weights: P ``[B, H, seq_q, seq_k]``.
    attn_weights_dropped: Pd ``[B, H, seq_q, seq_k]``, ``== round(P * keep / (1 - p))``
      (the precondition every real forward meets; the kernels rely on it).
    value_states: V ``[B, KVH, seq_k, D]``, ``H % KVH == 0``.
    dropout_mask: keep ``[B, H, seq_q, seq_k]`` bool, True = kept.
    attention_dropout: the rate p in [0, 1): a Python float, or a traced scalar (Triton).
    implementation: ``None`` (:func:`kernels_for`), ``"mosaic_gpu"`` or ``"triton"``.
    config: the chosen kernels' config (``pallas_mosaic_gpu.Config`` or the Triton
      ``Config``); by default theirs.
    causal: P is zero above the diagonal (accepted; the dense math handles it).
    interpret: run in the Pallas interpreter (any machine).
    **triton_options: the Triton entry point's other keywords (``delta``, ``block_q``,
      ``block_k``, ``num_warps``, ``num_stages``); they select the Triton kernels.

  Returns:
    ``(grad_attn_scores [B, H, seq_q, seq_k], grad_value_states [B, KVH, seq_k, D])`` in
    the inputs' dtype (bf16 is the target; fp16 and fp32 work, fp32 on Triton).
  """
  args = (grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
          attention_dropout)
  if implementation is None:
    if isinstance(config, pallas_mosaic_gpu.Config):
      implementation = MOSAIC_GPU
    elif config is not None or any(v is not None for v in triton_options.values()):
      implementation = TRITON
    else:
      implementation = kernels_for(*args, causal=causal, interpret=interpret)
  if implementation == MOSAIC_GPU:
    if any(v is not None for v in triton_options.values()):
      raise TypeError("implementation='mosaic_gpu' takes no Triton options, got "
                      f"{sorted(k for k, v in triton_options.items() if v is not None)}")
    return pallas_mosaic_gpu.attention_softmax_dropout_value_backward(
        *args, config=config, causal=causal, interpret=interpret)
  if implementation == TRITON:
    return pallas_triton.attention_softmax_dropout_value_backward(
        *args, config=config, causal=causal, interpret=interpret, **triton_options)
  raise ValueError(f"implementation: expected None or one of {IMPLEMENTATIONS}, got "
                   f"{implementation!r}")
