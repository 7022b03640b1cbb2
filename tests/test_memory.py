"""Memory per training step from XLA's analysis, the largest batch that fits, and
train.batch_size=-1 resolving to it before anything is written."""

import functools
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, cli, cli_args, run_cli, tiny_config
from electra_jax import config_lib, evaluation, memory, partitioning, resolve, train_state
from electra_jax.errors import ConfigError

SPECIAL = dict(pad=0, cls=2, sep=3, mask=4)
RESOURCE_EXHAUSTED = 8  # absl's status code, which XLA's out-of-memory errors carry


@pytest.fixture(scope="module")
def tiny_setup():
  config = tiny_config()
  mesh = partitioning.make_mesh(config.mesh)
  return config, mesh, train_state.build_setup(config, mesh, SPECIAL)


def test_step_memory_grows_linearly_with_the_batch(tiny_setup):
  config, mesh, setup = tiny_setup
  b8, b16, b32 = (
      memory.step_memory(
          functools.partial(train_state.compile_train_step, setup, config, mesh), b
      ).bytes_per_device
      for b in (8, 16, 32)
  )
  assert b8 < b16 < b32
  assert (b32 - b16) == pytest.approx(2 * (b16 - b8), rel=0.1)  # activations, per example
  # The fixed part holds at least the train state (parameters and Adam's two moments, float32).
  params = sum(int(np.prod(s)) for s in setup.param_shapes.values())
  assert b8 - (b16 - b8) > 3 * 4 * params


def _fake_step_memory(bytes_of):
  """Stands in for compiling: `bytes_of(batch)` per device; records the batches asked for."""
  asked = []

  def step_memory(compile_step, batch_size):
    asked.append(batch_size)
    return memory.StepMemory(batch_size, int(bytes_of(batch_size)))

  return step_memory, asked


# XLA's TPU layout for electra_base s512 on one v5e (MiB per device, `max_batch --device=tpu_v5e`):
# not even monotonic, batch 96 took less than 88; linear past it here.
_V5E_BASE = {0: 1900, 8: 2800, 32: 6420, 80: 13610, 88: 14180, 96: 14130, 1000: 14130 + 904 * 70}

CURVES = {  # bytes per device of a batch, the answer the search must find, the most compiles
    # Super-linear: the first linear fit overshoots, and the answer is bisected.
    "convex": (lambda b: 50_000 + 1_000 * b + 3 * b * b, 300, 16),  # noqa: E731
    # Sub-linear, as XLA's TPU memory is where the compiler starts rematerializing (1,592
    # electra_small examples took 14.37 GiB where the first two compiles' line said 22.7): each
    # fit lands short, and is re-aimed from the two largest batches that fit.
    "concave": (lambda b: 50_000 + 60_000 * b**0.5, 300, 10),  # noqa: E731
    # A flat pair (88, 96) must not send the next guess to 16 x 96 and bisect back from there.
    "uneven": (
        lambda b: int(np.interp(b, list(_V5E_BASE), list(_V5E_BASE.values())) * 2**20),
        122,
        9,
    ),
}


@pytest.mark.parametrize("curve", sorted(CURVES))
@pytest.mark.parametrize("quantum", [1, 8])
def test_largest_batch_is_the_last_that_fits(monkeypatch, quantum, curve):
  bytes_of, answer, most_compiles = CURVES[curve]
  fake, asked = _fake_step_memory(bytes_of)
  monkeypatch.setattr(memory, "step_memory", fake)
  limit = bytes_of(answer) + 1
  batch, measured = memory.largest_batch(None, limit, quantum)
  assert batch == answer // quantum * quantum  # the largest multiple of quantum that fits
  assert (
      all(b % quantum == 0 for b in asked) and len(asked) <= most_compiles
  )  # a handful of compiles
  assert bytes_of(batch + quantum) > limit
  with pytest.raises(ConfigError, match=f"Even a batch of {quantum} needs"):
    memory.largest_batch(None, limit_bytes=1000, quantum=quantum)


def _compiler_with_memory(monkeypatch, bytes_of, device_bytes, flops_of=None):
  """Stands in for compiling as XLA's TPU compiler does: a step needing more than
  `device_bytes` is refused with RESOURCE_EXHAUSTED instead of compiled; the rest report
  `bytes_of(batch)` in their memory analysis (and `flops_of(batch)` in their cost analysis).
  Records the batches asked for."""
  asked = []

  def compile_train_step(setup, config, mesh, batch_size):
    batch = batch_size
    asked.append(batch)
    if bytes_of(batch) > device_bytes:
      raise jax.errors.JaxRuntimeError(
          f"RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
          f"temporaries ({bytes_of(batch)}) exceeds available HBM ({device_bytes}).",
          RESOURCE_EXHAUSTED,
      )
    analysis = types.SimpleNamespace(
        argument_size_in_bytes=bytes_of(batch),
        output_size_in_bytes=0,
        alias_size_in_bytes=0,
        temp_size_in_bytes=0,
        generated_code_size_in_bytes=0,
    )
    cost = {} if flops_of is None else {"flops": float(flops_of(batch))}
    return types.SimpleNamespace(memory_analysis=lambda: analysis, cost_analysis=lambda: cost)

  monkeypatch.setattr(train_state, "compile_train_step", compile_train_step)
  return asked


@pytest.mark.parametrize("quantum", [1, 8])
def test_a_batch_the_compiler_refuses_does_not_fit(monkeypatch, tiny_setup, quantum):
  config, mesh, setup = tiny_setup
  bytes_of = CURVES["convex"][0]  # a guess (318 or 312) lands past the chip's memory
  limit = bytes_of(300) + 1  # memory_fraction's share of the chip
  hbm = bytes_of(310)
  asked = _compiler_with_memory(monkeypatch, bytes_of, hbm)
  batch, measured = memory.largest_batch(
      functools.partial(train_state.compile_train_step, setup, config, mesh), limit, quantum
  )
  assert batch == 300 // quantum * quantum
  assert any(m.bytes_per_device is None for m in measured)  # the search went past the chip
  assert len(asked) <= 16 and all(b % quantum == 0 for b in asked)

  # 4 x quantum refused outright: no line to extrapolate, the answer bisected below it.
  small = lambda b: 50_000 + 1_000 * b  # noqa: E731
  _compiler_with_memory(monkeypatch, small, device_bytes=small(4 * quantum) - 1)
  batch, measured = memory.largest_batch(
      functools.partial(train_state.compile_train_step, setup, config, mesh),
      small(3 * quantum) + 1,
      quantum,
  )
  assert (
      batch == 3 * quantum
      and measured[1].batch_size == 4 * quantum
      and measured[1].bytes_per_device is None
  )
  # Not even one quantum compiles: the message says so instead of showing the compiler's error.
  _compiler_with_memory(monkeypatch, small, device_bytes=small(quantum) - 1)
  with pytest.raises(
      ConfigError, match=f"Even a batch of {quantum} needs more than a device's memory"
  ):
    memory.largest_batch(
        functools.partial(train_state.compile_train_step, setup, config, mesh),
        small(quantum),
        quantum,
    )


@pytest.mark.parametrize("quantum", [1, 8])
def test_a_batch_fitted_by_recomputing_does_not_fit(monkeypatch, tiny_setup, quantum):
  config, mesh, setup = tiny_setup
  # Past 200 XLA's TPU compiler holds memory nearly flat by rematerializing activations: the
  # step then does a fifth more work, which its cost analysis counts. Memory alone would let the
  # search go to ~2,000.
  bytes_of = lambda b: 50_000 + 1_000 * min(b, 200) + 10 * max(0, b - 200)  # noqa: E731
  flops_of = lambda b: (1e6 + 1e4 * b) * (1.2 if b > 200 else 1.0)  # noqa: E731
  asked = _compiler_with_memory(
      monkeypatch, bytes_of, device_bytes=bytes_of(5000), flops_of=flops_of
  )
  batch, measured = memory.largest_batch(
      functools.partial(train_state.compile_train_step, setup, config, mesh),
      bytes_of(2000),
      quantum,
  )
  assert batch == 200
  assert len(asked) <= 14 and all(b % quantum == 0 for b in asked)
  # The same step without recomputation (flops linear in the batch) goes on to 2,000.
  _compiler_with_memory(
      monkeypatch, bytes_of, device_bytes=bytes_of(5000), flops_of=lambda b: 1e6 + 1e4 * b
  )
  assert (
      memory.largest_batch(
          functools.partial(train_state.compile_train_step, setup, config, mesh),
          bytes_of(2000),
          quantum,
      )[0]
      == 2000
  )


@pytest.mark.fault
def test_other_compile_errors_are_not_taken_for_memory(monkeypatch, tiny_setup):
  config, mesh, setup = tiny_setup

  def broken(setup, config, mesh, batch_size):
    raise RuntimeError("INVALID_ARGUMENT: a sharding that does not divide the batch")

  monkeypatch.setattr(train_state, "compile_train_step", broken)
  with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
    memory.step_memory(functools.partial(train_state.compile_train_step, setup, config, mesh), 8)


def test_batch_size_minus_one_resolves_before_training(monkeypatch):
  fake, asked = _fake_step_memory(lambda b: 1_000_000 + 10_000 * b)
  monkeypatch.setattr(memory, "step_memory", fake)
  monkeypatch.setattr(memory, "device_memory_bytes", lambda device=None: 1_000_000 + 10_000 * 37)
  auto = tiny_config(**{"train.batch_size": -1, "train.memory_fraction": 1.0})
  run = resolve.run(auto)
  assert run.config.train.batch_size == 37  # in the resolved config, which config.json records
  assert auto.train.batch_size == -1  # the config given is left as it was
  # Half of that memory does not hold even the fixed part: refused before anything runs.
  with pytest.raises(ConfigError, match="Even a batch of 1 needs"):
    resolve.run(tiny_config(**{"train.batch_size": -1, "train.memory_fraction": 0.5}))


@pytest.mark.fault
def test_a_batch_far_larger_than_memory_is_refused_in_one_line_before_compiling(
    tmp_path, monkeypatch
):
  # 8 MiB a device: the tiny model's batch of 8 fits; 3,000 of its 3,187 rows need ~12 MiB of
  # layer inputs alone (the 100,000 failed after a 22 s compile, with a traceback).
  monkeypatch.setattr(memory, "device_memory_bytes", lambda device=None: 8 * 2**20)
  monkeypatch.setattr(train_state, "compile_train_step", lambda *a, **k: pytest.fail("compiled"))
  workdir = tmp_path / "run"
  result = cli(cli_args(workdir, **{"train.batch_size": 3000, "train.memory_fraction": 1.0}))
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  refusal = [line for line in result.stderr.splitlines() if "train.batch_size=3000" in line]
  assert len(refusal) == 1, result.stderr[-2000:]
  for said in ("needs at least 0.01 GiB a device", "train.memory_fraction=1 of the 0.01 GiB"):
    assert said in refusal[0]
  assert "train.grad_accum_steps" in refusal[0] and "train.batch_size=-1" in refusal[0]
  assert not workdir.exists() or not (workdir / "config.json").exists()
  # Micro-batches of 375 fit, and so does the tiny recipe's batch; neither compiles here.
  accumulated = {"train.batch_size": 3000, "train.grad_accum_steps": 8}
  for fits in (accumulated, {}):
    resolve.run(tiny_config(**{"train.memory_fraction": 1.0, **fits}))


@pytest.mark.fault
def test_non_positive_batch_sizes_are_refused():
  with pytest.raises(
      ConfigError, match="train.batch_size=0: give a positive global batch size, or -1"
  ):
    config_lib.validate(tiny_config(**{"train.batch_size": 0}))


@pytest.mark.fault
@pytest.mark.parametrize(
    "args, message",
    [
        (["--configs=nope"], "no recipe configs/nope.py"),
        (["--seq_lens=abc"], "--seq_lens='abc': give positive whole numbers"),
        (["--step=-8"], "--step=-8 must be >= 0"),
    ],
)
def test_max_batch_refuses_bad_flags_before_compiling(args, message):
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  result = subprocess.run(
      [sys.executable, "benchmarks/max_batch.py", *args],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.fault
def test_out_of_memory_is_known_by_its_status_code():
  # A real one: 1 EiB is more than any address space, whatever the kernel's overcommit.
  with pytest.raises(jax.errors.JaxRuntimeError) as real:
    jax.block_until_ready(jax.jit(lambda: jnp.ones((2**30, 2**30), jnp.uint8))())
  assert memory.is_out_of_memory(real.value)
  coded = jax.errors.JaxRuntimeError("allocating 42 bytes", RESOURCE_EXHAUSTED)
  assert memory.is_out_of_memory(coded)
  # The code decides, not the words: another code, or another error type, is not out of memory.
  assert not memory.is_out_of_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: ", 3))
  assert not memory.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory"))
  assert not memory.is_out_of_memory(MemoryError())
  # And memory's search takes only it for a batch over memory.
  with pytest.raises(jax.errors.JaxRuntimeError):
    memory.step_memory(functools.partial(_raise, jax.errors.JaxRuntimeError("ran out", 3)), 8)
  assert memory.step_memory(functools.partial(_raise, coded), 8).bytes_per_device is None


def _raise(error, batch_size):
  raise error


def _run_out_of_memory(*args, **kwargs):
  """What a compiled step does when the device's memory runs out: XLA's error, its status code."""
  raise jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory allocating 391478336 bytes.", RESOURCE_EXHAUSTED
  )


def _one_line_naming(result, *named) -> str:
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if "ran out of memory" in line]
  assert len(lines) == 1 and all(name in lines[0] for name in named), result.stderr[-3000:]
  return lines[0]


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
  """A tiny run of 3 steps (batch 8), a checkpoint at 3."""
  workdir = tmp_path_factory.mktemp("three_steps") / "run"
  result = cli(cli_args(workdir, **{"train.steps": 3}))
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


def _kept(workdir) -> dict:
  """config.json and the checkpoints' files, with their bytes."""
  files = [workdir / "config.json", *(workdir / "checkpoints").rglob("*")]
  return {str(f): f.read_bytes() for f in files if f.is_file()}


@pytest.mark.fault
def test_out_of_memory_in_training_is_one_line_and_records_no_batch(
    tmp_path, monkeypatch, three_steps
):
  compile_train_step = train_state.compile_train_step

  def compile_over_memory(*args, **kwargs):
    compile_train_step(*args, **kwargs)  # compiles; its first call finds the device full
    return _run_out_of_memory

  monkeypatch.setattr(train_state, "compile_train_step", compile_over_memory)
  kept, fresh = _kept(three_steps), tmp_path / "fresh"
  for workdir in (fresh, three_steps):  # a new run, and a resume with 3 more steps
    overrides = {"train.batch_size": 16, "train.steps": 6}
    line = _one_line_naming(cli(cli_args(workdir, **overrides)), "train.batch_size=16:")
    for fix in ("train.grad_accum_steps", "model.remat", "train.batch_size=-1"):
      assert fix in line
  assert not (fresh / "config.json").exists() and not list(fresh.glob("checkpoints/[0-9]*"))
  assert _kept(three_steps) == kept  # config.json still records the batch of 8 that trained
  accumulated = {"train.batch_size": 16, "train.grad_accum_steps": 2}
  _one_line_naming(cli(cli_args(fresh, **accumulated)), "16 (micro-batches of 8)")


@pytest.mark.fault
def test_a_real_out_of_memory_in_training_is_one_line(tmp_path):
  # Hidden 1,024 at a batch of 3,000 rows: its step asks for ~12 GB of temporaries in one
  # allocation, which a 6 GiB address space (ulimit -v) refuses at once, without touching memory;
  # the floor resolve checks before compiling is 0.4 GB. XLA reports it as RESOURCE_EXHAUSTED.
  workdir = tmp_path / "run"
  overrides = {"model.hidden_size": 1024, "model.intermediate_size": 4096}
  overrides.update({"train.batch_size": 3000, "train.memory_fraction": 1.0})
  capped = ["bash", "-c", f'ulimit -v {6 * 2**20} && exec "$@"', "bash"]
  # Two malloc arenas: threads' arenas would reserve 64 MiB of address space each.
  result = run_cli([*capped, *cli_args(workdir, **overrides)], {"MALLOC_ARENA_MAX": "2"})
  line = _one_line_naming(result, "The CPU device ran out of memory with train.batch_size=3000")
  assert "train.grad_accum_steps" in line
  assert not (workdir / "config.json").exists() and not list(workdir.glob("checkpoints/[0-9]*"))


@pytest.mark.fault
def test_out_of_memory_in_eval_is_one_line(monkeypatch, three_steps):
  monkeypatch.setattr(evaluation, "eval_step", _run_out_of_memory)
  args = [*cli_args(three_steps, **{"eval.batch_size": 4}), "--mode=eval"]
  line = _one_line_naming(cli(args), "held-out batch of 4")
  assert "eval.batch_size" in line
  assert not list(three_steps.glob("eval_step_*.json"))


@pytest.mark.fault
def test_out_of_memory_outside_a_step_is_one_line_naming_the_mode(monkeypatch, three_steps):
  monkeypatch.setattr(resolve, "restore_checkpoint", _run_out_of_memory)  # a state over memory
  line = _one_line_naming(cli([*cli_args(three_steps), "--mode=eval"]), "in --mode=eval")
  assert "smaller model" in line


@pytest.mark.fault
def test_out_of_memory_in_fine_tuning_is_one_line(tmp_path, monkeypatch):
  from electra_jax.finetune import trainer  # noqa: PLC0415

  words = [f"w{i}" for i in range(20)]
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
  for split in ("train", "dev"):
    rows = [{"sentence": " ".join(words[i : i + 5]), "label": i % 2} for i in range(12)]
    (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
  compiled_steps = trainer._compiled_steps
  monkeypatch.setattr(
      trainer, "_compiled_steps", lambda *args: (_run_out_of_memory, compiled_steps(*args)[1])
  )
  out = tmp_path / "ft"
  args = [sys.executable, "-m", "electra_jax.main", "--mode=finetune", f"--workdir={out}"]
  args += [f"--config={REPO}/configs/finetune/tiny.py", f"--config.tokenizer={vocab}"]
  args += [f"--config.custom.{split}_file={tmp_path / split}.jsonl" for split in ("train", "dev")]
  line = _one_line_naming(cli(args), "batch_size=16 (eval_batch_size 16):")
  assert "eval_batch_size" in line
  assert not list(out.glob("custom/seed_*/metrics.json")) and not list(
      out.glob("custom/results.json")
  )
