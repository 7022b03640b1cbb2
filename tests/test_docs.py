"""The README and docs/ stay a map that works: every relative link resolves, every mode of the
CLI has its row in the README's table, and the README stays short."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _pages():
  return [os.path.join(ROOT, "README.md")] + sorted(
      os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md"))


def test_relative_links_resolve():
  broken = []
  for page in _pages():
    for target in re.findall(r"\]\(([^)\s]+)\)", open(page, encoding="utf-8").read()):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
      if not os.path.exists(path):
        broken.append(f"{os.path.relpath(page, ROOT)} -> {target}")
  assert not broken, broken


def test_readme_lists_every_mode_and_stays_short():
  from absl import flags  # noqa: PLC0415

  from electra_jax import main  # noqa: F401, PLC0415 (defines --mode)

  readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  modes = flags.FLAGS["mode"].parser.enum_values
  assert len(modes) >= 10
  missing = [mode for mode in modes if f"| `{mode}` |" not in readme]
  assert not missing, missing
  assert len(readme.splitlines()) < 200


def test_every_docs_page_is_linked_from_the_readme():
  readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  pages = [name for name in os.listdir(DOCS) if name.endswith(".md")]
  assert len(pages) >= 9
  assert [p for p in pages if f"(docs/{p})" not in readme] == []


def _console_script(*args):
  """The console script as pip writes it: a __main__ without a docstring that calls main.run."""
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  stub = "import sys; sys.argv[0] = 'electra-jax-stub'; from electra_jax.main import run; run()"
  return subprocess.run([sys.executable, "-c", stub, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_help_lists_every_mode_and_the_main_flags_and_version_names_the_release():
  from absl import flags  # noqa: PLC0415

  import electra_jax  # noqa: PLC0415
  from electra_jax import main  # noqa: F401, PLC0415

  shown = _console_script("--help").stdout
  for mode in flags.FLAGS["mode"].parser.enum_values:
    assert re.search(rf"^  {mode} +\S", shown, re.M), (mode, shown)
  for flag in ("config", "workdir", "mode", "out", "version"):
    assert re.search(rf"^  --(\[no\])?{flag}:", shown, re.M), (flag, shown)
  version = _console_script("--version")
  assert version.returncode == 0 and version.stdout.startswith(f"electra-jax {electra_jax.__version__} (jax ")
