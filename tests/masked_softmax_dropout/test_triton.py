"""The backward kernel's base suite on the Pallas Triton kernel, plus its configs, tuned
table and lowering."""

import json
import re

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from conftest import INTERPRET, ON_GPU, assert_close, triton_calls_in_gpu_lowering
from jax_ops import masked_softmax_dropout_backward_reference as reference
from pallas_kernels import _tuning
from pallas_kernels.masked_softmax_dropout import (Config, TableEntry, column_chunks, config_for,
                                                   default_config, heuristic_entry, length_class)
from pallas_kernels.masked_softmax_dropout.config import VARIANT_FIELDS

from .kernel_base import *  # noqa: F401,F403
from .kernel_base import make_inputs

kernel = pallas_kernels.masked_softmax_dropout_backward


@pytest.fixture
def backward():
  return kernel


@pytest.fixture
def pretend_gpu(pretend_h200, monkeypatch):
  """Lowering for a pretended H200 on any host: the entry point's "compiles only on a GPU"
  check (which sees the host's default device: traced arrays hold none) is switched off."""
  from pallas_kernels.masked_softmax_dropout import pallas_triton
  monkeypatch.setattr(pallas_triton._util, "check_can_compile", lambda *a, **k: None)


# Each shape with two of the configs, each config on two shapes.
_CONFIGS = (Config(1, 4, False), Config(4, 4, True), Config(2, 8, False))


@pytest.mark.parametrize("sq,sk,config", [
    (sq, sk, _CONFIGS[(i + j) % 3]) for i, (sq, sk) in enumerate([(5, 33), (33, 5), (3, 100)])
    for j in (0, 1)])
def test_explicit_configs(sq, sk, config):
  args = make_inputs(2, 2, sq, sk, seed=1)
  out = kernel(*args, 0.2, config=config, interpret=INTERPRET)
  assert_close(out, reference(*args, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sk,split,want", [
    (128, True, ((0, 128),)), (131, True, ((0, 128), (128, 4))), (131, False, ((0, 256),)),
    (919, True, ((0, 512), (512, 512))), (1, True, ((0, 1),)), (7, True, ((0, 4), (4, 4)))])
def test_column_chunks_cover_the_row(sk, split, want):
  chunks = column_chunks(sk, split)
  assert chunks == want
  assert chunks[-1][0] + chunks[-1][1] >= sk


def test_causal_is_the_dense_math():
  args = make_inputs(1, 2, 7, 7)
  a = kernel(*args, 0.1, interpret=INTERPRET)
  b = kernel(*args, 0.1, causal=True, interpret=INTERPRET)
  assert bool(jnp.all(a == b))


@pytest.mark.skipif(ON_GPU, reason="off a GPU only")
def test_off_gpu_without_interpret_says_so():
  args = make_inputs(1, 1, 3, 3)
  with pytest.raises(ValueError, match="interpret=True"):
    kernel(*args, 0.1)


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_rows=3), "block_rows"), (dict(block_rows=0), "block_rows"),
    (dict(block_rows=2.0), "block_rows"), (dict(num_warps=3), "num_warps"),
    (dict(num_warps=64), "num_warps"), (dict(split=1), "split"),
    (dict(stream_cache=".cs"), "stream_cache"), (dict(mask_cache="ca"), "mask_cache"),
    (dict(stream_eviction="first"), "stream_eviction"),
    (dict(store_eviction="evict"), "store_eviction"), (dict(mask_after_sum=None), "mask_after_sum"),
    (dict(row_group=-1), "row_group"), (dict(row_group=1.5), "row_group"),
    (dict(row_group=True), "row_group")])
def test_config_validates_its_fields(kwargs, field):
  with pytest.raises(ValueError, match=f"config.{field}"):
    Config(**{"block_rows": 2, "num_warps": 4, **kwargs})


def test_config_type_is_checked():
  args = make_inputs(1, 1, 3, 3)
  with pytest.raises(TypeError, match="config"):
    kernel(*args, 0.1, config=(1, 4), interpret=True)


def test_config_for_aims_at_the_target():
  assert config_for(512, 512, target=1024, num_warps=8, split=True) == Config(2, 8, True)
  assert config_for(3, 128, target=4096, num_warps=4, split=True) == Config(4, 4, True)  # <= Sq
  assert config_for(919, 919, target=512, num_warps=1, split=False) == Config(1, 1, False)


def test_length_classes():
  assert [length_class(s) for s in (128, 131, 293, 512, 919, 1)] == [
      "128", "256-ragged", "512-ragged", "512", "1024-ragged", "1"]


def test_tuned_table_has_named_configs_only():
  with open(_tuning.table_path("masked_softmax_dropout", "NVIDIA H200")) as f:
    data = json.load(f)
  assert set(data) == {"device_kind", "compute_capability", "date", "jax", "configs"}
  for key, entry in data["configs"].items():
    assert {"target", "num_warps", "split"} <= set(entry) <= {"target", "num_warps", "split",
                                                               *VARIANT_FIELDS}, key
    assert TableEntry.from_json(entry).to_json() == entry


def test_table_entries_round_trip_variant_fields():
  config = Config(2, 4, False, stream_cache=".cg", stream_eviction=None, mask_after_sum=True,
                  row_group=8)
  entry = TableEntry.of(512, config)
  assert entry.to_json() == {"target": 512, "num_warps": 4, "split": False,
                             "stream_cache": ".cg", "stream_eviction": None,
                             "mask_after_sum": True, "row_group": 8}
  assert TableEntry.from_json(entry.to_json()) == entry
  # 512 elements of 256-wide rows: two rows.
  assert entry.config(256, 256) == config
  assert TableEntry.of(1024, Config(2, 8)).to_json() == {"target": 1024, "num_warps": 8,
                                                         "split": True}
  with pytest.raises(ValueError, match="unknown fields"):
    TableEntry.from_json({"target": 512, "num_warps": 4, "split": False, "rows": 2})


def test_default_config_reads_the_table_for_its_device():
  # (64, 8, 128): class "128" -> 1024 elements of 128 -> 8 rows, 8 warps, no split.
  assert default_config(128, 128, "NVIDIA H200") == Config(8, 8, False,
                                                           store_eviction="evict_first")
  # 293 -> "512-ragged": 512 elements, one padded chunk of 512 -> 1 row, 1 warp.
  assert default_config(293, 293, "NVIDIA H200") == Config(
      1, 1, False, stream_cache=".cg", stream_eviction=None, store_eviction="evict_first",
      row_group=65536)
  # A ragged length whose class has no entry takes the aligned class of its padded length.
  assert default_config(2000, 2000, "NVIDIA H200") == default_config(2048, 2048, "NVIDIA H200")
  # Another device kind, or none (interpret mode): the heuristic.
  for kind in (None, "NVIDIA A100-SXM4-80GB"):
    assert default_config(293, 293, kind) == heuristic_entry(293).config(293, 293)
  assert heuristic_entry(293).config(293, 293) == Config(8, 4, True)  # 4096 // (256 + 64)


@pytest.mark.parametrize("p", [0.0, 0.1, None])
@pytest.mark.parametrize("split", [True, False])
def test_lowers_to_triton(pretend_gpu, p, split):
  """The kernel lowers to Triton IR for a GPU (no GPU needed; catches unsupported ops)."""
  b, h, s = 2, 3, 131
  shapes = [jax.ShapeDtypeStruct((b, h, s, s), jnp.float32)] * 2 + [
      jax.ShapeDtypeStruct((b, 1, s, s), jnp.bool_), jax.ShapeDtypeStruct((b, h, s, s), jnp.bool_)]
  assert triton_calls_in_gpu_lowering(kernel, shapes, p, config=Config(4, 4, split)) == 1


@pytest.mark.parametrize("config", [Config(1, 2, False, row_group=8),
                                    Config(2, 4, True, row_group=1 << 16)])
def test_program_orders_lower_to_triton(pretend_gpu, config):
  """The 1-D grid of a row group lowers to Triton IR."""
  b, h, s = 2, 3, 131
  shapes = [jax.ShapeDtypeStruct((b, h, s, s), jnp.float32)] * 2 + [
      jax.ShapeDtypeStruct((b, 1, s, s), jnp.bool_), jax.ShapeDtypeStruct((b, h, s, s), jnp.bool_)]
  assert triton_calls_in_gpu_lowering(kernel, shapes, 0.1, config=config) == 1


# --- Config fields that change the loads, the store and the order of the programs ----------

VARIANTS = {
    "stream_cg": Config(2, 4, True, stream_cache=".cg", stream_eviction=None),
    "stream_ca": Config(1, 2, False, stream_cache=".ca", stream_eviction=None),
    "stream_evict_last": Config(1, 2, False, stream_eviction="evict_last"),
    "mask_ca": Config(4, 4, True, mask_cache=".ca"),
    "mask_after_sum": Config(2, 4, True, mask_cache=".cg", mask_after_sum=True),
    "store_streaming": Config(2, 4, False, stream_eviction=None, store_eviction="evict_first"),
    "public_like": Config(1, 4, False, stream_cache=".cg", stream_eviction=None,
                          mask_cache=".ca", mask_after_sum=True, store_eviction="evict_first"),
    # Program orders: one head's row blocks in groups (3 does not divide the row blocks
    # of 7, 131 or 293 rows: the last group's extra programs are masked off); capped at a
    # head's row blocks (rows fastest), as the tuned table's 512 classes run.
    "row_group_3": Config(2, 4, True, row_group=3),
    "rows_fastest": Config(4, 2, False, row_group=1 << 20),
    "rows_fastest_cg": Config(1, 1, False, stream_cache=".cg", stream_eviction=None,
                              store_eviction="evict_first", row_group=65536),
}
RATES = (0.0, 0.1, None)  # None: traced


def test_cache_modifier_and_eviction_policy_do_not_combine():
  """ptxas refuses a load with both: said when the config is made."""
  with pytest.raises(ValueError, match=r"config.stream_cache='.cg' cannot be combined with "
                                       r"config.stream_eviction='evict_first'"):
    Config(2, 4, True, stream_cache=".cg")


def _run(args, p, config):
  if p is None:  # a traced rate of 0.1
    out = jax.jit(lambda rate: kernel(*args, rate, config=config, interpret=INTERPRET))(
        jnp.float32(0.1))
    return out, reference(*args, 0.1)
  return kernel(*args, p, config=config, interpret=INTERPRET), reference(*args, p)


# The program orders on two of the rows: 7 (a last group past the end) and 131 (split
# columns). The variants that only set cache
# hints compute as their tiling does (the interpreter has no caches; every variant is
# lowered to Triton IR at every rate below): one row each. The others on two of the four.
_HINTS_ONLY = ("stream_cg", "stream_ca", "stream_evict_last", "mask_ca", "store_streaming")
_ROWS = {name: (7, 131) if name.startswith(("row_group", "rows_"))
         else ((1, 7, 131, 293)[i % 4],) if name in _HINTS_ONLY
         else ((1, 7, 131, 293)[i % 4], (1, 7, 131, 293)[(i + 2) % 4])
         for i, name in enumerate(VARIANTS)}


@pytest.mark.parametrize("name,s", [(n, s) for n in VARIANTS for s in _ROWS[n]])
def test_variant_matches_reference(name, s):
  """Every variant on odd rows; the rate cycles through the three dropout modes with the
  variant and the row."""
  p = RATES[(list(VARIANTS).index(name) + [1, 7, 131, 293].index(s)) % 3]
  b = 1 if s > 256 else 2  # (fewer interpreted programs on the long rows)
  args = make_inputs(b, 3, s, s, seed=s)
  out, ref = _run(args, p, VARIANTS[name])
  assert out.shape == (b, 3, s, s) and out.dtype == jnp.float32
  assert_close(out, ref, atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(out - ref).max()) < 1e-5


def test_variant_rectangular_bfloat16():
  args = make_inputs(1, 5, 6, 37, dtype=jnp.bfloat16)
  out = kernel(*args, 0.1, config=VARIANTS["public_like"], interpret=INTERPRET)
  assert out.dtype == jnp.bfloat16
  assert_close(out, reference(*args, 0.1), atol=1e-5, rtol=1e-2)  # ~2 bf16 ulps


@pytest.fixture
def triton_ir(pretend_gpu, triton_modules):
  """``ir(config, p)``: the Triton IR text of the kernel on [2, 4, 131, 131] inputs."""
  mods = triton_modules

  def ir(config, p=0.1, heads=4):
    shapes = [jax.ShapeDtypeStruct((2, heads, 131, 131), jnp.float32)] * 2 + [
        jax.ShapeDtypeStruct((2, 1, 131, 131), jnp.bool_),
        jax.ShapeDtypeStruct((2, heads, 131, 131), jnp.bool_)]
    mods.clear()
    assert triton_calls_in_gpu_lowering(kernel, shapes, p, config=config) == 1
    (text,) = mods
    return [_one_attribute_each(line.strip()) for line in text.splitlines()
            if "tt.load" in line or "tt.store" in line or "tt.reduce\"" in line]
  return ir


def _one_attribute_each(line):
  """jax 0.12 prints a load's or store's cache modifier and eviction policy as one
  ``cachePolicy`` attribute; the checks read them as jax 0.11 prints them, one attribute each,
  absent when the default (``none``, ``evict_normal``)."""
  def attrs(m):
    cache, evict = m.group(1), m.group(2)
    return " ".join(([f"cacheModifier = {cache}"] if cache != "none" else [])
                    + ([f"evictionPolicy = {evict}"] if evict != "evict_normal" else []))
  return re.sub(r"\{cachePolicy = #tt\.cache_policy<cache_modifier = (\w+), "
                r"eviction_policy = (\w+)>\}", attrs, line)


@pytest.mark.parametrize("p", RATES)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_lowers_to_triton(triton_ir, name, p):
  assert triton_ir(VARIANTS[name], p)


def _loads(lines, pointee):
  return [l for l in lines if "tt.load" in l and f"!tt.ptr<{pointee}>>" in l]


def test_default_loads_and_store(triton_ir):
  lines = triton_ir(Config(2, 4, True))  # two chunks (128 + 4), static rate: g, P, keep, mask
  f32, i8 = _loads(lines, "f32"), _loads(lines, "i8")
  assert not any("cacheModifier" in l for l in lines)
  assert sum("evictionPolicy = evict_first" in l for l in f32) == 4  # g, P (the rest: stores)
  assert sum("evictionPolicy = evict_first" in l for l in i8) == 2  # keep; the mask has none
  assert not any("evictionPolicy" in l for l in lines if l.startswith("tt.store"))


def test_stream_cache_and_eviction_reach_the_streamed_loads(triton_ir):
  lines = triton_ir(Config(2, 4, True, stream_cache=".cg", stream_eviction=None))
  streamed = [l for l in lines if "cacheModifier = cg" in l]
  assert len(streamed) == 6  # g, P, keep of two chunks
  assert not any("evictionPolicy" in l for l in streamed)
  assert len([l for l in _loads(lines, "i8") if "cacheModifier" not in l]) == 2  # the mask
  lines = triton_ir(Config(2, 4, True, stream_eviction="evict_last"))
  assert sum("evictionPolicy = evict_last" in l for l in lines) == 6


def test_mask_cache_eviction_and_order(triton_ir):
  def mask_lines(lines):
    return [i for i, l in enumerate(lines) if "cacheModifier = ca" in l]
  reduces = lambda lines: [i for i, l in enumerate(lines) if "tt.reduce" in l]
  before = triton_ir(Config(2, 4, True, mask_cache=".ca"))
  after = triton_ir(Config(2, 4, True, mask_cache=".ca", mask_after_sum=True))
  assert len(mask_lines(before)) == len(mask_lines(after)) == 2
  assert mask_lines(before)[-1] < reduces(before)[-1]  # loaded with the streams
  assert mask_lines(after)[0] > reduces(after)[-1]  # after every row sum


def test_store_eviction(triton_ir):
  lines = triton_ir(Config(2, 4, True, store_eviction="evict_first"))
  stores = [l for l in lines if l.startswith("tt.store")]
  assert len(stores) == 2 and all("evictionPolicy = evict_first" in l for l in stores)


def test_row_group_under_x64():
  """The 1-D grid keeps int32 indices with x64 on."""
  with jax.enable_x64(True):
    args = make_inputs(1, 3, 7, 13, seed=2)
    out = kernel(*args, 0.1, config=Config(2, 4, True, row_group=3), interpret=INTERPRET)
    assert_close(out, reference(*args, 0.1), atol=1e-5, rtol=1e-5)
