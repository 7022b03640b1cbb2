"""Shared fixtures: tiny configs over a small slice of the built-in corpus, whose tokenizer and
packed arrays are built once per test session in a temporary cache."""

import contextlib
import importlib.abc
import io
import logging
import os
import subprocess
import sys
import traceback

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/gcs_server.py

# XLA's CPU backend without LLVM's optimizations and with its older (elemental) fusion emitters,
# for this process (set before jax is imported) and every subprocess: compiling is most of a tiny
# run's time. The first flag makes the tiny train step compile in 60% of the time (a tiny CLI
# run's losses came out identical); the second cuts another ~20% (4.4-5.7 s -> 3.5-3.7 s) and
# tests/test_ablations.py from 163 s to 113 s.
_COMPILE_FAST = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join((os.environ.get("XLA_FLAGS", ""), *_COMPILE_FAST)).strip()
# And the flags the CLI adds, so that a run in this process (`cli`) computes what a CLI subprocess does.
from electra_jax import xla_flags  # noqa: E402

xla_flags.apply_cpu_defaults(restart=False)


def with_devices(count: int) -> dict:
  """Environment entries that give a subprocess `count` CPU devices (keeping $XLA_FLAGS)."""
  return {
      "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
  }


from electra_jax import config_lib  # noqa: E402

base = config_lib.sibling(os.path.join(REPO, "configs", "base.py"), "base")

# Small enough for a CPU test, big enough that the slice of corpus fills a few batches. One layer:
# a tiny train step compiles in ~60% of the time two take, and its init in half; the tests of
# what layers do (stacking, scan, remat, layer-wise rates, re-initialised top layers, layer
# names in exports) take deep_tiny_config's two.
TINY_OVERRIDES = {
    "model.hidden_size": 32,
    "model.num_layers": 1,
    "model.num_heads": 2,
    "model.intermediate_size": 64,
    "model.embedding_size": 16,
    "model.vocab_size": 512,
    "model.max_position_embeddings": 64,
    "model.generator_fraction": 0.5,
    "data.max_seq_len": 32,
    "data.spm_vocab_size": 500,
    "data.max_documents": 120,
    "train.steps": 6,
    "train.batch_size": 8,
    "train.log_every": 1,
    "optimizer.warmup_steps": 2,
    "optimizer.learning_rate": 1e-3,
    "checkpoint.every_steps": 3,
}


# The longest files first: `--dist loadfile` hands whole files to the workers in collection
# order, and a long file collected last (test_train.py, by name) keeps one worker busy minutes
# after the other has run out of work. The files that load torch or pyarrow come last (their
# process compiles without its cache from then on: see _NativePeerWatch).
LONGEST_FILES = (
    "test_train.py",
    "test_distributed.py",
    "test_ablations.py",
    "test_sweep.py",
    "test_finetune.py",
)
PEER_FILES = (
    "test_squad.py",
    "test_plots.py",
    "test_finetune_metrics.py",
    "test_hf_datasets_source.py",
    "test_hf_peer.py",
    "test_interop.py",
    "test_interop_import.py",
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  rank.update({name: len(LONGEST_FILES) + 1 + i for i, name in enumerate(PEER_FILES)})
  items.sort(
      key=lambda item: rank.get(item.path.name, len(LONGEST_FILES))
  )  # stable: files keep their order


def tiny_config(**overrides):
  config = base.get_config()
  for key, value in {**TINY_OVERRIDES, **overrides}.items():
    group, name = key.split(".")
    config[group][name] = value
  return config


def deep_tiny_config(**overrides):
  """tiny_config with two layers."""
  return tiny_config(**{"model.num_layers": 2, **overrides})


def cli_args(workdir, **overrides):
  """Arguments of `python -m electra_jax.main` for the tiny config."""
  args = [
      sys.executable,
      "-m",
      "electra_jax.main",
      f"--config={REPO}/configs/base.py",
      f"--workdir={workdir}",
  ]
  args += [f"--config.{k}={v}" for k, v in {**TINY_OVERRIDES, **overrides}.items()]
  return args


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
  """One cache for the whole session, shared with subprocesses through the environment."""
  cache = str(tmp_path_factory.mktemp("electra_jax_cache"))
  os.environ["ELECTRA_JAX_CACHE"] = cache
  # Persistent XLA compilation caches: many tests compile the same tiny train and eval steps, and
  # compiling is most of a tiny run's time on a 2-core machine. No size limit: a limit turns on
  # JAX's eviction, which lists and reads the whole cache at every write. Without it JAX writes
  # entries in place and unlocked, so no two processes that may compile at once share one: this
  # process, its CLI subprocesses (they inherit the environment; test_distributed gives each of
  # its twin processes its own) and the other xdist worker (another temporary root) each have a
  # directory of their own.
  import jax  # noqa: PLC0415

  xla_cache = tmp_path_factory.mktemp("xla_cache")
  os.environ.update(
      JAX_COMPILATION_CACHE_DIR=str(xla_cache / "cli"),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  )
  jax.config.update("jax_compilation_cache_dir", str(xla_cache / "tests"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  return cache


# Each of the five workers lost in earlier runs died inside XLA in a test process that had torch
# (and once pyarrow) loaded, three of them while writing or reading a cache entry; no process
# without them ever did. So a test process stops using its cache the moment it first imports
# either (the tests import them inside the tests that need them, and their files run last).
class _NativePeerWatch(importlib.abc.MetaPathFinder):

  def find_spec(self, name, path=None, target=None):
    if name in ("torch", "pyarrow"):
      import jax  # noqa: PLC0415
      from jax._src import compilation_cache  # noqa: PLC0415 (reset_cache: only here)

      if jax.config.jax_enable_compilation_cache:
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
    return None  # the usual finders import it


if not any(name in sys.modules for name in ("torch", "pyarrow")):
  sys.meta_path.insert(0, _NativePeerWatch())


def run_cli(args, env_extra=None, timeout=600, **kwargs):
  """`args` in a subprocess: for what only a process of its own shows (its start, signals, devices)."""
  env = dict(os.environ, **(env_extra or {}))
  return subprocess.run(
      args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, **kwargs
  )


def cli(args, cwd=REPO) -> subprocess.CompletedProcess:
  """`python -m electra_jax.main ...` (`args` as for run_cli) run by absl in this process: the exit
  code, stdout and stderr (absl's log included) the subprocess would give, a traceback printed for
  an uncaught exception. JAX's traced and compiled steps of earlier runs here are reused, which
  makes it many times faster than run_cli."""
  from absl import app, flags  # noqa: PLC0415
  from absl import logging as absl_logging  # noqa: PLC0415

  from electra_jax import main  # noqa: PLC0415

  assert [os.path.basename(args[0]).startswith("python"), *args[1:3]] == [
      True,
      "-m",
      "electra_jax.main",
  ], args
  argv = ["electra-jax", *map(str, args[3:])]
  flags.FLAGS.unparse_flags()  # every flag back to its default, and no override of the last recipe
  for name in [name for name in flags.FLAGS if name.startswith("config.")]:
    delattr(flags.FLAGS, name)
  flags.FLAGS["config"].parser = config_lib.RecipeParser("config")
  stdout, stderr = io.StringIO(), io.StringIO()
  handler = absl_logging.get_absl_handler().python_handler
  saved = sys.argv, handler.stream, os.getcwd()  # put back after the run
  sys.argv, handler.stream = argv, stderr  # ml_collections reads the overrides from sys.argv
  os.chdir(cwd)
  try:
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
      try:
        app.run(main.main, argv=argv, flags_parser=config_lib.flags_parser("electra-jax"))
        code = 0
      except SystemExit as stop:
        code = 0 if stop.code is None else stop.code
        if isinstance(code, str):
          print(code, file=sys.stderr)
          code = 1
      except Exception:  # noqa: BLE001 (what the interpreter prints for an uncaught exception)
        traceback.print_exc()
        code = 1
  finally:
    sys.argv, handler.stream, previous_cwd = saved
    os.chdir(previous_cwd)
  return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


# The tiny config on a data x fsdp x tensor = 2 x 2 x 2 mesh. Adam's first updates are about
# lr * sign(g), which turns reduction-order noise (~1e-7) into lr-sized steps for gradients
# that are exactly zero in exact arithmetic; a small learning rate keeps five steps of that
# drift below the tests' tolerance. One layer: every kind of parameter is still sharded, and it
# compiles faster.
EIGHT_DEVICE_OVERRIDES = {
    "train.steps": 5,
    "checkpoint.every_steps": 5,
    "optimizer.learning_rate": 1e-4,
    "model.num_layers": 1,
    "mesh.data": 2,
    "mesh.fsdp": 2,
    "mesh.tensor": 2,
}


@contextlib.contextmanager
def logged_messages(name=None, level=logging.INFO):
  """The messages that logger `name` (the root for None) gets at `level` or above inside the block,
  as a list filled while it runs; the logger's own level is lowered to `level` meanwhile if needed.
  """
  messages = []
  handler = logging.Handler(level)
  handler.emit = lambda record: messages.append(record.getMessage())
  logger = logging.getLogger(name)
  previous = logger.level
  logger.addHandler(handler)
  if logger.getEffectiveLevel() > level:
    logger.setLevel(level)
  try:
    yield messages
  finally:
    logger.removeHandler(handler)
    logger.setLevel(previous)


@pytest.fixture(scope="session")
def gcs_server():
  """A local GCS API (tests/gcs_server.py) for this test process and the subprocesses it starts."""
  from gcs_server import GcsServer  # noqa: PLC0415

  server = GcsServer()
  saved = {name: os.environ.get(name) for name in server.env}
  os.environ.update(server.env)
  yield server
  server.stop()
  for name, value in saved.items():
    if value is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = value


@pytest.fixture
def bucket(gcs_server):
  """A new, empty bucket on the local GCS API: its gs:// URL."""
  return gcs_server.create_bucket()
