"""Tests for offline preparation (prepare_data), prepared shards as training data, the
sentencepiece-training backend and the batch prefetcher.

The corpus is a few dozen synthetic documents written into tmp_path; the tokenizer is a tiny
sentencepiece model trained once per module by train_tokenizer.
"""

import concurrent.futures
import errno
import json
import os
import random
import re
import resource
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from conftest import base, cli_args, run_cli
from electra_jax import workdir_files
from electra_jax.errors import ConfigError, OutOfSpace
from electra_jax.data import (
    SentencePieceTokenizer,
    get_batch,
    load_pretraining_data,
    load_tokenizer,
    prefetch,
    prepare,
    prepare_data,
    train_tokenizer,
)
from electra_jax.data.pipeline import PretrainingData
from electra_jax.data.shards import ShardedRows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORDS = (
    "the a of river mountain city old new green quiet people walked over bridge under light "
    "house small large north south winter summer music played stories books read carefully "
    "café naïve résumé über 東京 北京"
).split()


def _sentence(rng):
  words = [rng.choice(_WORDS) for _ in range(rng.randint(2, 14))]
  return " ".join(words).capitalize() + "."


def _write_corpus(directory, num_files=3, docs_per_file=12, seed=0):
  """Text files of documents (1-8 sentences) separated by blank lines; returns the glob."""
  rng = random.Random(seed)
  os.makedirs(directory, exist_ok=True)
  for f in range(num_files):
    documents = [
        "\n".join(_sentence(rng) for _ in range(rng.randint(1, 8))) for _ in range(docs_per_file)
    ]
    with open(os.path.join(directory, f"part{f}.txt"), "w", encoding="utf-8") as out:
      out.write("\n\n".join(documents) + "\n")
  return os.path.join(str(directory), "*.txt")


def _config(tmp_path, files, **overrides):
  """configs/base.py's data group (every config is completed with it) for a tiny text corpus."""
  config = base.get_config().data
  config.update(
      source="text",
      files=files,
      max_seq_len=32,
      cache_dir=str(tmp_path / "cache"),
      spm_vocab_size=120,
      max_documents=0,
      eval_fraction=0.1,
      prepared_dir=str(tmp_path / "prepared"),
      shard_documents=7,
  )
  config.update(overrides)
  return config


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
  return _write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory, corpus_files):
  directory = tmp_path_factory.mktemp("spm")
  out = str(directory / "spm.model")
  trained = train_tokenizer(_config(directory, corpus_files), out, num_threads=1)
  assert trained.model_path == out
  return out


def _all_rows(data):
  return np.asarray(data.input_ids), np.asarray(data.token_type_ids)


# ---------------------------------------------------------------- train_tokenizer


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_train_tokenizer_model_has_special_tokens_and_serves_the_pipeline(
    tmp_path, corpus_files, model_type
):
  out = str(tmp_path / "tok" / "spm.model")
  trained = train_tokenizer(
      _config(tmp_path, corpus_files, spm_model_type=model_type, spm_vocab_size=100),
      out,
      num_threads=1,
  )
  tokenizer = SentencePieceTokenizer(out)
  assert trained.vocab_size == tokenizer.vocab_size == 100
  assert trained.fingerprint == tokenizer.fingerprint
  assert [tokenizer.id_to_piece(i) for i in range(5)] == [
      "[PAD]",
      "[UNK]",
      "[CLS]",
      "[SEP]",
      "[MASK]",
  ]
  assert tokenizer.decode(tokenizer.encode("the old bridge")) == "the old bridge"
  # data.spm_model_file makes the cache use exactly this model.
  config = _config(tmp_path, corpus_files, spm_model_file=out)
  assert load_pretraining_data(config).tokenizer.fingerprint == tokenizer.fingerprint
  assert load_tokenizer(config).fingerprint == tokenizer.fingerprint
  # None trained: at most the prepared shards' copy of this one.
  given = (tmp_path / "tok" / "spm.model").read_bytes()
  assert all(path.read_bytes() == given for path in (tmp_path / "cache").rglob("*.model"))


@pytest.mark.fault
@pytest.mark.parametrize("fault", ["out is a directory", "no text", "no model file", "prepared"])
def test_train_tokenizer_errors(tmp_path, corpus_files, fault):
  out, empty = tmp_path / "x.model", tmp_path / "empty.txt"
  empty.write_text("\n\n")
  config, refusal = _config(tmp_path, corpus_files), "already exists"
  if fault == "out is a directory":
    out = tmp_path
  elif fault == "no text":
    config, refusal = _config(tmp_path, str(empty)), "no usable text"
  elif fault == "no model file":
    config.spm_model_file, refusal = str(tmp_path / "none.model"), "spm_model_file=.*is not a file"
  else:
    config.source, refusal = "prepared", "train_tokenizer reads documents.*has none"
  with pytest.raises(ConfigError, match=refusal):
    train_tokenizer(config, str(out))
  assert not out.is_file()


@pytest.mark.fault
def test_train_tokenizer_does_not_replace_an_existing_model(tmp_path, corpus_files, spm_model):
  """A model file may already serve prepared shards and workdirs, which record its
  fingerprint: training another one over it (other settings, or another core count) used to
  replace it silently, leaving them bound to a model that no longer exists."""
  out = tmp_path / "spm.model"
  shutil.copy(spm_model, out)
  before = out.read_bytes()
  with pytest.raises(ConfigError, match=r"already exists.*nothing was written"):
    train_tokenizer(_config(tmp_path, corpus_files, spm_vocab_size=90), str(out), num_threads=1)
  assert out.read_bytes() == before


# ---------------------------------------------------------------- prepare_data


def test_prepared_shards_on_two_workers_hold_the_caches_examples_in_order(
    tmp_path, corpus_files, spm_model
):
  num_workers = 2
  config = _config(tmp_path, corpus_files, spm_model_file=spm_model)
  manifest = prepare_data(config, num_workers=num_workers)
  assert manifest["complete"] and len(manifest["shards"]) == 6  # 36 documents, 7 per shard
  prepared_config = _config(tmp_path, corpus_files, spm_model_file=spm_model, source="prepared")
  for split in ("train", "eval"):
    cached = load_pretraining_data(config, split)
    prepared = load_pretraining_data(prepared_config, split)
    assert isinstance(prepared, PretrainingData)
    input_ids, token_type_ids = _all_rows(prepared)
    np.testing.assert_array_equal(input_ids, cached.input_ids)
    np.testing.assert_array_equal(token_type_ids, cached.token_type_ids)
    assert prepared.fingerprint == cached.fingerprint, "a checkpoint must resume on either"
    assert prepared.num_tokens == cached.num_tokens
    for step in (0, 3):
      ours, theirs = get_batch(prepared, step, 8, seed=1), get_batch(cached, step, 8, seed=1)
      for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key])
        assert ours[key].dtype == np.int32


def test_manifest_records_counts_checksums_and_tokenizer(tmp_path, corpus_files, spm_model):
  config = _config(tmp_path, corpus_files, spm_model_file=spm_model, max_seq_len=24)
  manifest = prepare_data(config, num_workers=0)
  on_disk = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
  assert on_disk == json.loads(json.dumps(manifest))
  assert (
      manifest["max_seq_len"] == 24
      and manifest["format_version"] == prepare.PREPARED_FORMAT_VERSION
  )
  assert manifest["tokenizer"]["kind"] == "sentencepiece"
  assert manifest["tokenizer"]["fingerprint"] == SentencePieceTokenizer(spm_model).fingerprint
  assert manifest["source"]["source"] == "text" and manifest["source"]["num_files"] == 3
  totals = manifest["totals"]
  assert totals["documents"] == 36 and totals["train_documents"] + totals["eval_documents"] == 36
  assert totals["eval_documents"] == 3  # floor(36 * 0.1)
  for split in ("train", "eval"):
    rows = 0
    for entry in manifest["shards"]:
      split_entry = entry["splits"][split]
      rows += split_entry["rows"]
      if split_entry["rows"]:
        path = tmp_path / "prepared" / split_entry["file"]
        data = path.read_bytes()
        assert len(data) == split_entry["bytes"]
        assert workdir_files.crc32c(data) == split_entry["crc32c"]
        array = np.load(path)
        assert array.shape == (split_entry["rows"], 2, 24) and array.dtype == np.uint16
        assert split_entry["tokens"] == int(np.count_nonzero(array[:, 0]))
    assert rows == totals[f"{split}_examples"]
  assert [entry["first_document"] for entry in manifest["shards"]] == [0, 7, 14, 21, 28, 35]


def test_prepare_logs_progress_with_eta(tmp_path, corpus_files, spm_model, monkeypatch, caplog):
  monkeypatch.setattr(prepare, "_LOG_EVERY_S", 0.0)
  with caplog.at_level("INFO"):
    prepare_data(_config(tmp_path, corpus_files, spm_model_file=spm_model), num_workers=0)
  progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepare_data:")]
  assert progress, caplog.text
  assert all("documents" in line and "tokens/s" in line and "ETA" in line for line in progress)
  assert "100.0% of the input" in progress[-1]


@pytest.mark.fault
def test_rerun_skips_finished_shards_and_rebuilds_damaged_ones(
    tmp_path, corpus_files, spm_model, monkeypatch
):
  config = _config(tmp_path, corpus_files, spm_model_file=spm_model)
  first = prepare_data(config, num_workers=0)
  directory = tmp_path / "prepared"
  stamps = {name: os.stat(directory / name).st_mtime_ns for name in os.listdir(directory)}
  packed = []
  original_pack_shard = prepare.pack_shard
  monkeypatch.setattr(
      prepare,
      "pack_shard",
      lambda task, tok=None: packed.append(task["index"]) or original_pack_shard(task, tok),
  )
  again = prepare_data(config, num_workers=0)
  assert packed == [] and again == first
  assert {name: os.stat(directory / name).st_mtime_ns for name in os.listdir(directory)} == stamps

  # Same size, different bytes: only the checksum can tell.
  damaged = directory / first["shards"][2]["splits"]["train"]["file"]
  original = damaged.read_bytes()
  damaged.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
  os.remove(directory / first["shards"][4]["splits"]["train"]["file"])
  repaired = prepare_data(config, num_workers=0)
  assert sorted(packed) == [2, 4]
  assert damaged.read_bytes() == original
  assert repaired["shards"] == first["shards"]


@pytest.mark.fault
def test_a_failed_shard_is_named_and_the_finished_ones_are_kept(
    tmp_path, corpus_files, spm_model, monkeypatch
):
  config = _config(tmp_path, corpus_files, spm_model_file=spm_model)
  original_pack_shard = prepare.pack_shard

  def failing(task, tokenizer=None):
    if task["index"] == 2:
      return {"index": 2, "error": "OSError: [Errno 28] No space left on device"}
    return original_pack_shard(task, tokenizer)

  monkeypatch.setattr(prepare, "pack_shard", failing)
  with pytest.raises(
      RuntimeError,
      match="shard 2 failed .OSError: .Errno 28. No space left.*run prepare_data again",
  ):
    prepare_data(config, num_workers=0)
  manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
  assert [entry["index"] for entry in manifest["shards"]] == [0, 1] and not manifest["complete"]
  monkeypatch.setattr(prepare, "pack_shard", original_pack_shard)
  assert prepare_data(config, num_workers=0)["complete"]


@pytest.mark.fault
def test_a_stop_while_a_finished_shard_is_read_back_still_lists_it(
    tmp_path, corpus_files, spm_model, monkeypatch
):
  """SIGTERM raises SystemExit wherever the main thread is; here it lands as the second finished
  shard's result is read. That shard's file is on disk, so the manifest must list it (a result
  taken off the pending list before it was recorded used to be lost)."""
  config = _config(tmp_path, corpus_files, spm_model_file=spm_model)
  original_result, calls = concurrent.futures.Future.result, [0]

  def interrupted(future, timeout=None):
    calls[0] += 1
    if calls[0] == 2:
      raise SystemExit("prepare_data stopped by SIGTERM (simulated)")
    return original_result(future, timeout)

  monkeypatch.setattr(concurrent.futures.Future, "result", interrupted)
  with pytest.raises(SystemExit, match="simulated"):
    prepare_data(config, num_workers=0)
  directory = tmp_path / "prepared"
  manifest = json.loads((directory / "manifest.json").read_text())
  listed = {
      entry["splits"]["train"]["file"]
      for entry in manifest["shards"]
      if entry["splits"]["train"]["rows"]
  }
  assert len(listed) >= 2 and listed == {p.name for p in directory.glob("train-?????.npy")}


_KILLED_RUN = """
import os, sys, time
sys.path.insert(0, {repo!r})
import ml_collections
from electra_jax.data import prepare_data
real_fsync, calls = os.fsync, [0]
def slow_fsync(fd):
  calls[0] += 1
  if calls[0] == {kill_at}:  # inside the atomic write of a shard: data written, not yet renamed
    print("WRITING", flush=True)
    time.sleep(600)
  real_fsync(fd)
os.fsync = slow_fsync
prepare_data(ml_collections.ConfigDict({config}), num_workers=0)
"""


@pytest.mark.fault
def test_kill_mid_way_leaves_no_half_shard_and_resume_equals_uninterrupted(
    tmp_path, corpus_files, spm_model
):
  reference = prepare_data(
      _config(tmp_path / "ref", corpus_files, spm_model_file=spm_model), num_workers=0
  )
  reference_dir = tmp_path / "ref" / "prepared"
  config = _config(tmp_path, corpus_files, spm_model_file=spm_model)
  directory = tmp_path / "prepared"
  # fsync calls: the tokenizer's copy, the first manifest, then one per shard file.
  script = _KILLED_RUN.format(repo=REPO, kill_at=7, config=repr(config.to_dict()))
  process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
  try:
    assert process.stdout.readline().strip() == "WRITING"
  finally:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
  names = os.listdir(directory)
  assert any(name.startswith(".tmp-") for name in names), "the kill should interrupt a shard write"
  shard_names = [name for name in names if name.endswith(".npy") and not name.startswith(".tmp-")]
  assert shard_names, names
  for name in shard_names:  # every visible shard is whole and equals the uninterrupted run's
    assert (directory / name).read_bytes() == (reference_dir / name).read_bytes()
  assert len(shard_names) < len(os.listdir(reference_dir)) - 1
  manifest = json.loads((directory / "manifest.json").read_text())
  assert not manifest["complete"]
  with pytest.raises(ConfigError, match="did not finish.*resumes"):
    load_pretraining_data(
        _config(tmp_path, corpus_files, spm_model_file=spm_model, source="prepared")
    )

  resumed = prepare_data(config, num_workers=0)
  assert resumed["shards"] == reference["shards"] and resumed["totals"] == reference["totals"]
  assert sorted(os.listdir(directory)) == sorted(os.listdir(reference_dir))
  for name in os.listdir(reference_dir):
    if name.endswith(".npy"):
      assert (directory / name).read_bytes() == (reference_dir / name).read_bytes()


_WORKER_RUN = """
import sys
sys.path.insert(0, {repo!r})
import ml_collections
from electra_jax.data import prepare_data
if __name__ == "__main__":
  prepare_data(ml_collections.ConfigDict({config}), num_workers=2)
"""


def _marked_processes(mark: str) -> list[int]:
  """Live processes whose environment carries `mark` (the run's workers inherit it)."""
  pids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/environ", "rb") as f:
          if mark.encode() in f.read():
            pids.append(int(entry))
      except OSError:
        continue
  return pids


@pytest.mark.fault
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_a_killed_prepare_leaves_no_workers_and_a_sigterm_keeps_the_manifest(
    tmp_path, spm_model, signum
):
  """Its spawned workers used to wait on their task queue forever after the parent died (one
  per core, each holding a tokenizer); on SIGTERM the manifest also missed the shards on disk."""
  files = _write_corpus(tmp_path / "corpus", num_files=30, docs_per_file=150, seed=3)
  config = _config(tmp_path, files, spm_model_file=spm_model, shard_documents=5)
  script = tmp_path / "run.py"
  script.write_text(_WORKER_RUN.format(repo=REPO, config=repr(config.to_dict())))
  mark = f"ELECTRA_JAX_TEST_MARK_{os.getpid()}_{signum}"
  process = subprocess.Popen(
      [sys.executable, str(script)],
      env=dict(os.environ, **{mark: "1"}),
      stderr=subprocess.PIPE,
      text=True,
  )
  directory = tmp_path / "prepared"
  try:
    deadline = time.time() + 120
    while time.time() < deadline and not list(directory.glob("train-*.npy")):
      assert process.poll() is None, process.stderr.read()[-2000:]
      time.sleep(0.05)
    assert len(_marked_processes(mark)) >= 3  # the parent and its two workers
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
  finally:
    if process.poll() is None:
      process.kill()
  deadline = time.time() + 20
  while time.time() < deadline and _marked_processes(mark):
    time.sleep(0.2)
  assert _marked_processes(mark) == []
  if signum != signal.SIGKILL:  # SIGHUP (a closed terminal) as SIGTERM
    stopped = f"prepare_data stopped by {signal.Signals(signum).name}"
    assert process.returncode != 0 and stopped in stderr, stderr[-2000:]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["shards"] and not manifest["complete"]
    listed = {
        entry["splits"]["train"]["file"]
        for entry in manifest["shards"]
        if entry["splits"]["train"]["rows"]
    }
    assert listed == {
        p.name for p in directory.glob("train-?????.npy")
    }  # every finished shard, no more


@pytest.mark.fault
def test_a_worker_whose_parent_died_while_it_started_exits():
  """A worker that read its parent's pid itself, after a SIGKILL had already orphaned it, saw
  the reaper's pid and waited forever (found as a leftover process after a CI run)."""
  script = (
      "import sys, time; sys.path.insert(0, %r)\n"
      "from electra_jax.data import prepare\n"
      "prepare._init_worker(None, 2 ** 22 + 7)  # not this process's parent: it is gone\n"
      "time.sleep(30); print('still here')" % REPO
  )
  started = time.time()
  result = subprocess.run(
      [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
  )
  assert result.returncode == 1 and not result.stderr and "still here" not in result.stdout
  assert time.time() - started < 20


def _listed_shards(out_dir):
  """The shards out_dir's manifest lists, none without one."""
  manifest = out_dir / "manifest.json"
  return json.loads(manifest.read_text())["shards"] if manifest.exists() else []


def _listed_shard_files(out_dir):
  splits = [split for entry in _listed_shards(out_dir) for split in entry["splits"].values()]
  return {split[key] for split in splits for key in ("file", "lengths_file") if key in split}


@pytest.mark.fault
@pytest.mark.parametrize(
    "full, after, refusal",
    [
        ("for every file", 9, errno.ENOSPC),
        ("for shards only", 9, errno.ENOSPC),
        ("for shards only", 7, errno.ENOSPC),
        ("for shards only", 7, errno.EDQUOT),
        ("for every file", 0, errno.ENOSPC),
    ],
)
def test_a_full_disk_ends_in_one_line_and_the_manifest_lists_what_is_kept(
    tmp_path, corpus_files, spm_model, monkeypatch, full, after, refusal
):
  """The disk (or quota) fills up after `after` files (for shards only: a small manifest still
  fits); 7 stops shard 1 between its files, whose written ones the manifest does not list; 0
  refuses the tokenizer's copy, before any manifest."""
  config = _config(tmp_path, corpus_files, spm_model_file=spm_model)
  out_dir, fsync, written = tmp_path / "prepared", os.fsync, []

  def filling(fd):  # (the write layer's own: a refused write is its OutOfSpace)
    is_shard = os.readlink(f"/proc/self/fd/{fd}").endswith(".npy")
    if len(written) >= after and (is_shard or full == "for every file"):
      raise OSError(refusal, os.strerror(refusal))
    fsync(fd)
    written.append(fd)

  ours = lambda: {name for name in os.listdir(tempfile.gettempdir()) if "electra_jax" in name}
  scratch = ours()
  monkeypatch.setattr(os, "fsync", filling)
  with pytest.raises(OutOfSpace) as refused:
    prepare_data(config, num_workers=0)
  monkeypatch.undo()
  message = str(refused.value)
  assert "\n" not in message and message.startswith(f"prepare_data: Writing {out_dir}/")
  assert {errno.ENOSPC: "full", errno.EDQUOT: "quota"}[refusal] in message
  kept = len(_listed_shards(out_dir))
  assert f"{out_dir} keeps the {kept} finished shards its manifest.json lists" in message
  if full == "for shards only":  # the last manifest's write went through: it lists them
    assert kept > 0
  on_disk = {name for name in os.listdir(out_dir) if name.endswith(".npy")}
  assert on_disk == _listed_shard_files(out_dir)  # no temporary, no shard it does not list
  assert not [name for name in os.listdir(out_dir) if name.startswith(".tmp-")]
  assert ours() <= scratch  # no temporary folder left
  assert prepare_data(config, num_workers=0)["complete"]  # space again: it resumes


@pytest.mark.fault
def test_a_file_size_limit_ends_prepare_data_in_one_line_from_its_worker(tmp_path, spm_model):
  """A real limit (ulimit -f, which a spawned worker inherits): the worker's shard is too large."""
  files = _write_corpus(tmp_path / "corpus", num_files=2, docs_per_file=1500)
  out = tmp_path / "prepared"
  data = {"source": "text", "files": files, "spm_model_file": spm_model, "prepared_dir": out}
  data.update(shard_documents=10**6, max_documents=0)
  args = cli_args(tmp_path / "unused", **{f"data.{k}": v for k, v in data.items()})
  limit = 2 * os.path.getsize(spm_model)  # the tokenizer's copy fits, the one shard does not
  done = run_cli(
      args + ["--mode=prepare_data", "--workers=1"],
      preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
  )
  assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith(f"electra-jax: error: prepare_data: Writing {out}/train-00000.npy: ")
  assert "ulimit -f" in last and last.endswith(
      f"{out} keeps the 0 finished shards its manifest.json lists."
  )
  assert json.loads((out / "manifest.json").read_text())["shards"] == []
  assert sorted(os.listdir(out)) == ["manifest.json", "spm.model"]  # no half-written file


@pytest.mark.fault
@pytest.mark.parametrize("where", ["a file", "inside a file", "someone else's files", "-1 workers"])
def test_a_prepared_dir_that_is_a_file_or_someone_elses_files_is_refused(
    tmp_path, corpus_files, spm_model, where
):
  (tmp_path / "afile").write_text("x")
  other = tmp_path / "photos"
  other.mkdir()
  (other / "cat.jpg").write_bytes(b"\xff\xd8")
  (other / ".tmp-keep").write_bytes(b"someone's")
  before = _listing(tmp_path)
  prepared_dir, refusal = {
      "a file": (tmp_path / "afile", "prepared_dir=.*afile cannot be a directory: .*is a file"),
      "inside a file": (tmp_path / "afile" / "sub", "afile/sub cannot be a directory: .*afile is"),
      "someone else's files": (other, "holds files but no manifest.json"),
      "-1 workers": (tmp_path / "new", "num_workers must be >= 0.*got -1"),
  }[where]
  config = _config(tmp_path, corpus_files, spm_model_file=spm_model, prepared_dir=str(prepared_dir))
  with pytest.raises(ConfigError, match=refusal):
    prepare_data(config, num_workers=-1 if where == "-1 workers" else 0)
  assert _listing(tmp_path) == before


def test_training_on_prepared_shards_names_the_settings_they_override(
    tmp_path, corpus_files, spm_model, caplog
):
  prepare_data(_config(tmp_path, corpus_files, spm_model_file=spm_model), num_workers=0)
  with caplog.at_level("WARNING"):
    load_pretraining_data(
        _config(
            tmp_path, corpus_files, spm_model_file=spm_model, source="prepared", eval_fraction=0.5
        )
    )
  assert "data.eval_fraction=0.5 (the shards' 0.1)" in caplog.text
  assert "shard_documents" not in caplog.text  # the same value: nothing to say


@pytest.mark.fault
def test_prepared_dir_of_another_config_is_refused_untouched(tmp_path, corpus_files, spm_model):
  prepare_data(_config(tmp_path, corpus_files, spm_model_file=spm_model), num_workers=0)
  before = {p: p.read_bytes() for p in (tmp_path / "prepared").iterdir()}
  with pytest.raises(ConfigError, match=r"another config.*'max_seq_len': \(32, 48\)"):
    prepare_data(
        _config(tmp_path, corpus_files, spm_model_file=spm_model, max_seq_len=48), num_workers=0
    )
  assert {p: p.read_bytes() for p in (tmp_path / "prepared").iterdir()} == before
  with pytest.raises(ConfigError, match="prepare_data reads documents"):
    prepare_data(_config(tmp_path, corpus_files, source="prepared"), num_workers=0)
  with pytest.raises(ConfigError, match="needs data.prepared_dir"):
    prepare_data(_config(tmp_path, corpus_files, prepared_dir=""), num_workers=0)


def _listing(directory):
  """Every file under `directory` (hidden ones too) with its bytes: what "untouched" compares."""
  return {
      os.path.relpath(os.path.join(root, name), directory): open(
          os.path.join(root, name), "rb"
      ).read()
      for root, _, names in os.walk(directory)
      for name in names
  }


@pytest.mark.fault
def test_another_config_is_refused_before_training_a_tokenizer(
    tmp_path, corpus_files, spm_model, monkeypatch
):
  # Prepared with a given model; re-run without data.spm_model_file, which would train one.
  prepare_data(_config(tmp_path, corpus_files, spm_model_file=spm_model), num_workers=0)
  directory = tmp_path / "prepared"
  before = _listing(directory)
  trained = []
  original_train = prepare.train_sentencepiece
  monkeypatch.setattr(
      prepare, "train_sentencepiece", lambda *a, **k: trained.append(a) or original_train(*a, **k)
  )
  with pytest.raises(
      ConfigError, match=r"another config.*'spm_trained_here': \(None, .*Nothing was changed"
  ):
    prepare_data(_config(tmp_path, corpus_files), num_workers=0)
  assert trained == [], "the settings alone decide the refusal: no tokenizer training before it"
  assert _listing(directory) == before, "a refused run must leave no spm.model (nor anything else)"
  # The directory still serves training exactly as before.
  data = load_pretraining_data(
      _config(tmp_path, corpus_files, spm_model_file=spm_model, source="prepared")
  )
  assert data.tokenizer.fingerprint == SentencePieceTokenizer(spm_model).fingerprint


@pytest.mark.fault
def test_a_retrained_tokenizer_of_another_fingerprint_is_refused_and_not_kept(
    tmp_path, corpus_files, monkeypatch
):
  config = _config(tmp_path, corpus_files, spm_vocab_size=100)
  prepare_data(config, num_workers=0)
  directory = tmp_path / "prepared"
  os.remove(directory / "spm.model")  # lost: the next run trains a model again
  before = _listing(directory)
  original_train = prepare.train_sentencepiece
  out_paths = []

  def another_model(sentences, out_path, vocab_size, model_type, num_threads):
    # Training happens outside the directory, so a kill here would leave nothing in it.
    out_paths.append(out_path)
    assert (
        not os.path.abspath(out_path).startswith(str(directory)) and _listing(directory) == before
    )
    return original_train(sentences, out_path, vocab_size, "bpe", num_threads)  # other pieces

  monkeypatch.setattr(prepare, "train_sentencepiece", another_model)
  with pytest.raises(
      ConfigError, match=r"another config.*'tokenizer_fingerprint'.*spm.model.*is missing.*put that"
  ):
    prepare_data(config, num_workers=0)
  assert len(out_paths) == 1 and not os.path.exists(out_paths[0]), "the scratch model is removed"
  assert _listing(directory) == before


@pytest.mark.fault
def test_training_refuses_shards_of_another_tokenizer_or_length(tmp_path, corpus_files, spm_model):
  prepare_data(_config(tmp_path, corpus_files, spm_model_file=spm_model), num_workers=0)
  with pytest.raises(ConfigError, match=r"max_seq_len=32, but data.max_seq_len=64"):
    load_pretraining_data(
        _config(tmp_path, corpus_files, source="prepared", spm_model_file=spm_model, max_seq_len=64)
    )
  other = str(tmp_path / "other.model")
  train_tokenizer(_config(tmp_path, corpus_files, spm_vocab_size=90), other, num_threads=1)
  expected = SentencePieceTokenizer(spm_model).fingerprint
  got = SentencePieceTokenizer(other).fingerprint
  with pytest.raises(
      ConfigError,
      match=f"fingerprint {expected}.*this config gives SentencePieceTokenizer.*other.model.*{got}",
  ):
    load_pretraining_data(_config(tmp_path, corpus_files, source="prepared", spm_model_file=other))
  with pytest.raises(ConfigError, match="has no manifest.json.*--mode=prepare_data"):
    load_pretraining_data(
        _config(tmp_path, corpus_files, source="prepared", prepared_dir=str(tmp_path / "none"))
    )


def _shard_path(tmp_path, index=0):
  return tmp_path / "prepared" / f"train-{index:05d}.npy"


def _rewrite_shard(path, change, update_manifest=False):
  """Writes shard `path` again with `change(rows)`, the same size and format; the manifest's
  crc32c of it is updated too if asked (a consistent edit, which only the id check sees)."""
  rows = np.load(path)
  change(rows)
  np.save(path, rows, allow_pickle=False)
  if update_manifest:
    manifest_path = path.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["shards"]:
      if entry["splits"]["train"].get("file") == path.name:
        entry["splits"]["train"]["crc32c"] = workdir_files.crc32c(path.read_bytes())
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.fault
@pytest.mark.parametrize("fault", ["edited", "ids outside the vocabulary", "truncated"])
def test_training_reads_shards_that_differ_from_the_manifest_never(
    tmp_path, corpus_files, spm_model, fault
):
  prepare_data(_config(tmp_path, corpus_files, spm_model_file=spm_model), num_workers=0)
  prepared = _config(tmp_path, corpus_files, source="prepared", spm_model_file=spm_model)
  path = _shard_path(tmp_path, 1)
  originals = {f: f.read_bytes() for f in (path, path.parent / "manifest.json")}
  if fault == "truncated":  # the cheap checks at load time see it
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(
        ConfigError,
        match=rf"(Cannot read shard .*{path.name}|{path.name} has \d+ bytes, the manifest says)",
    ):
      load_pretraining_data(prepared)
    return
  if fault == "edited":
    _rewrite_shard(path, lambda rows: rows.__setitem__((0, 0, 1), rows[0, 0, 1] + 1))
    message = "is not the file prepare_data wrote"
  else:
    _rewrite_shard(path, lambda rows: rows.__setitem__((0, 0, 1), 119 + 7), update_manifest=True)
    message = "holds token id 126, outside the tokenizer's 120 ids"
  data = load_pretraining_data(prepared)  # the run starts at once; the check runs beside it
  data.verification.result()
  with pytest.raises(
      ConfigError, match=rf"Shard .*{path.name} {message}.*--mode=prepare_data again"
  ):
    get_batch(data, 0, 4, seed=0)
  # The files as prepare_data wrote them pass the same check.
  for f, content in originals.items():
    f.write_bytes(content)
  data = load_pretraining_data(prepared)
  data.verification.result()
  assert get_batch(data, 0, 4, seed=0)["input_ids"].shape == (4, 32)


@pytest.mark.fault
@pytest.mark.parametrize("edit", ["../", "absolute", "symlink", "", "..", 7])
def test_a_shard_leading_outside_the_prepared_dir_is_refused_by_name(
    tmp_path, corpus_files, spm_model, edit
):
  config = _config(tmp_path, corpus_files, spm_model_file=spm_model)
  prepare_data(config, num_workers=0)
  prepared = _config(tmp_path, corpus_files, source="prepared", spm_model_file=spm_model)
  path, outside = _shard_path(tmp_path, 1), tmp_path / "outside"
  outside.mkdir()
  copy = outside / path.name  # the same bytes: only where the file lies is wrong
  shutil.copy(path, copy)
  manifest_path = path.parent / "manifest.json"
  if edit == "symlink":
    path.unlink()
    path.symlink_to(copy)
    expected = rf"Shard {path} links to {os.path.realpath(copy)}, outside {path.parent}"
  else:
    names = {"../": f"../outside/{path.name}", "absolute": str(copy)}
    name = names.get(edit, edit)
    manifest = json.loads(manifest_path.read_text())
    manifest["shards"][1]["splits"]["train"]["file"] = name
    manifest_path.write_text(json.dumps(manifest))
    expected = rf"{manifest_path}: shards\[1\]\.splits\.train\.file={re.escape(repr(name))}"
  with pytest.raises(ConfigError, match=expected + ".*--mode=prepare_data"):
    load_pretraining_data(prepared)
  if edit != "symlink":  # a re-run of prepare_data reads the same manifest
    with pytest.raises(ConfigError, match=expected + ".*--mode=prepare_data"):
      prepare_data(config, num_workers=0)
  if edit == "symlink":  # prepare_data packs that shard again: the link goes, its target stays
    prepare_data(config, num_workers=0)
    assert not path.is_symlink() and path.read_bytes() == copy.read_bytes()
    assert load_pretraining_data(prepared).num_examples > 0


@pytest.mark.fault
@pytest.mark.parametrize(
    "damage", ["cut short", "shards not a list", "an older layout: no crc32c", "another format"]
)
def test_a_damaged_or_older_manifest_is_refused_by_name_and_nothing_is_changed(
    tmp_path, corpus_files, spm_model, damage
):
  config = _config(tmp_path, corpus_files, spm_model_file=spm_model)
  prepare_data(config, num_workers=0)
  path = tmp_path / "prepared" / "manifest.json"
  text, manifest = path.read_text(), json.loads(path.read_text())
  refusal = "is not as electra-jax writes it"
  if damage == "cut short":
    text = text[: len(text) // 2]
  elif damage == "shards not a list":
    text = json.dumps(dict(manifest, shards="all"))
  elif damage == "another format":
    text, refusal = json.dumps(dict(manifest, format_version=0)), "is of prepared format 0"
  else:
    del manifest["shards"][1]["splits"]["train"]["crc32c"]
    text, refusal = json.dumps(manifest), "is not as electra-jax writes it .KeyError: 'crc32c'"
  path.write_text(text)
  before = _listing(path.parent)
  prepared = _config(tmp_path, corpus_files, source="prepared", spm_model_file=spm_model)
  for run in (lambda: load_pretraining_data(prepared), lambda: prepare_data(config, num_workers=0)):
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))} {refusal}"):
      run()
  assert _listing(path.parent) == before


def test_sentencepiece_trained_by_prepare_serves_training(tmp_path, corpus_files):
  config = _config(tmp_path, corpus_files, spm_vocab_size=100)
  manifest = prepare_data(config, num_workers=0)
  assert manifest["tokenizer"]["model_file"] == "spm.model"
  data = load_pretraining_data(
      _config(tmp_path, corpus_files, spm_vocab_size=100, source="prepared")
  )
  assert data.tokenizer.fingerprint == manifest["tokenizer"]["fingerprint"]
  assert data.tokenizer.vocab_size == 100
  assert np.asarray(data.input_ids).max() < 100
  assert (
      load_tokenizer(_config(tmp_path, corpus_files, source="prepared")).fingerprint
      == data.tokenizer.fingerprint
  )
  with pytest.raises(ConfigError, match=r"another config.*spm_trained_here.*100.*80"):
    prepare_data(_config(tmp_path, corpus_files, spm_vocab_size=80), num_workers=0)


def test_a_given_tokenizer_travels_with_the_shards(tmp_path, corpus_files, spm_model):
  manifest = prepare_data(_config(tmp_path, corpus_files, spm_model_file=spm_model), num_workers=0)
  with open(spm_model, "rb") as f:
    assert (tmp_path / "prepared" / "spm.model").read_bytes() == f.read()
  assert manifest["tokenizer"]["model_file"] == "spm.model"
  shutil.move(tmp_path / "prepared", tmp_path / "moved")  # to a machine without the given file
  moved = _config(tmp_path, corpus_files, source="prepared", prepared_dir=str(tmp_path / "moved"))
  data = load_pretraining_data(moved)
  assert data.tokenizer.fingerprint == manifest["tokenizer"]["fingerprint"]


@pytest.mark.fault
def test_a_model_left_by_a_run_killed_before_its_manifest_is_trained_again(
    tmp_path, corpus_files, spm_model
):
  directory = tmp_path / "prepared"
  directory.mkdir()
  shutil.copy(spm_model, directory / "spm.model")  # 120 pieces, of another config
  manifest = prepare_data(_config(tmp_path, corpus_files, spm_vocab_size=100), num_workers=0)
  kept = SentencePieceTokenizer(str(directory / "spm.model"))
  assert kept.vocab_size == 100 and manifest["tokenizer"]["fingerprint"] == kept.fingerprint


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_a_tokenizer_trained_by_prepare_equals_the_caches_on_any_core_count(
    tmp_path, corpus_files, monkeypatch, model_type
):
  # Without data.spm_model_file both paths train the model; the shards must still hold the
  # cache's examples (and fingerprint), whatever the machine's core count.
  config = _config(tmp_path, corpus_files, spm_vocab_size=100, spm_model_type=model_type)
  cached = load_pretraining_data(config)
  monkeypatch.setattr(prepare, "_default_workers", lambda: 5)  # a machine of another size
  prepare_data(config, num_workers=0)
  prepared = load_pretraining_data(
      _config(tmp_path, corpus_files, spm_vocab_size=100, source="prepared")
  )
  assert prepared.tokenizer.fingerprint == cached.tokenizer.fingerprint
  assert prepared.fingerprint == cached.fingerprint
  np.testing.assert_array_equal(np.asarray(prepared.input_ids), cached.input_ids)


# ---------------------------------------------------------------- bad input


@pytest.mark.fault
def test_bad_files_are_counted_skips_and_the_rest_is_prepared(tmp_path, spm_model):
  corpus = tmp_path / "messy"
  corpus.mkdir()
  (corpus / "a_good.txt").write_text(
      "The old bridge.\nA quiet city.\n\nMusic played.\n", encoding="utf-8"
  )
  (corpus / "b_latin1.txt").write_bytes("Caf\xe9 au lait.\n".encode("latin-1"))
  (corpus / "c_binary.txt").write_bytes(
      b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4
  )
  (corpus / "d_empty.txt").write_bytes(b"")
  (corpus / "e_long.txt").write_text("x" * (3 << 20) + "\nShort line after it.\n", encoding="utf-8")
  config = _config(tmp_path, str(corpus / "*.txt"), spm_model_file=spm_model, eval_fraction=0.0)
  manifest = prepare_data(config, num_workers=0)
  assert manifest["source_stats"] == {
      "files": 5,
      "empty_files": 1,
      "binary_files": 1,
      "replaced_lines": 1,
      "skipped_lines": 0,
      "long_sentences": 1,
      "documents": 4,
  }
  tokenizer = SentencePieceTokenizer(spm_model)
  data = load_pretraining_data(_config(tmp_path, "", spm_model_file=spm_model, source="prepared"))
  texts = [tokenizer.decode(row) for row in np.asarray(data.input_ids)]
  assert any("bridge" in text for text in texts) and any(
      "Short line after it." in text for text in texts
  )
  assert not any("xxxx" in text for text in texts), "the megabyte line must be skipped, not packed"
  assert any("\ufffd" in text or "⁇" in text for text in texts)  # the latin-1 byte, replaced


@pytest.mark.parametrize("block_bytes", [1, 3, 7, 64, 1 << 20])
def test_block_reader_splits_lines_like_decoding_the_whole_file(tmp_path, monkeypatch, block_bytes):
  from electra_jax.data import sources

  raw = (
      "First line.\r\nSecond\rthird\x0cfourth\u2028fifth\n\n\n  Doc two café.\n".encode("utf-8")
      + b"bad \xff\xfe bytes\r\n\r\nDoc three \xe9\n\xe4\xbd\xa0\xe5\xa5\xbd no newline at end"
  )
  path = tmp_path / "mixed.txt"
  path.write_bytes(raw)
  # The oracle: the whole file decoded at once, split into lines, grouped on blank lines.
  expected, document = [], []
  for line in raw.decode("utf-8", errors="replace").splitlines():
    if line.strip():
      document.append(line.strip())
    elif document:
      expected.append(document)
      document = []
  expected.append(document)
  monkeypatch.setattr(sources, "_BLOCK_BYTES", block_bytes)
  stats = sources.SourceStats()
  assert list(sources.iter_documents("text", [str(path)], "text", stats)) == expected
  assert (
      stats.problems["replaced_lines"] == 2
      and stats.first_problems["replaced_lines"] == f"{path}:9"
  )
  assert stats.bytes_read == len(raw)


@pytest.mark.fault
def test_no_usable_text_is_refused_before_any_shard(tmp_path, spm_model):
  corpus = tmp_path / "useless"
  corpus.mkdir()
  (corpus / "empty.txt").write_bytes(b"")
  (corpus / "blob.bin").write_bytes(b"\x00\x01\x02" * 1000)
  (corpus / "long.txt").write_text("y" * (1 << 20))
  config = _config(tmp_path, f"{corpus}/*", spm_model_file=spm_model)
  with pytest.raises(
      ConfigError, match=r"no usable text.*1 binary files skipped.*1 lines over 65536 characters"
  ):
    prepare_data(config, num_workers=0)
  assert not any(name.endswith(".npy") for name in os.listdir(tmp_path / "prepared"))


@pytest.mark.fault
def test_vocab_without_special_tokens_is_refused(tmp_path, corpus_files):
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "old"]) + "\n")
  config = _config(tmp_path, corpus_files, tokenizer="wordpiece", vocab_file=str(vocab))
  with pytest.raises(ConfigError, match=r"lacks the special token \[MASK\]"):
    prepare_data(config, num_workers=0)
  assert not (tmp_path / "prepared" / "manifest.json").exists()


class _FailingTokenizer:
  """Wraps a tokenizer; raises on any text containing BAD, as a tokenizer bug would."""

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer
    self.cls_id, self.sep_id, self.pad_id = tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id

  def encode(self, text):
    if "BAD" in text:
      raise RuntimeError("cannot tokenize this")
    return self._tokenizer.encode(text)

  def encode_batch(self, texts, num_threads=-1):
    return [self.encode(text) for text in texts]


@pytest.mark.fault
def test_worker_counts_a_document_it_cannot_tokenize_and_packs_the_rest(tmp_path, spm_model):
  tokenizer = SentencePieceTokenizer(spm_model)
  rng = random.Random(3)
  documents = [[_sentence(rng) for _ in range(4)] for _ in range(6)]
  task = dict(index=0, first_document=0, eval_fraction=0.0, max_seq_len=32, dtype="uint16")
  bad = [list(d) for d in documents]
  bad[2][1] = "A BAD sentence."
  result = prepare.pack_shard(
      dict(task, documents=bad, out_dir=str(tmp_path / "bad")), _FailingTokenizer(tokenizer)
  )
  assert "error" not in result, result
  assert result["skipped_documents"] == 1 and "cannot tokenize this" in result["first_skip"]
  without = [list(d) for d in documents]
  without[2] = []
  expected = prepare.pack_shard(
      dict(task, documents=without, out_dir=str(tmp_path / "good")), tokenizer
  )
  assert result["splits"]["train"]["crc32c"] == expected["splits"]["train"]["crc32c"]
  # A failure outside any document (here: an unwritable directory) names the shard, not a traceback.
  blocker = tmp_path / "file"
  blocker.write_text("")
  failed = prepare.pack_shard(
      dict(task, documents=documents, out_dir=str(blocker / "sub")), tokenizer
  )
  assert failed["index"] == 0 and "Error" in failed["error"]


# ---------------------------------------------------------------- loading prepared shards


def _indexed_shards(sizes, max_seq_len=4):
  """Shards whose row r (counted over all shards) holds r + 10 at position 1 and type 1 at 2."""
  shards, start = [], 0
  for size in sizes:
    array = np.zeros((size, 2, max_seq_len), np.uint16)
    array[:, 0, 1] = np.arange(start, start + size) + 10
    array[:, 1, 2] = 1
    shards.append(array)
    start += size
  return shards


def test_sharded_rows_index_like_the_concatenated_array():
  shards = _indexed_shards([3, 1, 5, 2])
  rows = ShardedRows(shards, 0, 4)
  reference = np.concatenate([shard[:, 0] for shard in shards]).astype(np.int32)
  assert rows.shape == (11, 4) and len(rows) == 11
  for index in (
      [10, 0, 3, 3, 9, 4],
      np.array([[1, 2], [8, 5]]),
      slice(2, 9, 3),
      slice(None),
      7,
      -1,
      -11,
  ):
    np.testing.assert_array_equal(rows[index], reference[index])
  np.testing.assert_array_equal(rows[[4, 1], 1:3], reference[[4, 1], 1:3])
  np.testing.assert_array_equal(
      np.asarray(ShardedRows(shards, 1, 4)), np.concatenate([s[:, 1] for s in shards])
  )
  assert rows[[0]].dtype == np.int32
  with pytest.raises(IndexError):
    rows[np.array([11])]


def test_two_hosts_read_disjoint_rows_that_cover_each_epoch(spm_model):
  tokenizer = SentencePieceTokenizer(spm_model)
  shards = _indexed_shards([7, 13, 4, 9])
  data = PretrainingData(tokenizer, ShardedRows(shards, 0, 4), ShardedRows(shards, 1, 4), "test")
  num_examples, batch = 33, 6
  epoch_rows = {0: [], 1: []}
  for step in range(11):  # 66 positions: exactly two epochs
    whole = get_batch(data, step, batch, seed=4)
    parts = [
        get_batch(data, step, batch, seed=4, process_index=p, process_count=2) for p in range(2)
    ]
    host_rows = [(part["input_ids"][:, 1] - 10).tolist() for part in parts]
    assert not set(host_rows[0]) & set(host_rows[1]), "hosts must read disjoint rows"
    for key in whole:
      np.testing.assert_array_equal(np.concatenate([part[key] for part in parts]), whole[key])
    for p in range(2):
      epoch_rows[p] += host_rows[p]
  both = epoch_rows[0] + epoch_rows[1]
  assert sorted(both) == sorted(list(range(num_examples)) * 2), "two epochs cover every row twice"


def test_resume_mid_epoch_gives_the_uninterrupted_batches(tmp_path, corpus_files, spm_model):
  prepare_data(_config(tmp_path, corpus_files, spm_model_file=spm_model), num_workers=0)
  config = _config(tmp_path, corpus_files, spm_model_file=spm_model, source="prepared")
  data = load_pretraining_data(config)
  steps_per_epoch = data.num_examples / 8
  assert steps_per_epoch > 4
  uninterrupted = [get_batch(data, step, 8, seed=3) for step in range(int(steps_per_epoch * 2) + 2)]
  resumed_at = int(steps_per_epoch) - 2  # the resumed run crosses an epoch boundary
  reloaded = load_pretraining_data(config)
  for step in range(resumed_at, len(uninterrupted)):
    batch = get_batch(reloaded, step, 8, seed=3)
    for key in batch:
      np.testing.assert_array_equal(batch[key], uninterrupted[step][key])


# ---------------------------------------------------------------- prefetcher


def test_prefetch_yields_consecutive_steps_and_runs_at_most_depth_ahead():
  calls = []
  lock = threading.Lock()

  def fetch(step):
    with lock:
      calls.append(step)
    return {"step": step, "data": np.full(3, step)}

  with prefetch(fetch, start_step=5, depth=2) as batches:
    first = next(batches)
    assert first["step"] == 5
    time.sleep(0.3)
    # Consumed 1; the queue holds at most 2; a third fetch may be waiting to be queued.
    assert sorted(calls) == [5, 6, 7, 8][: len(calls)] and len(calls) <= 4
    rest = [next(batches)["step"] for _ in range(10)]
    assert rest == list(range(6, 16))
  assert sorted(calls) == list(range(5, len(calls) + 5))


def test_prefetch_overlaps_depth_fetches_that_wait():
  """Reads that wait (on a bucket) run side by side: two fetches meet at a barrier of two."""
  meeting = threading.Barrier(2, timeout=10)

  def fetch(step):
    meeting.wait()
    return step

  with prefetch(fetch, start_step=0, depth=2, stop_step=6) as batches:
    assert list(batches) == list(range(6))


def _prefetch_threads():
  return [t for t in threading.enumerate() if t.name.startswith("electra-prefetch")]


@pytest.mark.fault
def test_prefetch_raises_the_fetch_error_at_its_step_and_stops():
  def fetch(step):
    if step == 3:
      raise ConfigError("bad step 3")
    return step

  calls = []
  with prefetch(lambda step: calls.append(step) or fetch(step), 0, depth=2) as batches:
    assert [next(batches) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ConfigError, match="bad step 3"):
      next(batches)
    with pytest.raises(StopIteration):
      next(batches)
  fetched = len(calls)
  time.sleep(0.2)
  assert len(calls) == fetched <= 6  # fetching stopped with the error: at most depth steps past it
  assert not _prefetch_threads()


def test_prefetch_stop_step_and_leaving_early():
  with prefetch(lambda step: step * 2, start_step=2, stop_step=6) as batches:
    assert list(batches) == [4, 6, 8, 10]
  assert not _prefetch_threads()  # the context's end ends the threads
  calls = []
  with prefetch(lambda step: calls.append(step) or step, start_step=0, depth=1) as batches:
    next(batches)
  fetched = len(calls)
  time.sleep(0.2)
  assert calls == [0, 1][:fetched] and len(calls) == fetched  # nothing fetched after leaving
  assert not _prefetch_threads()
  with pytest.raises(ValueError), prefetch(lambda step: step, 0, depth=0):
    pass


# ---------------------------------------------------------------- the README's CLI flow


def test_bring_your_corpus_from_the_command_line(tmp_path, corpus_files):
  """train_tokenizer -> prepare_data -> train on the shards, as the README's section runs it."""
  sys.path.insert(0, os.path.join(REPO, "tests"))
  from conftest import cli, cli_args  # noqa: PLC0415

  data_flags = [
      "--config.data.source=text",
      f"--config.data.files={corpus_files}",
      "--config.data.spm_vocab_size=120",
      "--config.data.eval_fraction=0.1",
      f"--config.data.prepared_dir={tmp_path / 'prepared'}",
  ]
  python_m_main = [
      sys.executable,
      "-m",
      "electra_jax.main",
      f"--config={REPO}/configs/base.py",
      "--config.data.max_seq_len=32",
  ]
  model = str(tmp_path / "spm.model")
  trained = cli(python_m_main + ["--mode=train_tokenizer", f"--out={model}", *data_flags])
  assert trained.returncode == 0, trained.stderr[-2000:]
  assert SentencePieceTokenizer(model).vocab_size == 120 and "spm_model_file=" in trained.stdout
  prepared = cli(
      python_m_main
      + ["--mode=prepare_data", "--workers=2", f"--config.data.spm_model_file={model}", *data_flags]
  )
  assert prepared.returncode == 0, prepared.stderr[-2000:]
  manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
  assert (
      manifest["totals"]["train_examples"] > 0
      and "Train with --config.data.source=prepared" in prepared.stdout
  )

  workdir = tmp_path / "run"
  args = cli_args(
      workdir,
      **{
          "data.source": "prepared",
          "data.prepared_dir": tmp_path / "prepared",
          "data.spm_model_file": model,
          "data.spm_vocab_size": 120,
          "train.steps": 2,
          "checkpoint.every_steps": 2,
          "eval.every_steps": 2,
      },
  )
  run = cli(args)
  assert run.returncode == 0, run.stderr[-2000:]
  logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in logged] == [1, 2] and all(np.isfinite(m["loss"]) for m in logged)
  assert (workdir / "eval_metrics.jsonl").exists()  # the held-out split of the shards
