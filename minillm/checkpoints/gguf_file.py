"""Reading a GGUF file's metadata and tensor table by walking its bytes.

A GGUF file is: the magic "GGUF", a version, the tensor and key/value counts; the key/value metadata
(config and tokenizer); a table with each tensor's name, dims, ggml type and offset; padding to
`general.alignment`; then the tensors' bytes. `gguf.GGUFReader` reads the same, but builds numpy views
for every string of the vocabulary and merges (7.5 s for SmolLM2's 49K tokens on a busy 2-core
machine, 13 s for Llama-3's 128K); walking the bytes takes a fraction of a second, which matters since
a pulled SmolLM2 is loaded from its GGUF every time (pull.py).

`GGUFFile` offers what minillm uses of GGUFReader, with the same meanings: `fields[key].contents()`,
and `tensors`, each with `name`, `tensor_type`, `shape` (GGUF order: fastest-varying dim first) and
`data` (a read-only view of the file: float arrays for float types, the raw block bytes [rows, bytes]
for quantized ones), which `gguf.quants.dequantize` takes as it takes GGUFReader's.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGUF metadata value types: struct format of each scalar type; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml types stored as plain numbers (GGUFReader gives these as typed arrays); the rest are blocks
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


class _Walker:
    """Reads values one after another from the file's bytes; ValueError names the file on garbage."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def fail(self, what: str):
        raise ValueError(f"{self.path}: truncated or corrupt GGUF {what}")

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            self.fail("file (it ends early)")
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        if n > len(self.buf) - self.pos:       # a garbled length: stop here, not read (or loop) past the end
            self.fail("metadata (a string runs past the end)")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, n = self.unpack("<IQ")
            if n > len(self.buf) - self.pos:        # every element takes at least one byte
                self.fail(f"metadata (an array of {n} values)")
            if elem in _SCALARS and elem != 7:      # numbers: one bulk read
                dtype = np.dtype(_SCALARS[elem])
                if n * dtype.itemsize > len(self.buf) - self.pos:
                    self.fail(f"metadata (an array of {n} values)")
                arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
                self.pos += n * dtype.itemsize
                return arr.tolist()
            return [self.value(elem) for _ in range(n)]
        if kind not in _SCALARS:
            self.fail(f"metadata (unknown value type {kind})")
        return self.unpack(_SCALARS[kind])[0]


def read_header(buf, path: Path) -> tuple[dict, _Walker, int]:
    """(metadata, a walker at the start of the tensor table, the tensor count) of a GGUF file's bytes."""
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    walk = _Walker(buf, path)
    walk.pos = 4
    version, n_tensors, n_kv = walk.unpack("<IQQ")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is too old (need 2 or later)")
    meta = {}
    for _ in range(n_kv):
        key = walk.string()
        (kind,) = walk.unpack("<I")
        meta[key] = walk.value(kind)
    return meta, walk, n_tensors


def read_metadata(path: str | Path) -> dict:
    """The key/value metadata at the head of a GGUF file, without touching the tensors."""
    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return read_header(buf, path)[0]


@dataclass
class Field:
    value: object

    def contents(self):
        return self.value


@dataclass
class Tensor:
    name: str
    tensor_type: object             # gguf.GGMLQuantizationType
    shape: np.ndarray               # GGUF order: [ne0 (fastest), ne1, ...]
    data: np.ndarray


class GGUFFile:
    """A GGUF file's `fields` and `tensors` (see the module docstring), its data memory-mapped."""

    def __init__(self, path: str | Path):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        meta, walk, n_tensors = read_header(self.data, self.path)
        self.fields = {key: Field(value) for key, value in meta.items()}
        table = []
        for _ in range(n_tensors):
            name = walk.string()
            (n_dims,) = walk.unpack("<I")
            if n_dims > 8:
                walk.fail(f"tensor table ({name} has {n_dims} dims)")
            dims = walk.unpack(f"<{n_dims}Q")
            kind, offset = walk.unpack("<IQ")
            try:
                table.append((name, dims, GGMLQuantizationType(kind), offset))
            except ValueError:
                walk.fail(f"tensor table ({name} has unknown type {kind})")
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            walk.fail("metadata (general.alignment is not a power of two)")
        start = -(-walk.pos // alignment) * alignment
        self.tensors = [self._tensor(start, *entry, GGML_QUANT_SIZES) for entry in table]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            walk.fail("tensor table (a tensor name appears twice)")

    def _tensor(self, start: int, name: str, dims: tuple, kind, offset: int, sizes) -> Tensor:
        n = math.prod(dims)                                              # Python ints: lying dims cannot wrap
        rows = tuple(reversed(dims))                                     # numpy order: slowest dim first
        block, block_bytes = sizes[kind]
        plain = _PLAIN.get(kind.name)
        dtype, shape = (plain, rows) if plain else (np.uint8, rows[:-1] + (rows[-1] // block * block_bytes,))
        nbytes = n * block_bytes // block
        begin = start + offset
        if rows and rows[-1] % block or begin + nbytes > len(self.data):
            raise ValueError(f"{self.path}: truncated or corrupt GGUF file (tensor {name} lies past the end "
                             f"or does not fill whole blocks)")
        data = np.frombuffer(self.data, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize, offset=begin)
        return Tensor(name, kind, np.array(dims, dtype=np.uint64), data.reshape(shape))


# ---- dequantizing the two block types SmolLM2's GGUF uses, without gguf.quants' temporaries -----------
# The same float32 arithmetic as gguf.quants (d * q + m, d * q), so the same bits; half the time, which
# counts because a pulled SmolLM2 is dequantized at every load. Other types go through gguf.quants.

def dequantize(data: np.ndarray, kind) -> np.ndarray:
    """float32 values of a tensor's `data` as GGUFFile gives it ([rows, bytes] for block types)."""
    fast = _FAST.get(getattr(kind, "name", None))
    if fast is None:
        from gguf.quants import dequantize as reference
        return reference(data, kind)
    *rows, row_bytes = data.shape
    block_bytes, block = fast[1], fast[2]
    out = np.empty((*rows, row_bytes // block_bytes * block), np.float32)   # owns its memory: no copy later
    fast[0](np.ascontiguousarray(data).reshape(-1, block_bytes), out.reshape(-1, block))
    return out


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_1: fp16 d, fp16 m, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31.
    blocks [n_blocks, 20] -> out [n_blocks, 32]."""
    d, m, qs = _scale(blocks, 0), _scale(blocks, 2), blocks[:, 4:]
    np.bitwise_and(qs, 15, out=out[:, :16], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, 16:], casting="unsafe")
    out *= d
    out += m


def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q8_0: fp16 d, then 32 int8 values. blocks [n_blocks, 34] -> out [n_blocks, 32]."""
    np.copyto(out, blocks[:, 2:].view(np.int8), casting="unsafe")
    out *= _scale(blocks, 0)


_FAST = {"Q4_1": (_q4_1, 20, 32), "Q8_0": (_q8_0, 34, 32)}
