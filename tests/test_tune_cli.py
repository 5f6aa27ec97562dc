"""``python -m pallas_kernels.tune`` on CPU with a fake timer: the user cache (its folder,
its precedence over the package's tables, per jax version and device kind), the command
line (``--quick``, ``--op``, ``--shape``, ``--write-package``), the progress bar, and the
``"backend": "xla"`` entries that make ``implementation=None`` run XLA for a class."""

from __future__ import annotations

import io
import json
import os

import jax
import pytest

from conftest import FakeHopper
from jax_ops import registry
from jax_ops.backend import Problem
from pallas_kernels import _tuning
from pallas_kernels import tune
from pallas_kernels import workloads as wl
from pallas_kernels.tune import common

H200 = "NVIDIA H200"
QK = "qk_scale_softmax"
MASKED = "masked_softmax_dropout"


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """An empty user cache under ``tmp_path``."""
  folder = tmp_path / "cache"
  monkeypatch.setenv(_tuning.CACHE_ENV, str(folder))
  _tuning.clear_caches()
  yield folder
  _tuning.clear_caches()


def _write(path, kind, configs, jax_version=None, cap="9.0"):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump({"device_kind": kind, "compute_capability": cap,
               "jax": jax_version or jax.__version__, "configs": configs}, f)
  _tuning.clear_caches()


def fake_measure(xla_classes=("128",)):
  """A timer: candidate ``i`` of a list takes ``10 + i``; the op's step 10 with the kernels,
  with XLA 5 in ``xla_classes`` and 1000 elsewhere. Records what it was asked."""
  asked = []

  def measure(trial, candidates, make_sets, *, calls):
    asked.append(trial)
    if trial.name == common.XLA:   # the op's step: XLA's against the kernels' (10)
      return {common.XLA: 5.0 if trial.key in xla_classes else 1000.0, common.PALLAS: 10.0}
    return {key: 10.0 + i for i, (key, _) in enumerate(candidates)}
  measure.asked = asked
  return measure


# ------------------------------------------------------------------- the user cache


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv(_tuning.CACHE_ENV, str(tmp_path / "mine"))
  assert _tuning.cache_dir() == str(tmp_path / "mine")
  assert _tuning.user_table_path(QK, H200) == str(
      tmp_path / "mine" / jax.__version__ / "nvidia_h200" / f"{QK}.json")
  monkeypatch.delenv(_tuning.CACHE_ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert _tuning.cache_dir() == str(tmp_path / "xdg" / "pallas_kernels")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert _tuning.cache_dir() == str(tmp_path / "home" / ".cache" / "pallas_kernels")


def test_the_user_cache_comes_ahead_of_the_package(cache):
  package = _tuning.table(MASKED, H200)
  assert _tuning.table_source(FakeHopper()) == "package"
  mine = {"target": 512, "num_warps": 2, "split": True}
  _write(_tuning.user_table_path(MASKED, H200), H200, {"256": mine})
  got = _tuning.table(MASKED, H200)
  assert got["256"] == mine and got["1024"] == package["1024"]  # other classes: the package's
  assert _tuning.table_source(FakeHopper()) == "user cache"
  assert _tuning.table_kind(FakeHopper()) == H200


def test_the_user_cache_serves_only_its_jax_and_device_kind(cache):
  package = _tuning.table(MASKED, H200)
  mine = {"256": {"target": 512, "num_warps": 2, "split": True}}
  _write(_tuning.user_table_path(MASKED, H200, "0.0.1"), H200, mine, "0.0.1")  # another jax
  assert _tuning.table(MASKED, H200) == package
  _write(_tuning.user_table_path(MASKED, H200), H200, mine, "0.0.1")  # says another jax
  assert _tuning.table(MASKED, H200) == package
  _write(_tuning.user_table_path(MASKED, H200), "NVIDIA H100", mine)  # another kind
  assert _tuning.table(MASKED, H200) == package
  assert _tuning.table_source(FakeHopper()) == "package"


def test_a_device_with_user_tables_keeps_its_architectures_package_classes(cache):
  """An H800 (no package tables) tuned by its user reads its own classes over those of its
  architecture's measured devices."""
  h800 = type("H800", (FakeHopper,), {"device_kind": "NVIDIA H800"})()
  assert _tuning.table_source(h800).startswith("fallback: ")
  mine = {"target": 512, "num_warps": 2, "split": True}
  _write(_tuning.user_table_path(MASKED, h800.device_kind), h800.device_kind, {"256": mine})
  assert _tuning.table_source(h800) == "user cache"
  kind = _tuning.table_kind(h800)
  assert kind == h800.device_kind
  got = _tuning.table(MASKED, kind)
  assert got["256"] == mine and got["1024"] == _tuning.table(MASKED, H200)["1024"]


# ------------------------------------------------------------------- XLA's classes


def _qk_problem(sk, *, causal=False, dtype="bfloat16", interpret=False, device=None):
  return Problem(op=QK, shapes=(("query", (2, 4, 128, 128)), ("key", (2, 4, sk, 128))),
                 dtype=dtype, causal=causal, device=device or FakeHopper(), interpret=interpret)


def test_an_xla_entry_runs_xla_for_its_class_only(cache):
  assert registry.resolve(QK, None, _qk_problem(128)).name == "mosaic_gpu"
  entry = dict(_tuning.table(QK, H200)["128"], backend="xla")
  _write(_tuning.user_table_path(QK, H200), H200, {"128": entry})
  assert registry.resolve(QK, None, _qk_problem(128)).name == "xla"
  assert registry.resolve(QK, None, _qk_problem(256)).name == "triton"   # another class
  assert registry.resolve(QK, None, _qk_problem(128, causal=True)).name == "mosaic_gpu"
  assert registry.resolve(QK, None, _qk_problem(128, dtype="float32")).name == "triton"
  assert registry.resolve(QK, None, _qk_problem(128, interpret=True)).name == "triton"
  assert registry.resolve(QK, "mosaic_gpu", _qk_problem(128)).name == "mosaic_gpu"
  assert registry.resolve(QK, "pallas", _qk_problem(128)).name == "mosaic_gpu"
  # The kernels still read the entry's config.
  assert _tuning.table(QK, H200)["128"] == {k: v for k, v in entry.items() if k != "backend"}
  assert _tuning.tuned_backend(QK, H200, "128") == "xla"
  assert _tuning.tuned_backend(QK, H200, "256") == "pallas"


def test_each_ops_rule_sends_only_its_tuned_problems_to_xla(cache):
  from pallas_kernels.attention_softmax_dropout_value import config as attention
  from pallas_kernels.masked_softmax_dropout import config as masked
  for op in tune.OPS:
    entry = dict(_tuning.table(op, H200)["1024"], backend="xla")
    _write(_tuning.user_table_path(op, H200), H200, {"1024": entry})
  assert attention.runs_xla(H200, 1024, 64, "bfloat16")
  assert not attention.runs_xla(H200, 512, 64, "bfloat16")     # another class
  assert not attention.runs_xla(H200, 1024, 64, "float32")     # not a tuned dtype
  assert not attention.runs_xla(H200, 1024, 256, "bfloat16")   # nor head dim
  assert masked.runs_xla(H200, 1024) and not masked.runs_xla(H200, 1000)
  problem = Problem(op="masked_softmax_dropout", shapes=(("scores", (2, 4, 8, 1024)),),
                    dtype="float32", device=FakeHopper())
  assert registry.resolve("masked_softmax_dropout", None, problem).name == "xla"
  assert not attention.runs_xla("NVIDIA A100-SXM4-80GB", 1024, 64, "bfloat16")
  bare = Problem(op="masked_softmax_dropout", shapes=(), dtype="float32", device=FakeHopper())
  assert not registry.tuned_to_xla("masked_softmax_dropout", bare)   # no shapes: no class


def test_the_shipped_tables_run_the_kernels():
  for op in tune.OPS:
    with open(_tuning.table_path(op, H200)) as f:
      configs = json.load(f)["configs"]
    assert not [k for k, e in configs.items() if e.get("backend", "pallas") != "pallas"], op


# ------------------------------------------------------------------- the command line


def test_quick_writes_every_kernels_table_to_the_user_cache(cache, capsys):
  measure = fake_measure()
  assert tune.main(["--quick"], measure=measure) == 0
  out = capsys.readouterr()
  kind = jax.devices()[0].device_kind
  for op in tune.OPS:
    path = _tuning.user_table_path(op, kind)
    assert path.startswith(str(cache)) and os.path.exists(path), op
    with open(path) as f:
      data = json.load(f)
    assert data["device_kind"] == kind and data["jax"] == jax.__version__
    assert data["configs"]["128"]["backend"] == "xla"
    assert all("backend" not in e for k, e in data["configs"].items() if k != "128")
    assert f"{op}: {path}" in out.out
  # One workload per class, each timed against XLA.
  for op in tune.OPS:
    keys = [t.key for t in measure.asked if t.op == op and t.name == common.XLA]
    assert keys and len(keys) == len(set(keys)), op
  assert "ETA" in out.err and "21/21" in out.err


def test_quick_takes_fewer_candidates():
  from pallas_kernels.tune import attention, masked
  for op in (attention.ATTENTION, attention.QK):
    full, quick = attention.candidates(op, False), attention.candidates(op, True)
    assert all(len(quick[n]) < len(full[n]) for n in full), op
  assert len(masked.candidates(True, {}, 512)) < len(masked.candidates(False, {}, 512))


def test_a_default_run_measures_every_class_of_the_spec_and_of_the_shipped_tables():
  """A class a run leaves out keeps the entry of the table under it: a whole run covers
  them all (the spec's workloads' classes, and those the shipped tables hold)."""
  for op in tune.OPS:
    constants, spec = wl.problem(op)
    classes = {tune.length_class(op, c, w) for c, w, _ in tune.default_workloads(op, False)}
    assert {tune.length_class(op, constants, w) for w in spec} <= classes, op
    for folder in os.listdir(_tuning.TUNED_DIR):
      path = os.path.join(_tuning.TUNED_DIR, folder, f"{op}.json")
      if os.path.exists(path):
        with open(path) as f:
          assert set(json.load(f)["configs"]) <= classes, (op, folder)


def test_quick_times_the_largest_workload_of_each_class():
  for op in tune.OPS:
    full, quick = tune.default_workloads(op, False), tune.default_workloads(op, True)
    key = lambda c, w, op=op: tune.length_class(op, c, w)
    assert sorted(key(c, w) for c, w, _ in quick) == sorted({key(c, w) for c, w, _ in full})
    for c, w, _ in quick:
      size = wl.floor_bytes(op, w, c)
      assert all(wl.floor_bytes(op, w2, c2) <= size
                 for c2, w2, _ in full if key(c2, w2) == key(c, w)), (op, w)
  masked_256 = [w for c, w, _ in tune.default_workloads(MASKED, True) if w["seq_len"] == 256]
  assert [(w["batch_size"], w["n_heads"]) for w in masked_256] == [(32, 8)]


def test_shape_tunes_the_class_of_the_shape_named(cache, capsys):
  measure = fake_measure(xla_classes=())
  assert tune.main(["--op", QK, "--shape", "8,32,1024,1024,128", "--shape", "1,2,300,300,64"],
                   measure=measure) == 0
  trials = [t for t in measure.asked if t.name == "row"]
  assert [(t.workload["batch_size"], t.constants["num_heads"], t.workload["seq_len_q"],
           t.workload["seq_len_k"], t.constants["head_dim"]) for t in trials] == [
      (8, 32, 1024, 1024, 128), (1, 2, 300, 300, 64)]
  assert trials[1].constants["scaling"] == 64 ** -0.5
  with open(_tuning.user_table_path(QK, jax.devices()[0].device_kind)) as f:
    assert sorted(json.load(f)["configs"]) == ["1024", "512-ragged"]
  assert not os.path.exists(_tuning.user_table_path(MASKED, jax.devices()[0].device_kind))
  capsys.readouterr()


def test_a_class_takes_the_untimed_causal_dl_of_the_table_that_served_it(
    cache, tmp_path, monkeypatch, capsys):
  """The causal dL launch is not timed: a class new to the device's table takes the one
  of the table that served the device (its architecture's, say)."""
  kind = jax.devices()[0].device_kind
  with open(_tuning.table_path(QK, H200)) as f:
    entry = json.load(f)["configs"]["256"]
  assert "causal_dl" in entry
  monkeypatch.setattr(_tuning, "TUNED_DIR", str(tmp_path / "tuned"))
  _write(_tuning.table_path(QK, kind), kind, {"256": entry})
  assert tune.main(["--op", QK, "--shape", "2,2,256,256,64"], measure=fake_measure()) == 0
  with open(_tuning.user_table_path(QK, kind)) as f:
    assert json.load(f)["configs"]["256"]["causal_dl"] == entry["causal_dl"]
  capsys.readouterr()


def test_each_workload_of_a_class_times_the_entry_the_run_found(cache, tmp_path, monkeypatch,
                                                                 capsys):
  """The run rewrites a class's entry after its first workload; the entry the tables held
  when it began is still a candidate on the class's later workloads, and masked's launches
  are timed with that entry's cache and eviction fields too."""
  from pallas_kernels import masked_softmax_dropout as msd
  kind = jax.devices()[0].device_kind
  found = {"target": 256, "num_warps": 1, "split": False, "store_eviction": "evict_first"}
  monkeypatch.setattr(_tuning, "TUNED_DIR", str(tmp_path / "tuned"))
  _write(_tuning.table_path(MASKED, kind), kind, {"256": found})
  asked = []
  measure_keys = fake_measure(xla_classes=())

  def recording(trial, candidates, make_sets, *, calls):
    if trial.name == "kernel":
      asked.append({key for key, _ in candidates})
    return measure_keys(trial, candidates, make_sets, calls=calls)
  assert tune.main(["--op", MASKED, "--shape", "2,4,256", "--shape", "4,16,256"],
                   measure=recording) == 0
  entry = msd.TableEntry.from_json(found)
  with_fields = msd.TableEntry(1024, 8, False, entry.variant)
  assert len(asked) == 2
  assert all(entry.config(256, 256) in keys for keys in asked)
  assert all(with_fields.config(256, 256) in keys for keys in asked)
  with open(_tuning.user_table_path(MASKED, kind)) as f:
    assert json.load(f)["configs"]["256"] != found  # the run did rewrite it
  capsys.readouterr()


@pytest.mark.parametrize("argv, message", [
    (["--shape", "1,2,3"], "exactly one --op"),
    (["--op", QK, "--shape", "1,2,3"], "B,H,Sq,Sk,D"),
    (["--op", MASKED, "--shape", "1,2,3,4,5"], "B,H,S[,P]"),
    (["--op", "attention_softmax_dropout_value", "--shape", "1,8,2,64,64"], "B,H,KVH,Sq,Skv,D"),
])
def test_bad_shapes_are_refused_before_tuning(argv, message, capsys):
  with pytest.raises(SystemExit):
    tune.main(argv, measure=fake_measure())
  assert message in capsys.readouterr().err


def test_help_defines_the_shapes(capsys):
  with pytest.raises(SystemExit):
    tune.main(["--help"])
  text = capsys.readouterr().out
  for tuple_ in ("B,H,KVH,Sq,Skv,D", "B,H,S[,P]", "B,H,Sq,Sk,D"):
    assert tuple_ in text
  assert "--write-package" in text and "--quick" in text


def test_write_package_writes_the_packages_table(cache, tmp_path, monkeypatch, capsys):
  tuned = tmp_path / "tuned"
  monkeypatch.setattr(_tuning, "TUNED_DIR", str(tuned))
  assert tune.main(["--op", MASKED, "--shape", "2,4,256", "--shape", "2,4,300,0.0",
                    "--write-package"], measure=fake_measure(xla_classes=("512-ragged",))) == 0
  kind = jax.devices()[0].device_kind
  with open(tuned / _tuning.device_dir(kind) / f"{MASKED}.json") as f:
    data = json.load(f)
  assert data["jax"] == jax.__version__ and data["device_kind"] == kind
  assert data["configs"]["256"] == {"target": 512, "num_warps": 1, "split": True}
  assert data["configs"]["512-ragged"]["backend"] == "xla"
  assert not os.path.exists(cache)  # nothing in the user cache
  _tuning.clear_caches()
  capsys.readouterr()


def test_without_a_gpu_it_exits_2(capsys):
  if jax.default_backend() == "gpu":
    pytest.skip("would tune")
  assert tune.main(["--quick"]) == 2
  assert "needs a CUDA GPU" in capsys.readouterr().err


# ------------------------------------------------------------------- the progress bar


class _Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_progress_bar_shows_steps_and_eta():
  stream, clock = io.StringIO(), _Clock()
  bar = common.Progress(4, stream=stream, clock=clock, width=8)
  bar.show("first")
  clock.now += 30
  bar.advance("one")
  clock.now += 90
  bar.advance("two")
  bar.close()
  lines = stream.getvalue().splitlines()
  assert lines[0] == "[........] 0/4   0%  elapsed 0s  ETA ?  first"
  assert lines[1] == "[##......] 1/4  25%  elapsed 30s  ETA 1m30s  one"
  assert lines[2] == "[####....] 2/4  50%  elapsed 2m00s  ETA 2m00s  two"


def test_progress_bar_redraws_one_line_on_a_terminal():
  class Tty(io.StringIO):
    def isatty(self):
      return True
  stream = Tty()
  bar = common.Progress(2, stream=stream, clock=_Clock())
  bar.advance()
  bar.advance()
  bar.close()
  text = stream.getvalue()
  assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1


# ------------------------------------------------------------------- what the device would run


def test_the_candidates_take_their_input_sets(cache, pretend_h200, monkeypatch, capsys):
  """Off a GPU nothing compiles for it, but what the timer gets fits together: XLA's backward
  runs on the workload's input sets, and the first candidate of each pass whose sets need no
  kernel to make lowers for a GPU (a pretended H200) on its sets."""
  from pallas_kernels import _util
  from pallas_kernels.attention_softmax_dropout_value import pallas_triton as asdv_triton
  from pallas_kernels.qk_scale_softmax import pallas_triton as qks_triton
  for module in (_util, asdv_triton, qks_triton):  # traced arguments hold no device
    monkeypatch.setattr(module, "check_can_compile", lambda *a, **k: None)
  ran = []

  def measure(trial, candidates, make_sets, *, calls):
    if trial.name in ("ds", "col"):  # their sets come from a pass-1 kernel
      return {key: 1.0 for key, _ in candidates}
    sets = make_sets()
    assert len(sets) >= 2
    key, fn = candidates[0]
    if trial.name == common.XLA:
      jax.block_until_ready(jax.jit(fn)(*sets[0]))
    else:
      shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in sets[0]]
      jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    ran.append((trial.op, trial.name))
    return {key: 1.0 for key, _ in candidates}

  # Attention's fused forward runs (and is timed) on rows of >= 512 keys off Hopper.
  for op, shape in [(MASKED, "1,2,40"), (QK, "1,2,40,48,32"),
                    ("attention_softmax_dropout_value", "1,4,2,24,40,32"),
                    ("attention_softmax_dropout_value", "1,4,2,24,512,32")]:
    assert tune.main(["--op", op, "--shape", shape, "--quick"], measure=measure) == 0
  assert sorted(set(ran)) == sorted({
      (MASKED, "kernel"), (MASKED, "op"), (MASKED, "xla"), (QK, "row"), (QK, "two_pass"),
      (QK, "head"), (QK, "dl"), (QK, "fwd"), (QK, "xla"), ("attention_softmax_dropout_value", "dv"),
      ("attention_softmax_dropout_value", "fwd"),
      ("attention_softmax_dropout_value", "xla")})
  capsys.readouterr()
