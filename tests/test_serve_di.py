"""Disaggregated serving end to end: `gigadecode serve --role prefill` and `--role decode` as separate
processes behind `gigadecode proxy`, driven with the official `openai` client. Outputs equal the
single-node engine; 64 concurrent streams complete; streams cancelled mid-way leave no KV blocks in use
on either engine (read from /metrics)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from gigadecode.cli import build_parser
from gigadecode.sampling import SamplingParams
from gigadecode.server.api import build_engine

from .helpers import random_prompt, stop_process_tree
from .test_server import assert_completion_ids, free_port, metrics, stream_and_cancel, wait_health, wait_idle

MODEL = "tiny"
FLAGS = ["--served-model-name", MODEL, "--num-blocks", "512", "--block-size", "16", "--kv-dtype", "fp8", "--max-num-seqs", "64"]


def start_gigadecode(args: list[str], ranks: int = 1) -> subprocess.Popen:
    """`gigadecode ARGS` in a subprocess (under torchrun with `ranks` > 1), one torch thread per process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GIGADECODE_API_KEY": ""}
    head = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(ranks), "--master-port",
            str(free_port())] if ranks > 1 else [sys.executable]
    return subprocess.Popen([*head, "-m", "gigadecode", *args, "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@contextlib.contextmanager
def di_servers(model_dir, prefill_args: list[str], decode_args: list[str], prefill_ranks: int = 1,
               decode_ranks: int = 1):
    """A prefill server, a decode server and the proxy in front -> {"prefill", "decode", "proxy"} URLs."""
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [start_gigadecode(["serve", "--model", str(model_dir), "--role", "prefill", "--port", str(ports[0]),
                               *prefill_args], prefill_ranks),
             start_gigadecode(["serve", "--model", str(model_dir), "--role", "decode", "--port", str(ports[1]),
                               *decode_args], decode_ranks),
             start_gigadecode(["proxy", "--prefill", urls[0], "--decode", urls[1], "--port", str(ports[2])])]
    try:
        for u, p in zip(urls, procs):
            wait_health(u, p, timeout=180)
        yield dict(prefill=urls[0], decode=urls[1], proxy=urls[2])
    finally:
        for p in procs:
            stop_process_tree(p)


@pytest.fixture(scope="module")
def di(tiny_ckpt):
    with di_servers(tiny_ckpt, FLAGS, FLAGS) as urls:
        yield urls


@pytest.fixture(scope="module")
def single(tiny_ckpt):
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), *FLAGS])
    assert args.served_model_name == MODEL
    return build_engine(args, "both")


def _greedy(engine, prompt, n):
    return engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].output_ids


def test_di_completions_equal_single_node(di, single):
    client = openai.OpenAI(base_url=di["proxy"] + "/v1", api_key="x", max_retries=0, timeout=60)
    for n in (1, 15, 16, 17, 31, 47):
        prompt = random_prompt(n, 1024, seed=700 + n)
        assert_completion_ids(client, MODEL, prompt, _greedy(single, prompt, 12))
    m = metrics(di["decode"])
    assert m["gigadecode_kv_bytes_transferred_total"] > 0 and m["gigadecode_kv_transfer_failures_total"] == 0


def test_di_chat(di, single, tiny_ckpt):
    from gigadecode.tokenizer import TextCodec
    msgs = [{"role": "user", "content": "How fast is the decode engine?"}]
    ids = TextCodec.from_dir(tiny_ckpt).apply_chat_template(msgs)
    want = _greedy(single, ids, 10)
    client = openai.OpenAI(base_url=di["proxy"] + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0.0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want


def test_64_concurrent_streams_and_cancellation(di, single):
    prompts = [random_prompt(5 + (i * 7) % 40, 1024, seed=i) for i in range(64)]
    want = {i: _greedy(single, p, 8) for i, p in enumerate(prompts) if i % 2 == 0}

    got = stream_and_cancel(di["proxy"], MODEL, prompts, 8, {i for i in range(64) if i % 2 == 1}, 200)
    for i in want:
        assert got[i] == want[i], i
    for k in ("prefill", "decode"):
        wait_idle(di[k], timeout=30)
