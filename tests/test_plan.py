"""The KV memory plan: the seed's 120B anchor, budget arithmetic, the uint32 offset check, the old
stacked-layout cap, errors, and the `plan` command line."""

from __future__ import annotations

import argparse
import json

import pytest

from gigadecode.checkpoint import make_checkpoint, preset_config
from gigadecode.plan import (
    DEFAULT_PREFILL_CHUNK, GIB, REQUIRED_KEYS, add_plan_arguments, estimate_activation_bytes, format_plan, plan_memory, run_plan,
    weight_breakdown,
)

# The seed's 120B decode rank: Trainium2 has 96 GiB HBM per chip for 8 NeuronCores -> 12 GiB per lnc1
# rank; gpu_memory_utilization 0.99; TP8 x DP16 x EP128, block 128, packed FP8.
SEED_120B = dict(tp=8, dp=16, ep=128, block_size=128, kv_dtype="fp8", device_memory_gib=12.0,
                 memory_utilization=0.99, max_prefill_tokens=512)   # (the numbers below: 512-token chunks)


def parse(argv: list[str]) -> argparse.Namespace:
    return add_plan_arguments(argparse.ArgumentParser(prog="gigadecode plan")).parse_args(argv)


def test_120b_decode_rank_matches_seed():
    p = plan_memory(preset_config("120b-shape"), **SEED_120B)
    assert p["group_size"] == 18 and p["num_groups"] == 2
    assert p["kv_heads_per_rank"] == 1 and p["q_heads_per_rank"] == 8 and p["experts_per_rank"] == 1
    assert p["bytes_per_block"] == 18 * 2 * 1 * 128 * 64 * 1 == 294_912
    assert abs(p["num_blocks"] - 36_175) <= 0.01 * 36_175
    assert p["kv_gib"] == pytest.approx(9.94, abs=0.1)
    assert 36_175 * p["bytes_per_block"] / GIB == pytest.approx(9.94, abs=0.005)   # the seed's own pair
    # real 120B weights on this rank: ~1.9 GiB (embedding replicated, lm_head vocab-sharded, 1 expert/layer)
    assert p["weight_bytes_per_rank"] == 2_046_088_512
    assert p["kv_tokens"] == p["num_blocks"] * 128
    assert p["max_sliding_blocks_per_request"] == 2
    assert p["offset_ok"] and p["max_buffer_offset"] == p["num_blocks"] * 128 * 64 < 2**32
    # the old stacked layout (one K tensor over the 18 buffers) capped num_blocks here
    assert p["stacked_layout_cap_blocks"] == (2**32 - 1) // (18 * 128 * 64) == 29_127
    assert p["stacked_cap_ratio"] == pytest.approx(p["num_blocks"] / 29_127)
    assert p["num_blocks"] > p["stacked_layout_cap_blocks"]
    assert p["stacked_all_layers_cap_blocks"] == 14_563


def test_weight_sharding():
    cfg = preset_config("120b-shape")
    full = weight_breakdown(cfg)
    shard = weight_breakdown(cfg, tp=8, ep=128)
    assert shard["embed"] == full["embed"]                              # replicated
    assert shard["lm_head"] == 201088 // 8 * 2880 * 2                   # vocab-sharded, bf16
    assert shard["o_w"] * 8 == full["o_w"]
    assert shard["qkv_w"] == 36 * (8 + 2) * 64 * 2880 * 2
    assert shard["gate_up_blocks"] * 128 == full["gate_up_blocks"]      # MXFP4 bytes, E/ep
    assert shard["gate_up_blocks"] == 36 * 5760 * 2880 // 2            # 4 bits per weight
    # kv heads replicated when tp > kv heads
    assert plan_memory(cfg, tp=16, dp=1, ep=1, kv_budget_gib=1)["kv_heads_per_rank"] == 1
    assert plan_memory(cfg, tp=2, kv_budget_gib=1)["kv_heads_per_rank"] == 4


def test_kv_budget_arithmetic_tiny():
    # tiny: 4 layers -> 2 buffers, kv 2, head_dim 16; block 16 fp8 -> 2*2*2*16*16*1 = 2048 B per block
    p = plan_memory(preset_config("tiny"), block_size=16, kv_dtype="fp8", kv_budget_gib=1 / 1024)
    assert p["bytes_per_block"] == 2048
    assert p["num_blocks"] == 1024**2 // 2048 == 512
    assert p["kv_bytes"] == 512 * 2048 and p["kv_tokens"] == 512 * 16
    assert p["max_buffer_offset"] == 512 * 2 * 16 * 16
    q = plan_memory(preset_config("tiny"), block_size=16, kv_dtype="bf16", kv_budget_gib=1 / 1024)
    assert q["bytes_per_block"] == 4096 and q["num_blocks"] == 256
    # kv_budget_gib is used as is: no weights or activations subtracted
    assert p["kv_budget_bytes"] == 1024**2


def test_device_budget_subtracts_weights_and_activations():
    cfg = preset_config("tiny")
    p = plan_memory(cfg, device_memory_gib=0.01, memory_utilization=0.5, block_size=4)
    act = estimate_activation_bytes(cfg)
    budget = 0.01 * GIB * 0.5 - p["weight_bytes_per_rank"] - act
    assert p["activation_bytes"] == act
    assert p["num_blocks"] == int(budget // p["bytes_per_block"])
    p2 = plan_memory(cfg, device_memory_gib=0.01, memory_utilization=0.5, block_size=4, activation_gib=0)
    assert p2["num_blocks"] == int((0.01 * GIB * 0.5 - p["weight_bytes_per_rank"]) // p["bytes_per_block"])


def test_uint32_offset_violation_reported():
    # 120B on one rank: kv 8 -> one buffer block half = 8*128*64 = 65536 elements; 2**32 allows 65535 blocks
    p = plan_memory(preset_config("120b-shape"), block_size=128, kv_budget_gib=200)
    assert p["max_blocks_uint32"] == 65_535
    assert p["num_blocks"] > 65_535 and not p["offset_ok"]
    assert p["max_buffer_offset"] == p["num_blocks"] * 65536 >= 2**32
    assert p["violations"] and "2**32" in p["violations"][0]
    assert "VIOLATION" in format_plan(p)
    ok = plan_memory(preset_config("120b-shape"), block_size=128, kv_budget_gib=100)
    assert ok["offset_ok"] and ok["violations"] == []


@pytest.mark.parametrize("kw,match", [
    (dict(tp=3, kv_budget_gib=1), "--tp 3 does not divide the model's num_attention_heads"),
    (dict(tp=8, ep=24, dp=3, kv_budget_gib=1), "--ep 24 does not divide the model's num_local_experts=128"),
    (dict(tp=1, ep=2, kv_budget_gib=1), "world size"),
    (dict(tp=0, kv_budget_gib=1), "--tp must be a positive integer"),
    (dict(device_memory_gib=1.0), "does not hold this rank's weights"),
    (dict(), "exactly one of"),
    (dict(device_memory_gib=80.0, kv_budget_gib=1), "exactly one of"),
    (dict(kv_budget_gib=1, kv_dtype="int8"), "--kv-dtype"),
    (dict(kv_budget_gib=1, block_size=15), "--block-size"),
    (dict(kv_budget_gib=1e-9), "at least 2"),
    (dict(device_memory_gib=80.0, memory_utilization=1.5), "--memory-utilization"),
])
def test_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        plan_memory(preset_config("120b-shape"), **kw)


def test_run_plan_json(capsys):
    args = parse(["--preset", "120b-shape", "--tp", "8", "--dp", "16", "--ep", "128", "--block-size", "128",
                  "--kv-dtype", "fp8", "--device-memory-gib", "12", "--memory-utilization", "0.99",
                  "--max-prefill-tokens", "512", "--json"])
    assert run_plan(args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in REQUIRED_KEYS:
        assert isinstance(out[key], int), key
    assert out == json.loads(json.dumps(plan_memory(preset_config("120b-shape"), **SEED_120B)))


def test_run_plan_model_dir_and_text(tmp_path, capsys):
    d = make_checkpoint(tmp_path / "tiny", "tiny")
    assert run_plan(parse(["--model", str(d), "--kv-budget-gib", "0.001"])) == 0
    text = capsys.readouterr().out
    assert "num_blocks" in text and "524" in text


def test_run_plan_errors(capsys):
    assert run_plan(parse(["--preset", "120b-shape", "--tp", "3", "--kv-budget-gib", "1"])) == 2
    assert "--tp 3 does not divide" in capsys.readouterr().err
    assert run_plan(parse(["--preset", "120b-shape", "--device-memory-gib", "1"])) == 2
    assert "weights" in capsys.readouterr().err
    assert run_plan(parse(["--preset", "nope", "--kv-budget-gib", "1"])) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert run_plan(parse(["--preset", "tiny", "--kv-budget-gib", "1", "--memory-utilization", "0.5"])) == 2
    with pytest.raises(SystemExit):
        parse(["--preset", "tiny"])                                         # no budget
    with pytest.raises(SystemExit):
        parse(["--preset", "tiny", "--device-memory-gib", "1", "--kv-budget-gib", "1"])
    with pytest.raises(SystemExit):
        parse(["--model", "x", "--preset", "tiny", "--kv-budget-gib", "1"])


# ---- decode context parallel (DCP) ---------------------------------------------------------------------------
# 120B at TP16 x DP8 x EP128, block 128, fp8, a 10 GiB KV budget, 128K context. 8 kv heads over 16 ranks: without
# DCP every kv head is held by 2 ranks; with --dcp 2 the kv heads split over 16/2 = 8 shards (still 1 per rank)
# and each rank of a DCP pair holds half of every sequence's tokens.
TP16 = dict(tp=16, dp=8, ep=128, block_size=128, kv_dtype="fp8", kv_budget_gib=10, context=131072,
            max_prefill_tokens=512)


def test_dcp1_baseline_is_the_plan_itself():
    p = plan_memory(preset_config("120b-shape"), **SEED_120B)
    assert p["dcp"] == 1 and p["dcp_interleave"] == 128 and p["context"] == 131072   # max_position_embeddings
    assert p["kv_tokens_per_rank"] == p["kv_tokens"] == p["num_blocks"] * 128
    assert p["kv_context_tokens"] == (p["num_blocks"] - 1) * 128
    # full group: cdiv(131072, 128) = 1024; sliding group (W 128, 512-token chunks): cdiv(127 + 512, 128) + 1 = 6
    assert p["blocks_per_seq"] == 1024 + 6
    assert p["max_concurrent_seqs"] == (p["num_blocks"] - 1) // 1030
    assert p["baseline_dcp1"] == {"kv_heads_per_rank": 1, "num_blocks": p["num_blocks"],
                                  "kv_tokens_per_rank": p["kv_tokens"], "blocks_per_seq": 1030,
                                  "max_concurrent_seqs": p["max_concurrent_seqs"]}
    assert p["dcp_seqs_ratio"] == 1.0
    assert "DCP 1 vs 1" not in format_plan(p)
    # the engine's default chunk (1,024 tokens) unless told: the sliding group cdiv(127 + 1024, 128) + 1 = 10
    default = plan_memory(preset_config("120b-shape"), **{**SEED_120B, "max_prefill_tokens": DEFAULT_PREFILL_CHUNK})
    assert DEFAULT_PREFILL_CHUNK == 1024 and default["blocks_per_seq"] == 1024 + 10
    assert plan_memory(preset_config("120b-shape"), **{k: v for k, v in SEED_120B.items()
                                                       if k != "max_prefill_tokens"}) == default
    parse = add_plan_arguments(argparse.ArgumentParser()).parse_args
    assert parse(["--preset", "tiny", "--kv-budget-gib", "1"]).max_prefill_tokens == DEFAULT_PREFILL_CHUNK
    assert parse(["--preset", "tiny", "--kv-budget-gib", "1", "--max-num-batched-tokens", "512"]).max_prefill_tokens == 512
    with pytest.raises(ValueError, match="--max-prefill-tokens must be a positive integer"):
        plan_memory(preset_config("tiny"), kv_budget_gib=1, max_prefill_tokens=0)


def test_dcp2_tp16_doubles_the_sequences():
    cfg = preset_config("120b-shape")
    p = plan_memory(cfg, **TP16, dcp=2)
    assert p["dcp"] == 2 and p["dcp_interleave"] == 128
    assert p["kv_heads_per_rank"] == 1 and p["q_heads_per_rank"] == 4
    assert p["bytes_per_block"] == 18 * 2 * 1 * 128 * 64 * 1 == 294_912        # same as without DCP
    assert p["num_blocks"] == 10 * 2**30 // 294_912 == 36_408
    assert p["kv_tokens_per_rank"] == 36_408 * 128
    # rank 0 (the fullest) may fill the 36,407 usable blocks: its local index 36,407*128 is position 36,407*128*2
    assert p["kv_context_tokens"] == 36_407 * 128 * 2
    # full group: rank 0 holds 65,536 of 131,072 tokens -> 512 blocks. Sliding group, a step c -> c + 512 holds
    # cdiv(most(c + 512), 128) - least(c - 127) // 128; with c = 256k + r: most(c + 512) = 128k + 256 + min(r, 128)
    # -> k + 2 + [r > 0] blocks; least(c - 127) // 128 = k for r >= 127, k - 1 for r < 127 -> at most 4 (0 < r < 127)
    assert p["blocks_per_seq"] == 512 + 4
    assert p["max_concurrent_seqs"] == 36_407 // 516 == 70
    b = p["baseline_dcp1"]
    assert b == {"kv_heads_per_rank": 1, "num_blocks": 36_408, "kv_tokens_per_rank": 36_408 * 128,
                 "blocks_per_seq": 1024 + 6, "max_concurrent_seqs": 36_407 // 1030}
    assert b["max_concurrent_seqs"] == 35 and p["dcp_seqs_ratio"] == 2.0
    assert p["weight_bytes_per_rank"] == plan_memory(cfg, **TP16)["weight_bytes_per_rank"]   # same k/v rows
    text = format_plan(p)
    assert "DCP 2 vs 1" in text and "2.00× seqs (70 vs 35" in text and "516 blocks per sequence" in text


def test_dcp2_tp8_splits_blocks_not_sequences():
    # TP8 holds each of the 8 kv heads once: with --dcp 2 a rank holds 2 heads (8/(8/2)) of half the tokens
    cfg = preset_config("120b-shape")
    p = plan_memory(cfg, tp=8, block_size=128, kv_budget_gib=10, dcp=2, max_prefill_tokens=512)
    assert p["kv_heads_per_rank"] == 2
    assert p["bytes_per_block"] == 18 * 2 * 2 * 128 * 64 == 589_824
    assert p["num_blocks"] == 10 * 2**30 // 589_824 == 18_204
    assert p["weight_breakdown"]["qkv_w"] == 36 * (8 + 2 * 2) * 64 * 2880 * 2
    assert weight_breakdown(cfg, tp=8, dcp=2)["qkv_w"] == p["weight_breakdown"]["qkv_w"]
    assert p["baseline_dcp1"]["kv_heads_per_rank"] == 1 and p["baseline_dcp1"]["num_blocks"] == 36_408
    assert p["max_concurrent_seqs"] == 18_203 // 516 == p["baseline_dcp1"]["max_concurrent_seqs"] == 35


def test_dcp_interleave_and_context():
    cfg = preset_config("120b-shape")
    p = plan_memory(cfg, **TP16, dcp=2, dcp_interleave=256)
    assert p["dcp_interleave"] == 256
    # rank 0's 36,407*128 tokens: 18,203 whole periods of 512 (256 its own) and 128 more
    assert p["kv_context_tokens"] == 18_203 * 512 + 128
    # the definition, by search: the largest T with cdiv(most(T), B) <= usable blocks
    for dcp, inter in ((1, 16), (2, 16), (2, 32), (4, 48)):
        q = plan_memory(preset_config("tiny"), block_size=16, kv_budget_gib=1 / 1024, dcp=dcp,
                        dcp_interleave=inter, tp=dcp)
        T, U = q["kv_context_tokens"], q["usable_blocks"]

        def most(n):     # rank 0's tokens among [0, n), counted one by one
            return sum(1 for pos in range(n) if (pos // inter) % dcp == 0)
        assert -(-most(T) // 16) <= U < -(-most(T + 1) // 16), (dcp, inter)
    short = plan_memory(cfg, **{**TP16, "context": 1000}, dcp=2)
    # 1000 tokens: rank 0 holds [0,128) [256,384) [512,640) [768,896) = 512 -> 4 full-group blocks. Sliding, one
    # 512-token chunk from c = 257: most(769) = 385 -> 4 blocks, least(130) = 2 -> none freed: 4 (all rank 0 has).
    # Without DCP: cdiv(1000, 128) = 8 full, min(8, cdiv(127 + 512, 128) + 1) = 6 sliding.
    assert short["context"] == 1000 and short["blocks_per_seq"] == 4 + 4
    assert short["max_concurrent_seqs"] == 36_407 // 8
    assert short["baseline_dcp1"]["blocks_per_seq"] == 8 + 6


@pytest.mark.parametrize("kw,match", [
    (dict(tp=16, dcp=2, dcp_interleave=100), "--dcp-interleave 100 must be a positive multiple of --block-size 128"),
    (dict(tp=16, dcp=2, dcp_interleave=0), "--dcp-interleave"),
    (dict(tp=4, dcp=3), "--dcp 3 does not divide --tp 4"),
    (dict(tp=32, dcp=2), "tp/dcp = 16 ranks, which must divide num_key_value_heads=8"),
    (dict(tp=16, dcp=0), "--dcp must be a positive integer"),
    (dict(tp=16, dcp=2, context=0), "--context must be a positive integer"),
])
def test_dcp_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        plan_memory(preset_config("120b-shape"), block_size=128, kv_budget_gib=10, **kw)


def test_run_plan_dcp_json_and_errors(capsys):
    args = parse(["--preset", "120b-shape", "--tp", "16", "--dp", "8", "--ep", "128", "--dcp", "2",
                  "--block-size", "128", "--kv-budget-gib", "10", "--context", "131072", "--json"])
    assert args.dcp == 2 and args.dcp_interleave is None and args.context == 131072
    assert run_plan(args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (*REQUIRED_KEYS, "dcp", "dcp_interleave", "kv_tokens_per_rank", "kv_context_tokens",
                "blocks_per_seq", "max_concurrent_seqs", "baseline_dcp1", "dcp_seqs_ratio"):
        assert key in out, key
    assert out["dcp"] == 2 and out["dcp_interleave"] == 128 and out["max_concurrent_seqs"] == 70
    assert out["baseline_dcp1"]["max_concurrent_seqs"] == 35
    defaults = parse(["--preset", "tiny", "--kv-budget-gib", "1"])
    assert defaults.dcp == 1 and defaults.dcp_interleave is None and defaults.context is None
    assert run_plan(parse(["--preset", "120b-shape", "--tp", "4", "--dcp", "3", "--kv-budget-gib", "1"])) == 2
    assert "--dcp 3 does not divide --tp 4" in capsys.readouterr().err
    assert run_plan(parse(["--preset", "120b-shape", "--tp", "16", "--dcp", "2", "--block-size", "128",
                           "--dcp-interleave", "64", "--kv-budget-gib", "1"])) == 2
    assert "--dcp-interleave 64" in capsys.readouterr().err
    assert run_plan(parse(["--preset", "120b-shape", "--tp", "32", "--dcp", "2", "--kv-budget-gib", "1"])) == 2
    assert "num_key_value_heads=8" in capsys.readouterr().err
