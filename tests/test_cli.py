"""`gigadecode generate` as a user runs it: the fast defaults (GK program on the native kernels, packed-FP8
KV, all cores), the per-request timing fields of `--json`, and refused bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gigadecode.cli import build_parser, engine_config
from gigadecode.config import ConfigError


def _generate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gigadecode", "generate", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_defaults_are_the_fast_decoder_fp8_kv_and_all_cores(tiny_ckpt, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ecfg = engine_config(build_parser().parse_args(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1"]))
    assert ecfg.decoder == "gk-native" and ecfg.kv_dtype == "fp8"
    assert ecfg.threads == len(os.sched_getaffinity(0))
    ref = engine_config(build_parser().parse_args(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1",
                                                   "--decoder", "reference"]))
    assert ref.kv_dtype == "auto"                  # the per-layer model keeps the model dtype
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert engine_config(build_parser().parse_args(["generate", "--model", str(tiny_ckpt), "--prompt-ids",
                                                    "1"])).threads == 1


def test_json_reports_ttft_and_prompt_throughput(tiny_ckpt):
    r = _generate("--model", str(tiny_ckpt), "--prompt-ids", "1,2,3,4,5", "--max-tokens", "4", "--json",
                  "--threads", "1")
    assert r.returncode == 0, r.stderr
    (d,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(d["token_ids"]) == 4
    assert 0 < d["ttft_s"] < 60 and d["prompt_tok_s"] > 0 and d["decode_tok_s"] > 0


def test_fast_defaults_give_the_reference_tokens_in_fp32(tiny_ckpt):
    """gk-native + FP8 KV (the default decoder and KV) against the per-layer model on the same FP8 KV, in fp32
    (the tiny checkpoint says bfloat16, which `--dtype auto` would pick: bf16 paths agree only within the
    bound test_gk checks, not token for token)."""
    ids = "5,6,7,8,9,10,11,12,13"
    fast = _generate("--model", str(tiny_ckpt), "--prompt-ids", ids, "--max-tokens", "12", "--json",
                     "--ignore-eos", "--dtype", "float32")
    ref = _generate("--model", str(tiny_ckpt), "--prompt-ids", ids, "--max-tokens", "12", "--json",
                    "--ignore-eos", "--dtype", "float32", "--decoder", "reference", "--kv-dtype", "fp8")
    assert fast.returncode == 0 and ref.returncode == 0, fast.stderr + ref.stderr
    assert json.loads(fast.stdout)["token_ids"] == json.loads(ref.stdout)["token_ids"]


@pytest.mark.parametrize("flag", [["--threads", "0"], ["--threads", "-2"]])
def test_bad_threads_are_refused(tiny_ckpt, flag):
    with pytest.raises(ConfigError, match="--threads"):
        engine_config(build_parser().parse_args(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1",
                                                 *flag]))


def test_without_native_kernels_the_twins_give_the_same_tokens(tiny_ckpt):
    """No kernels (no compiler, or GIGADECODE_NATIVE=0): one warning line, then the torch twins, same tokens."""
    ids = "3,1,4,1,5,9,2,6"
    fast = _generate("--model", str(tiny_ckpt), "--prompt-ids", ids, "--max-tokens", "10", "--json", "--ignore-eos")
    twins = _generate("--model", str(tiny_ckpt), "--prompt-ids", ids, "--max-tokens", "10", "--json",
                      "--ignore-eos", env={"GIGADECODE_NATIVE": "0"})
    assert fast.returncode == 0 and twins.returncode == 0, fast.stderr + twins.stderr
    assert json.loads(fast.stdout)["token_ids"] == json.loads(twins.stdout)["token_ids"]
    warnings = [line for line in twins.stderr.splitlines() if "native kernels unavailable" in line]
    assert len(warnings) == 1 and "GIGADECODE_NATIVE=0" in warnings[0]


def test_serve_prefill_or_decode_needs_a_kv_secret(tiny_ckpt):
    env = {k: v for k, v in os.environ.items() if k != "GIGADECODE_KV_SECRET"}
    for role in ("prefill", "decode"):
        r = subprocess.run([sys.executable, "-m", "gigadecode", "serve", "--model", str(tiny_ckpt), "--role", role,
                            "--port", "0"], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2 and "GIGADECODE_KV_SECRET" in r.stderr and "--kv-secret" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "gigadecode", "serve", "--model", str(tiny_ckpt), "--role", "decode",
                        "--kv-secret", "short"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "at least 16" in r.stderr
