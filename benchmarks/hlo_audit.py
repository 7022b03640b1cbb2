"""Reading an optimized HLO module (the text of `jax.jit(f).lower(...).compile().as_text()`):
the kernels it launches, counting while loops by their trip counts, the matmul FLOPs in them,
the bytes each kernel reads and writes (its operands and results), and a roofline bound
max(bytes / bandwidth, FLOPs / peak) per source operation. Used by compile_audit.py.

Matmuls are counted wherever XLA put them: `dot`s (inside Triton gemm fusions or alone), cuBLAS
calls (`__cublas$gemm`, `__cublas$lt$matmul`, read from their dot dimension numbers) and cuDNN's
fused attention (`__cudnn$fmha*`: 4 B N Tq Tk D forward, 2.5 times that backward, which
recomputes the scores). Bytes leave out a cuBLAS call's scratch workspace, and a fusion operand
that the fusion only slices or gathers from counts as the elements it takes.
"""

import collections
import math
import re

# HLO instructions that are kernels of their own on a GPU (everything else is metadata,
# a bitcast, a tuple, or is folded into one of these).
KERNELS = {
    "fusion",
    "custom-call",
    "dot",
    "copy",
    "sort",
    "scatter",
    "gather",
    "reduce",
    "transpose",
    "concatenate",
    "pad",
    "dynamic-update-slice",
    "dynamic-slice",
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "rng-bit-generator",
}
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}
_ARRAY = re.compile(r"\b(%s)\[([\d,]*)\]" % "|".join(_BYTES))
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z\-]+)\((.*?)\)(?:, |$)")
_CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul")
# Backward passes of flash attention take 2.5 times the forward's matmul FLOPs: the gradients
# of its two products (four matmuls) and the scores computed again (one more).
_FMHA_BACKWARD_FACTOR = 2.5


def _elements(dims: str) -> int:
  return math.prod(int(d) for d in dims.split(",") if d)


def _dims(shape_text: str) -> list[int]:
  """The dimensions of the first array in an HLO shape."""
  return [int(d) for d in _ARRAY.search(shape_text).group(2).split(",") if d]


def _contracted(line: str, lhs_dims: list[int], json_form: bool) -> int:
  """The product of the lhs contracting dimensions named in a dot's (or a cuBLAS call's) text."""
  if json_form:
    found = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', line).group(1)
    indices = re.findall(r"\d+", found)
  else:
    indices = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line).group(1).split(",")
  return math.prod(lhs_dims[int(i)] for i in indices if i)


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
    locations[int(i)] = (
        files[int(fields["file_name_id"])],
        functions[int(fields["function_name_id"])],
        int(fields["line"]),
    )
  frames = {
      int(i): tuple(int(v) for v in re.findall(r"=(\d+)", rest)) for i, rest in table("StackFrames")
  }

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
    """Matmul FLOPs of one instruction: a `dot` (2 x result elements x contracted elements),
    a cuBLAS call (the same, from its backend config) or cuDNN's fused attention; else 0."""
    m = _INSTRUCTION.match(line)
    if not m:
      return 0
    operands = re.findall(r"%([\w.\-]+)", m.group(4))
    if m.group(3) == "dot":
      return (
          2
          * _elements(_ARRAY.search(m.group(2)).group(2))
          * _contracted(line, _dims(shapes[operands[0]]), False)
      )
    if m.group(3) != "custom-call":
      return 0
    target = re.search(r'custom_call_target="([^"]*)"', line)
    target = target.group(1) if target else ""
    if target in _CUBLAS:  # result: (product, workspace)
      return (
          2
          * _elements(_ARRAY.search(m.group(2)).group(2))
          * _contracted(line, _dims(shapes[operands[0]]), True)
      )
    if target.startswith("__cudnn$fmha"):
      # Query and key come first, each [batch, seq, heads, head_dim].
      batch, q_len, heads, head_dim = _dims(shapes[operands[0]])
      forward = 4 * batch * heads * q_len * _dims(shapes[operands[1]])[1] * head_dim
      return int(forward * (_FMHA_BACKWARD_FACTOR if "Backward" in target else 1))
    return 0

  def _moved(self, m, line, shapes) -> int:
    """Bytes a kernel reads and writes: its results (less a custom call's scratch workspace,
    the u8/s8 array that ends its result tuple) and its operands, an operand that a fusion only
    slices or gathers from counted by what it takes."""
    results = _ARRAY.findall(m.group(2))
    if m.group(3) == "custom-call" and len(results) > 1 and results[-1][0] in ("u8", "s8"):
      results = results[:-1]
    moved = sum(_elements(dims) * _BYTES[dtype] for dtype, dims in results)
    fused = re.search(r"calls=%([\w.\-]+)", line) if m.group(3) == "fusion" else None
    sliced = self._sliced_parameters(fused.group(1)) if fused else {}
    for index, name in enumerate(re.findall(r"%([\w.\-]+)", m.group(4))):
      whole = array_bytes(shapes.get(name, ""))
      moved += min(
          sliced.get(index, whole), whole
      )  # overlapping gathers read no more than all of it
    return moved

  def _sliced_parameters(self, comp) -> dict[int, int]:
    """{parameter number: bytes read} for the parameters of fused computation `comp` that it
    reads only in part: through `slice`, `dynamic-slice` or `gather` (as the array they take
    from, perhaps after bitcasts), whose results are then what is read."""
    params, uses = {}, collections.defaultdict(list)
    for line in self.comps.get(comp, []):
      m = _INSTRUCTION.match(line)
      if not m:
        continue
      if m.group(3) == "parameter":
        params[m.group(1)] = int(m.group(4))
      for position, name in enumerate(re.findall(r"%([\w.\-]+)", m.group(4))):
        uses[name].append((m.group(3), position, m.group(1), array_bytes(m.group(2))))

    def partial_read(name, depth=0):  # bytes read, or None if some use reads it all
      total = 0
      for op, position, user, size in uses[name]:
        if op == "bitcast" and depth < 8:
          read = partial_read(user, depth + 1)
          if read is None:
            return None
          total += read
        elif op in ("slice", "dynamic-slice", "gather") and position == 0:
          total += size
        else:
          return None
      return total

    found = {index: partial_read(name) for name, index in params.items() if uses[name]}
    return {index: read for index, read in found.items() if read is not None}

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
      moved = self._moved(m, line, shapes)
      dot = self._dot(line, shapes) + sum(
          self.dot_flops(c) for c in re.findall(r"calls=%([\w.\-]+)", line)
      )
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
