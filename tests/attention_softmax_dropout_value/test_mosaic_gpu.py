"""The Mosaic GPU kernels of the op's backward (``pallas_mosaic_gpu``): numbers against the
jnp reference on the aligned shapes they take (the Mosaic GPU interpreter off a Hopper GPU,
compiled on one), their configs, the entry point's dispatch and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, ON_GPU
import pallas_kernels
from pallas_kernels._util import is_hopper
from pallas_kernels.attention_softmax_dropout_value import dispatch
from pallas_kernels.attention_softmax_dropout_value import mosaic_gpu_kernels as mk
from pallas_kernels.attention_softmax_dropout_value import pallas_mosaic_gpu as mg

from .kernel_base import check, garbage_mask, make_inputs, reference

HOPPER = ON_GPU and is_hopper(jax.devices()[0])
needs_kernels = pytest.mark.skipif(ON_GPU and not HOPPER, reason="needs a Hopper GPU")


def backward(*args, **kw):
  return pallas_kernels.attention_softmax_dropout_value_backward(
      *args, implementation="mosaic_gpu", interpret=INTERPRET, **kw)


# (B, H, KVH, Sq, Skv, D, p): G in {1, 2, 4, 10}, D in {64, 128}, one key block and two (delta
# in the dS-dV kernel or its cluster; G * seq_q = 64 there too), four (the delta kernel).
CASES = [
    (1, 4, 1, 64, 256, 64, 0.1),     # G = 4, two key blocks
    (1, 10, 1, 64, 256, 128, 0.1),   # G = 10, two key blocks, D = 128
    (1, 1, 1, 64, 256, 64, 0.1),     # G * seq_q = 64: two key blocks, no delta kernel
    (1, 4, 1, 64, 512, 64, 0.1),     # G = 4, the delta kernel
    (1, 2, 1, 128, 512, 128, 0.1),   # G = 2, D = 128, the delta kernel
    (2, 2, 2, 64, 128, 128, 0.0),    # G = 1, B = 2, one key block, no dropout
    (1, 20, 2, 64, 128, 64, 0.2),    # G = 10, one key block
]


@needs_kernels
@pytest.mark.parametrize("b,h,kvh,sq,skv,d,p", CASES)
def test_matches_reference(b, h, kvh, sq, skv, d, p):
  args = make_inputs(b, h, kvh, sq, skv, d, p)
  check(backward(*args, p), reference(*args, p))


@needs_kernels
@pytest.mark.parametrize("skv,config", [
    (512, mg.Config(delta_block_k=64, delta_stages=3, stages=3, split=2)),
    (512, mg.Config(split=4)),
])
def test_configs(skv, config):
  """Split dV partials (summed in fp32), 64-key delta steps, other ring depths."""
  p = 0.1
  args = make_inputs(1, 4, 2, 128, skv, 64, p, seed=3)
  check(backward(*args, p, config=config), reference(*args, p))


@pytest.mark.parametrize("cluster", [2, 3, 8])
def test_async_store_places_each_part_where_it_is_read(cluster):
  """The ``st.async`` exchange (compiled only) writes part ``(slot, rank, wg)`` where the
  reader's ``[slot, rank, wg]`` index of the receiving ref ``[2, cluster, WGS, 64]`` is: every
  sender's place distinct, none overlapping another's 64 elements."""
  shape = (2, cluster, mk.WGS, mk.ROWS)
  starts = set()
  for s in range(2):
    for w in range(mk.WGS):
      offset, stride = mk._receive_place(s, w, cluster)
      for rank in range(cluster):
        start = offset + rank * stride
        assert start == np.ravel_multi_index((s, rank, w, 0), shape)
        starts.add(start)
  assert sorted(starts) == list(range(0, int(np.prod(shape)), mk.ROWS))


@needs_kernels
@pytest.mark.parametrize("d,config", [(64, None), (128, None), (64, mg.Config(split=2)),
                                      (64, mg.Config(stages=3))])
def test_cluster_delta_with_async_stores(d, config):
  """Rows of 256 keys in two kv groups: the parts of delta sent with ``st.async`` into the
  peer's shared memory; two programs sharing a key block's rows too (split 2, as
  (4, 256, 256) takes), a deeper ring. (The interpreter, whose clusters stop in such grids,
  runs one launch per kv group, unsplit, with two slots.)"""
  p = 0.1
  args = make_inputs(1, 4, 2, 128, 256, d, p, seed=6)
  check(backward(*args, p, config=config), reference(*args, p))


@needs_kernels
def test_one_key_block_delta_is_the_references():
  """Rows of 128 keys: delta = rowsum(dW * P) across the two warpgroups, as the reference
  sums it, so dS is exact wherever the reference's rounding is (no Pd rounding in delta)."""
  p = 0.1
  args = make_inputs(1, 4, 1, 64, 128, 64, p, seed=4)
  ds, _ = backward(*args, p)
  ref_ds, _ = reference(*args, p)
  mismatch = np.mean(np.asarray(ds, np.float32) != np.asarray(ref_ds, np.float32))
  assert mismatch < 1e-3, mismatch


@needs_kernels
@pytest.mark.parametrize("programs,skv,block_k", [(3, 256, 64), (2, 384, 128)])
def test_delta_programs_loop_over_items(programs, skv, block_k, capsys):
  """``delta_pass(programs=n)``: n programs take the 8 items (2 kv groups x 4 row tiles)
  in turn, 3 / 3 / 2 with n = 3 and 4 / 4 with n = 2 (each dO buffer and its barrier used
  twice), carrying each item's dO in while the last one streams. delta as with one program
  per item, and as rowsum(dPd * Pd); no race in the interpreter's detector; the same under
  vmap and under x64."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  p = 0.2
  d_o, _, dropped, value, _ = make_inputs(1, 8, 2, 128, skv, 64, p, seed=11)
  groups = dropped.reshape(1, 2, 4 * 128, skv)
  kw = dict(block_k=block_k, stages=2)
  looped = mg.delta_pass(d_o, groups, value, programs=programs, **kw,
                         interpret=INTERPRET and plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(looped)
  jax.effects_barrier()
  assert "RACE DETECTED" not in capsys.readouterr().out
  one_each = mg.delta_pass(d_o, groups, value, programs=8, **kw, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(looped), np.asarray(one_each))
  do_g = d_o.astype(jnp.float32).transpose(0, 2, 1, 3).reshape(1, 2, 4 * 128, 64)
  dpd = jnp.einsum("bgrd,bgkd->bgrk", do_g, value.astype(jnp.float32))
  want = jnp.sum(dpd * groups.astype(jnp.float32), axis=-1)
  np.testing.assert_allclose(np.asarray(looped), np.asarray(want), rtol=2e-2, atol=2e-2)
  batched = jax.vmap(lambda *a: mg.delta_pass(*a, programs=programs, **kw,
                                              interpret=INTERPRET))(
      d_o[None], groups[None], value[None])
  np.testing.assert_array_equal(np.asarray(batched[0]), np.asarray(looped))
  # Under x64 one program per item (the looping pipeline does not trace there); the
  # global flag, as in test_vmap_and_x64.
  jax.config.update("jax_enable_x64", True)
  try:
    x64 = jax.jit(lambda *a: mg.delta_pass(*a, programs=programs, **kw,
                                           interpret=INTERPRET))(d_o, groups, value)
  finally:
    jax.config.update("jax_enable_x64", False)
  np.testing.assert_array_equal(np.asarray(x64), np.asarray(looped))


def test_delta_programs_lower_for_a_gpu():
  """The looping delta kernel (fewer programs than items) through the Mosaic GPU lowering
  rules for CUDA on any host."""
  s = jax.ShapeDtypeStruct
  args = [s((1, 128, 8, 128), jnp.bfloat16), s((1, 2, 512, 512), jnp.bfloat16),
          s((1, 2, 512, 128), jnp.bfloat16)]
  fn = jax.jit(lambda *a: mg.delta_pass(*a, block_k=128, stages=2, programs=3))
  assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_delta_pass_says_which_rows_do_not_tile():
  d_o, _, dropped, value, _ = make_inputs(1, 1, 1, 64, 256, 64, 0.1)
  with pytest.raises(ValueError, match=r"128 must divide G \* seq_q \(64\)"):
    mg.delta_pass(d_o, dropped.reshape(1, 1, 64, 256), value, interpret=True)


@needs_kernels
def test_keep_is_not_read():
  """The kernels use keep == (Pd != 0) (the precondition): any mask gives the same result."""
  p = 0.1
  args = make_inputs(1, 4, 1, 64, 256, 64, p, seed=2)
  out = backward(*args, p)
  other = backward(*args[:4], garbage_mask(args[4].shape, 7), p)
  for a, b in zip(out, other):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@needs_kernels
def test_float16():
  p = 0.1
  args = make_inputs(1, 4, 2, 64, 128, 64, p, dtype=jnp.float16, seed=6)
  check(backward(*args, p), reference(*args, p), dtype=jnp.float16)


@needs_kernels
def test_vmap_and_x64():
  p = 0.1
  args = make_inputs(2, 4, 2, 64, 128, 64, p, seed=8)
  ref = reference(*args, p)
  ds, dv = jax.vmap(lambda *a: backward(*a, p))(*(x[:, None] for x in args))
  check((ds[:, 0], dv[:, 0]), ref)
  # The global flag, not the jax.enable_x64 context: the Mosaic GPU interpreter traces the
  # kernel again on its own threads, which do not see a thread-local context.
  jax.config.update("jax_enable_x64", True)
  try:
    check(jax.jit(lambda *a: backward(*a, p))(*args), ref)
  finally:
    jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("shape,dtype,match", [
    ((1, 2, 1, 64, 131, 64), jnp.bfloat16, "seq_k 131"),
    ((1, 2, 1, 65, 128, 64), jnp.bfloat16, "seq_q 65"),
    ((1, 2, 1, 64, 128, 40), jnp.bfloat16, "head dim 40"),
    ((1, 2, 2, 64, 512, 64), jnp.bfloat16, "G \\* seq_q = 64"),  # 256 keys take it
    ((1, 2, 1, 64, 128, 64), jnp.float32, "dtype float32"),
])
def test_unsupported_problems_say_why(shape, dtype, match):
  b, h, kvh, sq, skv, d = shape
  args = make_inputs(b, h, kvh, sq, skv, d, 0.1, dtype=dtype)
  with pytest.raises(ValueError, match=match):
    pallas_kernels.attention_softmax_dropout_value_backward(
        *args, 0.1, implementation="mosaic_gpu", interpret=True)


def test_traced_rate_and_causal_say_why():
  args = make_inputs(1, 2, 1, 64, 128, 64, 0.1)
  with pytest.raises(ValueError, match="traced dropout rate"):
    jax.jit(lambda p: pallas_kernels.attention_softmax_dropout_value_backward(
        *args, p, implementation="mosaic_gpu", interpret=True))(0.1)
  with pytest.raises(ValueError, match="causal"):
    pallas_kernels.attention_softmax_dropout_value_backward(
        *args, 0.1, implementation="mosaic_gpu", causal=True, interpret=True)


@pytest.mark.skipif(HOPPER, reason="the off-Hopper error")
def test_off_hopper_without_interpret_says_why():
  args = make_inputs(1, 2, 1, 64, 128, 64, 0.1)
  with pytest.raises(ValueError, match="Hopper"):
    pallas_kernels.attention_softmax_dropout_value_backward(
        *args, 0.1, implementation="mosaic_gpu")


@pytest.mark.skipif(ON_GPU, reason="the Mosaic GPU interpreter's race detector")
@pytest.mark.parametrize("skv", [
    256,    # two key blocks: the cluster, no delta kernel
    384,    # the delta kernel
    128,    # delta in the dS-dV kernel
])
def test_rings_are_race_free(skv, capsys):
  """The consumers fence their generic loads from a ring slot before handing it back to the
  TMA producer: the interpreter's race detector finds no race in either kernel (it reports
  every kernel's races on stdout)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  p = 0.1
  args = make_inputs(1, 2, 1, 128, skv, 64, p, seed=11)
  fenced = pallas_kernels.attention_softmax_dropout_value_backward(
      *args, p, implementation="mosaic_gpu",
      interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(fenced)
  jax.effects_barrier()
  assert "RACE DETECTED" not in capsys.readouterr().out
  check(fenced, reference(*args, p))


def test_config_errors():
  with pytest.raises(ValueError, match="config.delta_block_k"):
    mg.Config(delta_block_k=32)
  with pytest.raises(ValueError, match="config.stages"):
    mg.Config(stages=1)
  with pytest.raises(ValueError, match="config.split"):
    mg.Config(split=0)
  with pytest.raises(ValueError, match="delta=None needs"):
    x = jnp.zeros((1, 1, 64, 512), jnp.bfloat16)
    mg.ds_dv_pass(jnp.zeros((1, 64, 1, 64), jnp.bfloat16), x, x, None,
                  jnp.zeros((1, 1, 512, 64), jnp.bfloat16), rate=0.1, interpret=True)
  with pytest.raises(ValueError, match="config.rebuild_stages"):
    mg.Config(rebuild_stages=9)
  with pytest.raises(ValueError, match="config.rebuild_stages"):
    mg.Config(rebuild_stages=2)
  args = make_inputs(1, 2, 1, 64, 128, 64, 0.1)
  with pytest.raises(TypeError, match="pallas_mosaic_gpu.Config"):
    pallas_kernels.attention_softmax_dropout_value_backward(
        *args, 0.1, implementation="mosaic_gpu", config=object(), interpret=True)
  with pytest.raises(TypeError, match="no Triton options"):
    pallas_kernels.attention_softmax_dropout_value_backward(
        *args, 0.1, implementation="mosaic_gpu", block_q=32, interpret=True)
  with pytest.raises(ValueError, match="implementation"):
    pallas_kernels.attention_softmax_dropout_value_backward(
        *args, 0.1, implementation="cuda", interpret=True)
  with pytest.raises(ValueError, match="must divide"):
    mg.resolve_split(3, 1, 1, 128, 4)


def test_auto_split_fills_small_launches():
  # 8 programs (B * KVH * key blocks) of 64 row tiles: doubled while they stay within one
  # wave of the 132 SMs.
  assert mg.resolve_split("auto", 1, 8, 128, 64) == 16
  assert mg.resolve_split("auto", 8, 8, 256, 80) == 1      # 128 programs: no split
  assert mg.resolve_split("auto", 1, 1, 128, 4) == 1       # shares keep >= 4 tiles


def test_dispatch(monkeypatch):
  """None: Mosaic GPU on a Hopper GPU for the problems it takes, else Triton."""
  ok = make_inputs(1, 4, 1, 64, 256, 64, 0.1)
  ragged = make_inputs(1, 4, 1, 64, 131, 64, 0.1)
  if not HOPPER:
    assert dispatch.kernels_for(*ok, 0.1) == "triton"
  monkeypatch.setattr(dispatch, "is_hopper", lambda device: True)
  assert dispatch.kernels_for(*ok, 0.1) == "mosaic_gpu"
  assert dispatch.kernels_for(*ok, 0.1, interpret=True) == "triton"
  assert dispatch.kernels_for(*ragged, 0.1) == "triton"
  assert dispatch.kernels_for(*ok, 0.1, causal=True) == "triton"
  assert jax.jit(lambda p: jnp.float32(dispatch.kernels_for(*ok, p) == "triton"))(0.1) == 1


@pytest.mark.parametrize("skv,config", [(256, mg.Config()), (128, mg.Config()),
                                        (512, mg.Config()),
                                        (512, mg.Config(delta_block_k=64, delta_stages=4))])
def test_lowers_for_a_gpu(skv, config):
  """The kernels go through the Mosaic GPU lowering rules for CUDA on any host (catches an
  unsupported op before a GPU sees it; the Mosaic passes and ptxas still need one)."""
  s = jax.ShapeDtypeStruct
  b, h, kvh, sq, d = 1, 4, 2, 128, 64
  args = [s((b, sq, h, d), jnp.bfloat16), s((b, h, sq, skv), jnp.bfloat16),
          s((b, h, sq, skv), jnp.bfloat16), s((b, kvh, skv, d), jnp.bfloat16),
          s((b, h, sq, skv), jnp.bool_)]
  fn = jax.jit(lambda *a: mg.attention_softmax_dropout_value_backward(
      *a, 0.1, config=config, interpret=False))
  with pytest.MonkeyPatch.context() as m:
    m.setattr(mg._mosaic, "check_hopper", lambda *a, **k: None)
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def _forward_residuals(b, h, kvh, sq, skv, d, p, seed):
  """``(dO, P, Pd, V, keep, O_f32, rate, seeds)`` from the jnp forward with the op's mask
  (``seeds``: the mask key's, ``None`` without dropout)."""
  import jax_ops
  from jax_ops.ops.attention_softmax_dropout_value import reference as ref_a
  k = jax.random.split(jax.random.key(seed), 4)
  scores = jax.random.normal(k[0], (b, h, sq, skv), jnp.bfloat16)
  value = jax.random.normal(k[1], (b, kvh, skv, d), jnp.bfloat16)
  d_o = jax.random.normal(k[3], (b, sq, h, d), jnp.bfloat16)
  keep = jax_ops.dropout_keep_mask(k[2], p, scores.shape) if p else None
  rate = jax_ops.effective_dropout_rate(p) if p else 0.0
  _, probs, dropped, out32 = ref_a.attention_softmax_dropout_value_forward(
      scores, value, keep, rate, with_f32_output=True)
  if keep is None:
    keep = jnp.ones(scores.shape, jnp.bool_)
  seeds = mg.keep_seeds_of(k[2], rate) if p else None
  return d_o, probs, dropped, value, keep, out32, rate, seeds


@needs_kernels
@pytest.mark.parametrize("b,h,kvh,sq,skv,d,p", [(1, 4, 2, 64, 256, 64, 0.1),
                                                (1, 2, 1, 128, 256, 128, 0.0)])
def test_backward_from_output(b, h, kvh, sq, skv, d, p):
  """delta from the saved output, keep drawn from the seeds, Pd rebuilt from P in the
  kernel: the reference's gradients (given the Pd the forward made)."""
  d_o, probs, dropped, value, keep, out32, rate, seeds = _forward_residuals(
      b, h, kvh, sq, skv, d, p, seed=12)
  got = mg.backward_from_output(d_o, probs, value, keep, rate, out32, keep_seeds=seeds,
                                interpret=INTERPRET)
  check(got, reference(d_o, probs, dropped, value, keep, rate))


@needs_kernels
def test_backward_from_output_draws_keep_from_the_seeds():
  """``keep_seeds``: the kernel draws the op's mask itself (nothing read for it), the
  reference's gradients; two batch entries, two heads of a group, two row tiles per head and
  two key blocks (every index of the hash)."""
  import jax_ops
  b, h, kvh, sq, skv, d, p = 2, 2, 1, 128, 256, 64, 0.1
  d_o, probs, dropped, value, keep, out32, rate, _ = _forward_residuals(
      b, h, kvh, sq, skv, d, p, seed=13)
  rng = jax.random.split(jax.random.key(13), 4)[2]        # _forward_residuals' mask key
  np.testing.assert_array_equal(np.asarray(keep),
                                np.asarray(jax_ops.dropout_keep_mask(rng, p, keep.shape)))
  unread = jax.ShapeDtypeStruct(keep.shape, jnp.bool_)
  got = mg.backward_from_output(d_o, probs, value, unread, rate, out32,
                                keep_seeds=mg.keep_seeds_of(rng, rate), interpret=INTERPRET)
  check(got, reference(d_o, probs, dropped, value, keep, rate))
  with pytest.raises(ValueError, match=r"keep_seeds: expected .*\[4\]"):
    mg.backward_from_output(d_o, probs, value, unread, rate, out32,
                            keep_seeds=jnp.zeros((3,), jnp.uint32), interpret=True)


@needs_kernels
@pytest.mark.parametrize("b,h,kvh,sq,skv,d,p", [(2, 4, 2, 64, 256, 64, 0.1),
                                                (1, 2, 1, 128, 384, 128, 0.0)])
def test_backward_from_the_unnormalized_forward(b, h, kvh, sq, skv, d, p):
  """``row_scale``: given the fused forward's unnormalized E and row scales
  (``P = E * scale``), its fp32 output and the key's seeds, the gradients are the exact
  ones (autodiff of the plain forward in fp32) at bf16 resolution, as the op's are; the
  errors are those of the kernels reading P (``test_backward_from_output``) on the same
  problem or smaller (5% slack)."""
  import jax_ops
  from conftest import assert_close
  from jax_ops.ops.attention_softmax_dropout_value import reference as ref_a
  from pallas_kernels.attention_softmax_dropout_value import forward
  k = jax.random.split(jax.random.key(15), 4)
  scores = (jax.random.normal(k[0], (b, h, sq, skv), jnp.float32) * 2).astype(jnp.bfloat16)
  value = jax.random.normal(k[1], (b, kvh, skv, d), jnp.bfloat16)
  d_o = jax.random.normal(k[3], (b, sq, h, d), jnp.bfloat16)
  rate = jax_ops.effective_dropout_rate(p) if p else 0.0
  keep = jax_ops.dropout_keep_mask(k[2], p, scores.shape) if p else None
  seeds = mg.keep_seeds_of(k[2], rate) if p else None
  unread = jax.ShapeDtypeStruct(scores.shape, jnp.bool_)
  _, exp, row_scale, out32 = forward.attention_softmax_dropout_value_forward_unnormalized(
      scores, value, p, k[2] if p else None, interpret=INTERPRET)
  got = mg.backward_from_output(d_o, exp, value, unread, rate, out32, keep_seeds=seeds,
                                row_scale=row_scale, interpret=INTERPRET)
  _, probs, _, _, out32_p = forward.attention_softmax_dropout_value_forward(
      scores, value, p, k[2] if p else None, store_keep=False, interpret=INTERPRET)
  from_p = mg.backward_from_output(d_o, probs, value, unread, rate, out32_p,
                                   keep_seeds=seeds, interpret=INTERPRET)
  plain = lambda s, v: ref_a.attention_softmax_dropout_value_forward(s, v, keep, rate)[0]
  _, pullback = jax.vjp(plain, scores.astype(jnp.float32), value.astype(jnp.float32))
  exact = pullback(d_o.astype(jnp.float32))
  for name, g, g_p, e in zip(("grad_attn_scores", "grad_value_states"), got, from_p, exact):
    scale = float(jnp.abs(e).max())
    assert_close(g, e, atol=2e-3 * scale, rtol=5e-2, name=name)
    err = lambda x: float(jnp.sqrt(jnp.mean((x.astype(jnp.float32) - e) ** 2)))
    assert err(g) <= 1.05 * err(g_p), (name, err(g), err(g_p))
  with pytest.raises(ValueError, match=r"row_scale: expected .*\[B, H, Skv / 64, Sq\]"):
    mg.backward_from_output(d_o, exp, value, unread, rate, out32, row_scale=row_scale[:, :1],
                            keep_seeds=seeds, interpret=True)


def test_drawn_keep_with_delayed_dv_is_race_free(capsys):
  """Keep drawn from the seeds, each step's dV GEMM waited for in the next step and the
  ring's slots released a step later: the interpreter's race detector finds no race in its
  TMA and generic accesses, and the numbers are the reference's. (The interpreter runs
  wgmma at once and does not track its reads, so a slot released before its GEMM has read
  it is for the compiled tests on a GPU to catch.)"""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  d_o, probs, dropped, value, keep, out32, rate, seeds = _forward_residuals(
      1, 2, 1, 128, 256, 64, 0.1, seed=14)
  unread = jax.ShapeDtypeStruct(keep.shape, jnp.bool_)
  delayed = mg.backward_from_output(d_o, probs, value, unread, rate, out32, keep_seeds=seeds,
                                    interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(delayed)
  jax.effects_barrier()
  assert "RACE DETECTED" not in capsys.readouterr().out
  check(delayed, reference(d_o, probs, dropped, value, keep, rate))


def test_backward_from_output_says_why():
  d_o, probs, _, value, keep, out32, rate, seeds = _forward_residuals(
      1, 2, 1, 64, 128, 64, 0.1, 1)
  with pytest.raises(ValueError, match="more than 128 keys"):
    mg.backward_from_output(d_o, probs, value, keep, rate, out32, keep_seeds=seeds,
                            interpret=True)
  d_o, probs, _, value, keep, out32, rate, seeds = _forward_residuals(
      1, 2, 1, 64, 256, 64, 0.1, 1)
  with pytest.raises(ValueError, match="attn_output_f32"):
    mg.backward_from_output(d_o, probs, value, keep, rate, out32[:, :32], keep_seeds=seeds,
                            interpret=True)
  with pytest.raises(ValueError, match="keep_seeds: needed"):
    mg.backward_from_output(d_o, probs, value, keep, rate, out32, interpret=True)
  with pytest.raises(TypeError, match=r"config: expected a pallas_mosaic_gpu.Config"):
    mg.backward_from_output(d_o, probs, value, keep, rate, out32, keep_seeds=seeds,
                            config=(64, 2, 2), interpret=True)


def test_backward_from_output_lowers_for_a_gpu():
  s = jax.ShapeDtypeStruct
  b, h, kvh, sq, skv, d = 1, 4, 2, 128, 256, 64
  args = [s((b, sq, h, d), jnp.bfloat16), s((b, h, sq, skv), jnp.bfloat16),
          s((b, kvh, skv, d), jnp.bfloat16), s((b, h, sq, skv), jnp.bool_)]
  out32 = s((b, sq, h, d), jnp.float32)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(mg._mosaic, "check_hopper", lambda *a, **k: None)
    seeded = jax.jit(lambda do, p, v, keep, o, sd: mg.backward_from_output(
        do, p, v, keep, 0.1, o, keep_seeds=sd, interpret=False))
    seeded_text = seeded.trace(*args, out32, s((4,), jnp.uint32)).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in seeded_text
