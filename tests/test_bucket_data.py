"""Prepared shards in a bucket, against the local GCS API (tests/gcs_server.py): prepare_data
writes there from the command line, training and evaluation read each process's rows by ranged
reads, and what they read is what a local preparation of the same config gives, bit for bit."""

import hashlib
import json
import os
import threading

import numpy as np
import pytest
from conftest import TINY_OVERRIDES, cli, cli_args, tiny_config
from etils import epath

from electra_jax import workdir_files
from electra_jax.data import get_batch, load_pretraining_data, load_tokenizer, shards
from electra_jax.errors import ConfigError

# Four shards of 30 documents (the tiny corpus is 120), both splits; the tokenizer is trained by
# prepare_data into the prepared directory, so training reads it from there too.
DATA = {"data.shard_documents": 30, "data.eval_fraction": 0.1}


def _prepare(prepared_dir, workers: int, workdir):
  args = cli_args(workdir, **DATA, **{"data.prepared_dir": prepared_dir})
  done = cli(args + ["--mode=prepare_data", f"--workers={workers}"])
  assert done.returncode == 0, done.stderr[-3000:]
  return done


def _data_config(prepared_dir):
  return tiny_config(**DATA, **{"data.source": "prepared", "data.prepared_dir": prepared_dir}).data


def _objects(url) -> dict[str, tuple[int, str]]:
  """name -> (generation, crc32c) of the objects under `url`, fresh from the bucket."""
  fs, prefix = workdir_files.filesystem(url)
  return {
      info["name"].rsplit("/", 1)[-1]: (info["generation"], info["crc32c"])
      for info in fs.ls(prefix, detail=True, refresh=True)
  }


def _upload(local_dir, url) -> None:
  for file in sorted(os.listdir(local_dir)):
    with open(os.path.join(local_dir, file), "rb") as f:
      workdir_files.write_bytes(f"{url}/{file}", f.read())


@pytest.fixture(scope="module")
def prepared(gcs_server, tmp_path_factory):
  """(a local preparation on the main process, the same config prepared into a bucket by a
  worker process). The bucket's tokenizer is trained there; the local preparation takes it as
  one an earlier run trained (the same file: it depends on the config alone)."""
  local = str(tmp_path_factory.mktemp("prepared"))
  remote = f"{gcs_server.create_bucket()}/corpus/prepared"
  _prepare(remote, workers=1, workdir=tmp_path_factory.mktemp("unused"))
  with open(os.path.join(local, "spm.model"), "wb") as f:
    f.write(epath.Path(remote, "spm.model").read_bytes())
  _prepare(local, workers=0, workdir=tmp_path_factory.mktemp("unused"))
  return local, remote


def test_prepare_data_writes_into_a_bucket_what_it_writes_locally(prepared):
  local, remote = prepared
  manifest = json.loads(epath.Path(remote, shards.MANIFEST).read_text())
  assert manifest["complete"] and len(manifest["shards"]) == 4
  assert manifest["shards"] == json.loads(epath.Path(local, shards.MANIFEST).read_text())["shards"]
  names = sorted(os.listdir(local))
  assert sorted(_objects(remote)) == names  # nothing else: no temporary objects either
  for name in names:
    with open(os.path.join(local, name), "rb") as f:
      assert epath.Path(remote, name).read_bytes() == f.read(), name
  # The bucket's own checksum of each object is the one the manifest recorded as it wrote it.
  crc32c = {name: workdir_files.list_files(remote)[name][1] for name in names}
  for split_entry in (e["splits"]["train"] for e in manifest["shards"]):
    assert crc32c[split_entry["file"]] == split_entry["crc32c"]
    assert crc32c[split_entry["lengths_file"]] == split_entry["lengths_crc32c"]


def test_training_from_a_bucket_reads_the_local_batches_and_gives_the_same_loss(
    prepared, tmp_path, monkeypatch
):
  local, remote = prepared
  for split in ("train", "eval"):
    ours, theirs = (load_pretraining_data(_data_config(d), split) for d in (remote, local))
    assert type(ours.input_ids._shards).__name__ == "BucketShards"
    assert ours.fingerprint == theirs.fingerprint  # a checkpoint resumes on either copy
    for step in range(0, 40, 7):  # past an epoch of both splits
      for process in range(2):
        batch = get_batch(ours, step, 8, seed=3, process_index=process, process_count=2)
        expected = get_batch(theirs, step, 8, seed=3, process_index=process, process_count=2)
        assert batch.keys() == expected.keys()
        for key in batch:
          np.testing.assert_array_equal(batch[key], expected[key])

  # Training and its held-out evaluation, from the command line; the bucket's reads of training
  # batches happen on the prefetcher's thread, ahead of the step.
  fetch, threads = shards.BucketShards._fetch, []

  def recording(reader, parts):
    split = reader.paths[0].rsplit("/", 1)[-1].split("-")[0]
    threads.append((split, threading.current_thread().name))
    return fetch(reader, parts)

  monkeypatch.setattr(shards.BucketShards, "_fetch", recording)
  runs = {}
  for name, directory in (("bucket", remote), ("local", local)):
    workdir = tmp_path / name
    args = cli_args(
        workdir,
        **DATA,
        **{
            "data.source": "prepared",
            "data.prepared_dir": directory,
            "train.steps": 3,
            "eval.every_steps": 3,
        },
    )
    run = cli(args)
    assert run.returncode == 0, run.stderr[-3000:]
    runs[name] = [
        workdir_files.read_jsonl(workdir / log) for log in ("metrics.jsonl", "eval_metrics.jsonl")
    ]
  (train_log, eval_log), (local_train_log, local_eval_log) = runs["bucket"], runs["local"]
  assert [m["step"] for m in train_log] == [1, 2, 3] and len(eval_log) == 1
  for ours, theirs in ((train_log, local_train_log), (eval_log, local_eval_log)):
    for a, b in zip(ours, theirs, strict=True):
      for key in ("loss", "masked_lm_loss", "disc_loss", "disc_accuracy", "masked_lm_accuracy"):
        if key in a:
          assert a[key] == b[key], (key, a[key], b[key])  # bitwise: the same float
  train_reads = [thread for split, thread in threads if split == "train"]
  assert len(train_reads) >= 3 and all(
      t.startswith("electra-prefetch") for t in train_reads
  ), threads


def test_a_tokenizer_in_a_bucket_is_read_from_a_local_copy_named_by_its_content(prepared):
  _, remote = prepared
  config = _data_config(remote)
  config.spm_model_file = f"{remote}/spm.model"  # given, as a file in a bucket
  tokenizer = load_tokenizer(config)  # refused unless it is the one the shards were made with
  model = epath.Path(config.spm_model_file).read_bytes()
  assert tokenizer.fingerprint == hashlib.sha256(model).hexdigest()[:16]
  cache = os.environ["ELECTRA_JAX_CACHE"]
  assert tokenizer.model_path.startswith(cache) and tokenizer.fingerprint in tokenizer.model_path
  with open(tokenizer.model_path, "rb") as f:
    assert f.read() == model


def test_a_process_fetches_only_its_rows_in_one_concurrent_read(prepared, monkeypatch):
  _, remote = prepared
  data = load_pretraining_data(_data_config(remote))
  fs, _ = workdir_files.filesystem(remote)  # (fsspec's cached instance: the one the reads use)
  read_ranges, reads = fs.cat_ranges, []
  monkeypatch.setattr(fs, "cat_ranges", lambda *a, **kw: reads.append(a) or read_ranges(*a, **kw))
  batch = get_batch(data, 5, 16, seed=0, process_index=1, process_count=2)
  assert len(reads) == 1, "both channels, every shard touched: one request batch"
  paths, starts, ends = reads[0]
  row_bytes = 2 * TINY_OVERRIDES["data.max_seq_len"] * 2  # uint16 ids and types
  rows = {
      (path, offset)
      for path, start, end in zip(paths, starts, ends)
      for offset in range(start, end, row_bytes)
  }
  # The 8 rows of process 1, each once (runs of consecutive rows come as one range).
  assert (
      sum(end - start for start, end in zip(starts, ends)) == 8 * row_bytes == len(rows) * row_bytes
  )
  assert batch["input_ids"].shape == (8, TINY_OVERRIDES["data.max_seq_len"])


@pytest.mark.fault
@pytest.mark.parametrize("change", ["bytes", "ids outside the vocabulary"])
def test_a_shard_object_that_differs_from_the_manifest_is_refused_by_name(prepared, bucket, change):
  local, _ = prepared
  remote = f"{bucket}/prepared"
  _upload(local, remote)  # a local preparation uploaded as it is also trains from the bucket
  name = "train-00001.npy"
  with open(os.path.join(local, name), "rb") as f:
    original = f.read()
  rows = np.load(os.path.join(local, name))
  if change == "bytes":  # one id one higher: the same size, another crc32c
    rows[0, 0, 1] += 1
    expected = rf"Shard {remote}/{name} is not the file prepare_data wrote \(its crc32c"
  else:  # and the manifest made to agree: only the ids read show it
    rows[0, 0, 1] = 9999
    expected = rf"Shard {remote}/{name} holds token id 9999, outside the tokenizer's 500 ids"
  damaged = original[: len(original) - rows.nbytes] + rows.tobytes()
  assert len(damaged) == len(original)
  workdir_files.write_bytes(f"{remote}/{name}", damaged)
  if change != "bytes":
    manifest = json.loads(epath.Path(remote, shards.MANIFEST).read_text())
    for entry in manifest["shards"]:
      if entry["splits"]["train"]["file"] == name:
        entry["splits"]["train"]["crc32c"] = workdir_files.crc32c(damaged)
    workdir_files.write_json(f"{remote}/{shards.MANIFEST}", manifest)
  with pytest.raises(ConfigError, match=expected + r".*--mode=prepare_data again"):
    data = load_pretraining_data(_data_config(remote))
    get_batch(data, 0, data.num_rows, seed=0)  # every row of the split, checked as it is read


@pytest.mark.fault
@pytest.mark.parametrize("name", ["../outside/train-00001.npy", "/train-00001.npy"])
def test_a_manifest_naming_a_shard_outside_its_bucket_folder_is_refused(prepared, bucket, name):
  local, _ = prepared
  remote = f"{bucket}/prepared"
  _upload(local, remote)
  _upload(local, f"{bucket}/outside")
  manifest = json.loads(epath.Path(remote, shards.MANIFEST).read_text())
  manifest["shards"][1]["splits"]["train"]["file"] = name
  workdir_files.write_json(f"{remote}/{shards.MANIFEST}", manifest)
  expected = rf"{remote}/{shards.MANIFEST}: shards\[1\]\.splits\.train\.file='{name}'"
  with pytest.raises(ConfigError, match=expected + ".*--mode=prepare_data"):
    load_pretraining_data(_data_config(remote))


@pytest.mark.fault
def test_prepare_data_into_a_bucket_resumes_from_the_shards_its_manifest_lists(
    prepared, bucket, tmp_path
):
  local, _ = prepared
  remote = f"{bucket}/prepared"
  _upload(local, remote)
  full = json.loads(epath.Path(remote, shards.MANIFEST).read_text())
  # What a run killed while packing shard 3 leaves: a manifest of shards 0-2, not complete (and,
  # here, shard 1's object replaced since, by another of the same size).
  killed = {k: v for k, v in full.items() if k not in ("totals", "documents_fingerprint")}
  killed.update(complete=False, shards=full["shards"][:3])
  workdir_files.write_json(f"{remote}/{shards.MANIFEST}", killed)
  damaged = bytearray(epath.Path(remote, "train-00001.npy").read_bytes())
  damaged[-1] ^= 1
  workdir_files.write_bytes(f"{remote}/train-00001.npy", bytes(damaged))
  before = _objects(remote)

  resumed = _prepare(remote, workers=0, workdir=tmp_path)
  after = _objects(remote)
  assert json.loads(epath.Path(remote, shards.MANIFEST).read_text())["shards"] == full["shards"]
  for name in after:
    with open(os.path.join(local, name), "rb") as f:
      assert epath.Path(remote, name).read_bytes() == f.read(), name
  rewritten = {name for name in after if after[name][0] != before[name][0]}
  assert rewritten == {
      "manifest.json",
      "train-00001.npy",  # listed, but its crc32c is not the manifest's: packed again
      "train-00001.lengths.npy",
      "train-00003.npy",  # not listed: packed again
      "train-00003.lengths.npy",
      "eval-00001.npy",
      "eval-00001.lengths.npy",
      "eval-00003.npy",
      "eval-00003.lengths.npy",
  }, rewritten
  assert "shard 1 in" in resumed.stderr and "packing it again" in resumed.stderr


@pytest.mark.fault
def test_a_prepared_dir_in_a_bucket_that_does_not_exist_is_refused_by_name(gcs_server, tmp_path):
  missing = "gs://no-such-bucket-electra/corpus"
  prepare = cli(
      cli_args(tmp_path / "a", **{"data.prepared_dir": missing})
      + ["--mode=prepare_data", "--workers=0"]
  )
  train = cli(cli_args(tmp_path / "b", **{"data.source": "prepared", "data.prepared_dir": missing}))
  for run in (prepare, train):
    assert run.returncode != 0
    refused = f"data.prepared_dir={missing}: the bucket gs://no-such-bucket-electra does not exist"
    assert refused in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr  # one line, before any work
