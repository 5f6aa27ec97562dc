"""Prints the import graph of the project's two packages and checks its rules.

    .venv/bin/python scripts/import_graph.py

Rules: no cycles; ``pallas_kernels`` imports nothing of ``jax_ops``, except its command-line
tools (:data:`TOOLS`: ``python -m pallas_kernels.check``, which runs the ops, and
``pallas_kernels.tune``), and no module but a tool imports a tool (the tuner times the op's
step as the check builds it), so no cycle can pass through one; no
``jax_ops`` module imports a backend file (``jax_ops/ops/<op>/xla.py``, ``pallas_triton.py``,
...), which the registry loads by name; no op's package imports another op's. Exits non-zero if
a rule is broken.
"""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pallas_kernels", "jax_ops")
# The command-line tools of pallas_kernels: they may import jax_ops, and nothing imports them.
TOOLS = ("pallas_kernels.check", "pallas_kernels.tune")
# Modules of pallas_kernels that belong to no op (the tools among them may import every op's).
SHARED = ("validation", "tuned", "workloads", *(t.split(".")[1] for t in TOOLS))


def modules() -> dict[str, str]:
  found = {}
  for pkg in PACKAGES:
    for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
          found[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
  return found


def imports(path: str, name: str, known: set[str]) -> set[str]:
  tree = ast.parse(open(path).read())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      base = node.module
      subs = [f"{base}.{a.name}" for a in node.names]
      # ``from pkg import submodule`` imports the submodule; other names come from pkg itself
      targets = [t for t in subs if t in known] or [base]
      if any(t not in known for t in subs) and base not in targets:
        targets.append(base)
    else:
      continue
    for t in targets:
      while t and t not in known:
        t = t.rpartition(".")[0]
      if t and t != name:
        out.add(t)
  return out


def graph() -> dict[str, set[str]]:
  mods = modules()
  return {m: imports(p, m, set(mods)) for m, p in sorted(mods.items())}


def is_backend(module: str) -> bool:
  parts = module.split(".")
  return parts[:2] == ["jax_ops", "ops"] and len(parts) == 4 and parts[3] not in ("api", "reference")


def op_of(module: str) -> str | None:
  """The op whose package holds ``module`` (``pallas_kernels.<op>...`` or
  ``jax_ops.ops.<op>...``), else ``None``."""
  parts = module.split(".")
  if parts[0] == "pallas_kernels" and len(parts) > 1 and not parts[1].startswith("_") \
      and parts[1] not in SHARED:
    return parts[1]
  if parts[:2] == ["jax_ops", "ops"] and len(parts) > 2:
    return parts[2]
  return None


def cross_op_edges(g: dict[str, set[str]]) -> list[tuple[str, str]]:
  """Imports from one op's package into another's."""
  return sorted((m, d) for m, ds in g.items() for d in ds
                if op_of(m) and op_of(d) and op_of(m) != op_of(d))


def is_tool(module: str) -> bool:
  return module in TOOLS or module.startswith(tuple(t + "." for t in TOOLS))


def jax_ops_imports(g: dict[str, set[str]]) -> list[tuple[str, str]]:
  """Imports of ``jax_ops`` by a ``pallas_kernels`` module other than a tool."""
  return sorted((m, d) for m, ds in g.items() for d in ds
                if m.startswith("pallas_kernels") and not is_tool(m) and d.startswith("jax_ops"))


def tool_imports(g: dict[str, set[str]]) -> list[tuple[str, str]]:
  """Imports of a tool by a module that is not a tool (a tool may use another; the cycle
  check covers them)."""
  return sorted((m, d) for m, ds in g.items() for d in ds if is_tool(d) and not is_tool(m))


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
  found, state = [], {}

  def visit(m, stack):
    state[m] = 1
    for d in sorted(g.get(m, ())):
      # a package's __init__ importing its own submodules is not a cycle of modules
      if d.startswith(m + "."):
        continue
      if state.get(d) == 1:
        found.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
      elif not state.get(d):
        visit(d, stack + [d])
    state[m] = 2

  for m in g:
    if not state.get(m):
      visit(m, [m])
  return found


def main() -> int:
  g = graph()
  for m, deps in g.items():
    print(f"{m} -> {', '.join(sorted(deps)) or '-'}")
  problems = [f"cycle: {' -> '.join(c)}" for c in cycles(g)]
  problems += [f"{m} imports jax_ops ({d})" for m, d in jax_ops_imports(g)]
  problems += [f"{m} imports the command-line tool {d}" for m, d in tool_imports(g)]
  problems += [f"{m} imports the backend file {d}" for m, deps in g.items()
               if m.startswith("jax_ops") for d in deps if is_backend(d) and not is_backend(m)]
  problems += [f"{m} imports another op's {d}" for m, d in cross_op_edges(g)]
  print("\n".join(problems) if problems else "\nno cycles; pallas_kernels does not import jax_ops "
        "(but for its command-line tools, which no module imports); no jax_ops module imports a "
        "backend file; no op's package imports another op's")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
