"""Data-pipeline throughput: preparation tokens/s with 1 and 2 workers, loader tokens/s on the
prepared shards, and, in the same run, the tokens/s that an electra_small train step consumes.

CPU seconds of the main process (reading, hashing, dispatching) and of the worker processes
(tokenizing, packing, writing) are reported beside the wall time: on a machine shared with
other jobs the wall time shows the load, while the CPU split shows how the work divides.

The corpus is the built-in one (Python's stdlib docstrings), written out as text files so the
preparation reads files as a user's corpus would; the tokenizer is a sentencepiece model trained
on it first (not timed). Tokens/s of preparation count the non-padding tokens written; loader
and training tokens/s count batch_size x max_seq_len positions per step, as train.py does.

  python benchmarks/data_throughput.py --workers=0,1,2 --rounds=3 --loader_steps=300 --train_steps=3

--bucket=emulator (or a gs:// folder) adds the same preparation written into a bucket and the
rows/s one host reads from it (ranged reads, per-host batches of --host_batch rows), beside the
local memory map's rows/s and the rows/s per host that an electra_base step on v5e chips consumes
(model FLOPs per token from flops.py at --v5e_mfu of the chip's peak). "emulator" starts the local
GCS API of the tests (fake-gcs-server on 127.0.0.1; loopback latency, not a real bucket's):

  python benchmarks/data_throughput.py --workers=2 --rounds=1 --max_seq_len=512 --train_steps=0 \
      --bucket=emulator

Figures and the commands that produced them are kept in benchmarks/RESULTS.md.
"""

import copy
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from electra_jax import config_lib  # noqa: E402
from electra_jax import data  # noqa: E402

_WORKERS = flags.DEFINE_list(
    "workers", ["0", "1", "2"], "Worker counts to time preparation with (0 = in the main process)."
)
_ROUNDS = flags.DEFINE_integer(
    "rounds", 3, "Timed preparations per worker count; the median is reported."
)
_MAX_DOCUMENTS = flags.DEFINE_integer(
    "max_documents", 0, "Documents of the built-in corpus (0 = all)."
)
_REPEAT = flags.DEFINE_integer(
    "repeat",
    10,
    "Write the corpus this many times (it is small; a bigger input makes worker "
    "start-up a small share of the preparation time).",
)
_SPM_VOCAB = flags.DEFINE_integer("spm_vocab_size", 8192, "Sentencepiece vocabulary trained first.")
_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 128, "Example length (electra_small's).")
_BATCH = flags.DEFINE_integer("batch_size", 128, "Global batch of the loader measurement.")
_LOADER_STEPS = flags.DEFINE_integer("loader_steps", 300, "get_batch calls per loader measurement.")
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", 3, "Timed electra_small steps (0 = skip).")
_TRAIN_BATCH = flags.DEFINE_integer("train_batch_size", 32, "Batch of the electra_small steps.")
_SHARD_DOCUMENTS = flags.DEFINE_integer(
    "shard_documents", 100, "Documents per shard (one worker task)."
)
_SPM_MODEL = flags.DEFINE_string(
    "spm_model", "", "A sentencepiece model to use instead of training one."
)
_WORKDIR = flags.DEFINE_string("workdir", "", "Where corpus and shards go ('' = a temporary dir).")
_BUCKET = flags.DEFINE_string(
    "bucket",
    "",
    "Also prepare into and read from a bucket: 'emulator' (a local GCS API started here) or a "
    "gs:// folder ('' = no bucket).",
)
_HOST_BATCH = flags.DEFINE_list(
    "host_batch", ["64", "256"], "Rows one host reads per step in the bucket measurement."
)
_V5E_MFU = flags.DEFINE_float(
    "v5e_mfu",
    0.5,
    "Share of a v5e chip's bf16 peak that the electra_base step is assumed to reach.",
)
_CHIPS_PER_HOST = flags.DEFINE_integer("chips_per_host", 4, "v5e chips per host (v5e-16: 4).")

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_builtin_corpus(directory, max_documents, repeat):
  """The built-in corpus, `repeat` times, as text files of 500 documents separated by blank lines."""
  documents = data.builtin_documents(max_documents or None) * repeat
  os.makedirs(directory, exist_ok=True)
  num_bytes = 0
  for part in range(0, len(documents), 500):
    text = "\n\n".join("\n".join(document) for document in documents[part : part + 500]) + "\n"
    with open(os.path.join(directory, f"part{part // 500:03d}.txt"), "w", encoding="utf-8") as f:
      f.write(text)
    num_bytes += len(text.encode("utf-8"))
  return len(documents), num_bytes


def _cpu_seconds():
  """CPU seconds (user + system) of this process and of its finished child processes."""
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
      resource.RUSAGE_CHILDREN
  )
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _time_loader(loaded, steps, batch_size, seed=0, prefetch=False):
  start = time.perf_counter()
  if prefetch:
    with data.prefetch(
        lambda step: data.get_batch(loaded, step, batch_size, seed), 0, depth=2
    ) as batches:
      for _ in range(steps):
        next(batches)
  else:
    for step in range(steps):
      data.get_batch(loaded, step, batch_size, seed)
  return steps * batch_size * loaded.max_seq_len / (time.perf_counter() - start)


def _rows_per_sec(loaded, steps, batch_size, prefetch):
  """Rows/s of get_batch (one host's share of every batch), read straight or through prefetch."""
  return _time_loader(loaded, steps, batch_size, prefetch=prefetch) / loaded.max_seq_len


def _electra_base_rows_per_host(seq_len):
  """Rows/s one v5e host's chips consume in electra_base train steps at --v5e_mfu of their peak."""
  from electra_jax import flops, models, objectives  # noqa: PLC0415

  config = config_lib.sibling(
      os.path.join(_REPO, "configs", "electra_base.py"), "electra_base"
  ).get_config()
  config.data.max_seq_len = seq_len
  max_predictions = objectives.official_max_predictions(config.objective.mask_prob, seq_len)
  per_token = flops.train_flops_per_token(
      models.build_model(config, objectives.towers(config)), seq_len, max_predictions
  )
  peak = dict(flops.PEAK_FLOPS)["TPU v5e"]
  rows_per_chip = peak * _V5E_MFU.value / per_token / seq_len
  return {
      "model_flops_per_token": round(per_token),
      "mfu": _V5E_MFU.value,
      "rows_per_sec_per_chip": round(rows_per_chip, 1),
      "chips_per_host": _CHIPS_PER_HOST.value,
      "rows_per_sec_per_host": round(rows_per_chip * _CHIPS_PER_HOST.value, 1),
  }


def _shards_touched(shard_rows, batch, samples=100):
  """The mean number of shards that `batch` rows drawn at random (as an epoch's permutation
  draws them) fall in: what downloading whole shards would fetch for one step."""
  rng, offsets = np.random.default_rng(0), np.cumsum(shard_rows)
  return statistics.mean(
      len(
          np.unique(
              np.searchsorted(offsets, rng.choice(offsets[-1], batch, replace=False), "right")
          )
      )
      for _ in range(samples)
  )


def _bucket_figures(data_config, workers, local_loaded):
  """Preparation into a bucket, and rows/s read from it against the local memory map's."""
  server = None
  if _BUCKET.value == "emulator":
    sys.path.insert(0, os.path.join(_REPO, "tests"))
    from gcs_server import GcsServer  # noqa: PLC0415 (the tests' local GCS API)

    server = GcsServer()
    os.environ.update(server.env)  # before gcsfs is first imported (GcsServer.env says why)
    url = f"{server.create_bucket()}/prepared"
  else:
    url = _BUCKET.value.rstrip("/") + f"/electra_data_throughput_{int(time.time())}"
  try:
    data_config.source, data_config.prepared_dir = "text", url
    start = time.perf_counter()
    manifest = data.prepare_data(data_config, num_workers=workers)
    prepare_seconds = time.perf_counter() - start
    tokens = manifest["totals"]["train_tokens"] + manifest["totals"]["eval_tokens"]
    data_config.source = "prepared"
    start = time.perf_counter()
    loaded = data.load_pretraining_data(data_config, "train")
    load_seconds = time.perf_counter() - start
    for step in range(3):  # the same rows as the local copy's
      ours, theirs = (data.get_batch(d, step, 64, 0) for d in (loaded, local_loaded))
      assert all((ours[k] == theirs[k]).all() for k in ours), "bucket and local batches differ"
    row_bytes = 2 * loaded.max_seq_len * np.dtype(manifest["dtype"]).itemsize
    shard_rows = [e["splits"]["train"]["rows"] for e in manifest["shards"]]
    shard_bytes = statistics.mean(e["splits"]["train"]["bytes"] for e in manifest["shards"])
    result = {
        "where": "fake-gcs-server on 127.0.0.1 (loopback)" if server else url,
        "prepare": {
            "workers": workers,
            "seconds": round(prepare_seconds, 2),
            "tokens_per_sec": round(tokens / prepare_seconds),
        },
        "load_seconds": round(load_seconds, 2),
        "shards": len(manifest["shards"]),
        "reads": {},
    }
    for batch in (int(b) for b in _HOST_BATCH.value):
      steps = max(20, _LOADER_STEPS.value * 64 // batch // 4)
      cpu_start = time.process_time()
      rows_per_sec = _rows_per_sec(loaded, steps, batch, False)
      cpu_per_row = (time.process_time() - cpu_start) / (steps * batch)
      result["reads"][f"host_batch_{batch}"] = {
          "bucket_rows_per_sec": round(rows_per_sec),
          "bucket_cpu_ms_per_row": round(1e3 * cpu_per_row, 3),  # this process, all its threads
          "bucket_rows_per_sec_prefetched": round(_rows_per_sec(loaded, steps, batch, True)),
          "local_rows_per_sec": round(_rows_per_sec(local_loaded, steps, batch, False)),
          "bytes_per_step_ranged": batch * row_bytes,
          "bytes_per_step_whole_shards": round(_shards_touched(shard_rows, batch) * shard_bytes),
      }
    return result
  finally:
    if server is not None:
      server.stop()


def _time_training(config, steps):
  """Tokens/s of electra_small train steps on the prepared shards (compile excluded)."""
  import jax  # noqa: PLC0415

  from electra_jax import partitioning, resolve, train_state  # noqa: PLC0415

  run = resolve.run(config)
  mesh, corpus, setup = run.mesh, run.corpus, run.setup
  batch_size = config.train.batch_size
  with partitioning.activate(mesh):
    state = train_state.fresh_state(setup, 0)
    step_fn = train_state.compile_train_step(setup, config, mesh)
  batches = [
      partitioning.global_batch_from_local(data.get_batch(corpus, i, batch_size, 0), mesh)
      for i in range(steps + 1)
  ]
  state, metrics = step_fn(state, batches[0], train_state.step_rng(0, 0), run.schedule)  # warm-up
  jax.block_until_ready(metrics)
  seconds = []
  for i in range(steps):
    start = time.perf_counter()
    state, metrics = step_fn(state, batches[i + 1], train_state.step_rng(0, i + 1), run.schedule)
    jax.block_until_ready(metrics)
    seconds.append(time.perf_counter() - start)
  return batch_size * config.data.max_seq_len / statistics.median(seconds), seconds


def main(argv):
  del argv
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="electra_data_throughput_")
  corpus_dir = os.path.join(workdir, "corpus")
  num_documents, num_bytes = _write_builtin_corpus(corpus_dir, _MAX_DOCUMENTS.value, _REPEAT.value)

  config = config_lib.sibling(
      os.path.join(_REPO, "configs", "electra_small.py"), "electra_small"
  ).get_config()
  data_config = config.data
  data_config.update(
      source="text",
      files=os.path.join(corpus_dir, "*.txt"),
      max_seq_len=_SEQ_LEN.value,
      spm_vocab_size=_SPM_VOCAB.value,
      shard_documents=_SHARD_DOCUMENTS.value,
  )
  spm_path = _SPM_MODEL.value or os.path.join(workdir, "spm.model")
  start = time.perf_counter()
  if not _SPM_MODEL.value:
    if os.path.exists(
        spm_path
    ):  # this benchmark's own model from an earlier run: train_tokenizer keeps existing files
      os.remove(spm_path)
    data.train_tokenizer(data_config, spm_path)
  tokenizer_seconds = time.perf_counter() - start
  data_config.spm_model_file = spm_path

  result = {
      "host": f"{platform.machine()}, {os.cpu_count()} cores (shared with other jobs)",
      "corpus": f"built-in x{_REPEAT.value}, {num_documents} documents, {num_bytes / 1e6:.1f} MB in {len(os.listdir(corpus_dir))} text files",
      "max_seq_len": _SEQ_LEN.value,
      "spm_vocab_size": _SPM_VOCAB.value,
      "train_tokenizer_seconds": round(tokenizer_seconds, 1),
      "prepare": {},
  }
  prepared_dir = None
  worker_counts = [int(w) for w in _WORKERS.value]
  seconds = {workers: [] for workers in worker_counts}
  cpu = {workers: [] for workers in worker_counts}  # (main process, worker processes) CPU seconds
  # Interleaved rounds (1, 2, 1, 2, ...) so every worker count sees the same machine load.
  for _ in range(_ROUNDS.value):
    for workers in worker_counts:
      prepared_dir = os.path.join(workdir, f"prepared_{workers}")
      shutil.rmtree(prepared_dir, ignore_errors=True)
      data_config.prepared_dir = prepared_dir
      start = time.perf_counter()
      self_before, children_before = _cpu_seconds()
      manifest = data.prepare_data(data_config, num_workers=workers)
      seconds[workers].append(time.perf_counter() - start)
      self_after, children_after = _cpu_seconds()
      cpu[workers].append((self_after - self_before, children_after - children_before))
  for workers in worker_counts:
    tokens = manifest["totals"]["train_tokens"] + manifest["totals"]["eval_tokens"]
    median = statistics.median(seconds[workers])
    result["prepare"][f"{workers}_workers"] = {
        "seconds": [round(s, 2) for s in seconds[workers]],
        "tokens": tokens,
        "tokens_per_sec": round(tokens / median),
        "input_mb_per_sec": round(num_bytes / 1e6 / median, 2),
        "shards": len(manifest["shards"]),
        "cpu_seconds_main": round(statistics.median(c[0] for c in cpu[workers]), 2),
        "cpu_seconds_workers": round(statistics.median(c[1] for c in cpu[workers]), 2),
    }

  data_config.source = "prepared"
  data_config.prepared_dir = prepared_dir
  loaded = data.load_pretraining_data(data_config, "train")
  result["loader"] = {
      "batch_size": _BATCH.value,
      "examples": loaded.num_examples,
      "tokens_per_sec": round(_time_loader(loaded, _LOADER_STEPS.value, _BATCH.value)),
      "tokens_per_sec_prefetched": round(
          _time_loader(loaded, _LOADER_STEPS.value, _BATCH.value, prefetch=True)
      ),
  }
  if _BUCKET.value:
    result["bucket"] = _bucket_figures(copy.deepcopy(data_config), max(worker_counts), loaded)
    result["electra_base_v5e"] = _electra_base_rows_per_host(_SEQ_LEN.value)
  if _TRAIN_STEPS.value:
    print(json.dumps(result, indent=1), flush=True)  # the data figures, before the slow part
    if "tie" not in config.model:
      # models.py reads model.tie (default "embeddings", ELECTRA's sharing); a checkout whose
      # configs/base.py does not list it yet still measures the standard model.
      config.model.tie = "embeddings"
    config.model.vocab_size = max(config.model.vocab_size, loaded.tokenizer.vocab_size)
    config.train.batch_size = _TRAIN_BATCH.value
    config.eval.every_steps = 0
    try:
      tokens_per_sec, seconds = _time_training(config, _TRAIN_STEPS.value)
    except Exception as e:  # noqa: BLE001 -- the data figures above stand on their own
      result["electra_small_train"] = {"error": f"{type(e).__name__}: {e}"}
      print(json.dumps(result, indent=1))
      raise
    result["electra_small_train"] = {
        "batch_size": _TRAIN_BATCH.value,
        "step_seconds": [round(s, 2) for s in seconds],
        "tokens_per_sec": round(tokens_per_sec),
    }
    result["loader_over_training"] = round(result["loader"]["tokens_per_sec"] / tokens_per_sec, 1)
    result["prepare_over_training"] = {
        name: round(entry["tokens_per_sec"] / tokens_per_sec, 1)
        for name, entry in result["prepare"].items()
    }
    print(json.dumps(result, indent=1))
  else:
    print(json.dumps(result, indent=1))
  if not _WORKDIR.value:
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
