"""The install is reproducible, licensed and typed: pinned versions that setup.sh installs from,
SPDX license metadata with the license file, and the PEP 561 marker in both packages."""

import os
import re
import shutil
import subprocess
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name):
  with open(os.path.join(ROOT, name)) as f:
    return f.read()


def test_constraints_pin_every_dependency_exactly():
  pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", _read("constraints.txt"), flags=re.M))
  assert pins["jax"] == "0.11.2" and pins["jaxlib"] == "0.11.2"
  meta = tomllib.loads(_read("pyproject.toml"))["project"]
  names = list(meta["dependencies"]) + [d for ds in meta["optional-dependencies"].values() for d in ds]
  for dep in names:
    name = re.split(r"[<>=\[ ]", dep)[0]
    assert name.lower() in {k.lower() for k in pins}, f"{name} is not pinned in constraints.txt"
  assert not [l for l in _read("constraints.txt").splitlines()
              if l and not l.startswith("#") and "==" not in l]


def test_setup_installs_from_the_constraints():
  assert re.search(r"pip install -q -e '\.\[test,flax,bench\]' -c constraints\.txt",
                   _read("scripts/setup.sh"))


def test_spdx_license_and_file():
  meta = tomllib.loads(_read("pyproject.toml"))
  assert meta["project"]["license"] == "Apache-2.0"
  assert meta["project"]["license-files"] == ["LICENSE"]
  assert "Apache License" in _read("LICENSE") and "Version 2.0" in _read("LICENSE")


def test_py_typed_ships_in_both_packages():
  """PEP 561: each package holds a ``py.typed`` marker and the package data lists it, so a
  wheel carries it and type checkers read the packages' annotations."""
  package_data = tomllib.loads(_read("pyproject.toml"))["tool"]["setuptools"]["package-data"]
  for package in ("jax_ops", "pallas_kernels"):
    assert "py.typed" in package_data.get(package, []), package
    assert os.path.isfile(os.path.join(ROOT, package, "py.typed")), package


def test_setup_names_the_python_it_needs(tmp_path):
  """Where no .venv works yet, setup.sh stops before pip on a Python older than 3.12 and
  says which one it needs."""
  (tmp_path / "scripts").mkdir()
  shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), tmp_path / "scripts" / "setup.sh")
  old = tmp_path / "python3.11"
  old.write_text('#!/bin/sh\n[ "$1" = "-V" ] && echo "Python 3.11.9" && exit 0\nexit 1\n')
  old.chmod(0o755)
  out = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True,
                       text=True, env={**os.environ, "PYTHON": str(old)}, timeout=60)
  assert out.returncode == 1
  assert f"setup.sh: needs Python >= 3.12, but {old} is Python 3.11.9" in out.stderr
  assert not (tmp_path / ".venv").exists()
  meta = tomllib.loads(_read("pyproject.toml"))["project"]
  assert meta["requires-python"] == ">=3.12"


def test_jax_range_holds_both_tested_versions():
  """pyproject.toml admits a jax range; CI tests its ends: the pins of constraints.txt and
  the jax of scripts/setup.sh --jax 0.12."""
  from packaging.requirements import Requirement
  pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", _read("constraints.txt"), flags=re.M))
  newest = re.search(r"^JAX012=(\S+)$", _read("scripts/setup.sh"), flags=re.M)[1]
  deps = [Requirement(d) for d in tomllib.loads(_read("pyproject.toml"))["project"]["dependencies"]]
  specs = {r.name: r.specifier for r in deps}
  for name in ("jax", "jaxlib"):
    assert not specs[name].contains("0.11.1") and not specs[name].contains("0.13.0"), specs[name]
    assert specs[name].contains(pins[name]) and specs[name].contains(newest), specs[name]
  assert newest.startswith("0.12.")


def test_package_data_holds_what_the_check_reads():
  """``python -m pallas_kernels.check`` runs from an install without ``benchmarks/``: the
  workloads file and the tuned tables are package data, and each pattern matches files."""
  import glob
  package_data = tomllib.loads(_read("pyproject.toml"))["tool"]["setuptools"]["package-data"]
  patterns = package_data["pallas_kernels"]
  assert "workloads.json" in patterns and "tuned/*/*.json" in patterns
  for pattern in patterns:
    assert glob.glob(os.path.join(ROOT, "pallas_kernels", pattern)), pattern
  from pallas_kernels import workloads
  assert os.path.samefile(workloads.PATH, os.path.join(ROOT, "pallas_kernels", "workloads.json"))
