"""Writes launch/colab_tpu.ipynb (nbformat 4) from the cells below, so the notebook is reviewed
and diffed as Python. Run `python launch/make_colab.py` after editing a cell; a test checks that
the committed notebook matches.

The notebook reads a few ELECTRA_JAX_* variables so that the test can run its code cells on CPU
with a shrunken config; in Colab they are unset and the defaults apply.
"""

import json
import os

# The test skips cells whose first line is this marker (they need Colab or the network).
COLAB_ONLY = "# colab-only"

CELLS = [
    (
        "markdown",
        """\
# ELECTRA pre-training on a Colab TPU with electra-jax

Pre-trains a small ELECTRA (a generator and a discriminator sharing one embedding) with
replaced-token detection on the built-in corpus, shows its metrics while it trains, then
evaluates it on held-out text.

1. *Runtime > Change runtime type > TPU* (a GPU or the CPU works too, slower).
2. Set `REPO_URL` in the first cell to the repository to install from, then *Run all*.

The demo recipe trains 600 steps; change `OVERRIDES` below for longer or larger runs.""",
    ),
    (
        "code",
        f"""\
{COLAB_ONLY}: clones electra-jax and installs it (the recipes come with the package), with
# JAX's TPU build on a TPU runtime.
import glob
REPO_URL = "https://github.com/OWNER/electra-jax"  # <- the repository to install from
BRANCH = "main"
ON_TPU = bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))
!git clone --quiet --depth=1 --branch={{BRANCH}} {{REPO_URL}} electra-jax
%pip install --quiet ./electra-jax {{'"jax[tpu]"' if ON_TPU else ''}}""",
    ),
    (
        "code",
        """\
# The devices JAX sees: 8 TPU cores on a v2-8/v3-8 runtime, 1 chip on v5e-1/v6e-1.
import json
import os
import threading

import jax

print(f"JAX {jax.__version__} on {jax.default_backend()}: {jax.device_count()} device(s)")
for device in jax.devices():
  print(" ", device)""",
    ),
    (
        "code",
        """\
# The run: the demo recipe plus OVERRIDES ("group.key": value, as --config.group.key=value
# on the command line). Re-running the notebook resumes from WORKDIR's latest checkpoint; a
# WORKDIR on a mounted Google Drive (/content/drive/MyDrive/...) outlives the Colab session.
from electra_jax import api

WORKDIR = os.environ.get("ELECTRA_JAX_NOTEBOOK_WORKDIR", "workdirs/colab_demo")
OVERRIDES = {
    # "train.steps": 2000,
    # "train.batch_size": 128,
}
OVERRIDES.update(json.loads(os.environ.get("ELECTRA_JAX_NOTEBOOK_OVERRIDES", "{}")))

config = api.load_config("demo", OVERRIDES)  # a mistyped key is refused, with the nearest name
m, t = config.model, config.train
print(f"hidden {m.hidden_size}, {m.num_layers} layers, generator {m.generator_fraction:g}x; "
      f"{t.steps} steps of {t.batch_size} x {config.data.max_seq_len} tokens -> {WORKDIR}")""",
    ),
    (
        "code",
        """\
# Pre-training, with live metrics: the run goes in a background thread while this cell
# reads WORKDIR/metrics.jsonl as it grows (a plot where matplotlib is at hand).
LIVE_PLOT = os.environ.get("ELECTRA_JAX_NOTEBOOK_PLOT", "1") == "1"
try:
  import matplotlib.pyplot as plt
  from IPython.display import clear_output
except ImportError:
  LIVE_PLOT = False

metrics_path = os.path.join(WORKDIR, "metrics.jsonl")
outcome = {}


def pretrain():
  try:
    outcome["metrics"] = api.pretrain(config, WORKDIR)
  except BaseException as error:  # shown by the cell below the thread, not lost in it
    outcome["error"] = error


def read_metrics():
  if not os.path.exists(metrics_path):
    return []
  with open(metrics_path) as f:
    return [json.loads(line) for line in f if line.strip()]


def describe(row):
  return (f"step {row['step']:>6} | loss {row['loss']:.4f} | mlm_acc {row['masked_lm_accuracy']:.3f} | "
          f"disc_auc {row['disc_auc']:.3f} | {row['tokens_per_sec']:,.0f} tokens/s")


def show(rows, new_rows):
  if not LIVE_PLOT:
    for row in new_rows:
      print(describe(row), flush=True)
    return
  clear_output(wait=True)
  fig, axes = plt.subplots(1, 3, figsize=(15, 3.2))
  for ax, name in zip(axes, ("loss", "masked_lm_accuracy", "disc_auc")):
    ax.plot([r["step"] for r in rows], [r[name] for r in rows])
    ax.set_title(name)
    ax.set_xlabel("step")
  plt.show()
  print(describe(rows[-1]), flush=True)


if "pretrain_thread" in globals() and pretrain_thread.is_alive():
  # Interrupting this cell stops the reading below, not the training thread: a second run
  # would write the same workdir.
  raise RuntimeError("The previous run is still training in the background: wait for it (run this "
                     "cell again when it is done) or restart the runtime.")
pretrain_thread = threading.Thread(target=pretrain, daemon=True)
pretrain_thread.start()
last_shown = 0
while True:
  finished = not pretrain_thread.is_alive()
  rows = read_metrics()
  new_rows = [row for row in rows if row["step"] > last_shown]
  if new_rows:
    show(rows, new_rows)
    last_shown = new_rows[-1]["step"]
  if finished:
    break
  pretrain_thread.join(timeout=2.0)
if "error" in outcome:
  raise outcome["error"]
print(f"Done: checkpoints in {WORKDIR}/checkpoints, metrics in {metrics_path}")""",
    ),
    (
        "code",
        """\
# Held-out evaluation of the latest checkpoint: documents the run never trained on, with
# fixed masks, so the figures compare across checkpoints and runs.
held_out = api.evaluate(WORKDIR)
print(f"held-out metrics of the checkpoint at step {held_out['step']}:")
for name, value in sorted(held_out.items()):
  if name != "step":
    print(f"  {name:28s} {value:.4f}")""",
    ),
    (
        "markdown",
        """\
Next: `api.export_hf(WORKDIR, "hf_model")` writes the discriminator and its tokenizer in Hugging
Face format (`transformers.ElectraForPreTraining` and `AutoTokenizer.from_pretrained`), and
`api.finetune(api.load_config("finetune/custom", {...}), "finetuned")` fine-tunes it.
For TPU pods, GPU hosts and SLURM clusters see `launch/README.md` in the repository.""",
    ),
]


def notebook() -> dict:
  cells = []
  for index, (kind, source) in enumerate(CELLS):
    lines = source.splitlines(keepends=True)
    cell = {"cell_type": kind, "id": f"cell-{index}", "metadata": {}, "source": lines}
    if kind == "code":
      cell.update(execution_count=None, outputs=[])
    cells.append(cell)
  return {
      "cells": cells,
      "metadata": {
          "accelerator": "TPU",
          "colab": {"provenance": []},
          "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"},
      },
      "nbformat": 4,
      "nbformat_minor": 5,
  }


def render() -> str:
  return json.dumps(notebook(), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
  import argparse

  parser = argparse.ArgumentParser(
      description="Writes launch/colab_tpu.ipynb from this file's cells."
  )
  parser.add_argument(
      "--check",
      action="store_true",
      help="only say whether the notebook is current (exit 1 if not)",
  )
  args = parser.parse_args()
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "colab_tpu.ipynb")
  if args.check:
    with open(path, encoding="utf-8") as f:
      current = f.read() == render()
    print(f"{path} is {'current' if current else 'out of date: run python launch/make_colab.py'}")
    raise SystemExit(0 if current else 1)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(render())
  os.replace(tmp, path)
  print(f"Wrote {path}")
