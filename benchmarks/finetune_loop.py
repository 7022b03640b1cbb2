"""Fine-tuning throughput: the whole loop of one seed (batches, steps, an evaluation on dev after
each epoch, the checkpoint) against its compiled train step alone on the same batches, in the
same run. Their ratio is the share of a seed's time that is not the step: host work per step,
evaluation, saving. A small model on an accelerator shows it most.

The task is benchmarks/stdlib_topic_task.py's (stdlib docstring sentences -> 4 topics), with a
sentencepiece model trained on the built-in corpus first (not timed). Rows are as wide as a
task's longest example: a task of shorter texts has narrower rows and a cheaper step.

  python benchmarks/finetune_loop.py --size=tiny --steps=1000
  python benchmarks/finetune_loop.py --size=quick --steps=500   # configs/quick.py's encoder

Figures and the commands that produced them are kept in benchmarks/RESULTS.md.
"""

import contextlib
import io
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clone

from electra_jax import xla_flags  # noqa: E402

xla_flags.apply_cpu_defaults()  # the CLI's start-up settings, before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from electra_jax import config_lib, data, preemption  # noqa: E402
from electra_jax.finetune import model as model_lib, optim, tasks, trainer  # noqa: E402

import stdlib_topic_task  # noqa: E402  (benchmarks/, beside this script)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {  # hidden, layers, heads, intermediate, embedding
    "tiny": (16, 1, 1, 32, 16),
    "quick": (128, 4, 2, 512, 128),  # configs/quick.py's discriminator
}
_SIZE = flags.DEFINE_enum("size", "tiny", list(SIZES), "Encoder size (random init).")
_STEPS = flags.DEFINE_integer(
    "steps", 1000, "Optimizer steps of the seed (min_steps; whole epochs)."
)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed seeds per measurement; the median is reported.")


def _write_task(directory: str) -> tuple[str, str, str]:
  with contextlib.redirect_stdout(io.StringIO()):  # it prints its statistics
    stdlib_topic_task.main(directory)
  spm_model = os.path.join(directory, "spm.model")
  data.train_sentencepiece(
      (s for document in data.builtin_documents() for s in document), spm_model, 4096
  )
  return os.path.join(directory, "train.jsonl"), os.path.join(directory, "dev.jsonl"), spm_model


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as workdir:
    train_file, dev_file, spm_model = _write_task(workdir)
    hidden, layers, heads, intermediate, embedding = SIZES[_SIZE.value]
    config = config_lib.sibling(
        os.path.join(_REPO, "configs", "finetune", "custom.py"), "custom"
    ).get_config()
    config.custom.update(train_file=train_file, dev_file=dev_file)
    config.model.update(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=intermediate,
        embedding_size=embedding,
    )
    config.update(tokenizer=spm_model, min_steps=_STEPS.value, log_every=10**9)
    config.select.learning_rates = ""
    backbone = model_lib.load_backbone(config)
    adapter = tasks.make_adapter(config, backbone)
    num_train = len(adapter.train_features["input_ids"])
    epochs, total = trainer.resolve_epochs(config, num_train)
    steps = trainer._compiled_steps(config, adapter, backbone)
    train_step, _ = steps
    schedule = optim.schedule(config, total)
    feed = list(trainer.batches(adapter.train_features, config.batch_size))
    key = jax.random.key(0)

    def seed_loop(round_, params, opt_state):
      del params, opt_state  # a seed draws its own: its init is part of what it costs
      run_dir = os.path.join(workdir, f"run_{round_}")
      signals = preemption.Preemption()  # never entered: no signal stops a benchmark
      trainer._run_seed(config, adapter, backbone, (*steps, signals), 0, run_dir)

    def step_alone(round_, params, opt_state):
      del round_
      for step in range(total):
        params, opt_state, loss = train_step(
            params, opt_state, feed[step % len(feed)], key, step, schedule
        )
      return loss

    timings = {}
    for name, work in (("seed loop", seed_loop), ("train step alone", step_alone)):
      seconds = []
      for round_ in range(-1, _ROUNDS.value):  # round -1 compiles
        params = model_lib.init_params(backbone, adapter.model, key, config.max_seq_len)
        tx = optim.make_optimizer(config, params, backbone.model.config.num_layers)
        state = jax.block_until_ready((params, tx.init(params)))
        start = time.perf_counter()
        jax.block_until_ready(work(round_, *state))
        seconds.append(time.perf_counter() - start)
      timings[name] = float(np.median(seconds[1:]))
    width = adapter.train_features["input_ids"].shape[1]
    print(
        f"{platform.machine()} {jax.devices()[0].device_kind}, jax {jax.__version__}; size {_SIZE.value}, "
        f"{total} steps of {config.batch_size} rows of {width} tokens over {epochs} epochs, median of "
        f"{_ROUNDS.value}:"
    )
    for name, seconds in timings.items():
      print(f"  {name:17s} {seconds:7.2f} s  {total / seconds:8.1f} steps/s")
    print(
        f"  the step is {timings['train step alone'] / timings['seed loop']:.0%} of the seed's time"
    )


if __name__ == "__main__":
  app.run(main)
