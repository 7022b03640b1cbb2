"""launch/: the detached-job shell snippets run for real on this machine, gpu.py's and
slurm.py's commands, and the Colab notebook's code cells executed on CPU with a shrunken demo
config."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, TINY_OVERRIDES
from launch_helpers import (
    _dry_run,
    _refused,
    _checkout,
    _fake_ssh,
    _tree,
    _option,
    _fake_python,
    _bash,
    _wait_for,
    LAUNCH,
    TRICKY_OVERRIDES,
    remote_job,
    make_colab,
)


# The detached run: quoting through every shell, start / status / stop for real
# ---------------------------------------------------------------------------------------
def test_run_command_reaches_python_with_overrides_intact(tmp_path):
  fake = _fake_python(str(tmp_path))
  (ssh,) = _dry_run(
      "tpu_vm.py",
      "run",
      "--name=pod",
      "--zone=z",
      "--workdir=gs://bucket/run 1",
      f"--python={fake}",
      "--env=XLA_FLAGS=--xla_a=1 --xla_b",
      "--dry-run",
      "--",
      *TRICKY_OVERRIDES,
  )
  assert _option(ssh, "worker") == "all"
  assert "ELECTRA_JAX_DISTRIBUTED=auto" in _option(ssh, "command")  # every worker joins one job
  # What the worker's login shell receives, run here in place of the worker.
  _bash(_option(ssh, "command"), cwd=tmp_path)
  assert _wait_for(lambda: (tmp_path / "electra-jax.exit").exists())
  argv = json.loads((tmp_path / "argv.json").read_text())
  assert argv == [
      "-m",
      "electra_jax.main",
      "--config=electra-jax/configs/electra_small.py",
      "--workdir=gs://bucket/run 1",
      *TRICKY_OVERRIDES,
  ]
  assert "started" in (tmp_path / "electra-jax.log").read_text()


def test_start_status_stop_lifecycle(tmp_path):
  # Stands in for train.py: saves and exits 0 on SIGTERM, logs "Done" when it finishes.
  body = (
      "trap 'echo saving; echo saved; exit 0' TERM\n"
      "for i in $(seq 300); do sleep 0.1; done\necho 'Done: step 300, checkpoints in x'"
  )
  fake = _fake_python(str(tmp_path), body)
  start = remote_job.start_script([fake, "-m", "electra_jax.main"], {})
  status = remote_job.status_script(sys.executable)

  def state():
    (worker,) = remote_job.parse_status(_bash(status, tmp_path))
    return worker

  assert state().run == "none"
  assert "started" in _bash(start, tmp_path)
  assert _wait_for(lambda: (tmp_path / "argv.json").exists())
  running = state()
  assert running.running and running.installed  # electra-jax is installed for this Python
  assert "still going" in _bash(start, tmp_path)  # never two runs on one worker
  assert "stopped" in _bash(remote_job.stop_script(grace_seconds=20), tmp_path)
  stopped = state()
  assert stopped.run == "stopped" and not stopped.done  # saved and left by `stop`, not finished
  assert "saved" in (tmp_path / "electra-jax.log").read_text()

  finishing = _fake_python(str(tmp_path), "echo 'Done: step 6, checkpoints in x'")
  _bash(remote_job.start_script([finishing], {}), tmp_path)
  assert _wait_for(lambda: (tmp_path / "electra-jax.exit").exists())
  finished = state()
  assert finished.run == "exited:0" and finished.done
  assert len(list(tmp_path.glob("electra-jax.log.*"))) == 1  # the first run's log is kept


def test_gpu_install_copies_the_git_files_of_a_local_checkout_to_a_host(tmp_path):
  checkout = _checkout(tmp_path / "checkout")
  remote_home = tmp_path / "home"
  (remote_home / "electra-jax").mkdir(parents=True)
  (remote_home / "electra-jax" / "stale.py").write_text("# from an older copy\n")
  notes = []
  copy, pip = _dry_run(
      "gpu.py", "install", "--host=me@gpu-box", f"--local={checkout}", "--dry-run", notes=notes
  )
  assert len(notes) == 1 and "is a git checkout" in notes[0]
  assert copy[:2] == ["bash", "-c"] and "ssh me@gpu-box" in copy[2]
  assert pip == [
      "ssh",
      "me@gpu-box",
      "python3 -m pip install --upgrade 'jax[cuda12]' ./electra-jax",
  ]
  # The copy, run for real through an ssh that lands in remote_home: the host gets exactly the
  # files git lists, and nothing of the copy it had before.
  subprocess.run(
      copy, check=True, capture_output=True, timeout=60, env=_fake_ssh(tmp_path, remote_home)
  )
  assert _tree(remote_home) == [
      "electra-jax/.gitignore",
      "electra-jax/configs/demo.py",
      "electra-jax/electra_jax/new_module.py",
      "electra-jax/setup.py",
  ]


# ---------------------------------------------------------------------------------------
# gpu.py and slurm.py
# ---------------------------------------------------------------------------------------
def test_gpu_host_run_over_ssh_and_here(tmp_path):
  (ssh,) = _dry_run(
      "gpu.py",
      "run",
      "--host=me@gpu-box",
      "--workdir=gs://b/r",
      "--gpus=0,1,2,3",
      "--dry-run",
      "--",
      "--config.train.steps=50",
  )
  assert ssh[:2] == ["ssh", "me@gpu-box"]
  assert (
      "env CUDA_VISIBLE_DEVICES=0,1,2,3 python3 -m electra_jax.main "
      "--config=electra-jax/configs/electra_small.py --workdir=gs://b/r --config.train.steps=50"
  ) in ssh[2]

  fake = _fake_python(str(tmp_path))
  (local,) = _dry_run(
      "gpu.py",
      "run",
      f"--job-dir={tmp_path}",
      "--workdir=relative/wd",
      f"--python={fake}",
      "--config=configs/demo.py",
      "--dry-run",
      "--",
      *TRICKY_OVERRIDES,
  )
  assert local[:2] == ["bash", "-c"]
  subprocess.run(local, cwd=REPO, timeout=60, check=True, capture_output=True)
  assert _wait_for(lambda: (tmp_path / "electra-jax.exit").exists())
  argv = json.loads((tmp_path / "argv.json").read_text())
  # Paths made absolute: the job runs in --job-dir, not where the command was typed.
  assert argv == [
      "-m",
      "electra_jax.main",
      f"--config={REPO}/configs/demo.py",
      f"--workdir={os.path.join(REPO, 'relative/wd')}",
      *TRICKY_OVERRIDES,
  ]


def test_gpu_local_install_from_git_twice_then_run_its_recipe(tmp_path):
  # Without --host, `install --repo-url` clones into --remote-dir here; a second install
  # replaces that checkout, and `run` finds a relative --config in it.
  origin = tmp_path / "origin"
  (origin / "configs").mkdir(parents=True)
  (origin / "configs" / "demo.py").write_text("# recipe\n")
  git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(origin)]
  for command in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-q", "-m", "first"]):
    subprocess.run(git + command, check=True, capture_output=True)
  fake = _fake_python(str(tmp_path))
  work = tmp_path / "work"
  work.mkdir()
  install = [
      sys.executable,
      os.path.join(LAUNCH, "gpu.py"),
      "install",
      f"--repo-url=file://{origin}",
      "--branch=main",
      f"--python={fake}",
  ]
  for _ in range(2):
    done = subprocess.run(install, cwd=work, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
  assert (work / "electra-jax" / "configs" / "demo.py").exists() and not (
      work / "electra-jax.new"
  ).exists()
  assert json.loads((work / "argv.json").read_text())[-1] == str(
      work / "electra-jax"
  )  # pip's target
  run = subprocess.run(
      [
          sys.executable,
          os.path.join(LAUNCH, "gpu.py"),
          "run",
          "--workdir=wd",
          "--config=configs/demo.py",
          "--dry-run",
      ],
      cwd=work,
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert f"--config={work}/electra-jax/configs/demo.py" in run.stdout, run.stdout


def test_slurm_script_runs_one_task_per_gpu(tmp_path):
  out = subprocess.run(
      [
          sys.executable,
          os.path.join(LAUNCH, "slurm.py"),
          "--nodes=4",
          "--gpus-per-node=8",
          "--partition=gpu",
          "--workdir=/shared/run",
          "--chain=2",
          f"--script={tmp_path}/job.sbatch",
          "--dry-run",
          "--",
          *TRICKY_OVERRIDES,
      ],
      capture_output=True,
      text=True,
      timeout=60,
      check=True,
      cwd=REPO,
  ).stdout
  script, submit = out.split("# submit with:\n")
  script = script.split("\n", 1)[1]  # after the "# <path>" header
  assert not os.path.exists(tmp_path / "job.sbatch")  # a dry run writes nothing
  directives = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH")]
  assert {
      "--nodes=4",
      "--ntasks-per-node=8",
      "--gpus-per-node=8",
      "--partition=gpu",
      "--requeue",
  } <= set(directives)
  assert any(d.startswith("--signal=TERM@") for d in directives)
  assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
  srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
  assert (
      "--cpus-per-task=8" in srun[: srun.index("-m")]
  )  # srun of Slurm 22.05-23.02 would give 1 core
  assert srun[srun.index("-m") - 1 :] == [
      "python3",
      "-m",
      "electra_jax.main",
      f"--config={REPO}/configs/electra_small.py",
      "--workdir=/shared/run",
      *TRICKY_OVERRIDES,
  ]
  submits = submit.splitlines()
  assert len(submits) == 3 and all("--dependency=afterany:$jobid" in line for line in submits[1:])
  assert f"--output={REPO}/slurm-logs/%x-%j.out" in directives  # not relative to where sbatch runs
  assert "must be non-empty and have no spaces" in _refused(
      "slurm.py", "--workdir=/r", "--job-name=my run", "--dry-run"
  )
  # A newline in any directive would end the #SBATCH block and run the rest as shell lines.
  for option in (
      "--time=1:00:00\nrm -rf ~",
      "--partition=gpu\ntouch /tmp/x",
      "--sbatch-arg=--qos=a\nid",
      "--job-name=",
  ):
    refused = _refused("slurm.py", "--workdir=/r", option, "--dry-run")
    assert "must be non-empty and have no spaces or control characters" in refused, (
        option,
        refused,
    )
  assert "--gpus='0, 1': give GPU indices" in _refused(
      "gpu.py", "run", "--workdir=/r", "--gpus=0, 1", "--dry-run"
  )
  assert "--gpus=''" in _refused("gpu.py", "run", "--workdir=/r", "--gpus=", "--dry-run")

  written = subprocess.run(
      [
          sys.executable,
          os.path.join(LAUNCH, "slurm.py"),
          "--workdir=/shared/run",
          f"--script={tmp_path}/job.sbatch",
          f"--log-dir={tmp_path}/logs",
      ],
      capture_output=True,
      text=True,
      timeout=60,
      check=True,
      cwd=REPO,
  )
  assert (tmp_path / "job.sbatch").read_text().startswith("#!/bin/bash\n#SBATCH")
  assert "sbatch --parsable" in written.stdout


@pytest.mark.fault
def test_a_recipe_that_is_not_there_is_refused_before_anything_is_written(tmp_path):
  # A typo: slurm.py would write a script whose every task fails once the job leaves the queue.
  script, logs = tmp_path / "job.sbatch", tmp_path / "logs"
  typo = _refused(
      "slurm.py",
      "--workdir=/shared/run",
      "--config=configs/electra_smal.py",
      f"--script={script}",
      f"--log-dir={logs}",
  )
  assert (
      f"--config=configs/electra_smal.py: there is no file {REPO}/configs/electra_smal.py" in typo
  )
  assert not script.exists() and not logs.exists()
  # From outside the checkout the default recipe is not under the current directory: the
  # error points at slurm.py's own checkout. A full path works from anywhere.
  outside = _refused(
      "slurm.py", "--workdir=/shared/run", f"--script={script}", "--dry-run", cwd=tmp_path
  )
  assert f"there is no file {tmp_path}/configs/electra_small.py" in outside
  assert f"--config={REPO}/configs/electra_small.py" in outside
  done = subprocess.run(
      [
          sys.executable,
          os.path.join(LAUNCH, "slurm.py"),
          "--workdir=/shared/run",
          f"--config={REPO}/configs/electra_small.py",
          "--dry-run",
      ],
      capture_output=True,
      text=True,
      timeout=60,
      cwd=tmp_path,
      check=True,
  )
  assert f"--config={REPO}/configs/electra_small.py" in done.stdout
  # gpu.py on this machine, and tpu_vm.py restart, which installs --local on the workers.
  assert "there is no file" in _refused(
      "gpu.py", "run", "--workdir=wd", "--config=configs/electra_smal.py", "--dry-run"
  )
  assert "relative to --local" in _refused(
      "tpu_vm.py",
      "restart",
      "--name=p",
      "--zone=z",
      "--accelerator-type=v4-8",
      f"--local={REPO}",
      "--workdir=gs://b/r",
      "--config=configs/electra_smal.py",
      "--dry-run",
  )


def test_electra_jax_joins_the_job_slurm_py_describes(monkeypatch):
  from electra_jax import distributed
  # What srun sets in each task of the script's step (--nodes=4 x --ntasks-per-node=8).
  for name, value in {
      "SLURM_NTASKS": "32",
      "SLURM_JOB_ID": "7",
      "SLURM_STEP_NODELIST": "gpu[01-04]",
      "SLURM_PROCID": "9",
      "SLURM_LOCALID": "1",
  }.items():
    monkeypatch.setenv(name, value)
  assert distributed._multi_host_environment() == "SLURM"


# ---------------------------------------------------------------------------------------
# The Colab notebook
# ---------------------------------------------------------------------------------------
def _notebook():
  with open(os.path.join(LAUNCH, "colab_tpu.ipynb"), encoding="utf-8") as f:
    return json.load(f)


def test_notebook_is_current_and_well_formed():
  with open(os.path.join(LAUNCH, "colab_tpu.ipynb"), encoding="utf-8") as f:
    assert f.read() == make_colab.render(), "run `python launch/make_colab.py`"
  notebook = _notebook()
  assert (notebook["nbformat"], notebook["nbformat_minor"]) == (4, 5)
  code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
  assert all(cell["outputs"] == [] and cell["execution_count"] is None for cell in code)
  install = "".join(code[0]["source"])
  assert install.startswith(make_colab.COLAB_ONLY) and 'REPO_URL = "https://github.com/' in install
  assert len({cell["id"] for cell in notebook["cells"]}) == len(notebook["cells"])


def test_notebook_pretrains_and_evaluates_on_cpu(tmp_path):
  cells = [
      "".join(cell["source"])
      for cell in _notebook()["cells"]
      if cell["cell_type"] == "code" and not cell["source"][0].startswith(make_colab.COLAB_ONLY)
  ]
  runner = (
      "import json, sys\nnamespace = {}\n"
      "for index, source in enumerate(json.load(sys.stdin)):\n"
      "  exec(compile(source, f'cell {index}', 'exec'), namespace)\n"
  )
  # No evaluation during training: the notebook's last cell evaluates the checkpoint.
  overrides = dict(
      TINY_OVERRIDES,
      **{
          "train.steps": 4,
          "train.log_every": 2,
          "checkpoint.every_steps": 4,
          "eval.every_steps": 0,
      },
  )
  env = dict(
      os.environ,
      ELECTRA_JAX_NOTEBOOK_WORKDIR=str(tmp_path / "wd"),
      ELECTRA_JAX_NOTEBOOK_PLOT="0",
      ELECTRA_JAX_NOTEBOOK_OVERRIDES=json.dumps(overrides),
  )
  done = subprocess.run(
      [sys.executable, "-c", runner],
      input=json.dumps(cells),
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout
  assert "device(s)" in out and f"hidden 32, {TINY_OVERRIDES['model.num_layers']} layers" in out
  # The live view printed each logged step as the run wrote it.
  assert [line.split("|")[0].split() for line in out.splitlines() if line.startswith("step ")] == [
      ["step", "2"],
      ["step", "4"],
  ]
  rows = [json.loads(line) for line in (tmp_path / "wd" / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows] == [2, 4]
  assert (tmp_path / "wd" / "checkpoints" / "4").is_dir()
  held_out = json.loads((tmp_path / "wd" / "eval_step_4.json").read_text())
  assert "held-out metrics of the checkpoint at step 4" in out
  assert 0.0 <= held_out["disc_auc"] <= 1.0 and held_out["loss"] > 0
  assert f"{held_out['disc_auc']:.4f}" in out
