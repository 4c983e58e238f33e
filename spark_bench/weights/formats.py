"""Readers of model weight files: safetensors (one file, a sharded checkpoint with its index, or a directory) and GGUF.

Both are memory-mapped and lazy: opening reads the headers only (names, dtypes, shapes, offsets); `load(name)` reads
one tensor's bytes. A reader counts what it read (`bytes_read`, `tensors_read`) and which files it opened
(`files_opened`), so a test can check that benchmarking layer 12 of a 100 GB model reads layer 12 only.

Tensors come back as stored, never requantized: floats as torch tensors of their stored dtype, GGUF K-quants as uint8
block rows ([..., rows, cols/256*block_bytes], the layout plugins/quant/kquants.py and the GGUF kernels take).
Shapes are in torch order ([out, in]); GGUF's reversed ggml dims are turned around here.

Errors (missing file, truncated file, not a safetensors/GGUF file) are `WeightError`: one line naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spark_bench.weights.errors import WeightError

GGUF_MAGIC = b"GGUF"
INDEX_SUFFIX = ".index.json"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # bf16, f16, f32, f64, i8, i16, i32, i64, u8, bool, q2_k, q3_k, or another GGML type in lower case
    shape: tuple[int, ...]  # torch order; for K-quants the logical weight shape [..., rows, cols]
    nbytes: int
    file: str

    def describe(self) -> str:
        return f"{self.name} {self.dtype}{list(self.shape)}"


FLOAT_DTYPES = ("bf16", "f16", "f32")
_ST_DTYPES = {"BF16": "bf16", "F16": "f16", "F32": "f32", "F64": "f64", "I8": "i8", "I16": "i16", "I32": "i32",
              "I64": "i64", "U8": "u8", "BOOL": "bool", "F8_E4M3": "f8_e4m3", "F8_E5M2": "f8_e5m2"}
_ST_ITEM = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "u8": 1, "bool": 1,
            "f8_e4m3": 1, "f8_e5m2": 1}


class Reader:
    """What every format's reader offers."""

    format = "?"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bytes_read = 0
        self.tensors_read: list[str] = []
        self.files_opened: set[str] = set()
        self._infos: dict[str, TensorInfo] = {}

    def names(self) -> list[str]:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo | None:
        return self._infos.get(name)

    def metadata(self) -> dict[str, Any]:
        return {}

    def files(self) -> list[Path]:
        return [self.path]

    def load(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes as stored (for the content hash)."""
        t = self.load(name)
        return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")

    def _count(self, name: str, nbytes: int) -> None:
        self.bytes_read += nbytes
        self.tensors_read.append(name)


# --- safetensors -----------------------------------------------------------------------------------------------
class SafetensorsReader(Reader):
    """A .safetensors file, an `*.safetensors.index.json` (shards named by its weight_map, opened only when one of
    their tensors is read), or a directory holding either."""

    format = "safetensors"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise WeightError("reading safetensors checkpoints needs the `safetensors` package: "
                              "pip install 'spark-bench[weights]'") from None
        self._shard_of: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        if path.name.endswith(INDEX_SUFFIX):
            self._read_index(path)
        else:
            self._read_header(path)
        self.root = path.parent

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightError(f"{index}: not a safetensors index (no readable weight_map: {exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightError(f"{index}: not a safetensors index (weight_map must map tensor names to shard files)")
        self._shard_files = sorted({index.parent / f for f in weight_map.values()})
        for name, shard in weight_map.items():
            self._shard_of[name] = index.parent / shard

    def _open(self, shard: Path):
        from safetensors import SafetensorError, safe_open

        if shard not in self._handles:
            if not shard.is_file():
                raise WeightError(f"{shard}: no such safetensors shard (named by {self.path})")
            try:
                handle = safe_open(str(shard), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise WeightError(f"{shard}: not a valid safetensors file ({_one_line(exc)}; truncated?)") from None
            self._handles[shard] = handle
            self.files_opened.add(str(shard))
            for name in handle.keys():
                sl = handle.get_slice(name)
                dtype = _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype().lower())
                shape = tuple(int(s) for s in sl.get_shape())
                self._infos[name] = TensorInfo(name, dtype, shape, int(np.prod(shape)) * _ST_ITEM.get(dtype, 1),
                                               str(shard))
                self._shard_of.setdefault(name, shard)
        return self._handles[shard]

    def _read_header(self, path: Path) -> None:
        self._shard_files = [path]
        self._open(path)

    def names(self) -> list[str]:
        return list(self._shard_of)

    def info(self, name: str) -> TensorInfo | None:
        if name not in self._shard_of:
            return None
        if name not in self._infos:
            self._open(self._shard_of[name])  # the header of the shard that holds it
            if name not in self._infos:
                raise WeightError(f"{self._shard_of[name]}: has no tensor {name}, but {self.path} says it does")
        return self._infos[name]

    def files(self) -> list[Path]:
        return list(self._shard_files)

    def metadata(self) -> dict[str, Any]:
        config = self.root / "config.json"
        if config.is_file():
            try:
                meta = json.loads(config.read_text())
            except ValueError as exc:
                raise WeightError(f"{config}: not valid JSON ({_one_line(exc)})") from None
            if not isinstance(meta, dict):
                raise WeightError(f"{config}: expected a JSON object (a model config), got {type(meta).__name__}")
            return meta
        return {}

    def load(self, name: str) -> torch.Tensor:
        info = self.info(name)
        if info is None:
            raise KeyError(name)
        tensor = self._open(self._shard_of[name]).get_tensor(name)
        self._count(name, info.nbytes)
        return tensor


# --- GGUF ------------------------------------------------------------------------------------------------------
class GGUFReader(Reader):
    """A GGUF file, through the `gguf` package's memory-mapped reader; tensor bytes are copied out one tensor at a
    time, only when loaded."""

    format = "gguf"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            import gguf  # noqa: F401 - present, or a clear error now
        except ImportError:
            raise WeightError("reading GGUF files needs the `gguf` package: pip install 'spark-bench[peers]'") from None
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise WeightError(f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")
        size = path.stat().st_size
        try:
            self._reader = _TruncationTolerantReader(str(path), "r")
        except (ValueError, IndexError, KeyError, OSError, TypeError) as exc:  # KeyError: a key stored twice
            raise WeightError(f"{path}: corrupt or truncated GGUF file ({_one_line(exc)})") from None
        self.files_opened.add(str(path))
        self._tensors = {}
        for t in self._reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise WeightError(f"{path}: truncated: tensor {t.name} ends at byte {end} but the file has {size}")
            dtype = t.tensor_type.name.lower()
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self._infos[t.name] = TensorInfo(t.name, dtype, shape, int(t.n_bytes), str(path))
            self._tensors[t.name] = t

    def metadata(self) -> dict[str, Any]:
        out = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF.") or key.startswith("tokenizer."):
                continue
            try:
                out[key] = field.contents()
            except Exception:  # noqa: BLE001 - an odd field is simply not offered
                continue
        return out

    def _bytes(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        start = int(t.data_offset)
        return self._reader.data[start:start + int(t.n_bytes)]  # a view of the memory map: nothing read yet

    def raw(self, name: str) -> memoryview:
        view = self._bytes(name)
        self._count(name, view.nbytes)
        return memoryview(np.ascontiguousarray(view)).cast("B")

    def load(self, name: str) -> torch.Tensor:
        info = self._infos[name]
        data = np.array(self._bytes(name))  # the one copy out of the map
        self._count(name, data.nbytes)
        raw = torch.from_numpy(data)
        if info.dtype in ("f32", "f16", "bf16", "i8", "i16", "i32", "i64", "f64"):
            torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i8": torch.int8,
                           "i16": torch.int16, "i32": torch.int32, "i64": torch.int64, "f64": torch.float64}
            return raw.view(torch_dtype[info.dtype]).reshape(info.shape)
        rows = info.shape[:-1]
        return raw.reshape(*rows, -1)  # quantized: [..., rows, bytes per row]


def _tolerant_reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        """gguf's reader, except that a tensor cut short by a truncated file gets a placeholder view (zero strides:
        no memory) instead of a reshape error, so the size check above can name the tensor; a header that runs past
        the end of the file (a corrupt count or length) is a ValueError."""

        _tensor_data = False

        def _build_tensors(self, start_offs, fields):
            self._tensor_data = True
            super()._build_tensors(start_offs, fields)

        def _get(self, offset, dtype, count=1, override_order=None):
            try:
                arr = super()._get(offset, dtype, count, override_order)
            except ValueError:  # less than one item left
                arr = np.empty(0, dtype=dtype)
            if arr.size < int(count):
                if not self._tensor_data:
                    raise ValueError(f"its header runs past the end of the file (at byte {offset})")
                return np.broadcast_to(np.zeros(1, dtype=arr.dtype), (int(count),))
            return arr

    return Reader


def _TruncationTolerantReader(*args):  # noqa: N802 - a class made on first use (gguf is optional)
    return _tolerant_reader_class()(*args)


# --- opening -----------------------------------------------------------------------------------------------------
def open_weights(path: str | os.PathLike) -> Reader:
    """The reader of `path`: a .gguf or .safetensors file (judged by its first bytes, not its name), a safetensors
    index, or a directory with one of those."""
    p = Path(path)
    if not p.exists():
        raise WeightError(f"{p}: no such weight file or directory")
    if p.is_dir():
        return open_weights(_pick_in_dir(p))
    if p.name.endswith(INDEX_SUFFIX) or p.suffix == ".json":
        return SafetensorsReader(p)
    with open(p, "rb") as f:
        head = f.read(9)
    if head[:4] == GGUF_MAGIC:
        return GGUFReader(p)
    if p.suffix == ".gguf":
        raise WeightError(f"{p}: not a GGUF file (starts with {head[:4]!r}, not {GGUF_MAGIC!r})")
    if len(head) >= 9 and head[8:9] == b"{":
        return SafetensorsReader(p)
    raise WeightError(f"{p}: neither a safetensors nor a GGUF file (starts with {head[:8]!r})")


def _pick_in_dir(d: Path) -> Path:
    indexes = sorted(d.glob(f"*{INDEX_SUFFIX}"))
    if len(indexes) == 1:
        return indexes[0]
    singles = sorted(d.glob("*.safetensors")) + sorted(d.glob("*.gguf"))
    if len(indexes) > 1 or len(singles) != 1:
        found = [x.name for x in indexes + singles] or ["nothing"]
        raise WeightError(f"{d}: expected one *.safetensors (or *{INDEX_SUFFIX}) or *.gguf file, found "
                          f"{', '.join(found[:6])}; name the file")
    return singles[0]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]
