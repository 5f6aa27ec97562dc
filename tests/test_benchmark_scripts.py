"""The benchmark scripts on CPU: they import, say they need a GPU and exit 2; their results
go to ``benchmarks/results/<device>/`` with the date, device, jax version and commit; two
runs compare workload by workload; runs of parts of the workloads merge."""

import json
import os

import pytest

from conftest import ON_GPU
from benchmarks import chart, run, step
from pallas_kernels import workloads as wl


@pytest.mark.skipif(ON_GPU, reason="on a GPU the scripts run")
@pytest.mark.parametrize("script, argv", [
    (run, ["--quick"]),
    (run, ["--op", "qk_scale_softmax_causal", "--out", "/nonexistent"]),
    (step, ["--op", "masked_softmax_dropout"]),
])
def test_scripts_exit_2_without_a_gpu(script, argv, capsys):
  assert script.main(argv) == 2
  assert "needs a CUDA GPU" in capsys.readouterr().err


def test_run_checks_its_arguments_before_the_gpu(capsys):
  with pytest.raises(SystemExit):
    run.main(["--backend", "nope"])
  assert "--backend: expected one of" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    run.main(["--op", run.FROM_DELTA, "--backend", "mosaic_gpu"])
  assert "times the Triton backend's" in capsys.readouterr().err


def test_result_names_keep_the_entry_points_results():
  """A named backend or a subset writes files of its own; the entry points' full run the
  ``<op>.*`` that the README links."""
  assert run.result_name("qk_scale_softmax", run.ENTRY, False) == "qk_scale_softmax"
  assert run.result_name("qk_scale_softmax", run.ENTRY, True) == "qk_scale_softmax_subset"
  assert run.result_name("qk_scale_softmax", "triton", False) == "qk_scale_softmax_triton"
  assert (run.result_name("masked_softmax_dropout", "xla", True)
          == "masked_softmax_dropout_xla_subset")
  names = {run.result_name(op, b, s) for op in run.PROBLEMS
           for b in (run.ENTRY, "triton", "mosaic_gpu", "xla") for s in (False, True)}
  assert len(names) == len(run.PROBLEMS) * 8


def test_default_ops_include_the_causal_table():
  from jax_ops import registry
  assert run.default_ops(run.ENTRY) == ["attention_softmax_dropout_value",
                                        "masked_softmax_dropout", "qk_scale_softmax",
                                        "qk_scale_softmax_causal"]
  for name in ("triton", "mosaic_gpu", "xla"):
    ops = run.default_ops(name)
    assert [op for op in ops if op in run.PROBLEMS] == [
        op for op in run.PROBLEMS if name in registry.available(op)]
    assert ("qk_scale_softmax_causal" in ops) == ("qk_scale_softmax" in ops)


def test_op_names_are_the_registry_names():
  from jax_ops import registry
  for op in run.PROBLEMS:
    assert registry.available(op)
  assert set(step.OPS) == set(run.PROBLEMS)
  assert {s.op for s in step.STEPS} == set(step.OPS)


def test_results_go_to_a_folder_per_device():
  assert run.results_dir("NVIDIA H200") == os.path.join(run.HERE, "results", "nvidia_h200")
  assert run.results_dir("NVIDIA H100 80GB HBM3").endswith(
      os.path.join("results", "nvidia_h100_80gb_hbm3"))


def test_results_header_names_date_device_jax_commit():
  meta = {"date": "2026-12-05T20:00:00+00:00", "device": "NVIDIA H200", "jax": "0.11.2",
          "commit": "c51e9d0", "calls": 30, "backend": "entry",
          "ceiling": {"TBps": 4.3, "method": "pallas_copy", "all_TBps": {"pallas_copy": 4.3}}}
  rows = [{"workload": "1, 128, 128", "kernels": "triton", "floor_us": 1.0, "pallas_us": 2.0,
           "xla_us": 4.0, "pallas_frac_floor": 0.5, "xla_frac_floor": 0.25, "speedup": 2.0,
           "checks": [{"within": 1.0, "ok": True}], "passed": True}]
  summary = dict(run.summarize(rows), workloads="1 of 1")
  text = run.markdown("qk_scale_softmax", meta, rows, summary)
  for line in ("- date: 2026-12-05", "- device: NVIDIA H200", "- jax: 0.11.2",
               "- commit: c51e9d0"):
    assert line in text
  assert "| 1, 128, 128 | triton | 1.0 | 2.0 | 50.0% | 4.0 | 25.0% | 2.00x | pass" in text
  text = step.markdown(meta, [])
  assert "- device: NVIDIA H200" in text and "- commit: c51e9d0" in text


def test_commit_names_the_timed_tree(monkeypatch):
  """In a git checkout: the short hash of HEAD (a prefix of its full hash), then
  ``+local changes`` or nothing."""
  import re
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.abspath(run.__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=root)
  except OSError:
    pytest.skip("no git")
  if head.returncode:
    pytest.skip("not a git checkout")
  monkeypatch.delenv("BENCH_COMMIT", raising=False)
  commit = run._commit()
  match = re.fullmatch(r"([0-9a-f]{7,40})( \+local changes)?", commit)
  assert match, commit
  assert head.stdout.strip().startswith(match.group(1))


def test_compare_pairs_rows_by_workload(tmp_path, capsys):
  def write(folder, name, times):
    folder.mkdir(exist_ok=True)
    rows = [{"workload" if "step" not in name else "step": label, "pallas_us": t,
             "passed": True} for label, t in times.items()]
    (folder / name).write_text(json.dumps({"commit": folder.name, "device": "GPU",
                                           "rows": rows}))
  old, new = tmp_path / "old", tmp_path / "new"
  write(old, "masked_softmax_dropout.json", {"1, 2, 256, 0.1": 10.0, "4, 4, 4096, 0.1": 100.0})
  write(new, "masked_softmax_dropout.json", {"4, 4, 4096, 0.1": 110.0, "1, 2, 256, 0.1": 10.1})
  write(old, "step.json", {"qk_scale_softmax, B=1 H=32 S=4096": 50.0})
  write(new, "step.json", {"qk_scale_softmax, B=1 H=32 S=4096": 40.0})
  write(new, "qk_scale_softmax.json", {"1, 128, 128": 1.0})  # not in the old run: skipped
  assert run.main(["--compare", str(old), str(new)]) == 0
  out = capsys.readouterr().out
  rows = run.compare(str(old), str(new))
  assert [(r["file"], r["row"], round(r["ratio"], 3)) for r in rows] == [
      ("masked_softmax_dropout.json", "4, 4, 4096, 0.1", 1.1),
      ("masked_softmax_dropout.json", "1, 2, 256, 0.1", 1.01),
      ("step.json", "qk_scale_softmax, B=1 H=32 S=4096", 0.8)]
  assert out.count("SLOWER") == 1 and "old (GPU) -> new (GPU)" in out


def test_merge_joins_workload_runs_in_order(tmp_path, capsys):
  spec = wl.spec()["masked_softmax_dropout_backward"]["workloads"]
  labels = [wl.label("masked_softmax_dropout", w, False) for w in spec]

  def write(folder, indices, commit="abc1234", ceiling=3.0):
    folder.mkdir()
    rows = [{"workload": labels[i], "floor_us": 1.0, "pallas_us": 2.0 + i, "xla_us": 4.0,
             "pallas_frac_floor": 1 / (2.0 + i), "xla_frac_floor": 0.25,
             "speedup": 4 / (2.0 + i), "kernels": "triton",
             "checks": [{"within": 1.0, "ok": True}], "passed": True}
            for i in indices]
    meta = {"date": "2026-12-06", "device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2",
            "commit": commit, "calls": 30, "backend": run.ENTRY,
            "ceiling": {"TBps": ceiling, "method": "xla_scale",
                        "all_TBps": {"xla_scale": ceiling}}}
    (folder / "masked_softmax_dropout_subset.json").write_text(json.dumps(
        {"op": "masked_softmax_dropout", **meta, "summary": {}, "rows": rows}))
  write(tmp_path / "b", range(8, 16), ceiling=3.1)
  write(tmp_path / "a", range(0, 8))
  out = tmp_path / "out"
  assert run.main(["--merge", str(out), str(tmp_path / "b"), str(tmp_path / "a")]) == 0
  res = json.loads((out / "masked_softmax_dropout.json").read_text())
  assert [r["workload"] for r in res["rows"]] == labels
  assert res["commit"] == "abc1234" and res["summary"]["all_passed"]
  assert res["summary"]["workloads"] == (
      "16 of 16 (merged from 2 runs, copy ceilings 3.000-3.100 TB/s)")
  assert "| **geomean** |" in (out / "masked_softmax_dropout.md").read_text()
  part = run.merge(str(tmp_path / "part"), [str(tmp_path / "a")])
  assert part == ["masked_softmax_dropout_subset"]
  write(tmp_path / "other", [3], commit="def5678")
  with pytest.raises(ValueError, match="differ in commit"):
    run.merge(str(out), [str(tmp_path / "a"), str(tmp_path / "other")])


def test_chart_needs_a_results_file(capsys):
  with pytest.raises(SystemExit):
    chart.main([])
  assert "usage" in capsys.readouterr().err


def test_committed_results_carry_their_provenance():
  """Every results JSON under benchmarks/results/<device>/ names its date, device, jax
  version and commit, and its device matches its folder."""
  from pallas_kernels import _tuning
  root = os.path.join(run.HERE, "results")
  found = 0
  for folder in sorted(os.listdir(root)):
    if folder == "runs" or not os.path.isdir(os.path.join(root, folder)):
      continue
    for name in sorted(os.listdir(os.path.join(root, folder))):
      if not name.endswith(".json"):
        continue
      with open(os.path.join(root, folder, name)) as f:
        res = json.load(f)
      assert {"date", "device", "jax", "commit"} <= set(res), name
      assert _tuning.device_dir(res["device"]) == folder, name
      found += 1
  assert found
