"""The package's import graph has no cycle: every module can be read (and imported) after the
modules it names, top-level and function-level imports alike."""

import ast
import os

from conftest import REPO

PACKAGE = "electra_jax"


def _modules() -> dict[str, str]:
  """{dotted module name: file} of every module in the package (packages by their __init__)."""
  modules = {}
  for directory, _, files in os.walk(os.path.join(REPO, PACKAGE)):
    for name in files:
      if name.endswith(".py"):
        parts = os.path.relpath(os.path.join(directory, name), REPO)[:-3].split(os.sep)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(
            directory, name
        )
  return modules


def import_graph() -> dict[str, set[str]]:
  """{module: the package's modules it imports}: `from a.b import c` names a.b.c when that is a
  module, else a.b; `import a.b` names a.b."""
  modules = _modules()
  graph = {}
  for module, file in modules.items():
    named = set()
    for node in ast.walk(ast.parse(open(file).read(), file)):
      if isinstance(node, ast.Import):
        named.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        named.update(
            f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
            for a in node.names
        )
    graph[module] = {n for n in named if n in modules and n != module}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of `graph` as [a, b, ..., a], or None."""
  state = {}  # absent: unseen; 1: on the current path; 2: done

  def visit(node, path):
    state[node] = 1
    for child in sorted(graph.get(node, ())):
      if state.get(child) == 1:
        return path[path.index(child) :] + [child]
      if child not in state:
        cycle = visit(child, path + [child])
        if cycle:
          return cycle
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node, [node])
      if cycle:
        return cycle
  return None


def test_find_cycle_finds_one():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_function_level_and_submodule_imports():
  graph = import_graph()
  assert (
      "electra_jax.errors" in graph["electra_jax.config_lib"]
  )  # from electra_jax.errors import ...
  assert "electra_jax.data.prepare" in graph["electra_jax.data.pipeline"]  # a submodule by name
  assert "electra_jax.plots" in graph["electra_jax.sweep"]  # imported inside a function


def test_the_package_has_no_import_cycle():
  cycle = find_cycle(import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_recipe_loads_without_jax():
  # configs/*.py import config_lib, which imports the model code only inside validate(): reading a
  # recipe (a launch script, a notebook cell that edits it) costs no jax import.
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  code = (
      "import importlib.util, sys; spec = importlib.util.spec_from_file_location('quick', 'configs/quick.py'); "
      "recipe = importlib.util.module_from_spec(spec); spec.loader.exec_module(recipe); recipe.get_config(); "
      "print(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))"
  )
  out = subprocess.run(
      [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"
