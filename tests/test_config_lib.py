"""Recipes and configs (config_lib.py): durations, saved configs completed with the defaults, the
--config flag and its overrides, recipes by name, one-line mistakes."""

import json
import shutil
import os
import subprocess
import sys

import pytest

from electra_jax.errors import ConfigError

from conftest import REPO, cli, cli_args, run_cli, tiny_config
from electra_jax import (
    config_lib,
    train,
)


def test_duration_strings():
  for text, seconds in [
      ("90s", 90),
      ("12m", 720),
      ("4h", 14400),
      ("1h30m", 5400),
      ("1.5h", 5400),
      ("2m30s", 150),
  ]:
    assert train.config_lib.parse_duration(text) == seconds, text


def test_a_saved_config_gets_the_defaults_of_keys_it_predates(tmp_path):
  saved = train.config_lib.as_saved(tiny_config(**{"objective.temperature": 2.0}))
  del (
      saved["model"]["scan_layers"],
      saved["objective"]["initial_temperature"],
      saved["train"]["time_budget"],
  )
  (tmp_path / "config.json").write_text(json.dumps(saved))
  config = train.config_lib.load_workdir_config(str(tmp_path))
  assert config.objective.initial_temperature == 1.0 and config.train.time_budget == ""
  assert config.model.scan_layers is False
  assert config.objective.temperature == 2.0 and config.model.hidden_size == 32  # saved values stay


@pytest.mark.fault
@pytest.mark.parametrize(
    "group, key, value, named",
    [
        (
            "model",
            "num_layers",
            True,
            "model.num_layers=True is of type bool, but the key's type is int",
        ),
        ("train", "steps", 7.9, "train.steps=7.9 is of type float, but the key's type is int"),
        (
            "model",
            "hidden_size",
            "32",
            "model.hidden_size='32' is of type str, but the key's type is int",
        ),
        (
            "data",
            "files",
            ["a.txt"],
            "data.files=['a.txt'] is of type list, but the key's type is str",
        ),
        ("model", "colour", "blue", "model.colour is no key of this electra-jax's config"),
        ("train", "steps", None, "train.steps=None is of type NoneType, but the key's type is int"),
        ("data", "lowercase", 1, "data.lowercase=1 is of type int, but the key's type is bool"),
        (
            "optimizer",
            "learning_rate",
            "1e-3",
            "optimizer.learning_rate='1e-3' is of type str, but the key's type is float",
        ),
    ],
)
def test_an_edited_config_json_is_refused_naming_the_file_and_key(
    tmp_path, group, key, value, named
):
  """config.json was merged without checks: `"num_layers": true` trained a one-layer model and
  exited 0. Its values are now checked as an override's are, and the file and key are named."""
  saved = train.config_lib.as_saved(tiny_config())
  saved[group][key] = value
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(ConfigError) as refused:
    train.config_lib.load_workdir_config(str(tmp_path))
  assert str(tmp_path / "config.json") in str(refused.value) and named in str(refused.value)


@pytest.mark.fault
@pytest.mark.parametrize("key, value", [("use_bias", None), ("attention_conv", True)])
def test_a_value_of_another_type_set_in_python_is_refused_at_the_door(key, value):
  # ConfigDict takes None for any key and True for an int: the model was built with no biases,
  # or a width-1 convolution.
  config = tiny_config()
  config.model[key] = value
  with pytest.raises(ConfigError, match=f"model.{key}={value} is of type"):
    train.config_lib.validate(config)


@pytest.mark.fault
def test_an_edited_config_json_ends_the_cli_in_one_line_and_a_number_may_be_an_int(tmp_path):
  saved = train.config_lib.as_saved(tiny_config())
  saved["optimizer"]["learning_rate"] = 1  # an integer where a float is taken: a number still
  (tmp_path / "config.json").write_text(json.dumps(saved))
  assert train.config_lib.load_workdir_config(str(tmp_path)).optimizer.learning_rate == 1
  saved["train"]["steps"] = "many"
  (tmp_path / "config.json").write_text(json.dumps(saved))
  result = cli(["python", "-m", "electra_jax.main", f"--workdir={tmp_path}"])
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert "config.json is not as electra-jax writes it" in result.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "checkpoints").exists()


@pytest.mark.fault
@pytest.mark.parametrize(
    "text, named",
    [
        ("def get_config(:\n", "SyntaxError: "),
        ("x = 1\n", "AttributeError: module 'electra_jax_configs_mine' has no attribute 'get_con"),
        ("def get_config():\n  return 1 / 0\n", "ZeroDivisionError: division by zero; fix the"),
        ("def get_config():\n  return 5\n", "get_config() returned 5, not a ConfigDict."),
    ],
)
def test_a_broken_recipe_ends_the_cli_in_one_line_naming_it(tmp_path, text, named):
  recipe = tmp_path / "mine.py"
  recipe.write_text(text)
  result = cli(
      [sys.executable, "-m", "electra_jax.main", f"--config={recipe}", f"--workdir={tmp_path}/w"]
  )
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(f"electra-jax: error: --config={recipe}: ") and named in last, last
  assert not (tmp_path / "w").exists()


@pytest.mark.fault
def test_mistyped_override_names_the_close_match(tmp_path):
  result = cli(cli_args(tmp_path / "run") + ["--config.train.stpes=5"])
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1] == (
      "electra-jax: error: --config.train.stpes: the config has no key 'stpes'. Did you mean 'steps'? "
      "configs/base.py lists every key with its default."
  )
  assert "Traceback" not in result.stderr
  result = cli(cli_args(tmp_path / "run") + ["--config.train.num_steps=5"])  # no close match
  assert "error: --config.train.num_steps: the config has no key 'num_steps'." in result.stderr
  assert not (tmp_path / "run").exists()
  # A fine-tuning recipe's keys are listed in its own base.
  result = cli(
      [
          "python",
          "-m",
          "electra_jax.main",
          "--mode=finetune",
          "--config=configs/finetune/tiny.py",
          "--config.epochz=1",
          f"--workdir={tmp_path / 'ft'}",
      ]
  )
  assert (
      result.stderr.strip()
      .splitlines()[-1]
      .endswith("configs/finetune/base.py lists every key with its default.")
  )


def test_overrides_apply_to_a_workdirs_own_config(tmp_path):
  # configs/workdir.py:DIR reads DIR/config.json, so a run can go on with overrides.
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(
      train.config_lib.config_file_text(tiny_config(**{"train.steps": 4}))
  )
  recipe = os.path.join(REPO, "configs", "workdir.py")
  result = run_cli(
      [
          sys.executable,
          "-c",
          (
              "import sys; from absl import flags; from ml_collections import config_flags;"
              "c = config_flags.DEFINE_config_file('config'); flags.FLAGS(sys.argv);"
              "print(c.value.train.steps, c.value.model.hidden_size)"
          ),
          f"--config={recipe}:{workdir}",
          "--config.train.steps=9",
      ]
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ["9", str(tiny_config().model.hidden_size)]
  # Overrides without any --config are answered with that recipe.
  result = cli(cli_args(workdir)[:3] + [f"--workdir={workdir}", "--config.train.steps=9"])
  assert "error: --config.train.steps changes a recipe, but no --config was given" in result.stderr
  assert "--config=configs/workdir.py:DIR" in result.stderr


@pytest.mark.fault
@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--config=configs/dem.py", "--workdir=W"],
            "--config=configs/dem.py: configs/dem.py is not a file, and no recipe has that name; give a recipe's file or name",
        ),
        (["--config=W/config.json", "--workdir=W"], "is a JSON file; --config takes a recipe"),
        (
            ["--config=configs/workdir.py", "--workdir=W"],
            "configs/workdir.py needs the workdir to read, after a colon",
        ),
        (
            ["--config=configs/finetune/tiny.py", "--workdir=W"],
            "--config is a fine-tuning recipe (configs/finetune/), but --mode=train",
        ),
        (
            ["--mode=finetune", "--config=configs/demo.py", "--workdir=W"],
            "--mode=finetune takes a fine-tuning recipe",
        ),
        (["--config=configs/demo.py"], "--mode=train needs --workdir."),
        (
            ["--workdir=W"],
            "has no config.json, so it is no pre-training workdir to go on with: give",
        ),
        (["--mode=bogus", "--workdir=W"], "flag --mode=bogus: value should be one of <train|"),
        (["--mode=eval", "--step=last", "--workdir=W"], "flag --step=last: invalid literal"),
    ],
)
def test_cli_mistakes_end_in_one_line(tmp_path, args, message):
  args = [a.replace("=W", f"={tmp_path}") for a in args]
  result = cli([sys.executable, "-m", "electra_jax.main", *args])
  assert result.returncode != 0 and "Traceback" not in result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("electra-jax: error: ") and message in last, result.stderr[-2000:]
  assert "FATAL" not in result.stderr and "--helpfull" not in result.stderr  # no flag listing


def test_recipes_by_name_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # not the checkout: configs/ is not here
  recipes = config_lib.RECIPES_DIR
  assert config_lib.resolve_recipe("demo") == f"{recipes}/demo.py"
  assert config_lib.resolve_recipe("finetune/glue.py") == f"{recipes}/finetune/glue.py"
  assert config_lib.resolve_recipe("configs/workdir.py:/runs/a") == f"{recipes}/workdir.py:/runs/a"
  assert (
      config_lib.resolve_recipe("electra_smal") == "electra_smal"
  )  # named by the error that follows
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "demo").write_text("")  # a file of that name is what the user meant
  assert config_lib.resolve_recipe("mine/demo") == "mine/demo"

  # From the CLI, outside the checkout: the recipe is loaded (its keys and its kind are known).
  def elsewhere(*args):
    return cli(
        [sys.executable, "-m", "electra_jax.main", *args, f"--workdir={tmp_path}/w"], cwd=tmp_path
    )

  typo = elsewhere("--config=demo", "--config.train.stpes=1")
  assert "--config.train.stpes: the config has no key 'stpes'" in typo.stderr, typo.stderr[-2000:]
  kind = elsewhere("--config=finetune/tiny")
  assert (
      "is a fine-tuning recipe (configs/finetune/), but --mode=train" in kind.stderr
  ), kind.stderr[-2000:]


def test_a_plain_install_carries_the_recipes(tmp_path):
  # `pip install .`, not editable, from a copy (a build writes build/ into its source).
  source, site = tmp_path / "source", tmp_path / "site"
  for tree in ("electra_jax", "configs"):
    shutil.copytree(
        os.path.join(REPO, tree), source / tree, ignore=shutil.ignore_patterns("__pycache__")
    )
  for file in ("setup.py", "README.md"):
    shutil.copy(os.path.join(REPO, file), source / file)
  installed = subprocess.run(
      [
          sys.executable,
          "-m",
          "pip",
          "install",
          "-q",
          "--no-deps",
          "--no-build-isolation",
          "--target",
          str(site),
          str(source),
      ],
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert installed.returncode == 0, installed.stderr[-2000:]
  shutil.rmtree(source)  # nothing of the checkout is left to fall back on
  env = dict(os.environ, PYTHONPATH=str(site))
  where = subprocess.run(
      [sys.executable, "-c", "from electra_jax import config_lib; print(config_lib.RECIPES_DIR)"],
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert where.stdout.strip() == str(site / "electra_jax" / "configs"), where.stderr[-2000:]
  typo = subprocess.run(
      [
          sys.executable,
          "-m",
          "electra_jax.main",
          "--config=demo",
          "--config.train.stpes=1",
          f"--workdir={tmp_path}/w",
      ],
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert "--config.train.stpes: the config has no key 'stpes'" in typo.stderr, typo.stderr[-2000:]
