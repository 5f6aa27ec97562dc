"""The Mosaic GPU entry points (Hopper, sm_90a) of the softmax -> dropout -> GQA P·V backward.

Same math as :mod:`.pallas_triton`; the kernels are in :mod:`.mosaic_gpu_kernels`. From P
and Pd (:func:`attention_softmax_dropout_value_backward`): rows of 128 keys run the dS-dV
kernel alone, computing delta itself (6 B per attention element: P, Pd, dS); rows of 256
keys run it as clusters of two programs exchanging their parts of delta (6 B); longer rows
run the delta kernel (Pd, 2 B) and then the dS-dV kernel (8 B in all). From the forward's
fp32 output (:func:`backward_from_output`): ``delta = rowsum(dO * O)`` in XLA and the dS-dV
kernel drawing keep again from the key's seeds and rebuilding Pd from P (4 B: P, dS).

Supported (:func:`unsupported_reason` says why not otherwise): bf16 or fp16, ``D`` of 64
or 128, ``seq_q % 64 == 0``, ``seq_k % 128 == 0``, ``(G * seq_q) % 128 == 0`` (not
needed at ``seq_k`` of 128 or 256), a static dropout rate, no causal mask.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import _dropout, _mosaic, validation
from pallas_kernels.attention_softmax_dropout_value.mosaic_gpu_kernels import (
    KEYS, ROWS, SMS, WGS, delta_pass, ds_dv_pass)
from pallas_kernels.attention_softmax_dropout_value.pallas_triton_from_delta import (
    delta_from_output)

__all__ = ["Config", "default_config", "unsupported_reason", "takes_output",
           "attention_softmax_dropout_value_backward", "backward_from_output",
           "keep_seeds_of", "delta_pass", "ds_dv_pass"]


def unsupported_reason(b, h, kvh, sq, skv, d, dtype, p_static, causal) -> str | None:
  """Why these kernels cannot run a problem (``None``: they can). ``p_static`` is the
  dropout rate as a float, ``None`` when traced."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype)} (bfloat16 or float16 only)"
  if d not in (64, 128):
    return f"head dim {d} (64 or 128 only)"
  if sq % ROWS:
    return f"seq_q {sq} (a multiple of {ROWS} only)"
  if skv % (WGS * KEYS):
    return f"seq_k {skv} (a multiple of {WGS * KEYS} only)"
  g = h // kvh
  if skv not in (WGS * KEYS, 2 * WGS * KEYS) and (g * sq) % (WGS * ROWS):
    # the delta kernel's row blocks (rows of 128 or 256 keys need no delta kernel)
    return (f"G * seq_q = {g * sq} (a multiple of {WGS * ROWS} only, unless seq_k is "
            f"{WGS * KEYS} or {2 * WGS * KEYS})")
  if p_static is None:
    return "a traced dropout rate (static rates only)"
  if causal:
    return "a causal mask"
  return None


def takes_output(seq_k: int) -> bool:
  """Whether :func:`backward_from_output` takes rows of ``seq_k`` keys: more than one key
  block (rows of one block compute delta from P and Pd in the dS-dV kernel instead)."""
  return seq_k > WGS * KEYS


@dataclasses.dataclass(frozen=True)
class Config:
  """Pipeline depths and sharing of the kernels.

  ``delta_block_k``: keys per step of the delta kernel (64 or 128).
  ``delta_stages`` / ``stages``: TMA ring depth of the delta / dS-dV kernel (2 to 8).
  ``rebuild_stages``: ring depth of the dS-dV kernel drawing keep from the seeds (3 to 8:
  each step's dV GEMM is waited for in the next, holding a slot a step longer).
  Not every combination fits the 227 KB of shared memory (at D = 128 the dS-dV kernel at
  most 3 stages); the Mosaic GPU compiler refuses the others with the bytes they need.
  ``split``: programs sharing each key block's rows in the dS-dV kernel (an int >= 1 or
  ``"auto"``: enough for one wave on launches of under half a wave).
  """
  delta_block_k: int = 128
  delta_stages: int = 2
  stages: int = 2
  rebuild_stages: int = 3
  split: int | str = "auto"

  def __post_init__(self):
    if self.delta_block_k not in (64, 128):
      raise ValueError(f"config.delta_block_k: expected one of (64, 128), got "
                       f"{self.delta_block_k!r}")
    # At least 2: with one slot the pipeline refills the slot a consumer still reads.
    for name, low in (("delta_stages", 2), ("stages", 2), ("rebuild_stages", 3)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= 8:
        raise ValueError(f"config.{name}: expected an int in [{low}, 8], got {v!r}")
    if self.split != "auto" and (isinstance(self.split, bool) or not isinstance(self.split, int)
                                 or self.split < 1):
      raise ValueError(f"config.split: expected 'auto' or an int >= 1, got {self.split!r}")


def default_config() -> Config:
  """The kernels' config: the same for every shape."""
  return Config()


def resolve_split(split, b, kvh, skv, row_tiles, sms=SMS) -> int:
  """``split`` of a launch: ``"auto"`` doubles it while the programs fill at most half the
  ``sms`` SMs and each share keeps >= 4 row tiles."""
  if split != "auto":
    if row_tiles % split:
      raise ValueError(f"config.split={split} must divide the {row_tiles} row tiles of a "
                       f"kv group (G * seq_q / {ROWS})")
    return split
  programs = b * kvh * (skv // (WGS * KEYS))
  split = 1
  while (2 * programs * split <= sms and row_tiles % (2 * split) == 0
         and row_tiles // (2 * split) >= 4):
    split *= 2
  return split


def attention_softmax_dropout_value_backward(
    grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
    attention_dropout, *, config: Config | None = None, causal=False, interpret=False):
  """Backward of ``O = transpose(dropout(P) @ V)`` with GQA, on the Mosaic GPU kernels.

  Same arguments and results as the Triton entry point
  (:func:`pallas_kernels.attention_softmax_dropout_value.pallas_triton.attention_softmax_dropout_value_backward`):
  dO ``[B, seq_q, H, D]``; P, Pd, keep ``[B, H, seq_q, seq_k]``; V ``[B, KVH, seq_k, D]``;
  returns ``(grad_attn_scores [B, H, seq_q, seq_k], grad_value_states [B, KVH, seq_k, D])``.
  ``dropout_mask`` is checked but not read (the precondition: ``keep == (Pd != 0)``).

  Raises ``ValueError`` for a problem outside :func:`unsupported_reason`'s limits, and off
  a Hopper GPU unless ``interpret`` (the Mosaic GPU interpreter, any machine).
  ``config``: :class:`Config` (default :func:`default_config`).
  """
  args = (grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
          attention_dropout)
  p = validation.check_attention_softmax_dropout_value(*args)
  b, h, sq, skv = attn_weights.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  validation.check_causal(causal, sq, skv, every_row_has_keys=False)
  why = unsupported_reason(b, h, kvh, sq, skv, d, attn_weights.dtype, p, causal)
  if why:
    raise ValueError(f"attention_softmax_dropout_value_backward (mosaic_gpu): {why}; the "
                     "Triton kernels take every shape")
  _mosaic.check_hopper("attention_softmax_dropout_value_backward", interpret, *args[:4])
  if config is not None and not isinstance(config, Config):
    raise TypeError(f"config: expected a pallas_mosaic_gpu.Config, got {type(config).__name__}")
  config = config or default_config()
  sms = _mosaic.sm_count(interpret, *args[:4])
  g = h // kvh
  groups = lambda x: x.reshape(b, kvh, g * sq, skv)
  pd_groups = groups(attn_weights_dropped)
  if skv in (WGS * KEYS, 2 * WGS * KEYS):
    delta = None            # the dS-dV kernel (or its cluster) computes delta itself
  else:
    delta = delta_pass(grad_attn_output, pd_groups, value_states,
                       block_k=config.delta_block_k, stages=config.delta_stages,
                       programs=sms, interpret=interpret)
  split = resolve_split(config.split, b, kvh, skv, g * sq // ROWS, sms)
  ds, dv = ds_dv_pass(grad_attn_output, groups(attn_weights), pd_groups, delta, value_states,
                      rate=p, stages=config.stages, split=split, interpret=interpret)
  return ds.reshape(b, h, sq, skv), dv


def keep_seeds_of(dropout_rng, rate):
  """``[k0, k1, threshold, 0]`` uint32: what the dS-dV kernel draws keep from
  (``ds_dv_pass(keep_seeds=...)``), the mask of ``jax_ops.dropout_keep_mask(dropout_rng,
  rate, ...)`` (``rate`` a float)."""
  if dropout_rng is None:
    raise ValueError("dropout_rng: the keep seeds need a PRNG key")
  return jnp.concatenate([_dropout.seeds(dropout_rng, rate), jnp.zeros((1,), jnp.uint32)])


def backward_from_output(grad_attn_output, attn_weights, value_states, dropout_mask,
                         attention_dropout, attn_output_f32, *, keep_seeds=None,
                         row_scale=None, config: Config | None = None, interpret=False):
  """:func:`attention_softmax_dropout_value_backward` given the forward's fp32 output O
  ``[B, seq_q, H, D]`` instead of Pd: ``delta = rowsum(dO * O)`` (no delta kernel) and the
  dS-dV kernel drawing keep again from the key's seeds (``keep_seeds``,
  :func:`keep_seeds_of` of the forward's key and rate; needed for a rate > 0) and rebuilding
  Pd from P: it reads P (2 B) and writes dS (2 B) per element. ``dropout_mask`` is checked
  but not read (a ``jax.ShapeDtypeStruct`` will do). Rows of more than one key block
  (:func:`takes_output`). Returns ``(grad_attn_scores, grad_value_states)``.

  ``row_scale`` (``[B, H, seq_k / 64, seq_q]`` fp32, a scale per row and 64 keys):
  ``attn_weights`` is the unnormalized ``E`` (fp16, ``[B, H, seq_q, seq_k]``) of
  :func:`.forward.attention_softmax_dropout_value_forward_unnormalized` and
  ``P[..., q, k] = E[..., q, k] * row_scale[..., k // 64, q]`` (in fp32, in the kernel).
  """
  weights = attn_weights
  if row_scale is not None:   # E's dtype checked here; its shape below, as P's
    validation.check_array("attn_weights", attn_weights, ("B", "H", "Sq", "Skv"),
                           dtypes=(jnp.float16,))
    weights = jax.ShapeDtypeStruct(attn_weights.shape, value_states.dtype)
  p = validation.check_attention_softmax_dropout_value(
      grad_attn_output, weights, weights, value_states, dropout_mask, attention_dropout)
  b, h, sq, skv = attn_weights.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  why = unsupported_reason(b, h, kvh, sq, skv, d, value_states.dtype, p, False)
  if why is None and not takes_output(skv):
    why = f"seq_k {skv} (from the output: more than {WGS * KEYS} keys only)"
  if why:
    raise ValueError(f"attention_softmax_dropout_value backward_from_output (mosaic_gpu): "
                     f"{why}")
  validation.check_array("attn_output_f32", attn_output_f32, ("B", "Sq", "H", "D"),
                         (b, sq, h, d), dtypes=(jnp.float32,))
  if row_scale is not None:
    validation.check_array("row_scale", row_scale, ("B", "H", "Skv / 64", "Sq"),
                           (b, h, skv // 64, sq), dtypes=(jnp.float32,))
  if p != 0:
    if keep_seeds is None:
      raise ValueError("keep_seeds: needed for a dropout rate > 0 (keep_seeds_of)")
    validation.check_array("keep_seeds", keep_seeds, ("4",), (4,), dtypes=(jnp.uint32,))
  _mosaic.check_hopper("attention_softmax_dropout_value backward_from_output", interpret,
                       grad_attn_output, attn_weights, value_states)
  if config is not None and not isinstance(config, Config):
    raise TypeError(f"config: expected a pallas_mosaic_gpu.Config, got {type(config).__name__}")
  config = config or default_config()
  g = h // kvh
  delta = delta_from_output(grad_attn_output, attn_output_f32).reshape(b, kvh, g * sq)
  split = resolve_split(config.split, b, kvh, skv, g * sq // ROWS,
                        _mosaic.sm_count(interpret, grad_attn_output, attn_weights,
                                         value_states))
  p_groups = attn_weights.reshape(b, kvh, g * sq, skv)
  rebuild = p != 0 or row_scale is not None
  ds, dv = ds_dv_pass(grad_attn_output, p_groups, p_groups, delta, value_states, rate=p,
                      stages=config.rebuild_stages if rebuild else config.stages, split=split,
                      keep_seeds=keep_seeds if p != 0 else None, row_scale=row_scale,
                      interpret=interpret)
  return ds.reshape(b, h, sq, skv), dv
