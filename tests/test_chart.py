"""benchmarks/chart.py: a results JSON gives a PNG; without matplotlib, None and a note."""

from __future__ import annotations

import builtins
import json

import pytest

from benchmarks import chart

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _results(tmp_path):
  rows = [{"workload": f"{b}, 256, 0.1", "batch_size": b, "seq_len": 256, "p_dropout": 0.1,
           "atol": 1e-5, "rtol": 1e-5, "floor_us": 10.0, "pallas_us": 12.0, "xla_us": 20.0,
           "pallas_frac_floor": 0.8 + 0.05 * i, "xla_frac_floor": 0.5, "passed": i != 1}
          for i, b in enumerate((1, 2, 4))]
  res = {"op": "toy_op", "date": "2026-11-30T06:41:43+00:00 / 2026-11-30T07:00:00+00:00",
         "device": "Toy GPU", "jax": "0", "commit": "abc1234", "backend": "triton",
         "summary": {"pallas_frac_floor": 0.85, "xla_frac_floor": 0.5}, "rows": rows}
  path = tmp_path / "toy_op.json"
  path.write_text(json.dumps(res))
  return path


def test_write_chart_writes_png(tmp_path):
  pytest.importorskip("matplotlib")  # the bench extra; without it the test below covers chart.py
  path = _results(tmp_path)
  png = chart.write_chart(str(path))
  assert png == str(tmp_path / "toy_op.png")
  data = (tmp_path / "toy_op.png").read_bytes()
  assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
  # An explicit destination, as benchmarks/run.py's write_results passes it.
  other = tmp_path / "other.png"
  assert chart.write_chart(str(path), str(other)) == str(other)
  assert other.read_bytes().startswith(PNG_SIGNATURE)


def test_write_chart_without_matplotlib(tmp_path, monkeypatch, capsys):
  real_import = builtins.__import__

  def no_matplotlib(name, *args, **kwargs):
    if name == "matplotlib" or name.startswith("matplotlib."):
      raise ImportError(f"No module named {name!r} (simulated)")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_matplotlib)
  path = _results(tmp_path)
  assert chart.write_chart(str(path)) is None
  assert not (tmp_path / "toy_op.png").exists()
  out = capsys.readouterr().out
  assert "matplotlib is not installed" in out and len(out.strip().splitlines()) == 1


def test_short_dates():
  assert chart._short_dates("2026-11-30T12:03:21+00:00 / 2026-11-30T15:47:03+00:00") == (
      "2026-11-30 12:03, 15:47 UTC")
  assert chart._short_dates("not a date") == "not a date"
