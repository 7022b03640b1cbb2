"""The GPU measurements of benchmarks/RESULTS.md, for a GPU machine reached one command at a time.

Rented and shared GPU machines often run one command per call, under a time limit, over a copy of
the checkout that has to be uploaded. This script plans for that: each mode is one command whose
runs go in order of importance under one deadline (--budget, seconds); a run gets what is left of
the deadline, up to its own cap, and a run that cannot start with the time it needs (a first
compile takes about a minute) is reported as skipped, so the command still returns what it
measured. Everything lands in three files under --out: summary.txt, results.jsonl (each run's
JSON) and log.txt (each run's stderr).

Once, on any machine (writes .bench_data/s128, .bench_data/s512 and, in .whl, wheels of what the
GPU machine's Python lacks; --upload-limit-mib checks what travels against an upload limit):

  python benchmarks/gpu_suite.py prepare
  python benchmarks/gpu_suite.py goals --dry-run    # the commands, caps and the deadline

On the GPU machine, from a copy of the checkout with .bench_data/s128, .bench_data/s512 and .whl
(the script installs the wheels into /tmp/site itself), one command per mode:

  python3 benchmarks/gpu_suite.py goals     # MFU and tokens/s of electra_small (seq 128) and
                                            # electra_base (seq 512) in bf16, against PyTorch's step
  python3 benchmarks/gpu_suite.py profile   # device traces: top kernels of both steps
  python3 benchmarks/gpu_suite.py check packed   # attention against xla; packed rows; the
                                                 # paper's attention dropout
  python3 benchmarks/gpu_suite.py memory    # largest batch per size and sequence length
  python3 benchmarks/gpu_suite.py layer     # one encoder layer against PyTorch's
  python3 benchmarks/gpu_suite.py finetune  # a seed of fine-tuning against its step alone

Several modes in one command share its deadline, in the order given.
"""

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = {128: ".bench_data/s128", 512: ".bench_data/s512"}
WHEELS = ".whl"
SITE = "/tmp/site"  # where the copied wheels are installed on the GPU machine
# What the benchmarks import beyond the standard library; a GPU image with jax and torch often
# lacks ml_collections, which then travels as a wheel (prepare --wheel for others).
NEEDED = (
    "jax",
    "flax",
    "optax",
    "orbax.checkpoint",
    "ml_collections",
    "absl",
    "sentencepiece",
    "tokenizers",
    "etils",
    "numpy",
    "torch",
    "transformers",
)
# issue 6's goals on an H100: MFU per recipe, and tokens/s over the PyTorch step's.
GOALS = {"electra_small": 0.25, "electra_base": 0.45}
GOAL_RATIO = 2.0
# Seconds of runs in one command: under a 10-minute limit per command, less the wheel install
# and the version probe (importing jax and torch), which come first.
DEFAULT_BUDGET = 540


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  kind: str  # "throughput", "profile" or "text": how its stdout is summarized
  argv: tuple  # after the interpreter: a script under benchmarks/ and its flags
  cap: int  # its own timeout, seconds
  need: int  # it is not started with fewer seconds left (a first compile is about a minute)
  recipe: str = ""  # configs/<recipe>.py, for the throughput and profile scripts
  overrides: tuple = ()  # (key, value) pairs given as --config.key=value

  @property
  def data_dir(self):
    return dict(self.overrides).get("data.prepared_dir")

  def command(self, python="python3"):
    flags = [f"--config=configs/{self.recipe}.py"] if self.recipe else []
    flags += [f"--config.{k}={v}" for k, v in self.overrides]
    return [python, *self.argv[:1], *flags, *self.argv[1:]]


def _recipe_overrides(seq_len, batch, *extra):
  data = (("data.source", "prepared"), ("data.prepared_dir", DATA[seq_len]))
  if seq_len != 128:
    data += (("data.max_seq_len", seq_len),)
  return data + (("train.dtype", "bfloat16"), ("train.batch_size", batch)) + extra


FAST = (("model.attention_impl", "cudnn"), ("model.attention_dropout_rate", 0.0))
PEER = ("--vs-huggingface", "--hf-gathered")
TIMING = ("--steps=20", "--windows=3", "--warmup=3")


def _throughput(name, recipe, seq_len, batch, extra=(), flags=(), cap=240, need=100):
  return Run(
      name,
      "throughput",
      ("benchmarks/pretrain_throughput.py", *TIMING, *flags),
      cap,
      need,
      recipe,
      _recipe_overrides(seq_len, batch, *extra),
  )


def _profile(name, recipe, seq_len, batch, cap=240, need=100):
  return Run(
      name,
      "profile",
      (
          "benchmarks/step_profile.py",
          "--parts=false",
          "--steps=10",
          "--top=30",
          f"--trace=/tmp/trace_{name}",
      ),
      cap,
      need,
      recipe,
      _recipe_overrides(seq_len, batch, *FAST),
  )


MODES = {
    # The figures issue 6 asks for first: MFU and the ratio to PyTorch (bf16 autocast, SDPA) for
    # electra_small at seq 128 and electra_base at seq 512, then small at a batch that fills the GPU.
    "goals": (
        _throughput("small_b128_cudnn", "electra_small", 128, 128, FAST, PEER, cap=240, need=100),
        _throughput("base_b32_cudnn", "electra_base", 512, 32, FAST, PEER, cap=280, need=130),
        _throughput(
            "small_b1024_packed_k10",
            "electra_small",
            128,
            1024,
            FAST + (("data.pack_rows", True), ("train.steps_per_call", 10)),
            cap=200,
            need=90,
        ),
    ),
    # The levers issue 74 names that need no new code, each beside its baseline in one command:
    # bias-free dense layers (their gradients are separate reductions) and several steps a call.
    "levers": (
        _throughput("base_b32_cudnn", "electra_base", 512, 32, FAST, PEER, cap=280, need=130),
        _throughput(
            "base_b32_cudnn_nobias",
            "electra_base",
            512,
            32,
            FAST + (("model.use_bias", False),),
            cap=200,
            need=90,
        ),
        _throughput(
            "small_b128_cudnn_k10",
            "electra_small",
            128,
            128,
            FAST + (("train.steps_per_call", 10),),
            cap=200,
            need=130,
        ),
        _throughput(
            "small_b128_cudnn_k10_nobias",
            "electra_small",
            128,
            128,
            FAST + (("train.steps_per_call", 10), ("model.use_bias", False)),
            cap=200,
            need=130,
        ),
        _throughput("small_b128_cudnn", "electra_small", 128, 128, FAST, PEER, cap=240, need=100),
    ),
    "profile": (
        _profile("prof_small_b128", "electra_small", 128, 128),
        _profile("prof_base_b32", "electra_base", 512, 32),
    ),
    "check": (
        Run(
            "attention_small",
            "text",
            ("benchmarks/attention_check.py", "--batch=8", "--seq=128"),
            150,
            40,
        ),
        Run(
            "attention_base",
            "text",
            (
                "benchmarks/attention_check.py",
                "--batch=4",
                "--seq=512",
                "--hidden=768",
                "--heads=12",
            ),
            150,
            40,
        ),
    ),
    "packed": (  # cuDNN reads packed rows' segment mask as a bias (a slower kernel): against xla
        _throughput(
            "base_b32_packed_cudnn", "electra_base", 512, 32, FAST + (("data.pack_rows", True),)
        ),
        _throughput(
            "base_b32_packed_xla",
            "electra_base",
            512,
            32,
            (("model.attention_dropout_rate", 0.0), ("data.pack_rows", True)),
        ),
        _throughput("small_b128_xla_attndrop", "electra_small", 128, 128, (), PEER),
    ),
    "memory": (
        Run(
            "max_batch",
            "text",
            ("benchmarks/max_batch.py", "--dtype=bfloat16", "--step=8"),
            540,
            120,
        ),
    ),
    "layer": tuple(
        Run(
            f"layer_{size}",
            "text",
            (
                "benchmarks/encoder_layer.py",
                *dims.split(),
                "--dtype=bfloat16",
                "--flax_dense",
                "--torch",
                "--runs=50",
            ),
            240,
            60,
        )
        for size, dims in (
            ("small", "--hidden=256 --heads=4 --ffn=1024 --batch=128 --seq=128"),
            ("base", "--hidden=768 --heads=12 --ffn=3072 --batch=32 --seq=512"),
        )
    ),
    "finetune": tuple(  # a seed of fine-tuning against its step alone: what the loop adds on a GPU
        Run(
            f"finetune_loop_{size}",
            "text",
            ("benchmarks/finetune_loop.py", f"--size={size}", "--steps=1000"),
            200,
            60,
        )
        for size in ("tiny", "quick")
    ),
}


# ---------------------------------------------------------------------------------------
# Running a plan under one deadline
# ---------------------------------------------------------------------------------------
def execute(runs, budget, launch, clock=time.monotonic, on_record=lambda records: None):
  """Runs `runs` in order within `budget` seconds. `launch(run, timeout)` returns (returncode,
  stdout, stderr); a run is given min(its cap, what is left) and is skipped when less than its
  `need` is left. `on_record(records so far)` follows each run. Returns one record per run."""
  deadline, records = clock() + budget, []
  for run in runs:
    left = int(deadline - clock())
    if left < run.need:
      records.append(
          dict(name=run.name, status="skipped", reason=f"{left} s left, it needs {run.need} s")
      )
      on_record(records)
      continue
    timeout, start = min(run.cap, left), clock()
    code, out, err = launch(run, timeout)
    record = dict(
        name=run.name,
        kind=run.kind,
        recipe=run.recipe,
        seconds=round(clock() - start, 1),
        timeout=timeout,
        command=shlex.join(run.command()),
        stderr_tail=err[-3000:],
    )
    if code is None:
      record.update(status="timed out", stdout=out[-3000:])
    elif code != 0:
      record.update(status=f"failed (exit {code})", stdout=out[-3000:])
    elif run.kind == "text":
      record.update(status="ok", stdout=out)
    else:
      try:
        record.update(status="ok", result=json.loads(out))
      except json.JSONDecodeError:
        record.update(status="unreadable output", stdout=out[-3000:])
    records.append(record)
    on_record(records)
  return records


def _text(output):
  return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _launch(env):
  def launch(run, timeout):
    try:
      done = subprocess.run(
          run.command(sys.executable),
          cwd=REPO,
          env=env,
          capture_output=True,
          text=True,
          timeout=timeout,
      )
      return done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:  # what it printed before, for the summary
      return None, _text(e.stdout), _text(e.stderr)

  return launch


def summarize(record):
  """A few lines per run for summary.txt (the end of the command's output)."""
  head = f"{record['name']}: {record['status']}"
  if record["status"] == "skipped":
    return f"{head} ({record['reason']})"
  if record["status"] != "ok":  # the error is at the end; log.txt has the rest
    last = [line for line in record["stderr_tail"].splitlines() if line.strip()][-4:]
    return "\n   ".join([f"{head} after {record['seconds']} s", *last])
  if record["kind"] == "text":
    return f"{head} ({record['seconds']} s)\n" + record["stdout"].rstrip()
  r = record["result"]
  if record["kind"] == "profile":
    lines = [f"{head}: whole step {r['ms_per_call']['whole train step']} ms"]
    lines += [
        f"   {ms:9.3f} ms  x{calls:<6g} {name[:90]}"
        for name, ms, calls in r["top_kernels_ms_per_step"][:16]
    ]
    return "\n".join(lines)
  mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
  line = (
      f"{head}: {r['device']}, batch {r['batch_size']} x {r['seq_len']}: {r['step_ms']} ms, "
      f"{r['tokens_per_sec']:,.0f} tokens/s, MFU {mfu}, compile {r['compile_seconds']} s"
  )
  for peer in ("huggingface", "huggingface_gathered"):
    if peer in r:
      line += f" | {peer} {r[peer]['step_ms']} ms: ours x{r[peer]['ratio_ours_over_theirs']}"
  return line


def verdict(records):
  """Issue 6's GPU goals against what was measured (MFU per recipe, tokens/s over PyTorch's)."""
  lines = []
  for record in records:
    if record.get("status") != "ok" or record.get("kind") != "throughput":
      continue
    r, goal = record["result"], GOALS.get(record["recipe"])
    if r["mfu"] is not None and goal is not None:
      lines.append(
          f"{record['name']}: MFU {r['mfu']:.1%} against the goal {goal:.0%}: "
          f"{'met' if r['mfu'] >= goal else 'NOT met'}"
      )
    if "huggingface" in r:
      ratio = r["huggingface"]["ratio_ours_over_theirs"]
      lines.append(
          f"{record['name']}: x{ratio} the PyTorch step's tokens/s against the goal x{GOAL_RATIO}: "
          f"{'met' if ratio >= GOAL_RATIO else 'NOT met'}"
      )
  return lines


# ---------------------------------------------------------------------------------------
# On the GPU machine: the copied wheels, then the plan
# ---------------------------------------------------------------------------------------
# One interpreter start (jax and torch take seconds to import): what is missing, else the versions.
_PROBE = """
import importlib, sys
missing = []
for name in sys.argv[1:]:
  try:
    importlib.import_module(name)
  except ImportError:
    missing.append(name)
print(" ".join(missing))
if not missing:
  import flax, jax, optax, torch, transformers
  print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, "torch", torch.__version__,
        "transformers", transformers.__version__, jax.devices())
"""


def _environment():
  """(environment for the runs, lines naming the GPU and versions), with the carried wheels
  installed if the image lacks one; exits naming what is still missing."""
  env = dict(
      os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false"
  )  # torch shares the GPU
  env.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jax_cache")
  wheels = os.path.join(REPO, WHEELS)
  if os.path.isdir(wheels) and os.listdir(wheels):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            SITE,
            *sorted(os.path.join(wheels, w) for w in os.listdir(wheels)),
        ],
        check=True,
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SITE, env.get("PYTHONPATH")]))
  probed = subprocess.run(
      [sys.executable, "-c", _PROBE, *NEEDED], env=env, capture_output=True, text=True, cwd=REPO
  ).stdout.split("\n")
  missing = probed[0].split()
  if missing:
    sys.exit(
        f"gpu_suite: {sys.executable} lacks {', '.join(missing)}. Carry wheels for them in {WHEELS}/ "
        "(python benchmarks/gpu_suite.py prepare --wheel=NAME==VERSION on the machine with PyPI)."
    )
  lines = [probed[1].strip()] if len(probed) > 1 else []
  if shutil.which("nvidia-smi"):
    lines.insert(
        0,
        subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,clocks.sm,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip(),
    )
  return env, lines


def measure(modes, budget, out_dir):
  """Runs the modes' steps; `budget` counts from here, the wheel install and probe included."""
  started = time.monotonic()
  runs = [run for mode in modes for run in MODES[mode]]
  missing = sorted(
      {
          run.data_dir
          for run in runs
          if run.data_dir and not os.path.isdir(os.path.join(REPO, run.data_dir))
      }
  )
  if missing:
    sys.exit(
        f"gpu_suite: {', '.join(missing)} missing: carry it "
        "(made by `python benchmarks/gpu_suite.py prepare`)."
    )
  env, versions = _environment()
  os.makedirs(out_dir, exist_ok=True)
  header = [
      f"gpu_suite {' '.join(modes)}, {time.strftime('%Y-%m-%d %H:%M:%S')}, budget {budget} s",
      *versions,
  ]
  print("\n".join(header), flush=True)
  launch = _launch(env)

  def logged(run, timeout):
    print(f"=== {run.name} (timeout {timeout} s, {time.strftime('%H:%M:%S')})", flush=True)
    return launch(run, timeout)

  def write(records):  # after every run: a call cut short still brings back what was measured
    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
    with open(os.path.join(out_dir, "log.txt"), "w") as f:
      for r in records:
        f.write(
            f"===== {r['name']}: {r['status']}\n{r.get('command', '')}\n{r.get('stderr_tail', '')}\n"
        )
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
      f.write("\n".join(header + [summarize(r) for r in records] + ["", *verdict(records)]) + "\n")

  records = execute(runs, budget - (time.monotonic() - started), logged, on_record=write)
  with open(os.path.join(out_dir, "summary.txt")) as f:
    print("\n===== summary\n" + f.read(), end="")
  return records


def dry_run(modes, budget):
  runs = [run for mode in modes for run in MODES[mode]]
  print(
      f"# {len(runs)} runs under one deadline of {budget} s (caps add up to {sum(r.cap for r in runs)} s)"
  )
  for run in runs:
    print(f"# {run.name}: cap {run.cap} s, started only with {run.need} s left")
    print(shlex.join(run.command()))


# ---------------------------------------------------------------------------------------
# Before: the data and wheels that go to the GPU machine
# ---------------------------------------------------------------------------------------
def _tree_bytes():
  """Bytes of the checkout that travels: tracked and untracked, not ignored, files."""
  names = subprocess.run(
      ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
      cwd=REPO,
      capture_output=True,
      text=True,
      check=True,
  ).stdout.split("\0")
  return sum(
      os.path.getsize(os.path.join(REPO, n))
      for n in names
      if n and os.path.isfile(os.path.join(REPO, n))
  )


def _dir_bytes(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def prepare(wheels, python_version="3.12", upload_limit_mib=0):
  for seq_len, path in DATA.items():
    if os.path.isdir(os.path.join(REPO, path)):
      print(f"{path}: there already")
      continue
    subprocess.run(
        [
            sys.executable,
            "-m",
            "electra_jax.main",
            "--mode=prepare_data",
            "--config=configs/electra_small.py",
            f"--config.data.max_seq_len={seq_len}",
            f"--config.data.prepared_dir={path}",
            "--config.data.max_documents=6000",
        ],
        cwd=REPO,
        check=True,
    )
  if not wheels:
    import ml_collections  # the version this machine runs

    wheels = [f"ml_collections=={ml_collections.__version__}"]
  # The GPU machine's Python: --python-version, manylinux x86_64.
  platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (28, 27, 17)] + [
      "--platform=manylinux2014_x86_64"
  ]
  subprocess.run(
      [
          sys.executable,
          "-m",
          "pip",
          "download",
          "-q",
          "--no-deps",
          "--only-binary=:all:",
          f"--python-version={python_version}",
          "--implementation=cp",
          *platforms,
          "-d",
          os.path.join(REPO, WHEELS),
          *wheels,
      ],
      check=True,
  )
  tracked = [
      p
      for p in [*DATA.values(), WHEELS]
      if subprocess.run(["git", "check-ignore", "-q", p], cwd=REPO).returncode != 0
  ]
  if tracked:
    sys.exit(
        f"gpu_suite: {', '.join(tracked)} must be git-ignored (copied beside the checkout; else they travel twice)."
    )
  copied = {p: _dir_bytes(os.path.join(REPO, p)) for p in [*DATA.values(), WHEELS]}
  total = _tree_bytes() + sum(copied.values())
  for path, size in copied.items():
    print(f"{path}: {size / 2**20:.1f} MiB")
  print(f"travels in all (checkout + {', '.join(copied)}): {total / 2**20:.1f} MiB")
  if upload_limit_mib and total > upload_limit_mib * 2**20:
    sys.exit(
        f"gpu_suite: over --upload-limit-mib={upload_limit_mib}; prepare less data "
        "(--config.data.max_documents) or fewer wheels."
    )
  print(
      f"On the GPU machine, with {', '.join(copied)} beside the checkout: python3 benchmarks/gpu_suite.py goals"
  )


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("modes", nargs="+", choices=["prepare", *MODES])
  parser.add_argument(
      "--budget",
      type=int,
      default=DEFAULT_BUDGET,
      help="Seconds for all runs of the command, installs and probe included.",
  )
  parser.add_argument(
      "--dry-run", action="store_true", help="Print the plan and its commands; run nothing."
  )
  parser.add_argument(
      "--wheel",
      action="append",
      default=[],
      metavar="NAME==VERSION",
      help="prepare: the wheels to copy (default: ml_collections at this machine's version).",
  )
  parser.add_argument(
      "--python-version", default="3.12", help="prepare: the GPU machine's Python, for its wheels."
  )
  parser.add_argument(
      "--upload-limit-mib",
      type=int,
      default=0,
      help="prepare: fail when the checkout and data exceed this upload limit (0: none).",
  )
  parser.add_argument(
      "--out", default=os.environ.get("OUT", "gpu_results"), help="Where the three files go."
  )
  args = parser.parse_args(argv)
  if "prepare" in args.modes:
    if len(args.modes) > 1:
      parser.error("prepare runs before, on any machine; the other modes run on the GPU machine")
    return prepare(args.wheel, args.python_version, args.upload_limit_mib)
  if args.dry_run:
    return dry_run(args.modes, args.budget)
  measure(args.modes, args.budget, args.out)


if __name__ == "__main__":
  main()
