"""The kernel dispatch of the attention softmax-dropout-value backward: the Mosaic GPU kernels
(:mod:`.pallas_mosaic_gpu`) on a Hopper GPU for the problems they take, the Triton kernels
(:mod:`.pallas_triton`) everywhere else; and what the op saves for the Mosaic GPU kernels."""

from __future__ import annotations

import jax

from pallas_kernels import validation
from pallas_kernels._util import device_of, is_hopper
from pallas_kernels.attention_softmax_dropout_value import forward, pallas_mosaic_gpu, pallas_triton

MOSAIC_GPU = "mosaic_gpu"
TRITON = "triton"
IMPLEMENTATIONS = (MOSAIC_GPU, TRITON)

# Residual policies (the names of ``jax_ops.backend``): what the op's forward saves.
INPUTS, OUTPUT, FUSED_INPUTS, FUSED_OUTPUT = "inputs", "output", "fused_inputs", "fused_output"
# The Triton kernels take delta from the saved output on rows of at least this many keys.
FROM_OUTPUT_MIN_KEYS = 512

mosaic_gpu_reason = pallas_mosaic_gpu.unsupported_reason


def mosaic_gpu_residuals(b, h, kvh, sq, skv, d) -> str:
  """What the op's forward saves for the Mosaic GPU kernels: ``"fused_output"`` (the
  unnormalized softmax and its scales, the fp32 output and the key's seeds, for
  :func:`pallas_mosaic_gpu.backward_from_output`) on rows of
  more than one key block, ``"fused_inputs"`` (P and Pd, for the one-key-block kernel, which
  computes delta from them) on rows of one, and ``"inputs"`` (the jnp forward) past the fused
  forward kernel's int32 offsets."""
  if not forward.takes(b, h, kvh, sq, skv, d):
    return INPUTS
  return FUSED_OUTPUT if pallas_mosaic_gpu.takes_output(skv) else FUSED_INPUTS


def triton_residuals(b, h, kvh, sq, skv, d) -> str:
  """What the op's forward saves for the Triton kernels. On rows of at least
  :data:`FROM_OUTPUT_MIN_KEYS` keys that are a multiple of 8 (16-byte aligned in bf16), with
  ``D <= 128`` and ``B * Sq * H * D < 2**31`` (the from-delta kernel's int32 offsets into
  dO): P, keep and the fp32 output O instead of Pd, for the one kernel that takes
  ``delta = rowsum(dO * O)``: ``"fused_output"`` where the fused forward kernel's int32
  offsets reach the scores (:func:`forward.takes`), else ``"output"`` (the jnp forward).
  Shorter rows, where delta's ``O(Sq * D)`` pass costs what the dropped Pd saves, and
  unaligned rows, which that kernel loads element by element: ``"inputs"`` (Pd saved, the
  two-kernel backward)."""
  if skv >= FROM_OUTPUT_MIN_KEYS and skv % 8 == 0 and d <= 128 and b * sq * h * d < 2**31:
    return FUSED_OUTPUT if forward.takes(b, h, kvh, sq, skv, d) else OUTPUT
  return INPUTS


def residuals_at_rate(policy: str, rate_static: float | None) -> str:
  """The residual policy for a call's dropout rate: ``"fused_inputs"`` needs a concrete
  rate (the kernels take it as a constant); a traced one gets ``"inputs"`` (the kernels
  that read keep, which the jnp forward draws)."""
  return INPUTS if policy == FUSED_INPUTS and rate_static is None else policy


def kernels_for(grad_attn_output, attn_weights, attn_weights_dropped, value_states,
                dropout_mask, attention_dropout, *, causal=False, interpret=False) -> str:
  """``"mosaic_gpu"`` or ``"triton"``: the kernels that ``implementation=None`` runs.

  The Mosaic GPU kernels on a Hopper GPU where :func:`mosaic_gpu_reason` allows the problem;
  the Triton kernels otherwise, and always under ``interpret=True`` (the portable path; name
  ``"mosaic_gpu"`` to run the Mosaic GPU interpreter).
  """
  validation.check_attention_softmax_dropout_value(
      grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
      attention_dropout)
  return _pick(attn_weights, value_states, attention_dropout, grad_attn_output,
               causal=causal, interpret=interpret)


def _pick(attn_weights, value_states, attention_dropout, *arrays, causal, interpret) -> str:
  """:func:`kernels_for` without the argument checks, which the chosen entry point makes
  (arrays of another rank go to the Triton entry point, whose checks name them)."""
  if interpret or not is_hopper(device_of(*arrays, attn_weights, value_states)):
    return TRITON
  if (getattr(attn_weights, "ndim", None) != 4 or getattr(value_states, "ndim", None) != 4
      or value_states.shape[1] < 1):
    return TRITON
  p = validation.concrete_float("attention_dropout", attention_dropout)
  b, h, sq, skv = attn_weights.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  why = mosaic_gpu_reason(b, h, kvh, sq, skv, d, attn_weights.dtype, p, causal)
  return TRITON if why else MOSAIC_GPU


def attention_softmax_dropout_value_backward(
    grad_attn_output: jax.typing.ArrayLike, attn_weights: jax.typing.ArrayLike,
    attn_weights_dropped: jax.typing.ArrayLike, value_states: jax.typing.ArrayLike,
    dropout_mask: jax.typing.ArrayLike | None, attention_dropout: float | jax.typing.ArrayLike,
    *, implementation: str | None = None,
    config: pallas_mosaic_gpu.Config | pallas_triton.Config | None = None, causal: bool = False,
    interpret: bool = False, **triton_options) -> tuple[jax.Array, jax.Array]:
  """Backward of ``O = transpose(dropout(P) @ V)`` with GQA: the kernel entry point.

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
    **triton_options: the Triton entry point's other keywords (``block_q``, ``block_k``,
      ``num_warps``, ``num_stages``); they select the Triton kernels.

  Returns:
    ``(grad_attn_scores [B, H, seq_q, seq_k], grad_value_states [B, KVH, seq_k, D])`` in
    the inputs' dtype (bf16 is the target; fp16 and fp32 work, fp32 on Triton).
  """
  arrays = validation.as_jax(grad_attn_output, attn_weights, attn_weights_dropped,
                             value_states, dropout_mask)
  grad_attn_output, attn_weights, _, value_states, _ = arrays
  args = (*arrays, attention_dropout)
  if implementation is None:
    if isinstance(config, pallas_mosaic_gpu.Config):
      implementation = MOSAIC_GPU
    elif config is not None or any(v is not None for v in triton_options.values()):
      implementation = TRITON
    else:   # the chosen entry point checks the arguments
      implementation = _pick(attn_weights, value_states, attention_dropout, grad_attn_output,
                             causal=causal, interpret=interpret)
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
