"""The safetensors files of a checkpoint: their headers (`read_safetensors_index`, checked against the
files' sizes), their tensors' bytes read with plain file reads (`FileTensor`), and a digest of the weights'
values (`weights_fingerprint`, DI's check that two engines run the same model).

Plain reads rather than a memory map: a mapped file's pages count in the process's RSS while the mapping
is open (a whole ~2 GB shard of a 20b checkpoint on top of the stacks being filled); read into the
preallocated stacks, the bytes pass through the page cache only.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (names the tensor and what is wrong)."""


ST_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8,
    "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn, "I32": torch.int32, "I64": torch.int64,
    "F64": torch.float64,
}


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0              # byte offset of the tensor's data in `file`


def read_safetensors_index(model_dir: Path) -> dict[str, TensorEntry]:
    """Parse every *.safetensors header in the directory (no tensor data is read).

    Fails with a CheckpointError naming the file and tensor for a bad header or a tensor whose bytes lie
    past the end of its file (a truncated download).
    """
    files = _checkpoint_files(model_dir)
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    index: dict[str, TensorEntry] = {}
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{f.name}: truncated file (no safetensors header)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > size - 8:
                raise CheckpointError(f"{f.name}: truncated file (header of {hlen} bytes, file is {size})")
            try:
                header = json.loads(fh.read(hlen))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{f.name}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{f.name}: corrupt safetensors header (not a JSON object)")
        data_size = size - 8 - hlen
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                start, end = (int(x) for x in meta["data_offsets"])
                dtype_name, shape = meta["dtype"], tuple(int(x) for x in meta["shape"])
            except (TypeError, KeyError, ValueError) as e:
                raise CheckpointError(f"{f.name}: corrupt safetensors header (entry {name!r}: "
                                      f"{type(e).__name__} {e})") from None
            if end > data_size or start > end:
                raise CheckpointError(f"tensor {name!r} in {f.name}: file truncated (data ends at byte {end} "
                                      f"of {data_size} present)")
            dt = ST_DTYPES.get(dtype_name)
            if dt is None:
                raise CheckpointError(f"tensor {name!r} in {f.name}: unsupported dtype {dtype_name}")
            if (end - start) != math.prod(shape) * dt.itemsize:
                raise CheckpointError(f"tensor {name!r} in {f.name}: {end - start} data bytes for shape {list(shape)} "
                                      f"of {dtype_name}")
            if name in index:
                raise CheckpointError(f"tensor {name!r} appears in both {index[name].file.name} and {f.name}")
            index[name] = TensorEntry(f, dt, shape, 8 + hlen + start)
    return index


def _checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files that hold the checkpoint. With a `model.safetensors.index.json`, the files
    transformers reads: model.safetensors when there is one, else the shards the index names (a stray
    *.safetensors beside them, such as a shard of an earlier download, is left out, with a warning); without an
    index, every *.safetensors file (each tensor in one of them)."""
    every = sorted(model_dir.glob("*.safetensors"))
    if not (model_dir / "model.safetensors.index.json").is_file():
        return every
    single = model_dir / "model.safetensors"
    files = [single] if single.is_file() else [model_dir / f for f in sorted(_check_shard_index(model_dir))]
    left = [f.name for f in every if f not in files]
    if left:
        log.warning("%s: reading %s, as transformers does; not %s", model_dir,
                    single.name if single.is_file() else "the shards model.safetensors.index.json names",
                    ", ".join(left))
    return files


def _check_shard_index(model_dir: Path) -> set[str]:
    """A sharded checkpoint's `model.safetensors.index.json` -> the shard files it names; one that is missing
    (an incomplete download) is named, rather than reported as the first tensor it held."""
    path = model_dir / "model.safetensors.index.json"
    try:
        shards = {str(f) for f in json.loads(path.read_text())["weight_map"].values()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path.name}: not a safetensors index (no weight_map of tensor -> file: "
                              f"{type(e).__name__} {e})") from None
    missing = sorted(f for f in shards if not (model_dir / f).is_file())
    if missing:
        raise CheckpointError(f"{path.name} lists {len(missing)} shard file(s) missing from {model_dir}: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (an incomplete download?)")
    return shards


class FileTensor:
    """One checkpoint tensor of an open file (`fh`, unbuffered), read on demand."""

    def __init__(self, fh, entry: TensorEntry) -> None:
        self.fh, self.entry = fh, entry

    def read_into(self, dst: torch.Tensor) -> None:
        """Fill `dst` (a slot of the tensor's shape or broadcastable to it) with the tensor's values: straight
        into its memory when dtype and layout match, else through one transient of the tensor (casting)."""
        e = self.entry
        direct = dst.dtype == e.dtype and dst.is_contiguous() and tuple(dst.shape) == e.shape
        buf = dst if direct else torch.empty(e.shape, dtype=e.dtype)
        self._read(buf)
        if not direct:
            dst.copy_(buf)

    def _read(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if n == 0:
            return
        view = memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
        self.fh.seek(self.entry.offset)
        got = 0
        while got < n:
            k = self.fh.readinto(view[got:])
            if not k:
                raise CheckpointError(f"{self.entry.file.name}: file truncated while reading a tensor")
            got += k


FINGERPRINT_VALUES = 64     # leading values of each tensor that go into `weights_fingerprint`


def weights_fingerprint(model_dir: Path) -> str:
    """A short digest (16 hex chars) of a checkpoint's weights, for DI engines to check that they run the same
    model, not only the same config: the names and leading values of every tensor outside the MoE experts,
    as bf16. As values, not bytes: the same model written in fp32 or bf16, with MXFP4 or bf16 experts (an
    exact copy of the same values), has the same fingerprint; another fine-tune of the same config does not."""
    import hashlib
    h = hashlib.sha256()
    index = read_safetensors_index(Path(model_dir))
    for name in sorted(n for n in index if ".mlp.experts." not in n):
        e = index[name]
        n = min(math.prod(e.shape), FINGERPRINT_VALUES)
        head = torch.empty(n, dtype=e.dtype)
        with open(e.file, "rb", buffering=0) as fh:
            FileTensor(fh, TensorEntry(e.file, e.dtype, (n,), e.offset))._read(head)
        h.update(name.encode() + b"\0" + head.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]
