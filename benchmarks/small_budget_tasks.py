"""Two classification tasks, each with its own pre-training corpus, built from English text that
Debian puts on this machine (nobody here wrote it). Used by benchmarks/small_budget.py.

  debian   the one-line synopsis of a Debian package -> its archive section (12 classes); the
           corpus is the long descriptions of the other packages. Needs the package index with
           English descriptions: `apt-get -o Acquire::Languages=en update`.
  manpages a paragraph of an English man page -> the page's section (1, 2, 3, 5, 7, 8); the
           corpus is the paragraphs of the other installed pages.

Labelled and corpus texts never share a source: a Debian source package (whose binary packages
repeat each other's descriptions) or a man page is in the training set, the dev set or the
corpus, never in two. Each task directory gets corpus.txt (one paragraph per line, a blank line
between documents), train.jsonl (2,000 examples), dev.jsonl (2,000 to 4,000) and stats.json; each
example has its sentence, label and group (its source package or man page).

  python benchmarks/small_budget_tasks.py OUT_DIR [debian manpages]
"""

import collections
import glob
import gzip
import hashlib
import json
import os
import random
import re
import subprocess
import sys

APT_LISTS = "/var/lib/apt/lists"
DEBIAN_SECTIONS = (
    "admin",
    "devel",
    "doc",
    "games",
    "graphics",
    "libs",
    "net",
    "science",
    "sound",
    "text",
    "utils",
    "x11",
)
MAN_SECTIONS = ("1", "2", "3", "5", "7", "8")
TRAIN_SIZE = 2000


def _apt_records(pattern: str):
  """The stanzas (dicts; continuation lines joined with newlines) of apt list files."""
  files = sorted(glob.glob(os.path.join(APT_LISTS, pattern)))
  for file in files:
    text = subprocess.run(
        ["/usr/lib/apt/apt-helper", "cat-file", file], check=True, capture_output=True, text=True
    ).stdout
    for stanza in text.split("\n\n"):
      record, key = {}, None
      for line in stanza.splitlines():
        if line.startswith(" ") and key:
          record[key] += "\n" + line[1:]
        elif ":" in line:
          key, _, value = line.partition(":")
          record[key] = value.strip()
      if record:
        yield record


def _split_groups(groups: dict, labels: dict, rng: random.Random, dev_size: int):
  """Train, dev and corpus groups: labelled examples come from groups drawn per class; the
  rest of the groups are the corpus. Returns (train groups, dev groups)."""
  by_label = collections.defaultdict(list)
  for group in sorted(groups):
    if labels.get(group) is not None:
      by_label[labels[group]].append(group)
  train, dev = [], []
  for label in sorted(by_label):
    members = by_label[label]
    rng.shuffle(members)
    # A quarter of each class's groups is labelled: half of those train, half dev.
    labelled = members[: max(4, len(members) // 4)]
    train += labelled[: len(labelled) // 2]
    dev += labelled[len(labelled) // 2 :]
  return set(train), set(dev)


def _examples(groups, texts_of, label_of, size: int, rng: random.Random):
  """Up to `size` examples of the groups' texts, each with its group (a Debian source package or
  a man page: --config.custom.group_column=group holds out whole groups when choosing a rate)."""
  examples = [
      {"sentence": text, "label": label_of(group), "group": os.path.basename(group)}
      for group in sorted(groups)
      for text in texts_of(group)
  ]
  rng.shuffle(examples)
  return examples[:size]


def _paragraphs(text: str) -> list[str]:
  paragraphs = [" ".join(p.split()) for p in re.split(r"\n\.\n|\n\s*\n", text)]
  return [p for p in paragraphs if len(p.split()) >= 4]


def debian(rng: random.Random):
  """(corpus documents, train, dev) of the Debian synopsis -> section task."""
  section_of, group_of, md5_of = {}, {}, {}
  for record in _apt_records("*_Packages.lz4"):
    name = record.get("Package")
    if not name or "Description-md5" not in record:
      continue
    section_of[name] = record.get("Section", "").split("/")[-1]
    group_of[name] = record.get("Source", name).split(" ")[0]
    md5_of[name] = record["Description-md5"]
  long_of = {}
  for record in _apt_records("*_i18n_Translation-en.lz4"):
    if (
        record.get("Package") in md5_of
        and record.get("Description-md5") == md5_of[record["Package"]]
    ):
      long_of[record["Package"]] = record["Description-en"]
  if len(long_of) < 10_000:
    sys.exit(
        "debian: the package index has no English descriptions; run "
        "`apt-get -o Acquire::Languages=en update` first."
    )
  members = collections.defaultdict(list)
  for name in sorted(long_of):
    members[group_of[name]].append(name)
  # A source's label: the section most of its binary packages are in, if one of the 12.
  labels = {}
  for group, names in members.items():
    section = collections.Counter(section_of[n] for n in names).most_common(1)[0][0]
    labels[group] = section if section in DEBIAN_SECTIONS else None
  train_groups, dev_groups = _split_groups(members, labels, rng, 4000)
  synopses = lambda group: sorted(
      {long_of[n].split("\n")[0].strip() for n in members[group] if section_of[n] == labels[group]}
  )
  train = _examples(train_groups, synopses, labels.get, TRAIN_SIZE, rng)
  dev = _examples(dev_groups, synopses, labels.get, 4000, rng)
  corpus = []
  for group in sorted(set(members) - train_groups - dev_groups):
    seen = set()
    for name in members[group]:
      text = long_of[name]
      if text not in seen:
        seen.add(text)
        corpus.append(_paragraphs(text))
  return corpus, train, dev


_ROFF_ESCAPE = re.compile(
    r"\\f(\[[^\]]*\]|\(..|.)|\\\(..|\\\[[^\]]*\]|\\[&|^%:]|\\s[-+]?\d+|\\\*\(?..?"
)


def _man_text(path: str) -> list[str]:
  """The paragraphs of a man page's sections from DESCRIPTION on, roff requests and font
  escapes removed (good enough for text statistics, not for display)."""
  with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
    lines = f.read().splitlines()
  paragraphs, current, in_body = [], [], False
  for line in lines:
    if line.startswith(('.\\"', "'\\\"")):
      continue
    if line.startswith("."):
      request = line[1:].split(" ", 1)
      if request[0] in ("SH", "SS"):
        in_body = in_body or "DESCRIPTION" in line.upper()
      if (
          request[0]
          in ("SH", "SS", "PP", "P", "LP", "TP", "IP", "sp", "br", "nf", "fi", "RS", "RE")
          and current
      ):
        paragraphs.append(" ".join(current))
        current = []
      if (
          request[0] in ("B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "SM")
          and len(request) > 1
          and in_body
      ):
        current.append(request[1].replace('"', ""))
      continue
    if in_body and line.strip():
      current.append(line.strip())
  if current:
    paragraphs.append(" ".join(current))
  cleaned = [
      " ".join(_ROFF_ESCAPE.sub("", p).replace("\\-", "-").replace("\\e", "\\").split())
      for p in paragraphs
  ]
  return [p for p in cleaned if len(p.split()) >= 8]


def manpages(rng: random.Random):
  """(corpus documents, train, dev) of the man-page paragraph -> section task."""
  pages, labels = {}, {}
  for section in ("1", "2", "3", "4", "5", "6", "7", "8"):
    for path in sorted(glob.glob(f"/usr/share/man/man{section}/*.gz")):
      paragraphs = _man_text(path)
      if paragraphs:
        pages[path] = paragraphs
        labels[path] = section if section in MAN_SECTIONS else None
  if len(pages) < 1000:
    sys.exit(
        f"manpages: only {len(pages)} English man pages under /usr/share/man; install more packages."
    )
  train_groups, dev_groups = _split_groups(pages, labels, rng, 2000)
  # At most 5 paragraphs from a page, so long pages do not fill a class.
  texts = lambda page: pages[page][:5]
  per_class = TRAIN_SIZE // len(MAN_SECTIONS)
  train, dev = [], []
  for section in MAN_SECTIONS:
    train += _examples(
        {g for g in train_groups if labels[g] == section}, texts, labels.get, per_class, rng
    )
    dev += _examples(
        {g for g in dev_groups if labels[g] == section}, texts, labels.get, per_class, rng
    )
  rng.shuffle(train)
  rng.shuffle(dev)
  corpus = [pages[p] for p in sorted(set(pages) - train_groups - dev_groups)]
  return corpus, train, dev


TASKS = {"debian": debian, "manpages": manpages}


def _digest(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:16]


def build(out_dir: str, name: str) -> str:
  task_dir = os.path.join(out_dir, name)
  if os.path.exists(os.path.join(task_dir, "stats.json")):
    return task_dir
  os.makedirs(task_dir, exist_ok=True)
  corpus, train, dev = TASKS[name](random.Random(0))
  with open(os.path.join(task_dir, "corpus.txt"), "w") as f:
    f.write("\n\n".join("\n".join(doc) for doc in corpus if doc) + "\n")
  for split, examples in (("train", train), ("dev", dev)):
    with open(os.path.join(task_dir, f"{split}.jsonl"), "w") as f:
      f.writelines(json.dumps(e) + "\n" for e in examples)
  counts = collections.Counter(e["label"] for e in dev)
  stats = {
      "corpus_documents": len(corpus),
      "corpus_words": sum(len(p.split()) for doc in corpus for p in doc),
      "train": len(train),
      "dev": len(dev),
      "classes": sorted(counts),
      "dev_majority": max(counts.values()) / len(dev),
      # The package index and the installed pages change from day to day: equal digests, equal task.
      "sha256": {
          file: _digest(os.path.join(task_dir, file))
          for file in ("corpus.txt", "train.jsonl", "dev.jsonl")
      },
  }
  with open(os.path.join(task_dir, "stats.json"), "w") as f:
    json.dump(stats, f, indent=2)
  return task_dir


if __name__ == "__main__":
  out = sys.argv[1]
  for task in sys.argv[2:] or list(TASKS):
    directory = build(out, task)
    print(directory, open(os.path.join(directory, "stats.json")).read())
