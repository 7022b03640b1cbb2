"""Fine-tuning throughput: the whole loop of one seed (batches, steps, an evaluation on dev after
each epoch, the checkpoint) against its compiled train step alone on the same batches, in the
same run. Their ratio is the share of a seed's time that is not the step: host work per step,
evaluation, saving. A small model on an accelerator shows it most.

The task is made from the built-in corpus (each sentence -> one of 12 labels by its index: the
labels mean nothing, the shapes and the work are a real task's), with a sentencepiece model
trained on those sentences first (not timed). Its rows are as wide as its longest example (128
tokens here): a task of short texts has narrower rows and a cheaper step.

  python benchmarks/finetune_loop.py --size=tiny --steps=1000
  python benchmarks/finetune_loop.py --size=quick --steps=500   # configs/quick.py's encoder

Figures and the commands that produced them are kept in benchmarks/RESULTS.md.
"""

import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clone

from electra_jax import xla_flags  # noqa: E402

xla_flags.apply_cpu_defaults(restart=True)  # the CLI's CPU defaults, set before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from electra_jax import config_lib, data  # noqa: E402
from electra_jax.finetune import model as model_lib, tasks, trainer  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {  # hidden, layers, heads, intermediate, embedding
    "tiny": (16, 1, 1, 32, 16),
    "quick": (128, 4, 2, 512, 128),  # configs/quick.py's discriminator
}
_SIZE = flags.DEFINE_enum("size", "tiny", list(SIZES), "Encoder size (random init).")
_STEPS = flags.DEFINE_integer("steps", 1000, "Optimizer steps of the seed (min_steps; whole epochs).")
_EXAMPLES = flags.DEFINE_integer("examples", 2000, "Training examples (dev gets as many).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed seeds per measurement; the median is reported.")


def _write_task(directory: str, examples: int) -> tuple[str, str, str]:
  sentences = [s for document in data.builtin_documents() for s in document]
  rows = [json.dumps({"sentence": s, "label": f"c{i // 2 % 12}"}) for i, s in enumerate(sentences[:2 * examples])]
  paths = [os.path.join(directory, name) for name in ("train.jsonl", "dev.jsonl", "spm.model")]
  for path, part in zip(paths, (rows[0::2], rows[1::2])):
    with open(path, "w") as f:
      f.write("\n".join(part) + "\n")
  data.train_sentencepiece(sentences, paths[2], vocab_size=4096)
  return tuple(paths)


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as workdir:
    train_file, dev_file, spm_model = _write_task(workdir, _EXAMPLES.value)
    hidden, layers, heads, intermediate, embedding = SIZES[_SIZE.value]
    config = config_lib.sibling(os.path.join(_REPO, "configs", "finetune", "custom.py"), "custom").get_config()
    config.custom.update(train_file=train_file, dev_file=dev_file)
    config.model.update(hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=intermediate,
                        embedding_size=embedding)
    config.update(tokenizer=spm_model, min_steps=_STEPS.value, log_every=10**9)
    config.select.learning_rates = ""
    backbone = model_lib.load_backbone(config)
    adapter = trainer.classification_adapter(config, tasks.load_task(config), backbone)
    epochs = trainer.resolve_epochs(config, trainer._num_examples(adapter.train_features))
    total = trainer._steps_per_seed(config, adapter.train_features, epochs)
    steps = trainer._compiled_steps(config, adapter, backbone, total)
    quiet = lambda *args: None
    tx, _, train_step, _ = steps
    feed = list(trainer.batches(adapter.train_features, config.batch_size))
    key = jax.random.key(0)

    def seed_loop(round_):  # what a seed costs in run_finetune, its parameters' init included
      trainer._run_seed(config, adapter, backbone, 0, os.path.join(workdir, f"run_{round_}"), epochs, steps, quiet)

    def init(round_):
      del round_
      return model_lib.init_params(backbone, adapter.model, key, config.max_seq_len)

    def step_alone(round_):
      del round_
      params, opt_state = fresh
      for step in range(total):
        params, opt_state, loss = train_step(params, opt_state, feed[step % len(feed)], key, step)
      jax.block_until_ready(loss)

    timings = {}
    for name, work in (("seed loop", seed_loop), ("parameters' init", init), ("train step alone", step_alone)):
      seconds = []
      for round_ in range(-1, _ROUNDS.value):  # round -1 compiles
        params = init(round_)
        fresh = (params, tx.init(params))
        jax.block_until_ready(fresh)
        start = time.perf_counter()
        jax.block_until_ready(work(round_))
        seconds.append(time.perf_counter() - start)
      timings[name] = float(np.median(seconds[1:]))
    width = adapter.train_features["input_ids"].shape[1]
    print(f"{platform.machine()} {jax.devices()[0].device_kind}, jax {jax.__version__}; size {_SIZE.value}, "
          f"{total} steps of {config.batch_size} rows of {width} tokens over {epochs} epochs, median of "
          f"{_ROUNDS.value}:")
    for name, seconds in timings.items():
      print(f"  {name:17s} {seconds:7.2f} s" + f"  {total / seconds:8.1f} steps/s" * (name != "parameters' init"))
    print(f"  the step is {timings['train step alone'] / timings['seed loop']:.0%} of the seed's time")


if __name__ == "__main__":
  app.run(main)
