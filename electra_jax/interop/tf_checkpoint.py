"""Official ELECTRA TF1 checkpoints (`model.ckpt-N`) read without TensorFlow: the V2 bundle's
`<prefix>.index` (a LevelDB table of name -> protobuf entry) and raw `<prefix>.data-*` files."""

import collections
import os
import pathlib
import re
import struct

import google_crc32c
import jax.numpy as jnp
import numpy as np

from electra_jax.data.sources import not_a_regular_file
from electra_jax.errors import ConfigError
from electra_jax.interop import hf

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_SIZE = 48
# tensorflow/core/framework/types.proto's numbers of the dtypes weights (and global_step) have.
_DTYPES = {1: np.float32, 2: np.float64, 3: np.int32, 9: np.int64, 14: jnp.bfloat16, 19: np.float16}
_OPTIMIZER_SLOT = re.compile(r"(/adam_[mv]|/Adam(_1)?|/Momentum|^global_step)$")


# Protocol buffers and LevelDB tables: just what a tensor bundle index uses.
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
  result = shift = 0
  while buf[pos] & 0x80:  # an IndexError past the end: a truncated varint
    result |= (buf[pos] & 0x7F) << shift
    pos, shift = pos + 1, shift + 7
  return result | buf[pos] << shift, pos + 1


def _proto_fields(buf: bytes):
  """(field number, value) pairs of a serialized protobuf message: ints, or bytes for
  length-delimited fields (a bundle's messages have no 64-bit fixed fields)."""
  pos = 0
  while pos < len(buf):
    key, pos = _varint(buf, pos)
    field, wire_type = key >> 3, key & 7
    if wire_type == 0:
      value, pos = _varint(buf, pos)
    elif wire_type == 2:
      length, pos = _varint(buf, pos)
      value, pos = buf[pos : pos + length], pos + length
    elif wire_type == 5:
      value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
    else:
      raise ValueError(f"unsupported protobuf wire type {wire_type}")
    yield field, value


def _block_entries(block: bytes):
  """(key, value) pairs of one table block (prefix-compressed keys, restart array at the end)."""
  num_restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
  end = len(block) - 4 - 4 * num_restarts
  pos, key = 0, b""
  while pos < end:
    shared, pos = _varint(block, pos)
    non_shared, pos = _varint(block, pos)
    value_length, pos = _varint(block, pos)
    key = key[:shared] + block[pos : pos + non_shared]
    pos += non_shared
    yield key, block[pos : pos + value_length]
    pos += value_length


def _masked_crc32c(data: bytes) -> int:
  """A crc32c in the masked form TensorFlow (and LevelDB) store it."""
  crc = google_crc32c.value(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _read_block(data: bytes, handle: bytes) -> bytes:
  """One table block, checked against the type byte (0: uncompressed, as TensorFlow writes index
  blocks) and masked crc32c that follow it."""
  offset, pos = _varint(handle, 0)
  size, _ = _varint(handle, pos)
  block, crc = data[offset : offset + size + 1], data[offset + size + 1 : offset + size + 5]
  if len(crc) != 4 or struct.unpack("<I", crc)[0] != _masked_crc32c(block) or block[-1] != 0:
    raise ValueError(f"the block at byte {offset} fails its checksum")
  return block[:-1]


def _table_items(data: bytes):
  if len(data) < _FOOTER_SIZE or struct.unpack_from("<Q", data, len(data) - 8)[0] != _TABLE_MAGIC:
    raise ValueError("no table footer")
  footer = data[-_FOOTER_SIZE:]
  _, pos = _varint(footer, 0)  # metaindex handle: offset ...
  _, pos = _varint(footer, pos)  # ... and size; nothing in it for bundles
  for _, handle in _block_entries(_read_block(data, footer[pos:])):
    yield from _block_entries(_read_block(data, handle))


TensorEntry = collections.namedtuple("TensorEntry", "dtype shape shard offset size crc32c slices")


def _tensor_entry(value: bytes) -> TensorEntry:
  # BundleEntryProto: 1 dtype, 2 shape, 3 shard, 4 offset, 5 size, 6 masked crc32c, 7 slices.
  fields = dict(_proto_fields(value))
  # TensorShapeProto: repeated Dim (field 2) of {size: 1}.
  dims = [dim for f, dim in _proto_fields(fields.get(2, b"")) if f == 2]
  shape = tuple(next((size for f, size in _proto_fields(dim) if f == 1), 0) for dim in dims)
  return TensorEntry(fields.get(1, 0), shape, *(fields.get(f, 0) for f in (3, 4, 5, 6, 7)))


class TFCheckpoint:
  """A TF V2 checkpoint, read lazily: `.entries` maps names to TensorEntry, `.read(name)` gives one
  array."""

  def __init__(self, prefix: str):
    self.prefix, index_path = prefix, prefix + ".index"
    try:
      items = dict(_table_items(pathlib.Path(index_path).read_bytes()))
      # The empty key's BundleHeaderProto: 1 num_shards, 2 endianness (0: little).
      header = dict(_proto_fields(items.pop(b"", b"")))
      self.entries = {key.decode("utf-8"): _tensor_entry(value) for key, value in items.items()}
    except (OSError, ValueError, IndexError, struct.error) as error:  # UnicodeDecodeError too
      raise ConfigError(
          f"{index_path} is not a readable TensorFlow checkpoint index ({error}): damaged, or "
          "another kind of file; copy the checkpoint again."
      ) from None
    if header.get(2, 0) != 0:
      raise ConfigError(f"{index_path}: a big-endian checkpoint; only little-endian is read.")
    self.num_shards = header.get(1, 1)

  def read(self, name: str) -> np.ndarray:
    entry = self.entries[name]
    if entry.slices:
      raise ConfigError(f"{self.prefix}: {name} is a partitioned (sliced) variable: not read here.")
    if entry.dtype not in _DTYPES:
      raise ConfigError(f"{self.prefix}: {name}'s TensorFlow dtype {entry.dtype} is not numeric.")
    dtype = np.dtype(_DTYPES[entry.dtype])
    if int(np.prod(entry.shape, dtype=np.int64)) * dtype.itemsize != entry.size:
      raise ConfigError(
          f"{self.prefix}: {name} claims shape {entry.shape} of {dtype} but {entry.size} bytes."
      )
    path = f"{self.prefix}.data-{entry.shard:05d}-of-{self.num_shards:05d}"
    if problem := not_a_regular_file(path):
      raise ConfigError(
          f"{path}, the data file {self.prefix}.index names for {name}, {problem}; copy every "
          "data file of the checkpoint beside its .index."
      )
    try:
      with open(path, "rb") as f:
        f.seek(entry.offset)
        raw = f.read(entry.size)
    except OSError as e:
      raise ConfigError(f"Cannot read the checkpoint data file {path} ({e}).") from e
    if len(raw) != entry.size or _masked_crc32c(raw) != entry.crc32c:
      raise ConfigError(
          f"{path} is truncated or damaged: {name}'s bytes {entry.offset}.."
          f"{entry.offset + entry.size} fail their checksum; copy the checkpoint again."
      )
    return np.frombuffer(raw, dtype=dtype).reshape(entry.shape).copy()


def resolve_prefix(path: str) -> str:
  """`model.ckpt-N` from a prefix, its .index file, or a directory (its highest-numbered
  model.ckpt-N: files named elsewhere, as by a `checkpoint` state file, are not followed)."""
  path = path.removesuffix(".index")
  if os.path.isfile(path + ".index"):
    return path
  steps = [
      (int(m[1]), name.removesuffix(".index"))
      for name in (os.listdir(path) if os.path.isdir(path) else [])
      if (m := re.fullmatch(r"model\.ckpt-(\d+)\.index", name))
  ]
  if not steps:
    raise ConfigError(
        f"{path} is not a TensorFlow checkpoint: give the prefix (e.g. "
        "electra_small/model.ckpt-1000000), its .index file, or the directory holding it."
    )
  return os.path.join(path, max(steps)[1])


# transformers' weight names -> the official code's, one substitution after another (a table is a
# bare variable: electra/embeddings/word_embeddings).
_OFFICIAL_RENAMES = (
    (r"^generator_lm_head\.bias$", "generator_predictions.output_bias"),
    (r"\.dense_prediction\.", ".dense_1."),
    (r"encoder\.layer\.(\d+)", r"encoder.layer_\1"),
    (r"LayerNorm\.weight$", "LayerNorm.gamma"),
    (r"LayerNorm\.bias$", "LayerNorm.beta"),
    (r"_embeddings\.weight$", "_embeddings"),
    (r"\.weight$", ".kernel"),
)


def official_name(hf_name: str, tower: str) -> str:
  """The official TF variable of `tower`'s transformers weight name (without "electra."): under
  "electra" (discriminator) or "generator", but the shared embeddings under "electra/embeddings"."""
  for pattern, replacement in _OFFICIAL_RENAMES:
    hf_name = re.sub(pattern, replacement, hf_name)
  name = hf_name.replace(".", "/")
  scope = name.split("/")[0]
  if scope.endswith("_predictions"):
    return name
  return f"{'electra' if scope == 'embeddings' or tower == 'discriminator' else 'generator'}/{name}"


def read_towers(prefix: str, num_heads: int | None = None):
  """{tower: (model, params)} of an official checkpoint, through hf.py's checks. Shapes hold no
  head count: the discriminator has `num_heads` (default hidden // 64), the generator its head's."""
  ckpt = TFCheckpoint(prefix)
  towers = {}
  for kind, scope in (("discriminator", "electra"), ("generator", "generator")):
    layers = {m[1] for n in ckpt.entries if (m := re.match(rf"{scope}/encoder/layer_(\d+)/", n))}
    projected = f"{scope}/embeddings_project/kernel" in ckpt.entries
    names = hf.weight_names(kind, len(layers), projected)
    towers[kind] = {official_name(n, kind): (n, path) for n, path in names.items()}
  expected = {name for names in towers.values() for name in names}
  held = {name for name in ckpt.entries if not _OPTIMIZER_SLOT.search(name)}
  if expected != held:
    raise ConfigError(
        f"{prefix} is not an official ELECTRA pre-training checkpoint (both towers; not another "
        f"objective such as Electric, nor a fine-tuned model): it lacks {sorted(expected - held)[:8]}"
        f" and holds {sorted(held - expected)[:8]} besides; electra-jax cannot represent it."
    )
  for kind, names in towers.items():
    weights = {n: hf.flip(path, ckpt.read(name)) for name, (n, path) in names.items()}
    sizes = hf.sizes_held(weights)
    if kind == "generator":
      num_heads = max(1, sizes["hidden_size"] // towers["discriminator"][0].config.head_dim)
    heads = num_heads or max(1, sizes["hidden_size"] // 64)
    hf_config = {"architectures": [hf.KINDS[kind][0]], **sizes, "num_attention_heads": heads}
    model = hf.model_from_hf_config(hf_config, prefix)[1]
    towers[kind] = (model, hf.params_from_hf_weights(model, kind, weights, prefix))
  return towers
