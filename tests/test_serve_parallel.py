"""`torchrun --nproc-per-node 4 -m gigadecode serve --tp 2 --dp 2 --ep 4`: the OpenAI server in front of the
parallel engine, driven with the official `openai` client. Greedy and seeded outputs (completions and
chat, streamed and not, concurrent) equal the single-rank engine's; a cancelled stream and a bad request
leave the server serving and no KV block in use; SIGTERM stops every rank; a SIGKILLed rank ends every open
stream with the error within seconds and the server exits; so does a SIGSTOPped (hung) rank, within
--distributed-timeout-s, while an idle server with a short one stays healthy.

Disaggregated serving across TP sizes (prefill tp=1 -> decode tp=2 and the reverse, prefill tp 1 / 2 ->
decode tp 4 with decode context parallel 2, and a prefill of two DP groups, behind the proxy):
token-identical to the single node for prompt lengths across block and window edges, both pools back to
empty; one corrupted kv head is refused by its decode group with the CRC error and serving goes on; a prefill
whose KV will never be read (released by the router, or refused by the decode side behind the proxy) frees it
on every rank at once, not when its lease runs out (in either DP group); `/metrics` counts the leases and
every decode rank's KV bytes.

The 4-rank server keeps fp32 KV, so its greedy tokens are also checked against transformers' own; the DI
stacks keep FP8 KV (the decode default) and are checked against the single rank with the same flags."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import openai
import pytest

from gigadecode.cli import build_parser
from gigadecode.connector.params import parse_kv_params, sign
from gigadecode.sampling import SamplingParams
from gigadecode.server.api import engine_from_args

from .helpers import KV_SECRET, descendants, hf_greedy, random_prompt, stop_process_tree
from .test_serve_di import di_servers, start_gigadecode
from .test_server import (assert_chat_equals_transformers, assert_completion_ids, free_port, metrics, stream_and_cancel,
                          wait_health, wait_idle)

MODEL = "tiny"
BASE_FLAGS = ["--served-model-name", MODEL, "--dtype", "float32", "--num-blocks", "256", "--block-size", "4"]
# fp32 compute and fp32 KV: transformers' numbers (FP8 KV rounds what it stores, so it is not token-identical)
FLAGS = BASE_FLAGS + ["--kv-dtype", "auto"]
DI_FLAGS = BASE_FLAGS + ["--kv-dtype", "fp8", "--kv-lease-s", "5"]


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    port = free_port()
    proc = start_gigadecode(["serve", "--model", str(tiny_ckpt), "--role", "both", "--port", str(port), "--tp", "2",
                             "--dp", "2", "--ep", "4", *FLAGS], ranks=4)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc, timeout=180)
        yield url, proc
    finally:
        stop_process_tree(proc)


@pytest.fixture(scope="module")
def single(tiny_ckpt):
    return engine_from_args(build_parser().parse_args(["serve", "--model", str(tiny_ckpt), *FLAGS]), "both")


@pytest.fixture(scope="module")
def single_fp8(tiny_ckpt):
    """The single-rank engine with the DI stacks' flags (FP8 KV)."""
    return engine_from_args(build_parser().parse_args(["serve", "--model", str(tiny_ckpt), *DI_FLAGS]), "both")


def _want(engine, prompt, **kw):
    return engine.generate([prompt], SamplingParams(**kw))[0].output_ids


def test_parallel_server_equals_single_rank(server, single, tiny_ckpt):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    extra = {"ignore_eos": True, "return_token_ids": True}
    for n in (1, 6, 19):
        prompt = random_prompt(n, 1024, seed=900 + n)
        assert_completion_ids(client, MODEL, prompt, _want(single, prompt, temperature=0.0, max_tokens=10,
                                                           ignore_eos=True))
    prompt = random_prompt(9, 1024, seed=1)
    want = _want(single, prompt, temperature=0.9, top_p=0.95, seed=42, max_tokens=8, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.9, top_p=0.95, seed=42,
                                  extra_body=extra)
    assert r.choices[0].model_extra["token_ids"] == want

    from gigadecode.tokenizer import TextCodec
    msgs = [{"role": "user", "content": "Which ranks hold the experts?"}]
    want = _want(single, TextCodec.from_dir(tiny_ckpt).apply_chat_template(msgs), temperature=0.0, max_tokens=8,
                 ignore_eos=True)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.0, extra_body=extra)
    assert r.choices[0].model_extra["token_ids"] == want

    with pytest.raises(openai.BadRequestError):                  # too long: refused, the server keeps serving
        client.completions.create(model=MODEL, prompt=[1] * 5000, max_tokens=2)


def test_parallel_server_equals_transformers(server, hf_model, tiny_ckpt):
    """tp 2 × dp 2 × ep 4 serves transformers' own greedy tokens (its `generate`, fp32, same checkpoint), for
    completions across block and window edges (whole and streamed, through both DP groups) and chat."""
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    for n in (1, 4, 17, 40):
        prompt = random_prompt(n, 1024, seed=950 + n)
        assert_completion_ids(client, MODEL, prompt, hf_greedy(hf_model, prompt, 10))
    assert_chat_equals_transformers(client, MODEL, hf_model, tiny_ckpt,
                                    [{"role": "user", "content": "Which ranks hold the experts?"}], 8)


def test_parallel_server_concurrent_streams_and_cancellation(server, single):
    url, _ = server
    prompts = [random_prompt(3 + (i * 5) % 25, 1024, seed=50 + i) for i in range(12)]
    want = {i: _want(single, p, temperature=0.0, max_tokens=6, ignore_eos=True)
            for i, p in enumerate(prompts) if i % 3}

    got = stream_and_cancel(url, MODEL, prompts, 6, {i for i in range(12) if i % 3 == 0}, 300)
    for i in want:
        assert got[i] == want[i], i
    m = wait_idle(url, timeout=30)
    assert m["gigadecode_kv_blocks_total"] == 2 * 255              # two DP groups, a pool each


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"       # a zombie has exited
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


def test_parallel_server_stops_every_rank_on_sigterm(server):
    url, proc = server
    port = url.rsplit(":", 1)[1]
    tree = descendants(proc.pid)
    ranks = [p for p in tree if "gigadecode serve" in _cmdline(p) and f"--port {port}" in _cmdline(p)]
    assert len(ranks) == 4, [(p, _cmdline(p)) for p in tree]
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(60)
    took = time.monotonic() - t0
    # torchrun's agent turns the SIGTERM it got into a SignalException, forwards it to the ranks, waits for
    # them and exits 1 (not killed, not a crash code) ...
    assert rc == 1, rc
    # ... soon: within its 30 s grace, after which it would SIGKILL a rank that did not leave by itself
    assert took < 20, f"torchrun took {took:.1f} s to stop"
    left = [p for p in tree if _alive(p)]
    assert not left, [(p, _cmdline(p)) for p in left]           # no rank (nor anything a rank started) is left
    out = proc.stdout.read()
    # every rank left cleanly (torchrun's own agent still reports the signal it got, with a traceback)
    assert "[rank" not in out and "engine.step() failed" not in out, out[-3000:]


def _rank_pid(proc, rank: int) -> int:
    """The pid of torchrun's worker of world rank `rank` (its environment says which)."""
    for pid in descendants(proc.pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and b"LOCAL_RANK" in env and "gigadecode" in _cmdline(pid):
            return pid
    raise AssertionError(f"no rank {rank} under torchrun {proc.pid}")


def _stream_ids(url: str, prompt: list[int], seen: dict, max_tokens: int = 400) -> None:
    """A greedy completion streamed with httpx: seen gets "ids" (as they come), "error" and "done"."""
    import httpx
    seen.update(ids=[], error=None, done=False)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,  # two of 400 fit the 255 blocks of 4
            "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        seen["status"] = r.status_code
        for line in r.iter_lines():
            if line == "data: [DONE]":
                seen["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    seen["error"] = event["error"]["message"]
                for choice in event.get("choices", []):
                    seen["ids"] += choice.get("token_ids") or []


def test_parallel_server_whose_rank_is_killed_fails_its_streams_and_exits(tiny_ckpt, single):
    """`torchrun … serve --tp 2 --ep 2` whose rank 1 is SIGKILLed while two streams decode: each stream ends
    within seconds with the error (not gloo's 30-minute timeout), its tokens a prefix of the single rank's
    answer (none computed after the failure), and torchrun exits non-zero with no rank left on the port."""
    import httpx
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_gigadecode(["serve", "--model", str(tiny_ckpt), "--role", "both", "--port", str(port), "--tp", "2",
                             "--ep", "2", *FLAGS], ranks=2)
    try:
        wait_health(url, proc, timeout=180)
        tree = descendants(proc.pid)
        prompts = [random_prompt(n, 1024, seed=700 + n) for n in (3, 11)]
        seen = [{} for _ in prompts]
        streams = [threading.Thread(target=_stream_ids, args=(url, p, s), daemon=True) for p, s in zip(prompts, seen)]
        for t in streams:
            t.start()
        t0 = time.monotonic()
        while not all(s.get("ids") for s in seen):                  # both decode
            assert time.monotonic() - t0 < 60 and all(t.is_alive() for t in streams), seen
            time.sleep(0.02)
        os.kill(_rank_pid(proc, 1), signal.SIGKILL)
        for t in streams:
            t.join(20)
        assert not any(t.is_alive() for t in streams), "a stream hung after its rank died"
        for prompt, s in zip(prompts, seen):
            assert s["error"] is not None and "parallel engine stopped" in s["error"], s["error"]
            # what happened, in an operator's words (not "rank 0: engine step failed"), gloo's error kept
            assert "parallel engine stopped: peer rank 1 of the world was lost: rank 0's " in s["error"], s["error"]
            assert "gloo" in s["error"], s["error"]
            assert s["done"] and len(s["ids"]) < 400
            assert s["ids"] == _want(single, prompt, temperature=0.0, max_tokens=len(s["ids"]), ignore_eos=True)
        rc = proc.wait(30)
        assert rc != 0
        out = proc.stdout.read()
        assert "gigadecode serve: the engine stopped" in out, out[-3000:]
        left = [p for p in tree if _alive(p)]
        assert not left, [(p, _cmdline(p)) for p in left]
        with pytest.raises(httpx.ConnectError):                     # nothing answers on the port any more
            httpx.get(url + "/health", timeout=2)
    finally:
        stop_process_tree(proc)


def _resume_and_kill(pids: list[int]) -> None:
    """Cleanup after a test that stopped a rank: wake it (a stopped process holds its SIGTERM) and kill it."""
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def test_parallel_server_whose_rank_hangs_fails_its_streams_and_exits(tiny_ckpt, single):
    """`torchrun … serve --tp 2 --ep 2 --distributed-timeout-s 3` whose rank 1 is SIGSTOPped while a stream
    decodes (a hung rank: alive, its sockets open, answering nothing): rank 0's collective gives up after 3 s
    instead of gloo's 30 minutes, the stream ends with "peer rank 1 did not answer within 3 s (hung?", its
    tokens a prefix of the single rank's, and rank 0 exits with the reason, leaving the port. torchrun then
    SIGTERMs the stopped rank and would SIGKILL it after its own 30 s grace; here it is SIGCONTed instead, finds
    rank 0 gone, leaves, and torchrun exits non-zero with nothing left."""
    import httpx
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_gigadecode(["serve", "--model", str(tiny_ckpt), "--role", "both", "--port", str(port), "--tp", "2",
                             "--ep", "2", "--threads", "1", "--distributed-timeout-s", "3", *FLAGS], ranks=2)
    ranks: list[int] = []
    try:
        wait_health(url, proc, timeout=180)
        tree = descendants(proc.pid)
        ranks += [_rank_pid(proc, r) for r in (0, 1)]
        prompt = random_prompt(7, 1024, seed=77)
        seen: dict = {}
        stream = threading.Thread(target=_stream_ids, args=(url, prompt, seen), daemon=True)
        stream.start()
        t0 = time.monotonic()
        while not seen.get("ids"):
            assert time.monotonic() - t0 < 60 and stream.is_alive(), seen
            time.sleep(0.02)
        os.kill(ranks[1], signal.SIGSTOP)
        t_stop = time.monotonic()
        stream.join(20)
        took = time.monotonic() - t_stop
        assert not stream.is_alive(), "the stream hung with its rank"
        assert 2.5 <= took < 10, f"the stream ended {took:.1f} s after the rank stopped"  # 3 s from a wait
        assert seen["error"] is not None and seen["done"], seen
        assert "parallel engine stopped: peer rank 1 did not answer within 3 s (hung?" in seen["error"], seen["error"]
        assert "gloo" in seen["error"], seen["error"]
        assert 0 < len(seen["ids"]) < 400
        assert seen["ids"] == _want(single, prompt, temperature=0.0, max_tokens=len(seen["ids"]), ignore_eos=True)
        while _alive(ranks[0]) and time.monotonic() - t_stop < 20:       # rank 0 shuts down and exits
            time.sleep(0.1)
        assert not _alive(ranks[0]), "rank 0 kept running after its peer hung"
        with pytest.raises(httpx.ConnectError):                     # nothing answers on the port any more
            httpx.get(url + "/health", timeout=2)
        assert proc.poll() is None, "torchrun left before its stopped rank"   # it waits on the stopped rank ...
        os.kill(ranks[1], signal.SIGCONT)                                       # ... which, woken, leaves
        rc = proc.wait(20)
        assert rc != 0
        out = proc.stdout.read()
        assert "gigadecode serve: the engine stopped: " in out and "did not answer within 3 s" in out, out[-3000:]
        left = [p for p in tree if _alive(p)]
        assert not left, [(p, _cmdline(p)) for p in left]
    finally:
        _resume_and_kill([p for p in ranks if _alive(p)])
        stop_process_tree(proc)


def test_parallel_server_idle_for_several_timeouts_stays_healthy(tiny_ckpt, single):
    """A short `--distributed-timeout-s` (2 s) does not fail an idle world: rank 0 steps the engine even with no
    work (every `IDLE_STEP_S`), so no rank waits in a collective for long. After 4 timeouts of idling (health
    checked throughout) the server answers a request with the single rank's tokens."""
    import httpx
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_gigadecode(["serve", "--model", str(tiny_ckpt), "--role", "both", "--port", str(port), "--tp", "2",
                             "--ep", "2", "--threads", "1", "--distributed-timeout-s", "2", *FLAGS], ranks=2)
    try:
        wait_health(url, proc, timeout=180)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 8:
            r = httpx.get(url + "/health", timeout=2)
            assert r.status_code == 200, (round(time.monotonic() - t0, 1), r.text)
            time.sleep(0.5)
        prompt = random_prompt(9, 1024, seed=99)
        seen: dict = {}
        _stream_ids(url, prompt, seen, max_tokens=16)
        assert seen["error"] is None and seen["done"], seen
        assert seen["ids"] == _want(single, prompt, temperature=0.0, max_tokens=16, ignore_eos=True)
        assert proc.poll() is None
    finally:
        stop_process_tree(proc)


def test_parallel_server_whose_torchrun_is_killed_stops_every_rank(tiny_ckpt):
    """SIGKILL of torchrun itself (nothing left to forward a signal, and each rank is in a session of its own):
    every rank stops as on SIGTERM, rank 0 ending the open stream with "the server is shutting down", and
    nothing is left serving or holding the port (before, both ranks served on)."""
    import httpx
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_gigadecode(["serve", "--model", str(tiny_ckpt), "--role", "both", "--port", str(port), "--tp", "2",
                             "--ep", "2", "--shutdown-timeout-s", "0.5", *FLAGS], ranks=2)
    ranks: list[int] = []                   # torchrun's children (once it is dead, no longer its descendants)
    try:
        wait_health(url, proc, timeout=180)
        ranks += [_rank_pid(proc, r) for r in (0, 1)]
        seen: dict = {}
        stream = threading.Thread(target=_stream_ids, args=(url, random_prompt(5, 1024, seed=3), seen), daemon=True)
        stream.start()
        t0 = time.monotonic()
        while not seen.get("ids"):
            assert time.monotonic() - t0 < 60 and stream.is_alive(), seen
            time.sleep(0.02)
        proc.kill()
        proc.wait(10)
        stream.join(20)
        assert not stream.is_alive(), "the stream hung after torchrun died"
        assert seen["done"] and (seen["error"] is None or "shutting down" in seen["error"]), seen["error"]
        t0 = time.monotonic()
        while any(_alive(p) for p in ranks) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        left = [p for p in ranks if _alive(p)]
        assert not left, [(p, _cmdline(p)) for p in left]
        with pytest.raises(httpx.ConnectError):                     # nothing answers on the port any more
            httpx.get(url + "/health", timeout=2)
    finally:
        for pid in descendants(proc.pid) + [p for p in ranks if _alive(p)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stop_process_tree(proc)


# --------------------------------------------------------------------------------------------------
# disaggregated serving across TP sizes (head_ratio != 1) behind the proxy
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[(1, 2, 1, 1), (2, 1, 1, 1), (1, 4, 2, 1), (2, 4, 2, 1), (1, 1, 1, 2)],
                ids=["prefill-tp1-decode-tp2", "prefill-tp2-decode-tp1", "prefill-tp1-decode-tp4-dcp2",
                     "prefill-tp2-decode-tp4-dcp2", "prefill-dp2-decode-tp1"])
def di_stack(request, tiny_ckpt):
    """Prefill and decode of other TP sizes; with dcp 2 each decode rank reads only the blocks of its tokens
    (tp 4 over 2 kv heads: without DCP every kv head would be held twice); a prefill of two DP groups."""
    p_tp, d_tp, dcp, p_dp = request.param
    tp = lambda n: ["--tp", str(n), "--ep", str(n)] if n > 1 else []      # noqa: E731
    d_flags = tp(d_tp) + (["--dcp", str(dcp)] if dcp > 1 else []) + DI_FLAGS
    p_flags = tp(p_tp) + (["--dp", str(p_dp)] if p_dp > 1 else []) + DI_FLAGS
    with di_servers(tiny_ckpt, p_flags, d_flags, p_tp * p_dp, d_tp) as urls:
        yield {**urls, "decode_ranks": d_tp, "dcp": dcp, "prefill_groups": p_dp}


def _pools_back(stack) -> dict:
    wait_idle(stack["prefill"], timeout=20)
    return wait_idle(stack["decode"], timeout=20)


def test_di_across_tp_sizes_equals_single_node(di_stack, single_fp8):
    client = openai.OpenAI(base_url=di_stack["proxy"] + "/v1", api_key="x", max_retries=0, timeout=120)
    for n in (1, 5, 15, 19, 38, 55):             # nothing to send; N % block == block-1 (the N-1 rule); > 3 windows
        prompt = random_prompt(n, 1024, seed=800 + n)
        assert_completion_ids(client, MODEL, prompt, _want(single_fp8, prompt, temperature=0.0, max_tokens=8,
                                                           ignore_eos=True))
    m = _pools_back(di_stack)
    assert m["gigadecode_kv_bytes_transferred_total"] > 0 and m["gigadecode_kv_transfer_failures_total"] == 0
    import httpx
    text = httpx.get(di_stack["decode"] + "/metrics", timeout=10).text    # every decode rank's own pool
    ranks = [ln for ln in text.splitlines() if ln.startswith("gigadecode_kv_rank_blocks_used{")]
    assert len(ranks) == di_stack["decode_ranks"] and all(ln.endswith(" 0.0") for ln in ranks), ranks


def test_di_across_tp_sizes_counts_the_whole_kv_moved(di_stack, tiny_ckpt):
    """`gigadecode_kv_bytes_transferred` is a request's whole KV whatever the TP sizes: every decode rank reads
    its own heads (and with DCP its own blocks), and all of them count (it counted the first rank's only)."""
    import httpx

    from gigadecode.config import GptOssConfig
    from gigadecode.engine_config import EngineConfig
    from gigadecode.kv.cache import KVCache
    before = _pools_back(di_stack)["gigadecode_kv_bytes_transferred_total"]
    prompt = random_prompt(41, 1024, seed=9)
    params = httpx.post(di_stack["prefill"] + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    ).json()["kv_transfer_params"]
    r = httpx.post(di_stack["decode"] + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    kv = KVCache(GptOssConfig.from_hf(tiny_ckpt), EngineConfig(kv_dtype="fp8", block_size=4), 2)
    per_block = sum(2 * buf[0][0].nbytes for buf in kv.group_bufs)         # K and V of a block, every buffer
    moved = _pools_back(di_stack)["gigadecode_kv_bytes_transferred_total"] - before
    assert moved == per_block * sum(len(ids) for ids in params["remote_block_ids"])


def test_di_across_tp_sizes_refuses_one_corrupted_head(di_stack, single_fp8):
    """One kv head's CRC is wrong: the decode rank (or the one engine) holding it refuses, its TP group
    agrees, the request fails with a clear error, nothing is decoded from it, and serving goes on."""
    import httpx
    prompt = random_prompt(19, 1024, seed=5)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(di_stack["prefill"] + "/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]
    ranks = params["remote_ranks"] if params.get("remote_ranks") else [params]
    assert len(ranks) == (2 if len(params.get("remote_ranks") or []) == 2 else 1)
    last = ranks[-1]
    last["kv_crc32_heads"] = last["kv_crc32_heads"][:-1] + [last["kv_crc32_heads"][-1] ^ 1]
    last["kv_crc32"] = last["kv_crc32"] ^ 1
    # signed again with the deployment key: bytes that changed after the CRC was taken look like this
    params = sign(parse_kv_params(params), KV_SECRET.encode()).to_dict()
    r = httpx.post(di_stack["decode"] + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
        "kv_transfer_params": params})
    assert r.status_code == 500 and "CRC32 mismatch" in r.json()["error"]["message"], r.text
    client = openai.OpenAI(base_url=di_stack["proxy"] + "/v1", api_key="x", max_retries=0, timeout=120)
    want = _want(single_fp8, prompt, temperature=0.0, max_tokens=4, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want
    m = _pools_back(di_stack)                     # the corrupted one's lease expired (5 s)
    assert m["gigadecode_kv_transfer_failures_total"] >= 1


def test_di_across_tp_sizes_releases_unread_prefill_kv(di_stack):
    """Params the decode side will never read: the prefill's lease ends at once on every rank of its TP group
    (the router's `/kv/release`, and the proxy when the decode server refuses), well before its 5 s run out."""
    import httpx
    _pools_back(di_stack)
    prompt = random_prompt(38, 1024, seed=21)
    t0 = time.monotonic()
    groups = di_stack["prefill_groups"]
    kvs = [httpx.post(di_stack["prefill"] + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    ).json()["kv_transfer_params"] for _ in range(groups)]          # a lease counts as load: one in each group
    assert len({kv["remote_engine_id"] for kv in kvs}) == groups
    m = metrics(di_stack["prefill"])
    assert m["gigadecode_kv_blocks_used"] > 0 and m["gigadecode_kv_leases"] == groups                # leased
    for kv in kvs:                     # a DP group's answers name its own rank: each is released
        r = httpx.post(di_stack["prefill"] + "/kv/release", json={"kv_transfer_params": kv}, timeout=30)
        assert r.status_code == 200 and r.json() == {"released": True}, r.text
    assert wait_idle(di_stack["prefill"], timeout=2.5)["gigadecode_kv_leases"] == 0
    assert time.monotonic() - t0 < 4.5, "the lease ran out instead"
    kv = kvs[-1]
    assert httpx.post(di_stack["prefill"] + "/kv/release", json={"kv_transfer_params": kv},
                      timeout=30).json() == {"released": False}                      # nothing left to release
    t0 = time.monotonic()
    r = httpx.post(di_stack["proxy"] + "/v1/completions", timeout=60, json={     # only the decode side refuses n=0
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    wait_idle(di_stack["prefill"], timeout=2.5)
    assert time.monotonic() - t0 < 4.5, "the lease ran out instead"
