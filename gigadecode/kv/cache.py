"""KV buffers: one allocation per HMA buffer, the packed-FP8 K view, and token writes/reads.

`initialize_kv_cache` allocates `group_bufs[i] : [2, num_blocks, kv, block, d]` for each buffer i
(K = `[0]`, V = `[1]`). With the FP8 cache (e4m3, per-tensor `k_scale`/`v_scale`, stored = x / scale)
K is used through the trailing packed view `[num_blocks, kv, block//2, d, 2]`: element
`[b, h, p, j, s]` is token `2p + s`, dim j of block b (token pairs interleaved per dim). V is never
packed. Other KV dtypes keep K token-major `[num_blocks, kv, block, d]`.

Writes go through a uint8 view for FP8 (CPU float8 lacks index_copy_/scatter_); reads return the
compute dtype. Slot of token at position p in a block table: `table[p // block] * block + p % block`.
"""

from __future__ import annotations

import math

import torch

from ..config import ConfigError, GptOssConfig
from ..engine_config import EngineConfig
from .spec import KVCacheConfig, get_kv_spec, make_kv_cache_config

FP8 = torch.float8_e4m3fn
MAX_DMA_OFFSET = 2**32  # one buffer's element offset must stay below this (the seed's uint32 DMA offset)


def pack_k_view(k: torch.Tensor) -> torch.Tensor:
    """[nb, kv, block, d] K storage -> packed view [nb, kv, block//2, d, 2] (same bytes)."""
    nb, kv, block, d = k.shape
    return k.view(nb, kv, block // 2, d, 2)


def token_major_to_packed(x: torch.Tensor) -> torch.Tensor:
    """[..., block, d] token-major -> [..., block//2, d, 2] packed (a copy)."""
    *lead, block, d = x.shape
    return x.reshape(*lead, block // 2, 2, d).transpose(-1, -2).contiguous()


def packed_to_token_major(x: torch.Tensor) -> torch.Tensor:
    """[..., block//2, d, 2] packed -> [..., block, d] token-major (a copy)."""
    *lead, half, d, two = x.shape
    return x.transpose(-1, -2).reshape(*lead, half * 2, d)


class KVCache:
    """The buffers of one engine (one rank). Attributes `K_cache_buf_i` / `V_cache_buf_i` are the views."""

    def __init__(self, cfg: GptOssConfig, ecfg: EngineConfig, num_blocks: int, num_kv_heads: int | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.cfg, self.ecfg = cfg, ecfg
        self.block_size = ecfg.block_size
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads or cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.storage_dtype = ecfg.kv_storage_dtype()
        self.compute_dtype = ecfg.torch_dtype
        self.fp8 = self.storage_dtype == FP8
        self.packed = self.fp8
        self.k_scale, self.v_scale = (ecfg.k_scale, ecfg.v_scale) if self.fp8 else (1.0, 1.0)
        itemsize = torch.empty((), dtype=self.storage_dtype).element_size()
        self.specs = get_kv_spec(cfg, self.block_size, itemsize, self.num_kv_heads)
        self.config: KVCacheConfig = make_kv_cache_config(self.specs, num_blocks)
        check_buffer_offset(num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        shape = (2, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        check_fits_memory(self.config.group_size * math.prod(shape) * itemsize, num_blocks, self.block_size)
        # One allocation per buffer (zeros: the null block and unwritten slots read as 0, never NaN).
        self.group_bufs = [torch.zeros(shape, dtype=self.storage_dtype, device=device)
                           for _ in range(self.config.group_size)]

    # -- views ---------------------------------------------------------------------------------------
    def k_buf(self, buffer: int) -> torch.Tensor:
        """K of a buffer: packed [nb, kv, block//2, d, 2] for fp8, else [nb, kv, block, d]."""
        k = self.group_bufs[buffer][0]
        return pack_k_view(k) if self.packed else k

    def v_buf(self, buffer: int) -> torch.Tensor:
        return self.group_bufs[buffer][1]

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.config.layer_buffer[layer]
        return self.k_buf(b), self.v_buf(b)

    def bind_map(self) -> dict[int, list[torch.Tensor]]:
        """{layer: [k, v]} as the generic `bind_kv_cache` signature takes it."""
        return {layer: list(self.layer_kv(layer)) for layer in range(self.cfg.num_hidden_layers)}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.group_bufs)

    # -- writes / reads ----------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [T] (block*block_size + offset); k, v [T, kv, d] in the compute dtype."""
        kb, vb = self.layer_kv(layer)
        write_kv(kb, vb, slots, k, v, self.block_size, self.k_scale, self.v_scale)

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids [nb] -> k, v [nb*block, kv, d] in the compute dtype (token-major)."""
        kb, vb = self.layer_kv(layer)
        return gather_kv(kb, vb, block_ids, self.compute_dtype, self.k_scale, self.v_scale)


MEMINFO = "/proc/meminfo"
CGROUP_DIR = "/sys/fs/cgroup"


def available_memory() -> int | None:
    """Bytes this process may still allocate: the kernel's MemAvailable, or less under a cgroup memory limit
    (the limit less what the cgroup holds, its page cache aside: memory.current counts the file pages a
    checkpoint's read leaves, which the kernel reclaims before it fails an allocation, as MemAvailable counts
    them free); None where neither can be read (not Linux)."""
    got = []
    try:
        with open(MEMINFO) as f:
            got += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = open(f"{CGROUP_DIR}/memory.max").read().strip()
        if limit != "max":
            cache = 0
            try:
                with open(f"{CGROUP_DIR}/memory.stat") as f:
                    cache = sum(int(line.split()[1]) for line in f
                                if line.split()[:1] in (["active_file"], ["inactive_file"]))
            except (OSError, ValueError, IndexError):
                pass
            got.append(int(limit) - int(open(f"{CGROUP_DIR}/memory.current").read()) + cache)
    except (OSError, ValueError):
        pass
    return min(got) if got else None


def check_fits_memory(nbytes: int, num_blocks: int, block_size: int) -> None:
    """A pool larger than the memory left is refused with its size (the allocation zeroes every page: the
    kernel's OOM killer would end the process without a word)."""
    free = available_memory()
    if free is not None and nbytes > free:
        size = lambda n: f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"  # noqa: E731
        raise ConfigError(f"the KV pool ({num_blocks} blocks of {block_size} tokens) needs {size(nbytes)}, and this "
                          f"machine has {size(free)} available: lower --num-blocks or --kv-budget-gib")


def check_buffer_offset(num_blocks: int, kv: int, block: int, d: int) -> int:
    """Largest element offset into one buffer half; must stay below 2**32 (the seed's DMA limit)."""
    off = num_blocks * kv * block * d
    if off >= MAX_DMA_OFFSET:
        raise ValueError(f"KV buffer element offset {off} >= 2**32 (num_blocks={num_blocks}); "
                         f"lower num_blocks or the block size")
    return off


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype == FP8:
        return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)
    return x.to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if x.dtype == FP8:
        y = x.to(torch.float32)
        return (y * scale).to(dtype) if scale != 1.0 else y.to(dtype)
    return x.to(dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Writable view: uint8 for fp8 (CPU float8 lacks most in-place index ops)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def write_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             block_size: int, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write tokens into one buffer. k_buf packed [nb, kv, B/2, d, 2] or [nb, kv, B, d]; v_buf [nb, kv, B, d]."""
    blk, off = slots // block_size, slots % block_size
    kq = _raw(quantize(k, k_buf.dtype, k_scale))             # [T, kv, d]
    vq = _raw(quantize(v, v_buf.dtype, v_scale))
    kr, vr = _raw(k_buf), _raw(v_buf)
    if k_buf.dim() == v_buf.dim() + 1:                       # packed K
        kr[blk, :, off // 2, :, off % 2] = kq                # advanced dims first: [T, kv, d]
    else:
        kr[blk, :, off, :] = kq
    vr[blk, :, off, :] = vq


def gather_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype,
              k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> k, v [nb*B, kv, d] token-major in `dtype`."""
    kb = k_buf.index_select(0, block_ids)
    vb = v_buf.index_select(0, block_ids)                    # [nb, kv, B, d]
    if k_buf.dim() == v_buf.dim() + 1:
        kb = packed_to_token_major(kb)                        # [nb, kv, B, d]
    k = dequantize(kb, dtype, k_scale).transpose(1, 2).flatten(0, 1)
    v = dequantize(vb, dtype, v_scale).transpose(1, 2).flatten(0, 1)
    return k, v
