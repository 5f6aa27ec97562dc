"""The tree's rules: source files stay readable, the packages' docs state contracts (history
belongs in docs/ and benchmarks/results/), and benchmarks/ holds only the maintained scripts."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 700
MAX_BENCHMARK_SCRIPTS = 8
MAX_RESULT_FILES = 40
MAX_README_WORDS = 2000

# What reads as lab notes in a docstring or comment: a commit hash, a timing, a verdict.
_LAB_NOTES = {
    "commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
    "timing": re.compile(r"\b\d+(\.\d+)?\s?(us|µs|ms)\b"),
    "opt-in": re.compile(r"\bopt-in\b", re.I),
    "measured verdict": re.compile(r"\bmeasured (slower|faster)\b", re.I),
}


def _tracked(*prefixes):
  out = subprocess.run(["git", "ls-files", *prefixes], cwd=ROOT, capture_output=True,
                       text=True, check=True).stdout.split()
  return [p for p in out if os.path.exists(os.path.join(ROOT, p))]


def _in_git():
  return os.path.exists(os.path.join(ROOT, ".git"))  # a directory, or a worktree's file


pytestmark = pytest.mark.skipif(not _in_git(), reason="needs the git checkout")


def lab_notes(text: str) -> list[str]:
  return [f"{kind}: {m.group(0)!r}" for kind, rx in _LAB_NOTES.items() for m in rx.finditer(text)]


def test_lab_notes_are_found():
  assert lab_notes("kept: 41.2 us at 3b1191a, opt-in, measured slower")
  assert not lab_notes("dS = P * (dW - delta); 7 bytes per element; block_q = 128")


@pytest.mark.parametrize("package", ["pallas_kernels", "jax_ops"])
def test_packages_carry_no_lab_notes(package):
  found = {p: lab_notes(open(os.path.join(ROOT, p)).read())
           for p in _tracked(package) if p.endswith(".py")}
  assert {p: n for p, n in found.items() if n} == {}


def test_no_source_file_is_too_long():
  long = {p: n for p in _tracked("pallas_kernels", "jax_ops", "tests", "benchmarks", "scripts",
                                 "examples") if p.endswith(".py")
          for n in [sum(1 for _ in open(os.path.join(ROOT, p)))] if n > MAX_LINES}
  assert long == {}


def test_benchmarks_hold_the_maintained_scripts():
  scripts = [p for p in _tracked("benchmarks") if not p.startswith("benchmarks/results/")
             and not p.endswith("__init__.py")]
  assert len(scripts) <= MAX_BENCHMARK_SCRIPTS, scripts
  assert len(_tracked("benchmarks/results")) <= MAX_RESULT_FILES


def test_readme_is_short():
  with open(os.path.join(ROOT, "README.md")) as f:
    assert len(f.read().split()) <= MAX_README_WORDS  # words, code included
