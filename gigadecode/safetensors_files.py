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

    Fails with a CheckpointError naming the file and tensor for what the safetensors library (and so
    transformers) refuses: a header that is not JSON, an entry whose dtype, shape or offsets are not what the
    format allows, tensors whose bytes overlap or leave bytes of the file unclaimed (a corrupt header), or
    bytes past the end of the file (a truncated download).
    """
    files = _checkpoint_files(model_dir)
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    index: dict[str, TensorEntry] = {}
    for f in files:
        for name, entry in _read_header(f).items():
            if name in index:
                raise CheckpointError(f"tensor {name!r} appears in both {index[name].file.name} and {f.name}")
            index[name] = entry
    return index


MAX_HEADER_BYTES = 100 * 1024**2        # the safetensors library's limit (a real checkpoint's is < 1 MiB)


def _is_count(v) -> bool:
    """A JSON integer >= 0 (the format's usize): not a bool, a float or a string."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_header(f: Path) -> dict[str, TensorEntry]:
    """One safetensors file's header -> its tensors, checked as the safetensors library checks them: the
    tensors' byte ranges tile the data section exactly (no overlap, no gap, nothing past its end)."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{f.name}: truncated file (no safetensors header)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > size - 8:
                raise CheckpointError(f"{f.name}: truncated file (header of {hlen} bytes, file is {size})")
            if hlen > MAX_HEADER_BYTES:
                raise CheckpointError(f"{f.name}: corrupt safetensors header (it claims {hlen} bytes, over the "
                                      f"format's limit of {MAX_HEADER_BYTES})")
            text = fh.read(hlen)
    except OSError as e:                 # a broken symlink (a blob missing from the HF cache), a directory, ...
        raise CheckpointError(f"{f.name}: cannot read it ({e.strerror or e})") from None
    try:
        header = json.loads(text, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f.name}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{f.name}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{f.name}: corrupt safetensors header (__metadata__ must be an object of strings)")
    data_size = size - 8 - hlen
    out: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, m in header.items():
        def corrupt(why: str) -> CheckpointError:
            return CheckpointError(f"{f.name}: corrupt safetensors header (entry {name!r}: {why})")
        if not isinstance(m, dict) or not {"dtype", "shape", "data_offsets"} <= m.keys():
            raise corrupt("needs dtype, shape and data_offsets")
        offsets, shape, dtype_name = m["data_offsets"], m["shape"], m["dtype"]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise corrupt(f"data_offsets must be two byte offsets >= 0, got {offsets!r}")
        if not (isinstance(shape, list) and all(map(_is_count, shape))):
            raise corrupt(f"shape must be a list of sizes >= 0, got {shape!r}")
        start, end = offsets
        if end > data_size or start > end:
            raise CheckpointError(f"tensor {name!r} in {f.name}: file truncated (data ends at byte {end} "
                                  f"of {data_size} present)")
        dt = ST_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dt is None:
            raise CheckpointError(f"tensor {name!r} in {f.name}: unsupported dtype {dtype_name}")
        if (end - start) != math.prod(shape) * dt.itemsize:
            raise CheckpointError(f"tensor {name!r} in {f.name}: {end - start} data bytes for shape {list(shape)} "
                                  f"of {dtype_name}")
        out[name] = TensorEntry(f, dt, tuple(shape), 8 + hlen + start)
        spans.append((start, end, name))
    at, last = 0, None                   # the byte ranges in order must tile [0, data_size)
    for start, end, name in sorted(spans):
        if start != at:
            what = (f"overlaps the bytes of {last!r}" if start < at else
                    f"leaves bytes {at}..{start} unclaimed")
            raise CheckpointError(f"tensor {name!r} in {f.name}: corrupt safetensors header (its data_offsets "
                                  f"[{start}, {end}] {what})")
        at, last = end, name
    if at != data_size:
        raise CheckpointError(f"{f.name}: corrupt safetensors header (its tensors claim {at} of the {data_size} "
                              f"data bytes in the file)")
    return out


def _no_constant(word: str):
    """json's hook for NaN / Infinity, which are not JSON (nor allowed in a safetensors header)."""
    raise ValueError(f"{word} is not a JSON value")


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
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise CheckpointError(f"{path.name}: not a safetensors index (no weight_map of tensor -> file: "
                              f"{type(e).__name__} {e})") from None
    if not shards:                      # transformers fails on it too (an IndexError)
        raise CheckpointError(f"{path.name}: its weight_map names no shard files")
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
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")   # the experts' matrices: MXFP4 (`*_blocks` + `*_scales`) or dense


def _probed_experts(num_experts: int) -> list[int]:
    """The experts whose values go into `weights_fingerprint`: the first, the middle and the last."""
    return sorted({0, num_experts // 2, num_experts - 1})


def _read_values(fh, e: TensorEntry, start: int, count: int, stride: int = 1) -> torch.Tensor:
    """`count` elements of tensor `e`, flat indices start, start + stride, ... (one contiguous read when
    stride is 1, else one read per element)."""
    out = torch.empty(count, dtype=e.dtype)
    size = out.element_size()
    if stride == 1:
        FileTensor(fh, TensorEntry(e.file, e.dtype, (count,), e.offset + start * size))._read(out)
        return out
    for k in range(count):
        FileTensor(fh, TensorEntry(e.file, e.dtype, (1,), e.offset + (start + k * stride) * size))._read(out[k:k + 1])
    return out


def _expert_probe(index: dict[str, TensorEntry], prefix: str, fhs: dict[Path, object]) -> bytes:
    """The bf16 values of the first 32 inputs of output 0 of experts 0, E/2 and E-1, for both expert matrices
    of the layer at `prefix` (`...mlp.experts.`), whatever form they are stored in. MXFP4 stores them as one
    group, `*_blocks [E, out, in/32, 16]` + `*_scales [E, out, in/32]`; the dense form `[E, in, out]` as a
    column (stride `out`). Decoding MXFP4 is exact, so an exact bf16 copy of MXFP4 experts probes the same."""
    from .mxfp4 import decode_mxfp4
    got = b""
    for w in EXPERT_WEIGHTS:
        blocks, scales, dense = (index.get(prefix + w + t) for t in ("_blocks", "_scales", ""))
        if blocks is not None and scales is not None:
            E, out_dim, groups = scales.shape[0], scales.shape[1], scales.shape[2]
            for x in _probed_experts(E):
                b = _read_values(fhs[blocks.file], blocks, x * out_dim * groups * 16, 16)
                s = _read_values(fhs[scales.file], scales, x * out_dim * groups, 1)
                got += decode_mxfp4(b.view(1, 16), s.view(1), torch.float32).to(torch.bfloat16).view(
                    torch.int16).numpy().tobytes()
        elif dense is not None and len(dense.shape) == 3:
            E, in_dim, out_dim = dense.shape
            for x in _probed_experts(E):
                col = _read_values(fhs[dense.file], dense, x * in_dim * out_dim, min(in_dim, 32), out_dim)
                got += col.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return got


def weights_fingerprint(model_dir: Path) -> str:
    """A short digest (16 hex chars) of a checkpoint's weights, for DI engines to check that they run the same
    model, not only the same config: the names and leading values of every tensor but the experts' matrices
    (of the expert biases, those of experts 0, E/2 and E-1), and a probe of each layer's expert matrices
    (`_expert_probe`: three experts' first MXFP4 group), as bf16. As values, not bytes: the same model written in fp32 or bf16, with MXFP4 or
    bf16 experts (an exact copy of the same values), has the same fingerprint; another fine-tune of the same
    config, experts-only included, does not."""
    import hashlib
    from contextlib import ExitStack
    h = hashlib.sha256()
    index = read_safetensors_index(Path(model_dir))

    def expert_matrix(name: str) -> bool:
        return ".mlp.experts." in name and name.split(".mlp.experts.")[1].removesuffix("_blocks").removesuffix(
            "_scales") in EXPERT_WEIGHTS

    with ExitStack() as files:
        fhs = {f: files.enter_context(open(f, "rb", buffering=0)) for f in sorted({e.file for e in index.values()})}
        for name in sorted(n for n in index if not expert_matrix(n)):
            e = index[name]
            if ".mlp.experts." in name and len(e.shape) >= 2:   # an expert bias [E, ...]: the probed experts'
                per = math.prod(e.shape[1:])
                starts = [x * per for x in _probed_experts(e.shape[0])] if per else [0]
            else:                                                # the tensor's leading values
                per, starts = math.prod(e.shape), [0]
            for start in starts:
                head = _read_values(fhs[e.file], e, start, min(per, FINGERPRINT_VALUES))
                h.update(name.encode() + b"\0" + head.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
        layers = sorted({n.split(".mlp.experts.")[0] for n in index if expert_matrix(n)})
        for layer in layers:
            h.update(layer.encode() + b"\0" + _expert_probe(index, layer + ".mlp.experts.", fhs))
    return h.hexdigest()[:16]
