"""Quality as a number: the demo model's answer accuracy on held-out sums per serving configuration
(bench/quality.py's scoring, on a subset here): fp32 must reach 95%, and bf16, FP8 KV and DI (prefill ->
NIXL -> GK decode) must stay within a few points of it. TP×EP runs in `bench/quality.py` and `-m slow`."""

from __future__ import annotations


import pytest

from gigadecode.checkpoint import make_checkpoint
from gigadecode.engine_config import EngineConfig
from gigadecode.tokenizer import TextCodec

from .helpers import load_script

N = 48


def _quality():
    return load_script("bench/quality.py", "bench_quality")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    q = _quality()
    d = make_checkpoint(tmp_path_factory.mktemp("q") / "demo", "demo")
    codec = TextCodec.from_dir(d)
    pairs = q.heldout(d, N)
    return q, d, codec, pairs, q.prompts(codec, pairs, False)


def test_fp32_reaches_95_percent_and_the_fast_paths_keep_it(setup):
    q, d, codec, pairs, plain = setup
    acc = {name: q.score(codec, pairs, q.run_engine(d, EngineConfig(**kw), plain), False)
           for name, kw in q.CONFIGS.items()}
    assert acc["fp32"] >= 0.95, acc
    for name in ("bf16", "fp32 + fp8 KV", "bf16 + fp8 KV"):
        assert acc[name] >= acc["fp32"] - 0.05, acc


def test_di_keeps_the_accuracy(setup):
    q, d, codec, pairs, plain = setup
    di = q.score(codec, pairs[:24], q.run_di(d, plain[:24], dtype="float32", kv_dtype="auto"), False)
    single = q.score(codec, pairs[:24], q.run_engine(d, EngineConfig(dtype="float32", kv_dtype="auto"), plain[:24]),
                     False)
    assert di == single and di >= 0.95


def test_tool_calls(setup):
    q, d, codec, pairs, _ = setup
    tooled = q.prompts(codec, pairs[:24], True)
    assert q.score(codec, pairs[:24], q.run_engine(d, EngineConfig(dtype="float32", kv_dtype="auto"), tooled),
                   True) >= 0.95


@pytest.mark.slow
def test_tp_ep_keeps_the_accuracy(setup):
    q, d, codec, pairs, plain = setup
    assert q.score(codec, pairs[:24], q.run_parallel(d, plain[:24]), False) >= 0.9
