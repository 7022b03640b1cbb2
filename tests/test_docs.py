"""The README, docs/, launch/README.md and benchmarks/*.md stay a map that works: every relative
link resolves, every command in them names real modes, flags, recipes and config keys, every
launcher command in them is one the launcher takes, every mode of the CLI has its row in the
README's table, and the README stays short."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _pages():
  """The README, docs/, the launchers' guide and the measurements in benchmarks/ that docs/ cites."""
  return [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "launch", "README.md")] + sorted(
      os.path.join(folder, name)
      for folder in (DOCS, os.path.join(ROOT, "benchmarks"))
      for name in os.listdir(folder)
      if name.endswith(".md")
  )


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


def test_readme_holds_no_dates_commit_hashes_or_test_counts():
  # They go stale with every change; measurements and their dates live in benchmarks/RESULTS.md.
  readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  date, commit = r"\b20\d\d-\d\d-\d\d\b", r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"
  stale = re.findall(rf"{date}|{commit}|\b\d+ (?:passed|tests)\b", readme)
  assert stale == []


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
  return subprocess.run(
      [sys.executable, "-c", stub, *args], capture_output=True, text=True, timeout=120, cwd=ROOT
  )


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
  assert version.returncode == 0 and version.stdout.startswith(
      f"electra-jax {electra_jax.__version__} (jax "
  )


def _block_lines(text):
  """The lines of the fenced shell blocks of `text`: continuations joined, comments dropped,
  and VAR="..." expanded in the lines after it (in later blocks too, as in the reader's shell)."""
  lines, variables = [], {}
  # Odd pieces between fences are the blocks; a block's first line names its language.
  for block in re.split(r"^```", text, flags=re.M)[1::2]:
    language, _, block = block.partition("\n")
    if language not in ("", "bash", "sh"):
      continue
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
      line = line.split(" #")[0].strip()
      assignment = re.match(r'([A-Z_]+)="(.*)"$', line)
      if assignment:
        variables[assignment.group(1)] = assignment.group(2)
        continue
      lines.append(re.sub(r"\$([A-Z_]+)", lambda m: variables.get(m.group(1), m.group(0)), line))
  return lines


def _documented_commands():
  """(page, argv) of every electra-jax command in the pages: the lines of fenced shell blocks
  and inline code spans."""
  import shlex  # noqa: PLC0415

  commands = []
  for page in _pages():
    text = open(page, encoding="utf-8").read()
    lines = _block_lines(text) + [
        span.replace("\n", " ")
        for span in re.findall(r"`((?:electra-jax|python -m electra_jax\.main) [^`]+)`", text)
    ]
    for line in lines:
      for part in line.split("&&"):
        if not re.match(r"\s*(electra-jax|python -m electra_jax\.main) ", part):
          continue
        words = shlex.split(part.replace("[", " ").replace("]", " "))
        argv = [w for w in words[1 if words[0] == "electra-jax" else 3 :] if w != "..."]
        commands.append((os.path.relpath(page, ROOT), argv))
  return commands


def _documented_launcher_commands():
  """(page, script, argv) of every `python launch/{tpu_vm,gpu,slurm}.py ...` line of the pages'
  shell blocks, up to a redirection or `&` (`nohup ... > log 2>&1 &`)."""
  import shlex  # noqa: PLC0415

  commands = []
  for page in _pages():
    for line in _block_lines(open(page, encoding="utf-8").read()):
      found = re.search(r"python launch/(tpu_vm|gpu|slurm)\.py (.*)", line)
      if found:
        words = shlex.split(found.group(2))
        ends = [i for i, w in enumerate(words) if w in ("&", "|", ";") or w.startswith((">", "2>"))]
        argv = words[: min(ends, default=len(words))]
        commands.append((os.path.relpath(page, ROOT), f"{found.group(1)}.py", argv))
  return commands


def test_every_documented_launcher_command_is_one_the_launcher_takes():
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  commands = _documented_launcher_commands()
  walkthrough = {
      argv[0] for page, script, argv in commands if page == os.path.join("launch", "README.md")
  }
  # The pod walkthrough shows every step, and each one is printed by its dry run.
  steps = {"fit", "create", "install", "prepare", "run", "follow", "status", "restart", "stop"}
  assert steps | {"delete"} <= walkthrough, walkthrough
  wrong = []
  for page, script, argv in commands:
    cut = argv.index("--") if "--" in argv else len(argv)
    done = subprocess.run(
        [sys.executable, os.path.join("launch", script), *argv[:cut], "--dry-run", *argv[cut:]],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    printed = [line for line in done.stdout.splitlines() if line and not line.startswith("#")]
    if done.returncode or not printed:
      wrong.append(f"{page}: {script} {' '.join(argv)}: {done.stderr.strip()[-300:]}")
  assert not wrong, wrong


def test_every_documented_command_names_real_modes_flags_recipes_and_config_keys():
  from absl import flags  # noqa: PLC0415

  from electra_jax import config_lib, main  # noqa: F401, PLC0415 (main defines the flags)

  commands = _documented_commands()
  assert len(commands) >= 25, commands
  modes = flags.FLAGS["mode"].parser.enum_values
  wrong = []
  for page, argv in commands:
    recipe, keys = None, []
    for arg in argv:
      name, _, value = arg.removeprefix("--").partition("=")
      if name.startswith("config."):
        keys.append(name.removeprefix("config."))
      elif name == "config":
        recipe = config_lib.resolve_recipe(value)
      elif name == "mode" and value not in modes:
        wrong.append(f"{page}: --mode={value}")
      elif (
          name not in flags.FLAGS and name.removeprefix("no") not in flags.FLAGS and name != "help"
      ):  # app.run's
        wrong.append(f"{page}: --{name}")
    if recipe is None:
      wrong += [f"{page}: --config.{key} without --config" for key in keys]
      continue
    path, _, argument = recipe.partition(":")
    if not os.path.isfile(os.path.join(ROOT, path)):
      wrong.append(f"{page}: --config={recipe}")
      continue
    if argument:  # configs/workdir.py:W reads a workdir that the docs only name
      continue
    config = config_lib.sibling(os.path.join(ROOT, path), os.path.basename(path)[:-3]).get_config()
    for key in keys:
      node = config
      for part in key.split("."):
        if part not in node:
          wrong.append(f"{page}: --config.{key} ({path} has no {part!r})")
          break
        node = node[part]
  assert not wrong, wrong


def test_the_config_reference_names_every_key_of_the_base_config():
  from electra_jax import config_lib  # noqa: PLC0415

  config = config_lib.sibling(os.path.join(ROOT, "configs", "base.py"), "base").get_config()
  reference = open(os.path.join(DOCS, "config.md"), encoding="utf-8").read()
  rows = {
      line.split("|")[1].strip(" `"): line
      for line in reference.splitlines()
      if line.startswith("| `")
  }
  missing = [
      f"{group}.{key}"
      for group, keys in config.items()
      for key in keys
      if f"`{key}`" not in rows.get(group, "")
  ]
  assert missing == [], f"docs/config.md does not describe {missing}"
