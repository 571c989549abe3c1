"""TP × DP × EP decode on torch.distributed (gloo on loopback, one torch thread per rank).

- the rank layout (`distributed.mesh`): the seed's TP8 × DP16 × EP128 and small layouts, and the errors;
- sharded loading: each rank's stacks are exact slices of the full model (kv heads replicated when
  tp > kv heads, uneven vocabulary shards zero-padded) and its resident bytes are its shard plus the
  replicated parts, never the full model;
- greedy generation on multi-rank worlds equals the single-rank output on the same checkpoint and prompts,
  with at most 2 collectives per layer per mesh in every decode step;
- the distributed greedy argmax equals torch.argmax (ties across shards, NaN, -inf rows, an empty shard).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gigadecode.checkpoint import make_checkpoint, preset_config
from gigadecode.config import GptOssConfig
from gigadecode.distributed.context import CollectiveStats
from gigadecode.parallel.launch import run_parallel_generate
from gigadecode.distributed.mesh import LayoutError, build_layout
from gigadecode.parallel.spawn import argmax_job, generate_job, run_world
from gigadecode.weights import Shard, load_weights

from .gk_harness import run_lockstep
from .helpers import random_prompt

# Block 4, window 16: prompt lengths across block edges, N % 4 == 3 and past the window; 5 prompts so the
# DP groups get uneven batches (3 + 2) and pad.
LENGTHS = [3, 17, 5, 23, 9]
MAX_TOKENS = 12
GEN = dict(max_tokens=MAX_TOKENS, kv_dtype="fp8", block_size=4)

LAYOUTS = [
    pytest.param((2, 1, 2), id="tp2-dp1-ep2"),
    pytest.param((1, 2, 2), id="tp1-dp2-ep2"),        # EP spans 2 DP groups: all_gather + reduce_scatter
    pytest.param((2, 2, 4), id="tp2-dp2-ep4"),        # EP spans 2 DP groups of 2 TP ranks
    pytest.param((4, 1, 4), id="tp4-dp1-ep4"),        # tp 4 > 2 kv heads: kv heads replicated
]
SLOW_LAYOUTS = [
    pytest.param((4, 1, 2), id="tp4-dp1-ep2"),        # EP inside a TP group
    pytest.param((2, 2, 2), id="tp2-dp2-ep2"),        # two EP groups
    pytest.param((1, 4, 4), id="tp1-dp4-ep4"),
    pytest.param((4, 1, 1), id="tp4-dp1-ep1"),
]


@pytest.fixture(scope="module")
def tiny_cfg(tiny_ckpt) -> GptOssConfig:
    return GptOssConfig.from_hf(tiny_ckpt)


@pytest.fixture(scope="module")
def prompts(tiny_cfg):
    return [random_prompt(n, tiny_cfg.vocab_size, seed=200 + n) for n in LENGTHS]


@pytest.fixture(scope="module")
def single_rank(tiny_ckpt, prompts):
    return run_parallel_generate(tiny_ckpt, prompts, **GEN)


@pytest.fixture(scope="module")
def odd_vocab_ckpt(tmp_path_factory) -> Path:
    """The tiny preset with a vocabulary (1021) no TP size divides: the last lm_head shard is padded."""
    cfg = preset_config("tiny").with_(vocab_size=1021)
    return make_checkpoint(tmp_path_factory.mktemp("odd") / "tiny1021", cfg=cfg, seed=1)


# --------------------------------------------------------------------------------------------------
# mesh
# --------------------------------------------------------------------------------------------------
def test_mesh_seed_layout_tp8_dp16_ep128():
    cfg = preset_config("120b-shape")
    lay = build_layout(8, 16, 128, 128, cfg)
    assert lay.world_size == 128
    assert len(lay.tp_groups) == 16 and lay.tp_groups[0] == tuple(range(8))
    assert lay.tp_groups[15] == tuple(range(120, 128))
    assert all(g == tuple(range(8 * i, 8 * i + 8)) for i, g in enumerate(lay.tp_groups))
    assert lay.ep_groups == (tuple(range(128)),)
    assert lay.ep_span == 16                                  # one EP group over all 16 DP groups
    r = 77
    assert (lay.tp_rank(r), lay.dp_rank(r), lay.ep_rank(r), lay.ep_slot(r)) == (5, 9, 77, 9)
    assert lay.tp_group_of(r) == tuple(range(72, 80)) and lay.ep_group_of(r) == tuple(range(128))
    assert lay.expert_range(r, cfg.num_local_experts) == (77, 78)   # one expert per rank
    assert lay.shard(r) == Shard(tp_rank=5, tp_size=8, ep_rank=77, ep_size=128)
    vs = -(-cfg.vocab_size // 8)
    assert lay.vocab_range(r, cfg.vocab_size) == (5 * vs, min(cfg.vocab_size, 6 * vs))
    # every expert held exactly once per EP group, every vocab id once per TP group
    assert sorted(e for rk in range(128) for e in range(*lay.expert_range(rk, 128))) == list(range(128))
    assert sum(b - a for a, b in (lay.vocab_range(rk, cfg.vocab_size) for rk in range(8))) == cfg.vocab_size


@pytest.mark.parametrize("tp,dp,ep,tp_groups,ep_groups,span", [
    (2, 2, 4, ((0, 1), (2, 3)), ((0, 1, 2, 3),), 2),
    (4, 1, 2, ((0, 1, 2, 3),), ((0, 1), (2, 3)), 1),      # EP inside the TP group
    (1, 4, 2, ((0,), (1,), (2,), (3,)), ((0, 1), (2, 3)), 2),
    (2, 2, 2, ((0, 1), (2, 3)), ((0, 1), (2, 3)), 1),
    (2, 1, 1, ((0, 1),), ((0,), (1,)), 1),
    (1, 1, 1, ((0,),), ((0,),), 1),
])
def test_mesh_small_layouts(tp, dp, ep, tp_groups, ep_groups, span):
    lay = build_layout(tp, dp, ep, tp * dp, preset_config("tiny"))
    assert lay.tp_groups == tp_groups and lay.ep_groups == ep_groups and lay.ep_span == span
    for r in range(lay.world_size):
        assert r in lay.tp_group_of(r) and r in lay.ep_group_of(r)
        assert lay.tp_group_of(r)[lay.tp_rank(r)] == r and lay.ep_group_of(r)[lay.ep_rank(r)] == r


@pytest.mark.parametrize("tp,dp,ep,world,match", [
    (2, 2, 2, 8, "world size 8 != tp\\*dp"),
    (2, 2, 3, None, "^--ep 3 does not divide the world size --tp × --dp = 4 "),
    (2, 3, 3, None, "^--ep 3 and --tp 2: one must divide the other"),        # EP groups straddling TP groups
    (3, 1, 1, None, "^--tp 3 does not divide the model's num_attention_heads=4 .*query heads"),
    (1, 16, 16, None, "^--ep 16 does not divide the model's num_local_experts=8 .*experts"),
    (0, 1, 1, None, "^--tp must be a positive integer"),
])
def test_mesh_errors(tp, dp, ep, world, match):
    """Each refusal names the flag a user set (`--tp 3`, not the keyword `tp=3`) and why it cannot work."""
    with pytest.raises(LayoutError, match=match):
        build_layout(tp, dp, ep, world, preset_config("tiny"))


def test_mesh_kv_head_error():
    cfg = preset_config("tiny").with_(num_attention_heads=12, num_key_value_heads=3)
    with pytest.raises(LayoutError, match="^--tp 2 and the model's num_key_value_heads=3: one must divide"):
        build_layout(2, 1, 1, 2, cfg)


# --------------------------------------------------------------------------------------------------
# sharded loading
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_weights(tiny_ckpt, tiny_cfg):
    return load_weights(tiny_ckpt, tiny_cfg)


@pytest.mark.parametrize("tp,ep,tp_rank,ep_rank", [(2, 2, 1, 1), (4, 4, 3, 2), (4, 1, 2, 0), (1, 8, 0, 5)])
def test_sharded_weights_are_slices_of_the_full_model(tiny_ckpt, tiny_cfg, full_weights, tp, ep, tp_rank, ep_rank):
    cfg, full = tiny_cfg, full_weights
    w = load_weights(tiny_ckpt, cfg, shard=Shard(tp_rank, tp, ep_rank, ep))
    nh, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    nh_l, kv_l = nh // tp, max(kv // tp, 1)
    q0 = tp_rank * nh_l
    k0 = tp_rank // (tp // kv) if tp > kv else tp_rank * kv_l     # kv head r // (tp // kv) when replicated
    rows = torch.cat([torch.arange(q0 * d, (q0 + nh_l) * d),
                      nh * d + torch.arange(k0 * d, (k0 + kv_l) * d),
                      (nh + kv) * d + torch.arange(k0 * d, (k0 + kv_l) * d)])
    assert torch.equal(w.tensors["qkv_w"], full.tensors["qkv_w"][:, rows])
    assert torch.equal(w.tensors["qkv_b"], full.tensors["qkv_b"][:, rows])
    assert torch.equal(w.tensors["o_w"], full.tensors["o_w"][:, :, q0 * d: (q0 + nh_l) * d])
    assert torch.equal(w.tensors["sinks"], full.tensors["sinks"][:, q0: q0 + nh_l])
    e_l = cfg.num_local_experts // ep
    for name in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales", "gate_up_bias", "down_bias"):
        assert torch.equal(w.tensors[name], full.tensors[name][:, ep_rank * e_l: (ep_rank + 1) * e_l]), name
    for name in ("embed", "norm", "input_norm", "post_norm", "router_w", "router_b", "o_b"):
        assert torch.equal(w.tensors[name], full.tensors[name]), name
    vs = -(-cfg.vocab_size // tp)
    assert torch.equal(w.lm_head, full.lm_head[tp_rank * vs: (tp_rank + 1) * vs])


def test_uneven_vocab_shard_is_zero_padded(odd_vocab_ckpt):
    cfg = GptOssConfig.from_hf(odd_vocab_ckpt)
    full = load_weights(odd_vocab_ckpt, cfg)
    w = load_weights(odd_vocab_ckpt, cfg, shard=Shard(3, 4, 0, 1))
    assert w.lm_head.shape[0] == 256                          # ceil(1021 / 4)
    assert torch.equal(w.lm_head[:253], full.lm_head[768:])
    assert not w.lm_head[253:].any()                          # padding rows: zeros, sliced off before argmax


def test_tied_embeddings_lm_head_is_a_view_of_the_vocab_rows(tmp_path):
    d = make_checkpoint(tmp_path / "tied", cfg=preset_config("tiny").with_(tie_word_embeddings=True), seed=2)
    cfg = GptOssConfig.from_hf(d)
    w = load_weights(d, cfg, shard=Shard(1, 2, 0, 1))
    assert torch.equal(w.lm_head, w.embed[512:]) and w.lm_head.data_ptr() == w.embed[512:].data_ptr()
    assert w.nbytes() == sum(t.numel() * t.element_size() for k, t in w.tensors.items() if k != "lm_head")


def _expected_rank_bytes(cfg: GptOssConfig, full, tp: int, ep: int) -> int:
    """This rank's shard plus the replicated parts, computed from the full model's tensors."""
    t = {k: v.numel() * v.element_size() for k, v in full.tensors.items()}
    nh, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    replicated = sum(t[n] for n in ("embed", "norm", "input_norm", "post_norm", "router_w", "router_b", "o_b"))
    heads = (nh // tp + 2 * max(kv // tp, 1)) / (nh + 2 * kv)  # qkv rows held (kv replicated when tp > kv)
    attention = (t["qkv_w"] + t["qkv_b"]) * heads + (t["o_w"] + t["sinks"]) / tp
    lm_head = -(-cfg.vocab_size // tp) * cfg.hidden_size * full.lm_head.element_size()
    experts = sum(t[n] for n in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales",
                                 "gate_up_bias", "down_bias")) / ep
    total = replicated + attention + lm_head + experts
    assert total == int(total)
    return int(total)


@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 4), (1, 2), (4, 1), (2, 8)])
def test_resident_bytes_are_the_shard_plus_replicated_parts(tiny_ckpt, tiny_cfg, full_weights, tp, ep):
    full_bytes = full_weights.nbytes()
    expected = _expected_rank_bytes(tiny_cfg, full_weights, tp, ep)
    for tp_rank in range(tp):
        for ep_rank in {0, ep - 1}:
            w = load_weights(tiny_ckpt, tiny_cfg, shard=Shard(tp_rank, tp, ep_rank, ep))
            assert w.nbytes() == expected
            assert w.nbytes() < full_bytes                     # no rank holds the full model


def test_single_rank_loading_unchanged(full_weights, tiny_cfg):
    assert full_weights.nbytes() == _expected_rank_bytes(tiny_cfg, full_weights, 1, 1)


def test_collective_stats_ring_bytes():
    s = CollectiveStats()
    s.record("tp", "all_reduce", 4, 1000)
    s.record("ep", "all_gather", 4, 100)
    s.record("ep", "reduce_scatter", 4, 400)
    assert s.calls == {"tp": 1, "ep": 2}
    assert s.bytes == {"tp": 1500, "ep": 300 + 300}


# --------------------------------------------------------------------------------------------------
# multi-rank generation == single rank
# --------------------------------------------------------------------------------------------------
def test_single_rank_reference_matches_the_lockstep_harness(tiny_ckpt, tiny_cfg, full_weights, prompts):
    """The single-rank path of run_parallel_generate is the GK lockstep harness (ignore_eos)."""
    got = run_parallel_generate(tiny_ckpt, prompts, ignore_eos=True, **GEN)
    ref = run_lockstep(tiny_cfg, full_weights, prompts, steps=MAX_TOKENS - 1, decoder="reference")
    assert [r["token_ids"] for r in got] == ref


def _check_world(tiny_ckpt, prompts, single_rank, layout, **kw):
    tp, dp, ep = layout
    outs = run_world(tp * dp, generate_job, str(tiny_ckpt), prompts, tp, dp, ep, {**GEN, **kw})
    res = outs[0][0]
    assert all(o[0] is None for o in outs[1:])                # only rank 0 returns results
    assert [r["token_ids"] for r in res] == [r["token_ids"] for r in single_rank]
    assert [r["finish_reason"] for r in res] == [r["finish_reason"] for r in single_rank]
    assert [r["prompt_ids"] for r in res] == prompts
    return outs


def _check_collectives(outs, layout, num_layers):
    tp, dp, ep = layout
    span = build_layout(tp, dp, ep).ep_span
    for _, rep in outs:
        assert rep["step_stats"], "no decode step recorded"
        for st in rep["step_stats"]:
            calls = st["calls"]
            assert set(calls) <= {"tp", "ep", "sched"}
            for mesh, n in calls.items():
                assert n <= 2 * num_layers, (mesh, n)          # at most 2 per layer per mesh
            # the engine's step agreement (one tiny all-reduce) only where an EP group spans DP groups
            assert calls.get("sched", 0) == (1 if span > 1 else 0)
            # exactly: TP one all-reduce per layer + one all-gather for the argmax; EP 1 (or 2 when it spans DP)
            assert calls.get("tp", 0) == (num_layers + 1 if tp > 1 else 0)
            assert calls.get("ep", 0) == (num_layers * (2 if span > 1 else 1) if ep > 1 else 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_generate_equals_single_rank(tiny_ckpt, tiny_cfg, full_weights, prompts, single_rank, layout):
    outs = _check_world(tiny_ckpt, prompts, single_rank, layout)
    _check_collectives(outs, layout, tiny_cfg.num_hidden_layers)
    tp, _, ep = layout
    assert {rep["weight_bytes"] for _, rep in outs} == {_expected_rank_bytes(tiny_cfg, full_weights, tp, ep)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_LAYOUTS)
def test_parallel_generate_more_layouts(tiny_ckpt, tiny_cfg, prompts, single_rank, layout):
    outs = _check_world(tiny_ckpt, prompts, single_rank, layout)
    _check_collectives(outs, layout, tiny_cfg.num_hidden_layers)


@pytest.mark.parametrize("layout", [
    pytest.param((1, 2, 2), id="tp1-dp2-ep2"),                        # the EP group gathers both DP groups
    pytest.param((2, 1, 2), id="tp2-dp1-ep2", marks=pytest.mark.slow),
])
def test_parallel_compiled_gk_equals_single_rank(tiny_ckpt, tiny_cfg, prompts, single_rank, layout):
    """--decoder gk-compiled on a world: each layer's attention and (EP-masked, fused MXFP4) MoE run as
    compiled graphs between the eager collectives; same tokens and the same collectives per step."""
    outs = _check_world(tiny_ckpt, prompts, single_rank, layout, decoder="gk-compiled")
    _check_collectives(outs, layout, tiny_cfg.num_hidden_layers)


def test_parallel_uneven_vocab_and_idle_dp_group(odd_vocab_ckpt):
    """vocab 1021 over tp=2 (last shard padded) and dp=2 with one prompt (DP group 1 has nothing to do but
    still joins the EP collectives every step)."""
    cfg = GptOssConfig.from_hf(odd_vocab_ckpt)
    prompts = [random_prompt(11, cfg.vocab_size, seed=5)]
    ref = run_parallel_generate(odd_vocab_ckpt, prompts, **GEN)
    res = run_world(4, generate_job, str(odd_vocab_ckpt), prompts, 2, 2, 4, GEN)[0][0]
    assert res == [{**ref[0], "decode_tok_s": res[0]["decode_tok_s"]}]


@pytest.mark.slow
def test_parallel_reference_decoder_and_bf16_experts(tiny_ckpt_bf16):
    """The per-layer model as decoder too (prefill-style collectives every step), on dense bf16 experts."""
    cfg = GptOssConfig.from_hf(tiny_ckpt_bf16)
    prompts = [random_prompt(n, cfg.vocab_size, seed=n) for n in (4, 19, 7)]
    kw = {**GEN, "decoder": "reference"}
    ref = run_parallel_generate(tiny_ckpt_bf16, prompts, **kw)
    for layout in ((2, 1, 2), (1, 2, 2)):
        res = run_world(2, generate_job, str(tiny_ckpt_bf16), prompts, *layout, kw)[0][0]
        assert [r["token_ids"] for r in res] == [r["token_ids"] for r in ref]


# --------------------------------------------------------------------------------------------------
# distributed greedy argmax
# --------------------------------------------------------------------------------------------------
def test_distributed_argmax_equals_torch_argmax_ties_included():
    """V = 6 over tp = 4: shards of 2, 2, 2 and an empty one. Ties across shard boundaries go to the lowest
    id, NaN wins (first NaN), an all -inf row gives 0 — exactly torch.argmax. Every rank gets each row's winning
    logit too: NaN, +inf and -inf rows are the ones the engine fails (their token means nothing)."""
    inf, nan = math.inf, math.nan
    logits = torch.tensor([
        [0.0, 1.0, 1.0, 0.0, 0.0, 1.0],            # tie across shards 0 and 1 and 2 -> 1
        [0.0, 0.0, 0.0, 2.0, 2.0, 0.0],            # tie inside shard 1 and into shard 2 -> 3
        [-inf, -inf, -inf, -inf, -inf, -inf],      # all -inf -> 0
        [1.0, 2.0, 3.0, nan, 5.0, nan],            # NaN is the max -> 3
        [-1.0, -2.0, -3.0, -4.0, -5.0, -0.5],      # max in the last real shard -> 5
        [0.0, 1.0, inf, 0.0, nan, 0.0],            # NaN beats +inf -> 4
    ])
    got = run_world(4, argmax_job, 4, logits)
    want = logits.argmax(-1).tolist()
    assert all(ids == want for ids, _ in got)
    for _, best in got:
        assert [b if math.isfinite(b) else str(b) for b in best] == [1.0, 2.0, "-inf", "nan", -0.5, "nan"]


# --------------------------------------------------------------------------------------------------
# torchrun
# --------------------------------------------------------------------------------------------------
def test_generate_under_torchrun_prints_what_one_process_prints(tiny_ckpt, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    args = ["-m", "gigadecode", "generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2,3",
            "--max-tokens", "6", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, check=True)
    port = __import__("gigadecode.parallel.spawn", fromlist=["free_port"]).free_port()
    par = subprocess.run([str(torchrun), "--nproc-per-node", "4", "--master-port", str(port), *args,
                          "--tp", "2", "--dp", "2", "--ep", "4"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert par.returncode == 0, par.stderr[-3000:]
    a = [json.loads(line) for line in one.stdout.splitlines()]
    b = [json.loads(line) for line in par.stdout.splitlines()]
    for d in a + b:
        for timing in ("decode_tok_s", "ttft_s", "prompt_tok_s"):
            assert d.pop(timing) is not None
    assert a == b and len(a) == 1
