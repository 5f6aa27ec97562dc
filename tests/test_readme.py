"""Every Python code block of the README runs, in order, as a reader would paste them into one
session (a fresh interpreter with 4 forced CPU devices, so the sharding block has a mesh)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The set-up the README's blocks assume and do not show: a CPU host with several devices.
SETUP = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
"""


def python_blocks():
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_python_blocks():
  """The blocks fenced with ```python (the ones test_every_python_block_runs runs)."""
  assert len(python_blocks()) == 6


def test_every_python_block_runs():
  blocks = python_blocks()
  script = SETUP + "".join(
      f"\nprint('README block {i}', flush=True)\n{block}" for i, block in enumerate(blocks))
  script += "\nprint('README OK', flush=True)\n"
  run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
  assert "README OK" in run.stdout


def test_readme_commands_use_the_venv():
  """Tool commands run with the environment the set-up script makes, not the system python."""
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
    for line in block.splitlines():
      assert not re.search(r"(^|\s)python3?\s", line), line
