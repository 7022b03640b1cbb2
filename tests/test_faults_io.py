"""Faults around the files we write and read (issue 78): a full disk and a file-size limit end in
one line naming the file, the previous version kept; Ctrl-C stops an eval; a live workdir's
rotating checkpoint is never called damaged; one mode for every file we write."""

import errno
import json
import os
import re
import shutil
import resource
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, cli, cli_args

from electra_jax import errors, workdir_files


def _fail_writes_under(monkeypatch, folder, code=errno.ENOSPC):
  """os.write, the lowest write call, refuses (as a full disk does) every write to a file under
  `folder`; writes elsewhere (pytest's, the log's) go through."""
  real_write = os.write

  def write(fd, data):
    if os.readlink(f"/proc/self/fd/{fd}").startswith(os.fspath(folder)):
      raise OSError(code, os.strerror(code))
    return real_write(fd, data)

  monkeypatch.setattr(os, "write", write)


def _leftovers(folder):
  return [name for name in os.listdir(folder) if name.startswith(".tmp-")]


@pytest.mark.fault
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_full_disk_is_one_error_naming_the_file_and_keeps_its_last_version(
    tmp_path, monkeypatch, code
):
  file = tmp_path / "config.json"
  workdir_files.write_json(file, {"steps": 6})
  _fail_writes_under(monkeypatch, tmp_path, code)
  with pytest.raises(errors.OutOfSpace, match="free space") as refusal:
    workdir_files.write_json(file, {"steps": 7})
  assert str(file) in str(refusal.value)
  assert json.loads(file.read_text()) == {"steps": 6}
  assert _leftovers(tmp_path) == []


def _limited_child(script: str, limit_bytes: int) -> subprocess.CompletedProcess:
  """`script` in a Python process whose files may not grow past `limit_bytes` (`ulimit -f`)."""
  prologue = (
      "import resource\n"
      f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, resource.RLIM_INFINITY))\n"
  )
  env = dict(os.environ, PYTHONPATH=REPO, PYTHONDONTWRITEBYTECODE="1")
  return subprocess.run(
      [sys.executable, "-c", prologue + textwrap.dedent(script)],
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )


@pytest.mark.fault
def test_file_size_limit_is_one_error_naming_the_file_and_keeps_its_last_version(tmp_path):
  file, log = tmp_path / "big.bin", tmp_path / "metrics.jsonl"
  file.write_bytes(b"old")
  log.write_text('{"step": 1}\n')
  child = _limited_child(
      f"""
      from electra_jax import errors, workdir_files
      for write in (
          lambda: workdir_files.write_bytes({str(file)!r}, b"x" * 200_000),
          lambda: workdir_files.JsonlLog({str(log)!r}).append({{"step": 2, "pad": "y" * 200_000}}),
      ):
        try:
          write()
        except errors.OutOfSpace as error:
          print("refused:", error)
      """,
      limit_bytes=64 * 1024,
  )
  refusals = [line for line in child.stdout.splitlines() if line.startswith("refused:")]
  assert child.returncode == 0, child.stderr
  assert len(refusals) == 2 and "Traceback" not in child.stderr, (child.stdout, child.stderr)
  assert str(file) in refusals[0] and str(log) in refusals[1]
  assert all("ulimit -f" in line for line in refusals)
  assert file.read_bytes() == b"old"
  assert _leftovers(tmp_path) == []
  assert [json.loads(line)["step"] for line in log.read_text().splitlines()[:1]] == [1]


def _logged_workdir(folder):
  folder.mkdir()
  lines = [json.dumps({"step": s, "loss": 5.0 / s}) for s in range(1, 6)]
  (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  return folder


@pytest.mark.fault
def test_cli_prints_a_full_disk_in_one_line(tmp_path, monkeypatch):
  workdir, out = _logged_workdir(tmp_path / "run"), tmp_path / "out"
  out.mkdir()
  _fail_writes_under(monkeypatch, out)
  args = [sys.executable, "-m", "electra_jax.main", "--mode=plot", f"--workdir={workdir}"]
  result = cli([*args, f"--out={out}/curves.png"])
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("electra-jax: error: ") and f"{out}/curves.png" in last, result.stderr
  assert "Traceback" not in result.stderr
  assert os.listdir(out) == []


@pytest.mark.fault
def test_cli_under_a_file_size_limit_ends_in_one_line(tmp_path):
  workdir = _logged_workdir(tmp_path / "run")
  out = tmp_path / "curves.png"
  child = _limited_child(
      f"""
      import sys
      from electra_jax import main
      sys.argv = ["electra-jax", "--mode=plot", "--workdir={workdir}", "--out={out}"]
      main.run()
      """,
      limit_bytes=8 * 1024,  # the PNG is larger
  )
  assert child.returncode == 1, child.stderr
  assert "Traceback" not in child.stderr
  last = child.stderr.strip().splitlines()[-1]
  assert last.startswith("electra-jax: error: ") and str(out) in last and "ulimit -f" in last
  assert not out.exists() and _leftovers(tmp_path) == []


@pytest.mark.fault
def test_an_error_line_stays_the_last_word_whatever_a_thread_prints_after_it():
  # The reads a damaged step's error cut short (orbax's threads) printed "RuntimeError: Event loop
  # is closed" tracebacks after the line, now and then.
  child = _limited_child(
      """
      import sys, threading, time
      from electra_jax import main
      def raise_later():
        time.sleep(1)
        raise RuntimeError("Event loop is closed")
      check = main._check_flags
      def check_with_a_thread_running(*args):
        threading.Thread(target=raise_later).start()
        check(*args)
      main._check_flags = check_with_a_thread_running
      sys.argv = ["electra-jax", "--mode=eval"]
      main.run()
      """,
      limit_bytes=resource.RLIM_INFINITY,
  )
  assert child.returncode == 1 and "Traceback" not in child.stderr, child.stderr[-3000:]
  assert child.stderr.strip().splitlines()[-1] == "electra-jax: error: --mode=eval needs --workdir."


@pytest.mark.fault
@pytest.mark.slow
def test_a_checkpoint_save_past_the_file_size_limit_ends_in_one_line_and_resumes(tmp_path):
  # A model whose checkpoint passes the limit, and its tokenizer (250 kB) does not. The word
  # embeddings (8192 x 16 float32, 512 kB) are one array: orbax may spread a state over several
  # data files (one per batch of writes), but no file holds less than one array.
  workdir = tmp_path / "run"
  wider = {"model.hidden_size": 64, "model.intermediate_size": 256, "model.vocab_size": 8192}
  overrides = {**wider, "checkpoint.every_steps": 3}
  assert cli(cli_args(workdir, **overrides, **{"train.steps": 3})).returncode == 0
  child = _limited_child(
      f"""
      import sys
      from electra_jax import main
      sys.argv = {cli_args(workdir, **overrides, **{"train.steps": 6})[2:]!r}
      main.run()
      """,
      limit_bytes=300_000,
  )
  assert child.returncode == 1, child.stderr[-3000:]
  last = child.stderr.strip().splitlines()[-1]
  assert last.startswith("electra-jax: error: ") and f"{workdir}/checkpoints" in last, last
  assert "ulimit -f" in last
  assert "Traceback" not in child.stderr, child.stderr[-3000:]  # not orbax's, nor tensorstore's
  assert os.listdir(workdir / "checkpoints") == ["3"]  # the unfinished step 6 is gone
  resumed = cli(cli_args(workdir, **overrides, **{"train.steps": 6}))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming from the checkpoint at step 3" in resumed.stderr
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]


@pytest.mark.fault
@pytest.mark.parametrize("mode", ["plot", "sweep_report"])
def test_a_log_with_bytes_not_utf8_is_one_line_naming_it_and_the_line(tmp_path, mode):
  folder = _sweep_folder(tmp_path / "sweep")
  log = _logged_workdir(folder / "learning_rate=0.001") / "metrics.jsonl"
  log.write_bytes(log.read_bytes().replace(b"step", b"st\xe9p", 1))
  workdir = log.parent if mode == "plot" else folder
  args = [sys.executable, "-m", "electra_jax.main", f"--mode={mode}", f"--workdir={workdir}"]
  result = cli([*args, f"--out={tmp_path}/curves.png"])
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert (
      last.startswith("electra-jax: error: ") and f"{log}, line 1, is not a JSON object" in last
  ), last


@pytest.mark.fault
def test_a_report_over_a_directory_is_one_line_naming_it(tmp_path):
  folder = _sweep_folder(tmp_path / "sweep")
  (folder / "results.csv" / "inside").mkdir(parents=True)
  result = _sweep_report(folder)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("electra-jax: error: ") and f"{folder}/results.csv" in last, last
  assert os.listdir(folder / "results.csv") == ["inside"]


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("trained") / "run"
  result = cli(cli_args(workdir))
  assert result.returncode == 0, result.stderr
  return workdir


def _assert_stopped_by_ctrl_c(child):
  assert child.returncode == 130, (child.stdout[-2000:], child.stderr[-3000:])
  assert "Traceback" not in child.stderr and "Held-out" not in child.stdout, child.stderr[-3000:]
  assert child.stderr.strip().splitlines()[-1].startswith("electra-jax: stopped by Ctrl-C")


@pytest.mark.fault
def test_eval_stops_at_a_ctrl_c_that_lands_in_a_gc_callback(trained_workdir):
  # Python drops a KeyboardInterrupt raised inside a gc callback (JAX has one at every
  # collection): here the first collection once the eval started takes the Ctrl-C.
  child = _limited_child(
      f"""
      import gc, signal, sys
      from electra_jax import main, train
      armed, evaluate = [], train.evaluate_checkpoint
      def arm_then_evaluate(*args):
        armed.append(True)
        return evaluate(*args)
      def ctrl_c_inside(phase, info):
        if armed and phase == "start":
          armed.clear()
          signal.raise_signal(signal.SIGINT)
      train.evaluate_checkpoint = arm_then_evaluate
      gc.callbacks.append(ctrl_c_inside)
      sys.argv = ["electra-jax", "--mode=eval", "--workdir={trained_workdir}"]
      main.run()
      """,
      limit_bytes=resource.RLIM_INFINITY,
  )
  _assert_stopped_by_ctrl_c(child)


@pytest.mark.fault
def test_eval_stops_at_a_ctrl_c_that_a_bare_except_takes(trained_workdir):
  # A library's `except BaseException` (or bare `except:`) takes the KeyboardInterrupt: the run
  # went on and ended with exit code 0.
  child = _limited_child(
      f"""
      import signal, sys
      from electra_jax import main, train
      evaluate = train.evaluate_checkpoint
      def swallow_then_evaluate(*args):
        try:
          signal.raise_signal(signal.SIGINT)
        except BaseException:
          pass
        return evaluate(*args)
      train.evaluate_checkpoint = swallow_then_evaluate
      sys.argv = ["electra-jax", "--mode=eval", "--workdir={trained_workdir}"]
      main.run()
      """,
      limit_bytes=resource.RLIM_INFINITY,
  )
  _assert_stopped_by_ctrl_c(child)


@pytest.mark.fault
def test_a_ctrl_c_lets_a_cleanup_that_handles_its_own_errors_finish(trained_workdir, tmp_path):
  # Raising the Ctrl-C again is for one that was lost: a `finally` that retries (its own
  # exception handled, the Ctrl-C in its context) was cut short.
  done = tmp_path / "cleanup_done"
  child = _limited_child(
      f"""
      import signal, sys, time
      from electra_jax import main, train
      def retrying_cleanup():
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
          try:
            raise TimeoutError
          except TimeoutError:
            time.sleep(0.01)
        open({str(done)!r}, "w").close()
      def ctrl_c_then_clean_up(*args):
        try:
          signal.raise_signal(signal.SIGINT)
        finally:
          retrying_cleanup()
      train.evaluate_checkpoint = ctrl_c_then_clean_up
      sys.argv = ["electra-jax", "--mode=eval", "--workdir={trained_workdir}"]
      main.run()
      """,
      limit_bytes=resource.RLIM_INFINITY,
  )
  _assert_stopped_by_ctrl_c(child)
  assert done.exists()


@pytest.mark.fault
def test_eval_stops_at_the_first_ctrl_c(trained_workdir):
  args = [sys.executable, "-m", "electra_jax.main", "--mode=eval", f"--workdir={trained_workdir}"]
  env = dict(os.environ, PYTHONPATH=REPO)
  process = subprocess.Popen(
      args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  seen = []
  for line in process.stderr:  # the Ctrl-C once the held-out data is loaded
    seen.append(line)
    if "loaded eval data" in line:
      process.send_signal(signal.SIGINT)
      break
  stdout, rest = process.communicate(timeout=300)
  _assert_stopped_by_ctrl_c(
      subprocess.CompletedProcess(args, process.returncode, stdout, "".join(seen) + rest)
  )


def test_every_exported_file_has_the_mode_of_the_files_we_write(tmp_path, trained_workdir):
  out = tmp_path / "hf"
  result = cli(
      [
          *cli_args(trained_workdir)[:3],
          "--mode=export_hf",
          f"--workdir={trained_workdir}",
          f"--out={out}",
      ]
  )
  assert result.returncode == 0, result.stderr[-3000:]
  modes = {
      name: oct(os.stat(os.path.join(root, name)).st_mode & 0o777)
      for root, _, names in os.walk(out)
      for name in names
  }
  assert "model.safetensors" in modes and "tokenizer.json" in modes
  assert set(modes.values()) == {oct(workdir_files.FILE_MODE)}, modes


@pytest.mark.fault
@pytest.mark.parametrize("mode", ["train", "eval", "export_hf"])
def test_a_bucket_workdir_without_gcsfs_is_one_line_naming_the_extra(tmp_path, monkeypatch, mode):
  monkeypatch.setitem(sys.modules, "gcsfs", None)  # as when it is not installed
  args = cli_args("gs://some-bucket/run") + [f"--mode={mode}", f"--out={tmp_path}/hf"]
  result = cli(args if mode == "train" else [a for a in args if not a.startswith("--config")])
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("electra-jax: error: ") and "pip install 'electra-jax[gcs]'" in last


@pytest.mark.fault
def test_api_load_config_takes_a_list_as_the_cli_takes_a_comma_separated_value(tmp_path):
  from electra_jax import api  # noqa: PLC0415

  files = [tmp_path / "a.txt", tmp_path / "b.txt"]
  for file in files:
    file.write_text("One sentence.\n")
  config = api.load_config("demo", {"data.source": "text", "data.files": [str(f) for f in files]})
  from_cli = api.load_config(
      "demo", {"data.source": "text", "data.files": ",".join(map(str, files))}
  )
  assert config.data.files == from_cli.data.files
  from electra_jax.data import sources  # noqa: PLC0415

  assert sources.resolve_files(config.data.files) == [str(f) for f in files]


@pytest.mark.fault
@pytest.mark.parametrize("where", ["ELECTRA_JAX_CACHE", "data.cache_dir"])
def test_a_cache_that_is_a_file_is_one_line_naming_it(tmp_path, monkeypatch, where):
  file = tmp_path / "not-a-folder"
  file.write_text("")
  overrides = {}
  if where == "ELECTRA_JAX_CACHE":
    monkeypatch.setenv("ELECTRA_JAX_CACHE", str(file))
  else:
    overrides["data.cache_dir"] = file
  result = cli(cli_args(tmp_path / "run", **overrides))
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("electra-jax: error: ") and f"{where}={file}" in last, last


def test_the_end_summary_lists_only_files_that_exist(tmp_path):
  from conftest import tiny_config  # noqa: PLC0415

  from electra_jax import main  # noqa: PLC0415

  workdir = _logged_workdir(tmp_path / "run")
  (workdir / "checkpoints").mkdir()
  (workdir / "config.json").write_text("{}")
  summary = main.end_summary(tiny_config(), {"step": 6, "loss": 1.0}, str(workdir), 3.0)
  files = summary.splitlines()[-1]
  assert files.startswith("Files: ")
  for name in ("checkpoints", "metrics.jsonl", "config.json"):
    assert f"{workdir}/{name}" in files
  assert "eval_metrics.jsonl" not in files


def _live_run_rotates(monkeypatch, workdir, times):
  """While export reads a checkpoint's arrays, a run holding `workdir` saves a newer step (a copy
  of its newest) and rotates the older ones away, `times` times."""
  from electra_jax import checkpointing  # noqa: PLC0415

  folder, real_restore, left = workdir / "checkpoints", checkpointing.Checkpointer.restore, [times]

  def read_while_the_run_saves(self, step, *args):
    if left[0]:
      left[0] -= 1
      steps = sorted(int(name) for name in os.listdir(folder) if name.isdigit())
      shutil.copytree(folder / str(steps[-1]), folder / str(steps[-1] + 3))
      for old in steps:
        shutil.rmtree(folder / str(old))
    return real_restore(self, step, *args)

  monkeypatch.setattr(checkpointing.Checkpointer, "restore", read_while_the_run_saves)


def _assert_no_damage_said(stderr):
  said = [line for line in stderr.splitlines() if re.search(r"\b(damaged|move)\b", line, re.I)]
  assert not said, said


@pytest.mark.fault
@pytest.mark.parametrize("mode", ["export_hf", "eval"])
def test_a_reader_of_a_live_workdir_reads_the_newest_step_again(
    tmp_path, monkeypatch, trained_workdir, mode
):
  """Every reader of the newest checkpoint (resolve.restore_checkpoint) reads again on rotation."""
  workdir, out = tmp_path / "run", tmp_path / "hf"
  shutil.copytree(trained_workdir, workdir)
  _live_run_rotates(monkeypatch, workdir, times=1)
  result = cli([*cli_args(workdir)[:3], f"--mode={mode}", f"--workdir={workdir}", f"--out={out}"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert mode == "eval" or (out / "discriminator" / "model.safetensors").exists()
  _assert_no_damage_said(result.stderr)


@pytest.mark.fault
def test_export_of_a_workdir_that_keeps_rotating_says_the_run_is_live(
    tmp_path, monkeypatch, trained_workdir
):
  workdir, out = tmp_path / "run", tmp_path / "hf"
  shutil.copytree(trained_workdir, workdir)
  _live_run_rotates(monkeypatch, workdir, times=100)
  result = cli([*cli_args(workdir)[:3], "--mode=export_hf", f"--workdir={workdir}", f"--out={out}"])
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("electra-jax: error: ") and "live run" in last, last
  _assert_no_damage_said(result.stderr)
  assert sorted(os.listdir(workdir / "checkpoints"))  # the run's newest step is still there


def _sweep_folder(folder, edit=lambda record: None):
  """A sweep folder of one run, not started, whose sweep.json `edit` changed as a person might."""
  from conftest import tiny_config  # noqa: PLC0415

  from electra_jax import config_lib  # noqa: PLC0415

  run = {"name": "learning_rate=0.001", "overrides": [["optimizer.learning_rate", "0.001"]]}
  record = {"base_config": config_lib.as_saved(tiny_config()), "runs": [run]}
  edit(record)
  folder.mkdir()
  (folder / "sweep.json").write_text(json.dumps(record))
  return folder


def _sweep_report(folder):
  return cli(
      [sys.executable, "-m", "electra_jax.main", "--mode=sweep_report", f"--workdir={folder}"]
  )


@pytest.mark.fault
@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda r: r["runs"][0].update(name="../outside"), "'../outside'"),
        (lambda r: r["runs"][0].update(name="/tmp"), "'/tmp'"),
        (lambda r: r["runs"][0].update(overrides=[["optimizer.learning_rate"]]), "overrides"),
        (lambda r: r["base_config"]["train"].update(steps="many"), "train.steps='many'"),
        (lambda r: r["base_config"]["model"].update(depth=3), "model.depth"),
        (lambda r: r.update(base_config=[]), "base_config"),
    ],
)
def test_an_edited_sweep_file_is_refused_naming_it_and_the_key(tmp_path, edit, named):
  folder = _sweep_folder(tmp_path / "sweep", edit)
  result = _sweep_report(folder)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("electra-jax: error: ") and f"{folder}/sweep.json" in last, last
  assert named in last, last
  assert not (folder / "results.csv").exists() and not (tmp_path / "outside").exists()


@pytest.mark.fault
def test_an_edited_finetune_result_in_a_sweep_is_refused_naming_it(tmp_path):
  folder = _sweep_folder(tmp_path / "sweep")
  results = folder / "learning_rate=0.001" / "finetune" / "glue" / "results.json"
  results.parent.mkdir(parents=True)
  results.write_text(json.dumps({"task": "sst2"}))  # no summary
  result = _sweep_report(folder)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert str(results) in result.stderr.strip().splitlines()[-1]
