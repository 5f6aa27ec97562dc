"""Tests of the benchmark bookkeeping: ``benchmarks.merge`` (joining partial runs) and the floors."""

from __future__ import annotations

import json
import os

from benchmarks import merge

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                       "attention_softmax_dropout_value.json")


def _load():
  with open(RESULTS) as f:
    return json.load(f)


def _part(tmp_path, name, commit, rows):
  """A results file of one run at ``commit`` (rows carry no commit of their own)."""
  part = {k: v for k, v in _load().items() if k not in ("rows", "summary", "ceilings_TBps")}
  part.update(commit=commit, date=f"date-{name}", calls=12,
              rows=[{k: v for k, v in r.items() if k != "commit"} for r in rows])
  path = tmp_path / f"{name}.json"
  path.write_text(json.dumps(part))
  return str(path)


def test_merge_keeps_each_rows_commit(tmp_path):
  rows = _load()["rows"]
  # Two runs overlapping on two workloads: the later run's rows win.
  op, meta, merged, summary = merge.merge([_part(tmp_path, "a", "aaaaaaa", rows[:10]),
                                           _part(tmp_path, "b", "bbbbbbb", rows[8:])])
  assert op == "attention_softmax_dropout_value"
  assert [r["workload"] for r in merged] == [r["workload"] for r in rows]
  assert [r["commit"] for r in merged] == ["aaaaaaa"] * 8 + ["bbbbbbb"] * 8
  assert meta["commit"] == "aaaaaaa (8 workloads) / bbbbbbb (8 workloads)"
  assert summary["workloads"] == "16 (merged from 2 runs)"
  # A merged file merges again: its rows keep their commits, its runs are counted.
  again = tmp_path / "merged.json"
  again.write_text(json.dumps(dict(meta, op=op, rows=merged, calls=12)))
  _, meta, merged, summary = merge.merge([str(again), _part(tmp_path, "c", "ccccccc", rows[:1])])
  assert meta["commit"] == "ccccccc (1 workloads) / aaaaaaa (7 workloads) / bbbbbbb (8 workloads)"
  assert summary["workloads"] == "16 (merged from 3 runs)"


def test_causal_floor_counts_the_elements_on_and_below_the_diagonal():
  """The causal table's floor reads g and P only where a causal P may be non-zero."""
  import numpy as np
  from benchmarks import run
  for sq, sk in [(1, 1), (5, 5), (3, 7), (7, 3), (211, 211)]:
    brute = int(np.sum(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)))
    assert run.causal_elements(sq, sk) == brute, (sq, sk)
  w = {"batch_size": 2, "seq_len_q": 8, "seq_len_k": 8}
  c = {"num_heads": 3, "head_dim": 4}
  qkd = 2 * 2 * 2 * 3 * (8 + 8) * 4
  assert run._c_floor(w, c) == 4 * 2 * 3 * 64 + qkd
  assert run._c_floor(w, c, causal=True) == 4 * 2 * 3 * 36 + qkd


def test_merge_keeps_the_floor_and_refuses_to_mix_floors(tmp_path):
  import pytest
  rows = _load()["rows"]
  a, b = _part(tmp_path, "a", "aaaaaaa", rows[:8]), _part(tmp_path, "b", "bbbbbbb", rows[8:])
  for path in (a, b):
    part = json.loads(open(path).read())
    part["floor_note"] = "the causal problem's"
    open(path, "w").write(json.dumps(part))
  _, meta, _, _ = merge.merge([a, b])
  assert meta["floor_note"] == "the causal problem's"
  with pytest.raises(ValueError, match="different floors"):
    merge.merge([a, _part(tmp_path, "c", "ccccccc", rows[:2])])
