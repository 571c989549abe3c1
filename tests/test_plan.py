"""The KV memory plan: the seed's 120B anchor, budget arithmetic, the uint32 offset check, the old
stacked-layout cap, errors, and the `plan` command line."""

from __future__ import annotations

import argparse
import json

import pytest

from gigadecode.checkpoint import make_checkpoint, preset_config
from gigadecode.plan import (
    GIB, REQUIRED_KEYS, add_plan_arguments, estimate_activation_bytes, format_plan, plan_memory, run_plan,
    weight_breakdown,
)

# The seed's 120B decode rank: Trainium2 has 96 GiB HBM per chip for 8 NeuronCores -> 12 GiB per lnc1
# rank; gpu_memory_utilization 0.99; TP8 x DP16 x EP128, block 128, packed FP8.
SEED_120B = dict(tp=8, dp=16, ep=128, block_size=128, kv_dtype="fp8", device_memory_gib=12.0,
                 memory_utilization=0.99)


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
    (dict(tp=3, kv_budget_gib=1), "tp=3 does not divide num_attention_heads"),
    (dict(tp=8, ep=3, dp=3, kv_budget_gib=1), "ep=3 does not divide num_local_experts"),
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
                  "--kv-dtype", "fp8", "--device-memory-gib", "12", "--memory-utilization", "0.99", "--json"])
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
    assert "tp=3 does not divide" in capsys.readouterr().err
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
