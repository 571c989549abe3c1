"""DI when servers come and go behind the same addresses (a Kubernetes pod restarted in place). With real
servers: a prefill server told to stop (SIGTERM) keeps the KV it answered until the decode server has read it.
"""

from __future__ import annotations

import signal
import socket
import time

import pytest

from .helpers import random_prompt, stop_process_tree


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------
# real servers
# --------------------------------------------------------------------------------------------------
def _serve(model_dir, role: str, port: int, *extra: str):
    from .test_serve_di import FLAGS, start_gigadecode
    return start_gigadecode(["serve", "--model", str(model_dir), "--role", role, "--port", str(port), *FLAGS,
                             *extra])


@pytest.mark.slow
def test_a_prefill_server_told_to_stop_keeps_the_kv_it_answered_until_read(tiny_ckpt):
    """SIGTERM right after a prefill server answered: it stops taking requests but keeps its engine, side
    channel and KV until the decode server has read that KV (then exits at once, long before the grace and the
    lease), so the request decodes to the single node's tokens. It used to exit at once: the decode failed."""
    import httpx

    from .test_serve_di import MODEL
    from .test_server import wait_health
    pp, dp = _free_port(), _free_port()
    prefill = _serve(tiny_ckpt, "prefill", pp, "--kv-lease-s", "60", "--shutdown-timeout-s", "20")
    decode = _serve(tiny_ckpt, "decode", dp)
    try:
        for port, proc in ((pp, prefill), (dp, decode)):
            wait_health(f"http://127.0.0.1:{port}", proc, timeout=180)
        body = {"model": MODEL, "prompt": random_prompt(30, 1024, seed=1400), "max_tokens": 6, "temperature": 0.0,
                "ignore_eos": True}
        want = httpx.post(f"http://127.0.0.1:{dp}/v1/completions", json=body, timeout=60).json()
        kv = httpx.post(f"http://127.0.0.1:{pp}/v1/completions", timeout=60, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        prefill.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        time.sleep(0.5)                                            # its HTTP side is down by now
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"http://127.0.0.1:{pp}/v1/completions", json=body, timeout=5)
        r = httpx.post(f"http://127.0.0.1:{dp}/v1/completions", json={**body, "kv_transfer_params": kv}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
        prefill.wait(15)
        assert time.monotonic() - t0 < 10                          # gone once read: not after 20 s (or 60)
    finally:
        stop_process_tree(prefill)
        stop_process_tree(decode)
