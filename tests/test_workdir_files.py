"""Workdir files on local disk and in a bucket. The bucket is an in-memory fsspec filesystem
registered for gs:// that, like GCS, refuses to append; etils.epath (which orbax uses for
gs:// too) reaches it exactly as it would reach gcsfs."""

import json
import os

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from electra_jax import checkpointing, config_lib, errors, workdir_files


class FakeBucket(MemoryFileSystem):
  protocol = ("gs", "gcs")
  store: dict = {}
  pseudo_dirs = [""]
  writes: list = []

  def __init__(self, *args, finalize_on_close=None, **kwargs):  # gcsfs's extra argument
    super().__init__(*args, **kwargs)

  def _open(self, path, mode="rb", **kwargs):
    if "a" in mode:
      raise OSError("GCS objects cannot be appended to")
    if "w" in mode:
      FakeBucket.writes.append(path)
    return super()._open(path, mode, **kwargs)


@pytest.fixture
def bucket(monkeypatch):
  monkeypatch.setattr(FakeBucket, "store", {})
  monkeypatch.setattr(FakeBucket, "pseudo_dirs", [""])
  monkeypatch.setattr(FakeBucket, "writes", [])
  for name in ("gs", "gcs"):
    fsspec.register_implementation(name, FakeBucket, clobber=True)
  from etils.epath import backend  # noqa: PLC0415

  backend.fsspec_backend._get_filesystem.cache_clear()
  yield FakeBucket
  backend.fsspec_backend._get_filesystem.cache_clear()


def _lines(path):
  return [json.loads(line) for line in workdir_files.read_text(path).splitlines()]


def test_paths_keep_bucket_uris_and_make_local_ones_absolute(tmp_path, monkeypatch):
  assert os.fspath(workdir_files.path("gs://b/run", "config.json")) == "gs://b/run/config.json"
  monkeypatch.chdir(tmp_path)
  assert os.fspath(workdir_files.path("run", "x")) == str(tmp_path / "run" / "x")


def test_bucket_log_is_rewritten_whole_and_only_now_and_then(bucket):
  log = workdir_files.JsonlLog(
      workdir_files.path("gs://b/run", "metrics.jsonl"), remote_flush_seconds=3600
  )
  for step in (1, 2, 3):
    log.append({"step": step, "loss": 1.0 / step})
  assert not workdir_files.exists("gs://b/run/metrics.jsonl")  # buffered: no rewrite per step
  log.flush()
  assert [r["step"] for r in _lines("gs://b/run/metrics.jsonl")] == [1, 2, 3]
  log.append({"step": 4, "loss": 0.25})
  log.flush()
  assert [r["step"] for r in _lines("gs://b/run/metrics.jsonl")] == [1, 2, 3, 4]
  assert len(bucket.writes) == 2

  # A resumed run (a new process) cuts the log back to its checkpoint and goes on from there.
  resumed = workdir_files.JsonlLog(
      workdir_files.path("gs://b/run", "metrics.jsonl"), remote_flush_seconds=0
  )
  resumed.truncate_after(2)
  assert [r["step"] for r in _lines("gs://b/run/metrics.jsonl")] == [1, 2]
  resumed.append({"step": 3, "loss": 0.3})  # flush interval 0: written at once
  assert [r["step"] for r in _lines("gs://b/run/metrics.jsonl")] == [1, 2, 3]


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
  workdir_files.makedirs(workdir_files.path("gs://b/run"))
  workdir_files.write_text(
      workdir_files.path("gs://b/run", "config.json"), json.dumps({"train": {"steps": 7}})
  )
  assert config_lib.load_workdir_config("gs://b/run").train.steps == 7
  with pytest.raises(errors.ConfigError, match="gs://b/other has no config.json"):
    config_lib.load_workdir_config("gs://b/other")
  # Orbax gets the bucket path itself, not /cwd/gs:/b/run/... (it needs google-cloud-storage
  # for buckets, which this machine lacks, so the manager itself is not built here).
  assert checkpointing.checkpoints_directory("gs://b/run") == "gs://b/run/checkpoints"


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
  record = tmp_path / sweep.SWEEP_FILE
  for text in ("{", '{"runs": [{"name": "a"}]}', '{"runs": 5}'):
    record.write_text(text)
    with pytest.raises(errors.ConfigError, match=f"{record} is not as electra-jax writes it"):
      sweep.read_record(str(tmp_path))
  record.write_text(json.dumps({"runs": [{"name": "a", "overrides": [["k", "1"]]}]}))
  assert sweep.read_record(str(tmp_path))["runs"][0].overrides == [("k", "1")]
