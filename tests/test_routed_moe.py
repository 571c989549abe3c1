"""The routed MoE's two ways of multiplying an expert (`gigadecode.routed_moe`): the grouped MXFP4 kernel, and
for experts with many tokens on AMX CPUs the bf16 GEMM over the expert decoded once (`DENSE_BF16_EXPERTS`,
forced on here so every CPU checks it). Both against the fp32 torch reference (`ops.moe_tokens`), with the
experts split between the two ways, under EP offsets, and with no expert big enough."""

from __future__ import annotations

import pytest
import torch

from gigadecode import gemm, routed_moe
from gigadecode.checkpoint import make_checkpoint, preset_config
from gigadecode.config import GptOssConfig
from gigadecode.ops import moe_tokens
from gigadecode.weights import load_weights


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    cfg = preset_config("tiny").with_(num_hidden_layers=1, layer_types=("full_attention",), hidden_size=128,
                                      intermediate_size=96, num_local_experts=6, num_experts_per_tok=2)
    d = make_checkpoint(tmp_path_factory.mktemp("moe") / "c", cfg=cfg, seed=3)
    cfg = GptOssConfig.from_hf(d)
    return cfg, load_weights(d, cfg, torch.bfloat16).layers[0], load_weights(d, cfg, torch.float32).layers[0]


@pytest.mark.parametrize("T,offset", [(100, 0), (70, 3), (40, 0), (20, 0)])
def test_dense_experts_agree_with_the_grouped_kernel(layer, monkeypatch, T, offset):
    cfg, lw16, lw32 = layer
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
    args = (cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit, offset)
    ref = moe_tokens(x.float(), lw32, *args)                               # fp32, every expert in torch
    monkeypatch.setattr(gemm, "DENSE_BF16_EXPERTS", False)
    grouped = routed_moe.native_routed_moe(x, lw16, *args)
    monkeypatch.setattr(gemm, "DENSE_BF16_EXPERTS", True)
    idx, _ = routed_moe.route(x, lw16.router_w, lw16.router_b, cfg.num_experts_per_tok)
    local = idx - offset
    counts = torch.bincount(local[(local >= 0) & (local < 6)], minlength=6)
    dense_ones = int((counts >= routed_moe.DENSE_MIN_TOKENS).sum())
    if T >= 100:                                   # the split this case is for: some experts each way
        assert 0 < dense_ones < int((counts > 0).sum()), counts
    if T == 20:
        assert dense_ones == 0                     # too few tokens: the grouped kernel alone
    mixed = routed_moe.native_routed_moe(x, lw16, *args, max_tokens=64, dense_experts=True)
    assert torch.equal(routed_moe.native_routed_moe(x, lw16, *args), grouped)     # decode: the kernel alone
    span = ref.abs().max().item()
    for got in (grouped, mixed):
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert (got.float() - ref).abs().max().item() <= 0.03 * span, ((got.float() - ref).abs().max(), span)
    assert (mixed.float() - grouped.float()).abs().max().item() <= 0.03 * span
