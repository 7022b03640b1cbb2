"""Reading an optimized HLO module (the text of `jax.jit(f).lower(...).compile().as_text()`):
the kernels it launches, counting while loops by their trip counts, the matmul FLOPs in them,
the bytes each kernel reads and writes (its operands and results), and a roofline bound
max(bytes / bandwidth, FLOPs / peak) per source operation. Used by gpu_compile_audit.py.
"""

import collections
import math
import re

# HLO instructions that are kernels of their own on a GPU (everything else is metadata,
# a bitcast, a tuple, or is folded into one of these).
KERNELS = {"fusion", "custom-call", "dot", "copy", "sort", "scatter", "gather", "reduce", "transpose",
           "concatenate", "pad", "dynamic-update-slice", "dynamic-slice", "all-reduce",
           "all-gather", "reduce-scatter", "collective-permute", "rng-bit-generator"}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(%s)\[([\d,]*)\]" % "|".join(_BYTES))
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z\-]+)\((.*?)\)(?:, |$)")


def _elements(dims: str) -> int:
  return math.prod(int(d) for d in dims.split(",") if d)


def array_bytes(shape_text: str) -> int:
  """Bytes of every array in an HLO shape (a tuple's too)."""
  return sum(_elements(dims) * _BYTES[dtype] for dtype, dims in _ARRAY.findall(shape_text))


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  """HLO text -> {computation name: its instruction lines}, and the entry's name."""
  comps, current, entry = {}, None, None
  for line in hlo.split("\n"):
    header = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
    if header:
      current = header.group(2)
      comps[current] = []
      entry = current if header.group(1) else entry
    elif current and line.startswith("  "):
      comps[current].append(line)
  return comps, entry


def source_frames(hlo: str):
  """stack_frame_id -> the innermost frame in electra_jax, as 'file:line function'."""
  def table(name):
    found = re.search(r"\n%s\n(.*?)\n\n" % name, hlo, re.S)
    return [line.split(None, 1) for line in found.group(1).split("\n")] if found else []
  files = {int(i): rest.strip('"') for i, rest in table("FileNames")}
  functions = {int(i): rest.strip('"') for i, rest in table("FunctionNames")}
  locations = {}
  for i, rest in table("FileLocations"):
    fields = dict(re.findall(r"(\w+)=(\d+)", rest))
    locations[int(i)] = (files[int(fields["file_name_id"])], functions[int(fields["function_name_id"])],
                         int(fields["line"]))
  frames = {int(i): tuple(int(v) for v in re.findall(r"=(\d+)", rest)) for i, rest in table("StackFrames")}

  def ours(frame_id):
    seen = set()
    while frame_id in frames and frame_id not in seen:
      seen.add(frame_id)
      location, parent = frames[frame_id]
      path, function, line = locations[location]
      if "/electra_jax/" in path:
        return f"{path.split('/electra_jax/')[-1]}:{line} {function}"
      frame_id = parent
    return "(outside electra_jax)"
  return ours


class Audit:
  """Kernel launches, matmul FLOPs, bytes and roofline bound of one compiled program."""

  def __init__(self, hlo: str, peak: float, bandwidth: float):
    self.comps, self.entry = computations(hlo)
    self.peak, self.bandwidth = peak, bandwidth
    self.where = source_frames(hlo)
    # per source operation: [bound seconds, launches, FLOPs, bytes]
    self.by_source = collections.defaultdict(lambda: [0.0, 0, 0, 0])
    self._walk(self.entry, 1)

  def _shapes(self, comp):
    return {m.group(1): m.group(2) for m in map(_INSTRUCTION.match, self.comps.get(comp, [])) if m}

  def _dot(self, line, shapes) -> int:
    """FLOPs of one `dot` instruction: 2 x result elements x contracted elements."""
    m = _INSTRUCTION.match(line)
    if not m or m.group(3) != "dot":
      return 0
    lhs = re.findall(r"%([\w.\-]+)", m.group(4))[0]
    lhs_dims = [int(d) for d in _ARRAY.search(shapes[lhs]).group(2).split(",") if d]
    contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line).group(1)
    depth = math.prod(lhs_dims[int(i)] for i in contracted.split(",") if i)
    return 2 * _elements(_ARRAY.search(m.group(2)).group(2)) * depth

  def dot_flops(self, comp) -> int:
    """Matmul FLOPs inside computation `comp` and everything it calls."""
    shapes = self._shapes(comp)
    total = 0
    for line in self.comps.get(comp, []):
      total += self._dot(line, shapes)
      for called in re.findall(r"calls=%([\w.\-]+)", line):
        total += self.dot_flops(called)
    return total

  def _walk(self, comp, repeats):
    shapes = self._shapes(comp)
    for line in self.comps[comp]:
      m = _INSTRUCTION.match(line)
      if not m:
        continue
      op = m.group(3)
      if op == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        trips = int(trips.group(1)) if trips else 1  # unknown: counted once
        for part in ("condition", "body"):
          self._walk(re.search(part + r"=%([\w.\-]+)", line).group(1), repeats * trips)
        continue
      if op == "conditional":  # the costliest branch
        if "branch_computations=" in line:
          branches = re.findall(r"%([\w.\-]+)", line.split("branch_computations=")[1].split("}")[0])
        else:
          branches = re.findall(r"(?:true|false)_computation=%([\w.\-]+)", line)
        worst = max(branches, key=lambda b: len(self.comps.get(b, [])))
        self._walk(worst, repeats)
        continue
      if op not in KERNELS:
        continue
      moved = array_bytes(m.group(2)) + sum(
          array_bytes(shapes.get(name, "")) for name in re.findall(r"%([\w.\-]+)", m.group(4)))
      dot = self._dot(line, shapes) + sum(self.dot_flops(c) for c in re.findall(r"calls=%([\w.\-]+)", line))
      frame = re.search(r"stack_frame_id=(\d+)", line)
      name = re.search(r'op_name="([^"]*)"', line)
      operation = re.sub(r"layer_\d+", "layer_N", name.group(1).split("/", 1)[-1]) if name else "?"
      where = self.where(int(frame.group(1))) if frame else "(outside electra_jax)"
      entry = self.by_source[(where, operation[-90:])]
      entry[0] += repeats * max(moved / self.bandwidth, dot / self.peak)
      entry[1] += repeats
      entry[2] += repeats * dot
      entry[3] += repeats * moved

  def totals(self):
    bound, launches, dot, moved = (sum(v[i] for v in self.by_source.values()) for i in range(4))
    return dict(bound_s=bound, launches=launches, dot_flops=dot, bytes=moved)
