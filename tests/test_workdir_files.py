"""Workdir files on local disk and in a bucket (the local GCS API of tests/gcs_server.py, reached
through etils.epath and gcsfs as a run reaches it)."""

import errno
import json
import os

import pytest

from electra_jax import checkpointing, config_lib, errors, workdir_files


def _lines(path):
  return [json.loads(line) for line in workdir_files.read_text(path).splitlines()]


def test_paths_keep_bucket_uris_and_make_local_ones_absolute(tmp_path, monkeypatch):
  assert os.fspath(workdir_files.path("gs://b/run", "config.json")) == "gs://b/run/config.json"
  monkeypatch.chdir(tmp_path)
  assert os.fspath(workdir_files.path("run", "x")) == str(tmp_path / "run" / "x")


def test_bucket_log_is_rewritten_whole_and_only_now_and_then(bucket, gcs_server):
  url = f"{bucket}/run/metrics.jsonl"
  log = workdir_files.JsonlLog(url, remote_flush_seconds=3600)
  for step in (1, 2, 3):
    log.append({"step": step, "loss": 1.0 / step})
  assert gcs_server.objects(bucket) == []  # buffered: no rewrite per step
  log.flush()
  assert [r["step"] for r in _lines(url)] == [1, 2, 3]
  first = gcs_server.generations(bucket)["run/metrics.jsonl"]
  log.append({"step": 4, "loss": 0.25})
  assert gcs_server.generations(bucket)["run/metrics.jsonl"] == first  # not yet
  log.flush()
  assert [r["step"] for r in _lines(url)] == [1, 2, 3, 4]  # one new object, the whole log
  assert gcs_server.generations(bucket)["run/metrics.jsonl"] != first

  # A resumed run (a new process) cuts the log back to its checkpoint and goes on from there.
  resumed = workdir_files.JsonlLog(url, remote_flush_seconds=0)
  resumed.truncate_after(2)
  assert [r["step"] for r in _lines(url)] == [1, 2]
  resumed.append({"step": 3, "loss": 0.3})  # flush interval 0: written at once
  assert [r["step"] for r in _lines(url)] == [1, 2, 3]


@pytest.mark.fault
def test_a_bucket_log_is_not_written_once_the_run_lost_the_workdir(bucket, gcs_server):
  url = f"{bucket}/run/metrics.jsonl"
  log = workdir_files.JsonlLog(url, remote_flush_seconds=3600)
  held = [True]
  log.holds = lambda: held[0]
  log.append({"step": 1})
  log.flush()
  written = gcs_server.generations(bucket)
  log.append({"step": 2})
  held[0] = False  # another run took the workdir over: the log is its own from now on
  log.flush()
  log.append({"step": 3})
  log.flush()
  assert gcs_server.generations(bucket) == written and [r["step"] for r in _lines(url)] == [1]


def test_local_log_appends_at_once_and_truncates_atomically(tmp_path):
  path = workdir_files.path(tmp_path, "metrics.jsonl")
  log = workdir_files.JsonlLog(path)
  for step in (1, 2, 3):
    log.append({"step": step})
    assert len(_lines(path)) == step
  with open(path, "a") as f:
    f.write('{"step": 4, "lo')  # a line cut short by a crash
  workdir_files.JsonlLog(path).truncate_after(2)
  assert [r["step"] for r in _lines(path)] == [1, 2]
  assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no temporary file left behind


def test_config_and_checkpoint_directory_in_a_bucket(bucket):
  workdir = f"{bucket}/run"
  workdir_files.makedirs(workdir_files.path(workdir))
  workdir_files.write_text(
      workdir_files.path(workdir, "config.json"), json.dumps({"train": {"steps": 7}})
  )
  assert config_lib.load_workdir_config(workdir).train.steps == 7
  with pytest.raises(errors.ConfigError, match=f"{bucket}/other has no config.json"):
    config_lib.load_workdir_config(f"{bucket}/other")
  # Orbax gets the bucket path itself, not /cwd/gs:/b/run/...
  assert checkpointing.checkpoints_directory(workdir) == f"{workdir}/checkpoints"


@pytest.mark.fault
def test_our_json_files_damaged_are_refused_naming_the_file(tmp_path):
  from electra_jax import sweep  # noqa: PLC0415

  config = tmp_path / "config.json"
  for text in ('{"model": {"hidden_size": 32', "[1, 2]", '{"model": 3, "train": {}, "data": {}}'):
    config.write_text(text)
    with pytest.raises(errors.ConfigError, match=f"{config} is not as electra-jax writes it"):
      config_lib.saved_config(str(tmp_path))
  config.write_text(json.dumps({"model": {}, "train": {"steps": 7}, "data": {}}))
  assert (
      config_lib.saved_config(str(tmp_path))["train"]["steps"] == 7
  )  # completed with the defaults
  record = tmp_path / workdir_files.SWEEP_FILE
  for text in ("{", '{"runs": [{"name": "a"}]}', '{"runs": 5}'):
    record.write_text(text)
    with pytest.raises(errors.ConfigError, match=f"{record} is not as electra-jax writes it"):
      sweep.read_record(str(tmp_path))
  record.write_text(json.dumps({"runs": [{"name": "a", "overrides": [["k", "1"]]}]}))
  with pytest.raises(errors.ConfigError, match="KeyError: 'base_config'"):  # run_sweep reads it
    sweep.read_record(str(tmp_path))
  record.write_text(
      json.dumps({"base_config": {}, "runs": [{"name": "a", "overrides": [["k", "1"]]}]})
  )
  assert sweep.read_record(str(tmp_path))["runs"][0].overrides == [("k", "1")]


@pytest.mark.fault
def test_a_bucket_workdir_without_the_gcs_extra_is_refused_naming_it(monkeypatch):
  import sys  # noqa: PLC0415

  monkeypatch.setitem(sys.modules, "gcsfs", None)  # what `import gcsfs` finds when not installed
  with pytest.raises(errors.ConfigError, match=r"--workdir=gs://b/run needs gcsfs .*\[gcs\]"):
    workdir_files.check_usable("gs://b/run")
  with pytest.raises(
      errors.ConfigError, match="--workdir=s3://b/run: a remote path must be a gs:// path"
  ):
    workdir_files.check_usable("s3://b/run")


@pytest.mark.fault
def test_a_link_to_nothing_is_left_out_of_a_listing_and_the_rest_is_listed(tmp_path):
  (tmp_path / "shard.npy").write_bytes(b"12345")
  (tmp_path / "linked.npy").symlink_to(tmp_path / "shard.npy")
  (tmp_path / "dangling.npy").symlink_to(tmp_path / "gone.npy")
  assert workdir_files.list_files(tmp_path) == {"shard.npy": (5, None), "linked.npy": (5, None)}


def _log(folder, *lines: bytes):
  (folder / "metrics.jsonl").write_bytes(b"".join(lines))
  return folder / "metrics.jsonl"


@pytest.mark.fault
@pytest.mark.parametrize("damage", [b"\xff\xfe", b"{'step': 2}", b'{"step": 2', b"[2]"])
def test_a_log_line_not_json_before_the_last_is_refused_naming_the_file_and_line(tmp_path, damage):
  log = _log(tmp_path, b'{"step": 1}\n', damage + b"\n", b'{"step": 3}\n')
  with pytest.raises(errors.ConfigError, match=f"{log}, line 2, is not a JSON object"):
    workdir_files.read_jsonl(log)


@pytest.mark.fault
def test_a_log_whose_last_line_a_crash_cut_in_bytes_keeps_its_whole_lines(tmp_path, caplog):
  log = _log(tmp_path, b'{"step": 1}\n', b'{"step": 2}\n', b'{"step": 3, "lo\xe2\x82')
  assert workdir_files.read_jsonl(log) == [{"step": 1}, {"step": 2}]
  assert f"Skipping the last line of {log}" in caplog.text


@pytest.mark.fault
def test_a_write_to_a_directory_is_refused_naming_it_and_leaves_it(tmp_path):
  folder = tmp_path / "config.json"
  (folder / "inside").mkdir(parents=True)
  for write in (
      lambda: workdir_files.write_json(folder, {"steps": 7}),
      lambda: workdir_files.JsonlLog(folder).append({"step": 1}),
  ):
    with pytest.raises(errors.ConfigError, match=f"Writing {folder}: it is a directory"):
      write()
  assert sorted(os.listdir(tmp_path)) == ["config.json"] and os.listdir(folder) == ["inside"]


@pytest.mark.fault
def test_a_disk_quota_is_found_as_a_full_disk_is(tmp_path, monkeypatch):
  def over_quota(fd, offset, size):  # what a filesystem answers once this user's quota is used up
    raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

  monkeypatch.setattr(os, "posix_fallocate", over_quota)
  assert workdir_files.short_of_space(tmp_path, 1000) == errno.EDQUOT
  assert os.listdir(tmp_path) == []


@pytest.mark.fault
def test_a_resumed_run_cuts_a_log_with_bytes_not_utf8_back_to_its_whole_lines(tmp_path):
  log = _log(tmp_path, b'{"step": 1}\n', b'{"step": 2, "lo\xff\n', b'{"step": 3}\n')
  workdir_files.JsonlLog(log).truncate_after(2)
  assert workdir_files.read_jsonl(log) == [{"step": 1}]
