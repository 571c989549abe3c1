"""KV-cache specs per layer and the hybrid (HMA) grouping into shared buffers.

`get_kv_spec` is honest per layer: sliding layers report their window, full layers full attention.
`group_kv_specs` groups layers by spec (vLLM's hybrid KV-cache manager): each group is one kind of
layer, `group_size` layers long, and buffer j is shared by the j-th layer of every group. For GPT-OSS
(alternating sliding/full) that is 2 groups of L/2 and buffer i `shared_by = [2i, 2i+1]`, so a layer
finds its block table by group (`i % 2`) and its buffer by `i // 2`. A block id belongs to one group;
in every buffer it holds that group's layer's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import GptOssConfig
from .dcp import TokenShard


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AttentionSpec:
    """What every kind of attention layer's KV shares: its block geometry."""

    block_size: int
    num_kv_heads: int
    head_size: int
    itemsize: int

    @property
    def page_size_bytes(self) -> int:
        """K and V of one block of one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.itemsize


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token stays visible."""

    def max_blocks(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def peak_blocks(self, num_tokens: int, chunk: int, tokens: TokenShard | None = None) -> int:
        """Most blocks a request of `num_tokens` tokens holds at once, prefilled `chunk` tokens a step (on
        every rank of a DCP group: `tokens`, see `kv.manager`)."""
        return cdiv(tokens.most(num_tokens) if tokens else num_tokens, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A query sees its window: the W-1 tokens before it and itself."""

    sliding_window: int = 128

    def max_blocks(self, num_tokens: int) -> int:
        # Blocks that can hold a live token: the window's W-1 earlier tokens plus the current one.
        return min(cdiv(num_tokens, self.block_size), cdiv(self.sliding_window - 1, self.block_size) + 1)

    def peak_blocks(self, num_tokens: int, chunk: int, tokens: TokenShard | None = None) -> int:
        if tokens is None or tokens.trivial:
            # a chunk's tokens plus the window's W-1 before it, at any block alignment
            return min(cdiv(num_tokens, self.block_size),
                       cdiv(self.sliding_window - 1 + chunk, self.block_size) + 1)
        # DCP: a step from c to c + chunk holds local blocks [least(c-W+1) // B, cdiv(most(c + chunk), B));
        # the count is periodic in c (period I·N) but for the clip at num_tokens: try both ends
        B, W, n = self.block_size, self.sliding_window, num_tokens
        span = W + chunk + 2 * tokens.period
        starts = set(range(min(n, span))) | set(range(max(0, n - span), n))

        def held(c: int) -> int:
            return cdiv(tokens.most(min(n, c + chunk)), B) - tokens.least(max(0, c - W + 1)) // B
        return max((held(c) for c in starts), default=0)


KVSpec = FullAttentionSpec | SlidingWindowSpec


def get_kv_spec(cfg: GptOssConfig, block_size: int, itemsize: int, num_kv_heads: int | None = None) -> dict[int, KVSpec]:
    """layer -> its spec (sliding layers report the window)."""
    kv = num_kv_heads or cfg.num_key_value_heads
    out: dict[int, KVSpec] = {}
    for i in range(cfg.num_hidden_layers):
        if cfg.is_sliding(i):
            out[i] = SlidingWindowSpec(block_size, kv, cfg.head_dim, itemsize, cfg.attention_window)
        else:
            out[i] = FullAttentionSpec(block_size, kv, cfg.head_dim, itemsize)
    return out


@dataclass(frozen=True)
class KVCacheTensor:
    """One buffer allocation and the layers that share it."""

    size: int                     # bytes
    shared_by: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    layers: tuple[int, ...]
    spec: KVSpec


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...]
    tensors: tuple[KVCacheTensor, ...]
    layer_group: tuple[int, ...]    # layer -> group index (its block table / write index)
    layer_buffer: tuple[int, ...]   # layer -> buffer index

    @property
    def group_size(self) -> int:
        return len(self.tensors)


def group_kv_specs(specs: dict[int, KVSpec]) -> tuple[list[KVCacheGroupSpec], list[list[int]]]:
    """Group layers by spec -> (groups, buffers) with buffers[j] = layers sharing buffer j."""
    by_spec: dict[KVSpec, list[int]] = {}
    for layer in sorted(specs):
        by_spec.setdefault(specs[layer], []).append(layer)
    # Sliding first (the seed's order: group 0 = sliding, group 1 = full).
    kinds = sorted(by_spec.items(), key=lambda kv: (not isinstance(kv[0], SlidingWindowSpec), kv[1][0]))
    group_size = min(len(layers) for _, layers in kinds)
    groups: list[KVCacheGroupSpec] = []
    for spec, layers in kinds:
        for s in range(0, len(layers), group_size):
            groups.append(KVCacheGroupSpec(tuple(layers[s: s + group_size]), spec))
    buffers = [[g.layers[j] for g in groups if j < len(g.layers)] for j in range(group_size)]
    return groups, buffers


def make_kv_cache_config(specs: dict[int, KVSpec], num_blocks: int) -> KVCacheConfig:
    groups, buffers = group_kv_specs(specs)
    n = len(specs)
    layer_group, layer_buffer = [0] * n, [0] * n
    for gi, g in enumerate(groups):
        for j, layer in enumerate(g.layers):
            layer_group[layer], layer_buffer[layer] = gi, j
    page = next(iter(specs.values())).page_size_bytes
    tensors = tuple(KVCacheTensor(page * num_blocks, tuple(b)) for b in buffers)
    return KVCacheConfig(num_blocks, tuple(groups), tensors, tuple(layer_group), tuple(layer_buffer))
