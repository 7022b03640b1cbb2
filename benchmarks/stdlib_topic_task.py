"""Topic classification of single sentences from the built-in corpus (stdlib docstrings).

Label = which group of stdlib modules the sentence's docstring comes from:
  net      (email, http, urllib, smtplib, imaplib, poplib, ftplib, nntplib, telnetlib, socket,
            socketserver, ssl, mailbox, mimetypes, cgi, wsgiref, xmlrpc, ipaddress)
  numbers  (_pydecimal, statistics, fractions, numbers, random, datetime, calendar, _strptime,
            colorsys, heapq, bisect, zoneinfo)
  files    (os, pathlib, shutil, tarfile, zipfile, _pyio, tempfile, gzip, bz2, lzma, fileinput,
            glob, fnmatch, filecmp, posixpath, genericpath, ntpath, stat, shelve, dbm, zipimport)
  concurrency (threading, multiprocessing, concurrent, asyncio, queue, sched, subprocess,
            selectors)
Words naming a module of any group (e.g. "smtplib", "os.path.join", "asyncio.Future",
"Decimal") are removed, so the label is not given away by an identifier.
Train and dev come from DIFFERENT source files (file-level split), so dev measures
generalization to unseen modules of a topic, not memorization of one file's vocabulary.
All sentences were seen (unlabelled) by pre-training: only 11 of 583 corpus documents are held
out (data.eval_fraction=0.02), far too few for a dev set.
The downstream task of the reference sweep in docs/objectives.md: it needs no download, and at
the official fine-tuning lr of 1e-4 a pre-trained demo model beats random init on it (37% vs
25% dev accuracy, chance 25%; a TF-IDF logistic regression gets 60%).

  python benchmarks/stdlib_topic_task.py workdirs/topic_task
  electra-jax --mode=finetune --config=configs/finetune/custom.py \
      --config.custom.train_file=workdirs/topic_task/train.jsonl \
      --config.custom.dev_file=workdirs/topic_task/dev.jsonl \
      --config.custom.text_a_column=sentence --config.custom.label_column=label \
      --config.max_seq_len=64 --config.init_from=workdirs/demo --workdir=workdirs/demo_topic

Writes OUT_DIR/train.jsonl (2,687 sentences), dev.jsonl (828, balanced), train400.jsonl
(100 per class) and task_stats.json. Deterministic for a given Python standard library.
"""

import collections, json, os, random, re, sys
from electra_jax.data import corpus

GROUPS = {
    "net": [
        "email/",
        "http/",
        "urllib/",
        "smtplib.py",
        "imaplib.py",
        "poplib.py",
        "ftplib.py",
        "nntplib.py",
        "telnetlib.py",
        "socket.py",
        "socketserver.py",
        "ssl.py",
        "mailbox.py",
        "mimetypes.py",
        "cgi.py",
        "wsgiref/",
        "xmlrpc/",
        "ipaddress.py",
        "smtpd.py",
    ],
    "numbers": [
        "_pydecimal.py",
        "decimal.py",
        "statistics.py",
        "fractions.py",
        "numbers.py",
        "random.py",
        "datetime.py",
        "calendar.py",
        "_strptime.py",
        "colorsys.py",
        "heapq.py",
        "bisect.py",
        "_pydatetime.py",
        "zoneinfo/",
    ],
    "files": [
        "os.py",
        "pathlib.py",
        "shutil.py",
        "tarfile.py",
        "zipfile.py",
        "zipfile/",
        "_pyio.py",
        "io.py",
        "tempfile.py",
        "gzip.py",
        "bz2.py",
        "lzma.py",
        "fileinput.py",
        "glob.py",
        "fnmatch.py",
        "filecmp.py",
        "posixpath.py",
        "genericpath.py",
        "ntpath.py",
        "stat.py",
        "shelve.py",
        "dbm/",
        "zipimport.py",
        "_compression.py",
    ],
    "concurrency": [
        "threading.py",
        "multiprocessing/",
        "concurrent/",
        "asyncio/",
        "queue.py",
        "sched.py",
        "subprocess.py",
        "selectors.py",
        "_threading_local.py",
    ],
}
CAP_PER_FILE = 300  # keeps one big file (e.g. _pydecimal) from dominating its class
TRAIN_CAP = 700
ALIASES = {"decimal", "io", "tar", "zip", "dbm", "futures", "concurrent", "datetime", "zoneinfo"}


def group_of(rel):
  for label, prefixes in GROUPS.items():
    for p in prefixes:
      if (p.endswith("/") and rel.startswith(p)) or rel == p:
        return label
  return None


def stems():
  out = set(ALIASES)
  for prefixes in GROUPS.values():
    for p in prefixes:
      out.add(p.split("/")[0].removesuffix(".py").lstrip("_"))
  return out


STEMS = stems()


def clean(sentence):
  kept = []
  for w in sentence.split():
    pieces = [x.lstrip("_") for x in re.split(r"[^A-Za-z0-9_]+", w.lower()) if x]
    if any(x in STEMS for x in pieces):
      continue
    kept.append(w)
  return " ".join(kept)


def main(out):
  os.makedirs(out, exist_ok=True)
  root = corpus.stdlib_root()
  by_file = collections.defaultdict(list)  # (label, rel) -> sentences
  for rel in corpus._stdlib_source_files():
    label = group_of(rel)
    if label is None:
      continue
    tree = corpus._parse(os.path.join(root, rel))
    if tree is None:
      continue
    for ds in corpus._iter_docstrings(tree):
      for para in corpus.split_sentences(ds):
        for s in re.split(r"(?<=[.!?])\s+", para):
          s = clean(s)
          n = len(s.split())
          if 6 <= n <= 40 and s.isascii():
            by_file[(label, rel)].append(s)
  rng = random.Random(0)
  seen = collections.Counter()
  for key in by_file:
    by_file[key] = list(dict.fromkeys(by_file[key]))
    rng.shuffle(by_file[key])
    by_file[key] = by_file[key][:CAP_PER_FILE]
    seen.update(by_file[key])
  # Drop sentences that occur in more than one file (boilerplate), so no dev sentence is in train.
  for key in by_file:
    by_file[key] = [s for s in by_file[key] if seen[s] == 1]
  train, dev = collections.defaultdict(list), collections.defaultdict(list)
  files = collections.defaultdict(dict)
  for label in GROUPS:
    keys = sorted(k for k in by_file if k[0] == label)
    rng.shuffle(keys)
    total = sum(len(by_file[k]) for k in keys)
    for k in keys:  # dev gets whole files until it holds ~25% of the class
      split = (
          dev
          if sum(len(x) for x in dev[label]) < 0.25 * total and len(by_file[k]) < 0.15 * total
          else train
      )
      split[label].append(by_file[k])
      files[label].setdefault("dev" if split is dev else "train", []).append(k[1])
  train = {l: [s for f in v for s in f] for l, v in train.items()}
  dev = {l: [s for f in v for s in f] for l, v in dev.items()}
  n_train = min(len(v) for v in train.values())
  n_dev = min(len(v) for v in dev.values())

  def write(name, rows):
    rng.shuffle(rows)
    with open(f"{out}/{name}.jsonl", "w") as f:
      f.writelines(json.dumps({"sentence": s, "label": l}) + "\n" for s, l in rows)

  # Train: up to TRAIN_CAP per class (mildly imbalanced; the smallest class has fewer); dev balanced.
  train_rows = [(s, l) for l, v in train.items() for s in rng.sample(v, min(len(v), TRAIN_CAP))]
  dev_rows = [(s, l) for l, v in dev.items() for s in rng.sample(v, n_dev)]
  write("train", train_rows)
  write("dev", dev_rows)
  small = [(s, l) for l in GROUPS for s in rng.sample([s for s, ll in train_rows if ll == l], 100)]
  write("train400", small)
  stats = {
      l: {
          "train_avail": len(train[l]),
          "dev_avail": len(dev[l]),
          "dev_files": files[l]["dev"],
          "n_train_files": len(files[l]["train"]),
      }
      for l in GROUPS
  }
  stats.update(train_counts=collections.Counter(l for _, l in train_rows), n_dev_per_class=n_dev)
  json.dump(stats, open(f"{out}/task_stats.json", "w"), indent=1)
  print(json.dumps(stats, indent=1))


if __name__ == "__main__":
  main(sys.argv[1])
