"""The tuners (``pallas_kernels.tune``'s modules) on CPU: their candidate lists build valid
configs, ``--cands`` maps the old positional tuples to named fields, and the tables they
write are read back by the kernels' ``default_config``. The command line, the user cache and
XLA's entries: ``tests/test_tune_cli.py``."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import _tuning
from pallas_kernels import attention_softmax_dropout_value as asdv
from pallas_kernels import masked_softmax_dropout as msd
from pallas_kernels import qk_scale_softmax as qks
from pallas_kernels.tune import attention as ta
from pallas_kernels.tune import attention_run as tr
from pallas_kernels.tune import common
from pallas_kernels.tune import masked as tune

REPO_TUNED_DIR = _tuning.TUNED_DIR  # the checked-in tables
FAKE = "Fake GPU 9000"  # a device kind no real table has: tables under a temp TUNED_DIR
SHAPES = [(1, 1), (16, 100), (128, 128), (300, 293), (1024, 1024), (4096, 4096)]

# The candidate lists as they were (positional tuples), which the named lists must keep.
OLD = {
    ta.ATTENTION: {
        "dv": [(64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3),
               (128, 128, 8, 2), (32, 64, 4, 3), (128, 64, 8, 2), (64, 128, 4, 2), (32, 128, 4, 3),
               (64, 64, 4, 3, 1), (128, 64, 8, 2, 1), (64, 128, 4, 2, 1), (64, 32, 4, 3),
               (64, 64, 4, 3, 4), (64, 64, 4, 3, 8), (128, 64, 8, 2, 4), (128, 128, 8, 3)],
        "ds": [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2),
               (64, 128, 8, 3), (128, 32, 4, 3), (256, 64, 8, 2), (128, 64, 4, 3), (64, 32, 4, 3)],
    },
    ta.QK: {
        "row": [(16, 0, 4, 1), (32, 0, 4, 1), (32, 0, 8, 1), (64, 0, 8, 1), (16, 128, 4, 2),
                (32, 128, 4, 2), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3),
                (32, 256, 8, 2), (64, 256, 8, 2), (32, 64, 4, 2, 16)],
        "col": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 4, 2),
                (128, 128, 8, 2), (32, 64, 4, 3), (64, 128, 8, 3), (128, 64, 4, 3)],
        "head": [(16, 0, 4, 2), (32, 0, 4, 2), (32, 0, 8, 2), (64, 0, 8, 2), (16, 0, 8, 2),
                 (32, 0, 16, 2), (64, 0, 16, 2), (32, 0, 8, 3), (16, 0, 4, 3), (128, 0, 16, 2)],
    },
}
OLD_MASKED = [(512, 1), (512, 2), (512, 4), (1024, 1), (1024, 2), (1024, 4), (1024, 8), (2048, 2),
         (2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16), (8192, 8), (8192, 16)]


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
  """Tables under ``tmp_path``: ``_tuning.table`` reads ``TUNED_DIR`` (its cache cleared)."""
  monkeypatch.setattr(_tuning, "TUNED_DIR", str(tmp_path))
  _tuning.table.cache_clear()
  _tuning.measured_kinds.cache_clear()
  yield tmp_path
  _tuning.table.cache_clear()
  _tuning.measured_kinds.cache_clear()


# ------------------------------------------------------------------- candidate lists


@pytest.mark.parametrize("op", [ta.ATTENTION, ta.QK])
def test_candidates_build_valid_configs(op):
  for name, entries in ta.CANDIDATES[op].items():
    assert entries, (op, name)
    for entry in entries:
      expected = (ta.FORWARD_CONFIG[op] if name == "fwd"
                  else asdv.PassConfig if op == ta.ATTENTION else qks.PassConfig)
      for sq, sk in SHAPES:
        if op == ta.QK and entry["block_k"] == qks.WHOLE_ROW and sk > 512:
          continue  # whole-row candidates are timed on short rows only
        cfg = ta.pass_config(op, entry, sq, sk, name)  # the dataclass validation runs
        assert type(cfg) is expected
        assert cfg.block_q <= max(16, entry["block_q"])
      key = ta.candidate_key(op, entry, name)
      assert ta._pass_entry(op, name, dict(key)) == dict(key)  # the key is a table entry
      assert common.label(key).startswith(f"{entry['block_q']}x")
    keys = [ta.candidate_key(op, e, name) for e in entries]
    assert len(set(keys)) == len(keys), (op, name, "duplicate candidates")


@pytest.mark.parametrize("op", [ta.ATTENTION, ta.QK])
def test_candidates_are_the_old_ones(op):
  for name, old in OLD[op].items():
    assert ([ta.candidate_key(op, ta.from_tuple(op, t)) for t in old]
            == [ta.candidate_key(op, e) for e in ta.CANDIDATES[op][name]]), name


def test_masked_candidates_build_valid_configs():
  assert [(c["target"], c["num_warps"]) for c in tune.CANDIDATES] == OLD_MASKED
  for cand in tune.CANDIDATES:
    for split in (True, False):
      entry = msd.TableEntry(**cand, split=split)
      for sq, sk in SHAPES:
        cfg = entry.config(sq, sk)
        assert isinstance(cfg, msd.Config)
        assert cfg == msd.config_for(sq, sk, target=cand["target"],
                                     num_warps=cand["num_warps"], split=split)


def test_invalid_candidates_raise():
  with pytest.raises(ValueError, match="block_q"):
    ta.attention_pass_entry(dict(block_q=48, block_k=64, num_warps=4, num_stages=2))
  with pytest.raises(ValueError, match="split"):
    ta.attention_pass_entry(dict(block_q=64, block_k=64, num_warps=4, num_stages=2, split=0))
  with pytest.raises(ValueError, match="row_align"):
    ta.qk_pass_entry(dict(block_q=32, block_k=ta.ROW, num_warps=4, num_stages=2, row_align=3))
  with pytest.raises(ValueError, match="heads"):  # not a field of qk_scale_softmax's PassConfig
    ta.qk_pass_entry(dict(block_q=32, block_k=64, num_warps=4, num_stages=2, heads=2))


# ------------------------------------------------------------------- --cands


def test_cands_maps_old_tuples_to_named_fields():
  got = ta.parse_cands(ta.ATTENTION, "ds=[(64,64,4,2),(64,128,4,2,0,2,16)];dv=[(64,64,4,3,1)]")
  assert got == {
      "ds": [dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
             dict(block_q=64, block_k=128, num_warps=4, num_stages=2, split="auto", heads=2,
                  row_align=16)],
      "dv": [dict(block_q=64, block_k=64, num_warps=4, num_stages=3, split=1)],
  }
  assert ta.candidate_key(ta.ATTENTION, got["ds"][1]) == (
      ("block_q", 64), ("block_k", 128), ("num_warps", 4), ("num_stages", 2),
      ("heads", 2), ("row_align", 16))
  got = ta.parse_cands(ta.QK, "row=[(16,0,4,1),(32,64,4,2,16)];head=(32,0,8,3)")
  assert got == {
      "row": [dict(block_q=16, block_k="row", num_warps=4, num_stages=1),
              dict(block_q=32, block_k=64, num_warps=4, num_stages=2, row_align=16)],
      "head": [dict(block_q=32, block_k="row", num_warps=8, num_stages=3)],
  }
  assert ta.pass_config(ta.QK, got["row"][0], 100, 200) == qks.PassConfig(16, 256, 4, 1)
  # Named fields work too.
  assert ta.parse_cands(ta.QK, "col=[{'block_q': 32, 'block_k': 64, 'num_warps': 4, "
                              "'num_stages': 3, 'row_align': 0}]") == {
      "col": [dict(block_q=32, block_k=64, num_warps=4, num_stages=3, row_align=0)]}


def test_cands_errors():
  with pytest.raises(ValueError, match="no pass"):
    ta.parse_cands(ta.ATTENTION, "row=[(64,64,4,2)]")
  with pytest.raises(ValueError, match="4 to 5 values"):
    ta.parse_cands(ta.QK, "row=[(64,64,4,2,0,1)]")
  with pytest.raises(ValueError, match="num_warps"):
    ta.parse_cands(ta.ATTENTION, "dv=[(64,64,3,2)]")


def test_main_checks_cands_then_needs_a_gpu(capsys):
  from pallas_kernels import tune as cli
  if jax.default_backend() == "gpu":
    pytest.skip("would tune")
  with pytest.raises(SystemExit):  # validated before the GPU check
    cli.main(["--op", ta.QK, "--cands", "col=[(64,24,4,2)]"])
  assert "block_k" in capsys.readouterr().err
  assert cli.main(["--op", ta.ATTENTION, "--cands", "ds=[(64,64,4,2,0,2)]"]) == 2
  assert cli.main([]) == 2
  assert "needs a CUDA GPU" in capsys.readouterr().err


# ------------------------------------------------------------------- write, read back


def _ratios(keys, scores):
  """One workload's ``{candidate: time / best}``."""
  return dict(zip(keys, scores))


def test_masked_table_round_trip(tuned_dir):
  out = _tuning.table_path(msd.config.KERNEL, FAKE)
  assert out.startswith(str(tuned_dir))
  win = msd.TableEntry(target=2048, num_warps=8, split=False)
  lose = msd.TableEntry(target=512, num_warps=1, split=True)
  win_ragged = msd.TableEntry(target=1024, num_warps=2, split=True)
  by_class = {"512": [_ratios([win, lose], [1.0, 1.3]), _ratios([win, lose], [1.02, 1.0])],
              "512-ragged": [_ratios([lose, win_ragged], [1.1, 1.0])]}
  result = tune._write_table(by_class, out, device_kind=FAKE)
  with open(out) as f:
    data = json.load(f)
  assert data == result and data["device_kind"] == FAKE
  assert data["configs"] == {"512": {"target": 2048, "num_warps": 8, "split": False},
                             "512-ragged": {"target": 1024, "num_warps": 2, "split": True}}
  for sq, sk, entry in [(512, 512, win), (64, 300, win_ragged), (7, 511, win_ragged)]:
    assert msd.default_config(sq, sk, FAKE) == entry.config(sq, sk)
  assert msd.tuned_entry(512, FAKE) == win
  # Another run merges its classes in; a class it measures is replaced whole.
  _tuning.table.cache_clear()
  tune._write_table({"512": [_ratios([lose], [1.0])]}, out, device_kind=FAKE)
  assert msd.tuned_entry(512, FAKE) == lose
  assert msd.tuned_entry(300, FAKE) == win_ragged


def test_attention_table_round_trip(tuned_dir):
  out = _tuning.table_path(asdv.config.KERNEL, FAKE)
  dv = [ta.candidate_key(ta.ATTENTION, e) for e in ta.ATTENTION_DV[9:12]]  # split=1 among them
  ds = [ta.candidate_key(ta.ATTENTION, dict(e, row_align=0)) for e in ta.ATTENTION_DS[:3]]
  ratios = {"256": {"dv": [_ratios(dv, [1.2, 1.0, 1.1])], "ds": [_ratios(ds, [1.0, 1.5, 1.1])]}}
  tr._write_table(ta.ATTENTION, ratios, out, device_kind=FAKE)
  with open(out) as f:
    entry = json.load(f)["configs"]["256"]
  assert entry == {"dv": dict(dv[1]), "ds": dict(ds[0])}
  assert entry["dv"]["split"] == 1 and "split" not in entry["ds"]
  for sq, sk in [(256, 256), (40, 200)]:
    got = asdv.default_config(2, 8, 2, sq, sk, 128, jnp.bfloat16, FAKE)
    assert got == asdv.Config(ta.pass_config(ta.ATTENTION, dict(dv[1]), sq, sk),
                              ta.pass_config(ta.ATTENTION, dict(ds[0]), sq, sk))
    assert got.ds.row_align == 0 and got.dv.split == 1
  assert asdv.Config.from_json(entry).to_json() == entry
  # A run of one pass keeps the other pass's entry.
  _tuning.table.cache_clear()
  tr._write_table(ta.ATTENTION, {"256": {"ds": [_ratios(ds, [1.3, 1.0, 1.1])]}}, out, device_kind=FAKE)
  got = asdv.default_config(2, 8, 2, 256, 256, 128, jnp.bfloat16, FAKE)
  assert got == asdv.Config(ta.pass_config(ta.ATTENTION, dict(dv[1]), 256, 256),
                            ta.pass_config(ta.ATTENTION, dict(ds[1]), 256, 256))


def test_a_run_never_trades_a_workload_of_the_served_entry_for_the_geomean():
  """A candidate better in geomean but over ``KEEP_SLACK`` slower than the served entry on
  one workload of the class loses to it; one within the slack on each workload wins."""
  small_fast = [{"a": 1.0, "served": 1.2}, {"a": 1.1, "served": 1.0}]
  assert common.best_by_geomean(small_fast)[0] == "a"
  assert common.best_by_geomean(small_fast, keep="served")[0] == "served"
  close = [{"a": 1.0, "served": 1.2}, {"a": 1.005, "served": 1.0}]
  assert common.best_by_geomean(close, keep="served")[0] == "a"
  # An entry that did not run on every workload guards nothing.
  assert common.best_by_geomean([{"a": 1.0, "served": 1.2}, {"a": 1.1}], keep="served")[0] == "a"


def test_the_tuners_keep_the_served_entry_of_a_class(tuned_dir):
  """Both writers take each class's served entry from the records (``"served"``)."""
  win, served = (msd.TableEntry(target=1024, num_warps=8, split=True),
                 msd.TableEntry(target=512, num_warps=1, split=False))
  times = [{win: 10.0, served: 12.0}, {win: 110.0, served: 100.0}]
  records = {"512": [{"key": "512", "times": {tune.PASS: t}, "served": served} for t in times]}
  out = _tuning.table_path(msd.config.KERNEL, FAKE)
  assert tune.write(records, out, FAKE, show=set())["configs"]["512"] == served.to_json()
  for record in records["512"]:
    record["served"] = None
  _tuning.table.cache_clear()
  assert tune.write(records, out, FAKE, show=set())["configs"]["512"] == win.to_json()
  # masked's entry serves the op's backward too: its launch there counts as much.
  records = {"512": [{"key": "512", "served": served,
                      "times": {tune.PASS: {win: 10.0, served: 10.05},
                                tune.OP_PASS: {win: 12.0, served: 10.0}}}]}
  _tuning.table.cache_clear()
  assert tune.write(records, out, FAKE, show=set())["configs"]["512"] == served.to_json()
  # ... unless the op runs XLA in that class: then only the entry point's launch counts.
  records["512"][0].update(pallas=12.0, xla=11.0)
  _tuning.table.cache_clear()
  entry = tune.write(records, out, FAKE, show=set())["configs"]["512"]
  assert entry == {**win.to_json(), "backend": "xla"}

  dv = [ta.candidate_key(ta.ATTENTION, e) for e in ta.ATTENTION_DV[:2]]
  ds = [ta.candidate_key(ta.ATTENTION, e) for e in ta.ATTENTION_DS[:2]]
  records = {"256": [{"key": "256", "served": {"dv": dv[1], "ds": ds[1]},
                      "times": {"dv": {dv[0]: a, dv[1]: b}, "ds": {ds[0]: a, ds[1]: b}}}
                     for a, b in [(10.0, 12.0), (110.0, 100.0)]]}
  out = _tuning.table_path(asdv.config.KERNEL, FAKE)
  entry = tr.write(ta.ATTENTION, records, out, FAKE, show=set())["configs"]["256"]
  assert entry == {"dv": dict(dv[1]), "ds": dict(ds[1])}
  served = {"256": {"dv": dict(dv[1]), "ds": dict(ds[1])}}
  kept = ta.served_keys(ta.ATTENTION, _tuning.lookup(served, "256"))
  assert kept == {"dv": dv[1], "ds": ds[1]}
  assert ta.served_keys(ta.ATTENTION, {}) == {}


def test_qk_table_round_trip(tuned_dir):
  out = _tuning.table_path(qks.config.KERNEL, FAKE)
  row = [ta.candidate_key(ta.QK, e) for e in (ta.QK_ROW[0], ta.QK_ROW[-1])]  # whole row; row_align
  col = [ta.candidate_key(ta.QK, e) for e in ta.QK_COL[-2:]]
  head = [ta.candidate_key(ta.QK, e) for e in ta.QK_HEAD[:2]]
  ratios = {"256": {"row": [_ratios(row, [1.0, 1.4])], "col": [_ratios(col, [1.2, 1.0])],
                    "two_pass": [_ratios(["table"], [1.0])], "head": [_ratios(head, [1.1, 1.0])]},
            "512-ragged": {"row": [_ratios(row, [1.3, 1.0])], "col": [_ratios(col, [1.0, 1.2])]}}
  best_times = {"256": {"two_pass": [10.0], "head": [8.0]}, "512-ragged": {"two_pass": [5.0]}}
  tr._write_table(ta.QK, ratios, out, best_times, device_kind=FAKE)
  with open(out) as f:
    configs = json.load(f)["configs"]
  assert list(configs) == ["256", "512-ragged"]
  assert configs["256"] == {"scheme": "per_head", "row": dict(row[0]), "col": dict(col[1]),
                            "head": dict(head[1])}
  assert configs["256"]["row"]["block_k"] == qks.WHOLE_ROW
  assert configs["512-ragged"]["scheme"] == "two_pass"
  assert configs["512-ragged"]["row"]["row_align"] == 16
  # Read back by the kernel.
  cfg = ta.pass_config(ta.QK, dict(head[1]), 256, 256)
  assert qks.default_config(256, 256, 128, jnp.bfloat16, FAKE) == qks.Config(cfg, cfg, "per_head")
  two = qks.default_config(100, 256, 128, jnp.bfloat16, FAKE, schemes=("two_pass",))
  assert two == qks.Config(qks.PassConfig(16, 256, 4, 1), ta.pass_config(ta.QK, dict(col[1]), 100, 256))
  assert qks.default_config(300, 293, 64, jnp.float16, FAKE) == qks.Config(
      qks.PassConfig(32, 64, 4, 2, row_align=16), ta.pass_config(ta.QK, dict(col[0]), 300, 293))


def test_qk_forward_table_round_trip(tuned_dir, capsys, monkeypatch):
  """The forward's launch (pass ``fwd``) goes into its class's entry beside the backward's,
  and the forward reads it back for 16-bit inputs with D <= 128 (tiles capped at the padded
  lengths); other problems, and classes without one, keep the default."""
  out = _tuning.table_path(qks.config.KERNEL, FAKE)
  fwd = [ta.candidate_key(ta.QK, e, "fwd") for e in ta.QK_FWD[:3]]
  col = ta.candidate_key(ta.QK, ta.QK_COL[0])
  row = ta.candidate_key(ta.QK, ta.QK_ROW[4])
  ratios = {"1024": {"row": [_ratios([row], [1.0])], "col": [_ratios([col], [1.0])],
                     "fwd": [_ratios(fwd, [1.3, 1.1, 1.0]), _ratios(fwd, [1.2, 1.0, 1.05])]}}
  tr._write_table(ta.QK, ratios, out, {"1024": {"two_pass": [9.0, 9.0]}}, device_kind=FAKE)
  capsys.readouterr()
  with open(out) as f:
    entry = json.load(f)["configs"]["1024"]
  assert entry["fwd"] == dict(fwd[2]) == ta.QK_FWD[2]  # the best geomean over the workloads
  tuned = qks.ForwardConfig(64, 128, 4, 2)
  assert qks.forward_config(4096, 4096, 128, jnp.bfloat16, FAKE) == tuned
  assert qks.forward_config(100, 2048, 64, jnp.float16, FAKE) == tuned
  assert qks.forward_config(16, 1000, 64, jnp.bfloat16, FAKE) == qks.ForwardConfig(16, 128, 4, 2)
  default = qks.forward.default_forward_config
  f32 = jnp.float32
  assert qks.forward_config(4096, 4096, 128, f32, FAKE) == default(4096, 4096, 128, f32)
  assert qks.forward_config(4096, 4096, 256, jnp.bfloat16, FAKE) == default(4096, 4096, 256)
  assert qks.forward_config(64, 256, 128, jnp.bfloat16, FAKE) == default(64, 256, 128)  # no entry
  assert qks.forward_config(4096, 4096, 128, jnp.bfloat16, None) == default(4096, 4096, 128)
  # The entry point launches with it on the device (its kind FAKE); a config given wins.
  from pallas_kernels import _util
  monkeypatch.setattr(_util, "check_can_compile", lambda *a, **k: None)
  monkeypatch.setattr(_tuning, "device_kind_of", lambda *a, **k: FAKE)
  launched = []
  monkeypatch.setattr(qks.forward, "_call", lambda *a, config, **k: launched.append(config))
  query, key = jnp.zeros((1, 1, 16, 64), jnp.bfloat16), jnp.zeros((1, 1, 1000, 64), jnp.bfloat16)
  qks.forward.qk_scale_softmax_forward(query, key, 0.125)
  qks.forward.qk_scale_softmax_forward(query, key, 0.125, config=qks.ForwardConfig(16, 32, 4, 1))
  assert launched == [qks.ForwardConfig(16, 128, 4, 2), qks.ForwardConfig(16, 32, 4, 1)]
  with pytest.raises(ValueError, match="fwd: unknown fields"):
    ta.fwd_entry(ta.QK, dict(block_q=64, block_k=64, num_warps=4, num_stages=2, row_align=16))
  with pytest.raises(ValueError, match="block_k"):
    ta.parse_cands(ta.QK, "fwd=[(64,512,8,2)]")


def test_attention_forward_table_round_trip(tuned_dir, monkeypatch):
  """attention_softmax_dropout_value's forward launch (pass ``fwd``) rides in its class's
  entry beside dV and dS, and the forward reads it back (16-bit, D <= 128; capped)."""
  from pallas_kernels.attention_softmax_dropout_value import forward as fwd_kernel
  out = _tuning.table_path(asdv.config.KERNEL, FAKE)
  dv = ta.candidate_key(ta.ATTENTION, ta.ATTENTION_DV[0])
  ds = ta.candidate_key(ta.ATTENTION, ta.ATTENTION_DS[0])
  fwd = [ta.candidate_key(ta.ATTENTION, e, "fwd") for e in ta.ATTENTION_FWD[:3]]
  ratios = {"512": {"dv": [_ratios([dv], [1.0])], "ds": [_ratios([ds], [1.0])],
                    "fwd": [_ratios(fwd, [1.2, 1.1, 1.0])]}}
  tr._write_table(ta.ATTENTION, ratios, out, device_kind=FAKE)
  with open(out) as f:
    entry = json.load(f)["configs"]["512"]
  assert entry["fwd"] == ta.ATTENTION_FWD[2] and set(entry) == {"dv", "ds", "fwd"}
  tuned = _tuning.TritonPassConfig(32, 128, 4, 2)
  assert fwd_kernel.forward_config(512, 512, 128, jnp.bfloat16, FAKE) == tuned
  assert fwd_kernel.forward_config(16, 500, 64, jnp.float16, FAKE) == tuned.capped(16, 500)
  assert asdv.default_config(2, 8, 2, 512, 512, 128, jnp.bfloat16, FAKE) == asdv.Config(
      ta.pass_config(ta.ATTENTION, dict(dv), 512, 512),
      ta.pass_config(ta.ATTENTION, dict(ds), 512, 512))  # the backward ignores "fwd"
  # The entry point launches with it on the device (its kind FAKE); arguments given win.
  from pallas_kernels import _util
  monkeypatch.setattr(_util, "check_can_compile", lambda *a, **k: None)
  monkeypatch.setattr(_tuning, "device_kind_of", lambda *a, **k: FAKE)
  scores = jnp.zeros((1, 2, 16, 500), jnp.bfloat16)
  value = jnp.zeros((1, 1, 500, 64), jnp.bfloat16)
  launch = fwd_kernel._launch_args(scores, value, 0.0, None, None, None, None, None, False)[1][2]
  assert (launch["block_q"], launch["block_k"], launch["num_warps"], launch["num_stages"]) == (
      16, 128, 4, 2)
  launch = fwd_kernel._launch_args(scores, value, 0.0, None, None, 16, None, 3, False)[1][2]
  assert (launch["block_q"], launch["block_k"], launch["num_warps"], launch["num_stages"]) == (
      16, 16, 4, 3)
  default = _tuning.TritonPassConfig(32, 64, 4, 3)
  assert fwd_kernel.forward_config(512, 512, 128, jnp.float32, FAKE) == default
  assert fwd_kernel.forward_config(512, 2048, 128, jnp.bfloat16, FAKE) == default  # no entry
  assert fwd_kernel.forward_config(512, 512, 128, jnp.bfloat16, None) == default


def test_attention_tuner_times_the_forward_the_op_runs(monkeypatch):
  """The tuner's ``fwd`` pass times the fused forward the op's residual policy runs: on a
  Hopper GPU the Mosaic GPU backend's forward that normalizes last (rows of more than 128
  keys) or the one writing P and Pd (128 keys), elsewhere the Triton backend's."""
  import functools
  from pallas_kernels.attention_softmax_dropout_value import forward as fwd_kernel
  for hopper in (True, False):
    monkeypatch.setattr(tr, "is_hopper", lambda _, hopper=hopper: hopper)
    long = tr._attention_forward(2, 8, 2, 512, 512, 128, 0.1)
    short = tr._attention_forward(2, 8, 2, 128, 128, 128, 0.1)
    if hopper:
      assert long is fwd_kernel.attention_softmax_dropout_value_forward_unnormalized
      assert isinstance(short, functools.partial) and short.keywords == dict(
          store_dropped=True, store_keep=False, store_f32=False)
    else:
      assert long is fwd_kernel.attention_softmax_dropout_value_forward
      assert short is None   # the jnp forward: nothing to tune


def test_writer_leaves_out_entries_it_cannot_read(tuned_dir, capsys):
  old = str(tuned_dir / "old.json")
  with open(old, "w") as f:
    json.dump({"device_kind": FAKE, "configs": {
        "128": {"row": [64, 128, 8, 2], "col": [32, 64, 4, 3], "row_geomean_vs_best": 1.0},
        "256": {"scheme": "two_pass", "row": {"block_q": 64, "block_k": 256, "num_warps": 8,
                                              "num_stages": 2},
                "col": {"block_q": 32, "block_k": 64, "num_warps": 4, "num_stages": 3}}}}, f)
  col = ta.candidate_key(ta.QK, ta.QK_COL[0])
  result = tr._write_table(ta.QK, {"256": {"col": [_ratios([col], [1.0])]}}, old, {},
                           device_kind=FAKE)
  assert list(result["configs"]) == ["256"]
  assert result["configs"]["256"]["col"] == dict(col)
  assert result["configs"]["256"]["row"]["block_k"] == 256  # kept from the old entry
  assert "class 128 left out" in capsys.readouterr().out


def test_qk_tuner_keeps_dl_gemm_classes(tuned_dir, capsys):
  """The tuner does not time the dL + GEMM scheme: a class whose entry uses it keeps its
  scheme and its dl and causal_dl fields, and takes the new passes (its two-pass fallback)."""
  old = str(tuned_dir / "old.json")
  entry = {"scheme": "dl_gemm", "dl": {"rows": 2, "num_warps": 4},
           "causal_dl": {"rows": 1, "num_warps": 2},
           "row": {"block_q": 32, "block_k": 128, "num_warps": 4, "num_stages": 2},
           "col": {"block_q": 32, "block_k": 64, "num_warps": 4, "num_stages": 3}}
  with open(old, "w") as f:
    json.dump({"device_kind": FAKE, "configs": {"1024": entry}}, f)
  col = ta.candidate_key(ta.QK, ta.QK_COL[0])
  ratios = {"1024": {"col": [_ratios([col], [1.0])], "two_pass": [_ratios(["table"], [1.0])]}}
  result = tr._write_table(ta.QK, ratios, old, {"1024": {"two_pass": [9.0]}}, device_kind=FAKE)
  got = result["configs"]["1024"]
  assert got["scheme"] == "dl_gemm" and got["dl"] == {"rows": 2, "num_warps": 4}
  assert got["causal_dl"] == {"rows": 1, "num_warps": 2}
  assert got["col"] == dict(col) and got["row"] == entry["row"]
  assert "dl_gemm kept" in capsys.readouterr().out


def test_dl_candidates_build_valid_launches():
  for sk in (1, 100, 128, 293, 1024, 4096):
    for entry in ta.QK_DL:
      dl = qks.dl_config(entry, sk)
      assert isinstance(dl, qks.DlConfig) and dl.phased == entry.get("phased", False)
  assert common.label(tuple(ta.QK_DL[-1].items())) == "dl 2r/8w/phased"
  assert len({tuple(e.items()) for e in ta.QK_DL}) == len(ta.QK_DL)


def test_qk_tuner_picks_dl_gemm_when_its_launch_is_fastest(tuned_dir, capsys):
  """A class whose dL launch was timed takes the scheme with the best geomean, dl_gemm
  included, and its ``dl`` entry; ``default_config`` then runs that launch."""
  old = _tuning.table_path(qks.config.KERNEL, FAKE)
  os.makedirs(os.path.dirname(old))
  with open(old, "w") as f:  # a dl_gemm class whose causal launch the tuner does not time
    json.dump({"device_kind": FAKE, "configs": {"1024": {
        "scheme": "dl_gemm", "dl": {"rows": 1, "num_warps": 1},
        "causal_dl": {"rows": 2, "num_warps": 4},
        "row": {"block_q": 32, "block_k": 128, "num_warps": 4, "num_stages": 2},
        "col": {"block_q": 32, "block_k": 64, "num_warps": 4, "num_stages": 3}}}}, f)
  row, col = ta.candidate_key(ta.QK, ta.QK_ROW[5]), ta.candidate_key(ta.QK, ta.QK_COL[0])
  fast, slow = (tuple(e.items()) for e in ta.QK_DL[5:7])
  ratios = {key: {"row": [_ratios([row], [1.0])], "col": [_ratios([col], [1.0])],
                  "two_pass": [_ratios(["table"], [1.0])],
                  "dl": [_ratios([fast, slow], [1.0, 1.2])]} for key in ("1024", "2048")}
  best_times = {"1024": {"two_pass": [10.0], "dl": [8.0]},
                "2048": {"two_pass": [10.0], "dl": [12.0]}}
  result = tr._write_table(ta.QK, ratios, old, best_times, device_kind=FAKE)
  got = result["configs"]
  assert got["1024"]["scheme"] == "dl_gemm" and got["1024"]["dl"] == dict(fast)
  assert got["1024"]["causal_dl"] == {"rows": 2, "num_warps": 4}
  assert got["2048"]["scheme"] == "two_pass"
  _tuning.table.cache_clear()
  cfg = qks.default_config(1024, 1024, 128, jnp.bfloat16, FAKE)
  assert cfg.scheme == "dl_gemm" and cfg.dl == qks.dl_config(dict(fast), 1024, 1024)
  assert "dl 2r/2w" in capsys.readouterr().out


@pytest.mark.parametrize("op", [ta.ATTENTION, ta.QK, msd.config.KERNEL])
def test_checked_in_tables_are_valid_entries(op):
  """The writer keeps (re-writes unchanged in meaning) the classes of the tables there."""
  canonical = {ta.ATTENTION: tr.TABLE_ENTRY[ta.ATTENTION], ta.QK: tr.TABLE_ENTRY[ta.QK]}.get(op, tune.entry_json)
  with open(_tuning.table_path(op, "NVIDIA H200")) as f:
    configs = json.load(f)["configs"]
  for key, entry in configs.items():
    again = canonical(entry)
    assert canonical(again) == again, key


def test_merge_into_checked_in_tables_keeps_their_configs(tuned_dir):
  """A run that measured nothing re-writes each checked-in table with the same meaning."""
  kind = "NVIDIA H200"
  folder = tuned_dir / _tuning.device_dir(kind)
  folder.mkdir()
  lengths = [1, 100, 128, 131, 200, 256, 293, 512, 541, 1024, 1500, 2048, 4096]
  ops = {
      ta.ATTENTION: lambda sk: asdv.default_config(2, 8, 2, 256, sk, 128, jnp.bfloat16, kind),
      ta.QK: lambda sk: (qks.default_config(256, sk, 128, jnp.bfloat16, kind),
                         qks.default_config(sk, sk, 128, jnp.bfloat16, kind, causal=True)),
      msd.config.KERNEL: lambda sk: msd.default_config(256, sk, kind),
  }
  for op, default in ops.items():
    shutil.copy(os.path.join(REPO_TUNED_DIR, folder.name, f"{op}.json"), folder / f"{op}.json")
    _tuning.table.cache_clear()
    before = [default(sk) for sk in lengths]
    canonical = tr.TABLE_ENTRY.get(op, tune.entry_json)
    common.write_table({}, str(folder / f"{op}.json"), entry_json=canonical, merge=True,
                     per_field=True, device_kind=kind)
    _tuning.table.cache_clear()
    assert [default(sk) for sk in lengths] == before, op


def test_run_workload_times_the_served_entry_and_keeps_causal_dl():
  """A workload's record: every pass's candidates plus the class's served entry (timed by a
  stand-in measurement here), ``served`` naming that entry's candidates, and
  qk_scale_softmax's untimed ``causal_dl`` kept as the served entry has it."""
  from pallas_kernels import workloads as wl
  seen = {}

  def measure(trial, cands, sets, calls):
    seen[trial.name] = [key for key, _ in cands]
    return {key: 1.0 for key, _ in cands}

  spec = wl.spec()["qk_scale_softmax_backward"]
  w = spec["workloads"][14]   # (1, 4096, 4096)
  key = tr.length_class(ta.QK, spec["constants"], w)
  extra = dict(block_q=16, block_k=64, num_warps=2, num_stages=2)
  row = ta.candidate_key(ta.QK, extra, "row")
  served = {key: {"scheme": "two_pass", "row": extra, "col": ta.QK_COL[0],
                  "causal_dl": {"rows": 2, "num_warps": 4}}}
  record = tr.run_workload(ta.QK, spec["constants"], w, 14, measure, quick=True,
                           passes=("row",), served=served)
  assert record["key"] == key and set(record["times"]) == {"row"}
  assert row in seen["row"] and record["served"]["row"] == row
  assert record["causal_dl"] == {"rows": 2, "num_warps": 4}
  record = tr.run_workload(ta.QK, spec["constants"], w, 14, measure, quick=True,
                           passes=("row",))
  assert record["served"] == {} and "causal_dl" not in record
