"""Rotary position embedding: YaRN inverse frequencies and the GPT-OSS (half-split) rotation.

YaRN (as transformers computes it): frequencies of the low-rotation dims are interpolated (divided by
`factor`), high-rotation dims are kept, with a linear ramp between the dims that turn `beta_fast` and
`beta_slow` times over `original_max_position_embeddings` (floored/ceiled when `truncate`). cos and
sin are multiplied by the attention factor `0.1 * ln(factor) + 1`. Linear scaling divides every frequency by
`factor`.
"""

from __future__ import annotations

import math

import torch

from .config import GptOssConfig, yarn_mscale


def rope_inv_freq(cfg: GptOssConfig) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim/2] fp32, attention scaling)."""
    r, dim = cfg.rope, cfg.head_dim
    pos_freqs = r.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if r.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if r.rope_type == "linear":                   # positions / factor
        return 1.0 / pos_freqs / r.factor, 1.0
    factor = r.factor
    attn = float(r.attention_factor) if r.attention_factor is not None else yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(r.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp          # 1 = keep the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attn


class Rope:
    """cos/sin tables for positions; computed in fp32 like transformers, cast to the compute dtype."""

    def __init__(self, cfg: GptOssConfig, dtype: torch.dtype) -> None:
        self.inv_freq, self.scaling = rope_inv_freq(cfg)
        self.dtype = dtype

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> cos, sin [T, head_dim/2]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.scaling).to(self.dtype), (freqs.sin() * self.scaling).to(self.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, d/2]. Rotates the first half against the second half."""
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
