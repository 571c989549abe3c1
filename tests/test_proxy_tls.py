"""The proxy's TLS toward its servers (`--upstream-ssl-certfile`, `--upstream-ssl-keyfile`,
`--upstream-ssl-ca-certs`): a prefill and a decode server that require client certificates signed by a
private CA (`serve --ssl-cert-reqs 2`, mutual TLS) are out of reach for a proxy without them, which says why
in its /health and its 502s, and serve a DI completion and a streamed chat through one with them; each bad
value is refused at start with the flag's name."""

from __future__ import annotations

import contextlib
import json
import ssl
import time

import httpx
import openai
import pytest

from gigadecode.cli import build_parser, main
from gigadecode.server.proxy import build_proxy_app
from gigadecode.server.proxy_tls import upstream_tls_context, warn_if_unused

from .helpers import stop_process_tree
from .test_http_options import _openssl, _wait_up, pki  # noqa: F401  (pki: the test CA's fixture)
from .test_serve_di import start_gigadecode
from .test_server import ServerThread, free_port

SERVER_FLAGS = ["--dtype", "float32", "--no-warmup", "--num-blocks", "64", "--block-size", "16", "--kv-lease-s", "10",
                "--kv-secret", "mtls-test-secret"]


def _proxy_health(url: str, want: int, timeout: float = 30.0) -> dict:
    """The proxy's /health once it answers `want` with every server probed at least once."""
    deadline, body = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=2)
            body = r.json()
            probed = all(s["healthy"] is not None for role in ("prefill", "decode") for s in body[role].values())
            if r.status_code == want and probed:
                return body
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}/health did not answer {want} in {timeout} s: {body}")


def test_the_proxy_reaches_servers_that_require_client_certificates(tiny_ckpt, pki):  # noqa: F811
    """Prefill and decode servers with --ssl-cert-reqs 2 and a private CA. A proxy that trusts only the system's
    CAs, and one that trusts the CA but has no client certificate, find both out of rotation (/health 503
    naming the flag that is missing) and answer a completion and a streamed chat with a 502 that names it, at
    once. With the client certificate and the CA (`gigadecode proxy` with the flags) the DI hand-off runs (the
    decode server read the prefill's KV), a streamed chat ends with [DONE], /v1/models and /health answer 200."""
    mtls = ["--ssl-keyfile", str(pki["key"]), "--ssl-certfile", str(pki["cert"]), "--ssl-ca-certs", str(pki["ca"]),
            "--ssl-cert-reqs", "2"]
    ports = [free_port() for _ in range(3)]
    pre, dec = (f"https://127.0.0.1:{p}" for p in ports[:2])
    procs = [start_gigadecode(["serve", "--model", str(tiny_ckpt), "--role", role, "--port", str(port),
                               *SERVER_FLAGS, *mtls]) for role, port in (("prefill", ports[0]), ("decode", ports[1]))]
    procs.append(start_gigadecode(["proxy", "--prefill", pre, "--decode", dec, "--port", str(ports[2]),
                                   "--upstream-ssl-ca-certs", str(pki["ca"]), "--upstream-ssl-certfile",
                                   str(pki["ccert"]), "--upstream-ssl-keyfile", str(pki["ckey"])]))
    parse = build_parser().parse_args
    without = {"--upstream-ssl-ca-certs": [],                       # the system's CAs: the private CA is unknown
               "--upstream-ssl-certfile": ["--upstream-ssl-ca-certs", str(pki["ca"])]}     # no client certificate
    try:
        ctx = ssl.create_default_context(cafile=str(pki["ca"]))
        ctx.load_cert_chain(str(pki["ccert"]), str(pki["ckey"]))
        for url, proc in ((pre, procs[0]), (dec, procs[1])):
            _wait_up(url, proc, verify=ctx)
        chat = {"model": tiny_ckpt.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "stream": True}
        with contextlib.ExitStack() as stack:                   # (in this process: two fewer to start)
            proxies = {flag: stack.enter_context(ServerThread(build_proxy_app(
                [pre], [dec], upstream_tls=upstream_tls_context(parse(["proxy", "--decode", dec, *flags])))))
                for flag, flags in without.items()}
            for flag, px in proxies.items():
                health = _proxy_health(px.url, 503)
                assert health["reason"] == "no prefill server in rotation; no decode server in rotation", flag
                for role, server in (("prefill", pre), ("decode", dec)):
                    assert flag in health[role][server]["out_of_rotation_because"], (flag, health)
                t0 = time.monotonic()
                r = httpx.post(px.url + "/v1/completions", json={"model": tiny_ckpt.name, "prompt": [5, 6, 7],
                                                                 "max_tokens": 4}, timeout=30)
                assert r.status_code == 502 and flag in r.json()["error"]["message"], (flag, r.text)
                r = httpx.post(px.url + "/v1/chat/completions", json=chat, timeout=30)
                assert r.status_code == 502 and flag in r.json()["error"]["message"], (flag, r.text)
                assert time.monotonic() - t0 < 10, flag                 # refused at once, not after a hang

        url = f"http://127.0.0.1:{ports[2]}"
        assert _proxy_health(url, 200)["status"] == "ok"
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        got = client.completions.create(model=tiny_ckpt.name, prompt=[5, 6, 7, 8] * 5, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert len(got.choices[0].token_ids) == 6 and got.choices[0].finish_reason == "length"
        with httpx.Client(verify=ctx) as hc:                  # the decode server read the prefill's KV over NIXL
            m = hc.get(dec + "/metrics").text
        read = [float(line.split()[-1]) for line in m.splitlines()
                if line.startswith("gigadecode_kv_bytes_transferred_total")]
        assert read and read[0] > 0, m
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat, timeout=60) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), events
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == tiny_ckpt.name
    finally:
        for p in procs:
            stop_process_tree(p)


@pytest.fixture(scope="module")
def encrypted_key(pki, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("enc") / "ckey.enc.pem"
    _openssl("pkey", "-in", str(pki["ckey"]), "-aes256", "-passout", "pass:secret", "-out", str(path))
    return path


@pytest.mark.parametrize("flags, message", [
    (["--upstream-ssl-certfile", "CCERT"], "--upstream-ssl-certfile and --upstream-ssl-keyfile go together"),
    (["--upstream-ssl-keyfile", "CKEY"], "--upstream-ssl-certfile and --upstream-ssl-keyfile go together"),
    (["--upstream-ssl-certfile", "/nonexistent/c.pem", "--upstream-ssl-keyfile", "CKEY"],
     "--upstream-ssl-certfile /nonexistent/c.pem: no such file"),
    (["--upstream-ssl-certfile", "CCERT", "--upstream-ssl-keyfile", "/nonexistent/k.pem"],
     "--upstream-ssl-keyfile /nonexistent/k.pem: no such file"),
    (["--upstream-ssl-ca-certs", "/nonexistent/ca.pem"], "--upstream-ssl-ca-certs /nonexistent/ca.pem: no such file"),
    (["--upstream-ssl-certfile", "CCERT", "--upstream-ssl-keyfile", "OKEY"], "OKEY is not the key of "
                                                                             "--upstream-ssl-certfile CCERT"),
    (["--upstream-ssl-certfile", "CKEY", "--upstream-ssl-keyfile", "CKEY"], "CKEY: no PEM certificate in it"),
    (["--upstream-ssl-certfile", "CCERT", "--upstream-ssl-keyfile", "CCERT"], "CCERT: no PEM private key in it"),
    (["--upstream-ssl-certfile", "CCERT", "--upstream-ssl-keyfile", "ENC"], "ENC: the key is encrypted"),
    (["--upstream-ssl-ca-certs", "CKEY"], "--upstream-ssl-ca-certs CKEY: no PEM certificate in it"),
])
def test_bad_upstream_tls_flags_are_refused_at_start(flags, message, pki, encrypted_key, capsys):  # noqa: F811
    """One line on stderr naming the flag and the file, exit status 2 (as every flag error), before the proxy
    listens (its upstreams here would not even answer)."""
    files = {"CCERT": str(pki["ccert"]), "CKEY": str(pki["ckey"]), "OKEY": str(pki["okey"]), "ENC": str(encrypted_key)}
    for name, path in files.items():
        message = message.replace(name, path)
    code = main(["proxy", "--prefill", "https://127.0.0.1:1", "--decode", "https://127.0.0.1:2", "--port",
                 str(free_port()), *[files.get(f, f) for f in flags]])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("gigadecode proxy: error: --upstream-ssl-") and message in err and err.count("\n") == 1, err


def test_the_ca_bundle_replaces_the_systems(pki):  # noqa: F811
    """--upstream-ssl-ca-certs: the servers are checked against that CA alone (not every public CA as well);
    the client certificate is loaded with it."""
    args = build_parser().parse_args(["proxy", "--decode", "https://x:1", "--upstream-ssl-ca-certs", str(pki["ca"]),
                                      "--upstream-ssl-certfile", str(pki["ccert"]), "--upstream-ssl-keyfile",
                                      str(pki["ckey"])])
    ctx = upstream_tls_context(args)
    assert [c["subject"] for c in ctx.get_ca_certs()] == [((("commonName", "test-ca"),),)]
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


def test_upstream_tls_flags_without_an_https_server_are_said_to_do_nothing(pki, caplog):  # noqa: F811
    parse = build_parser().parse_args
    args = parse(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2", "--upstream-ssl-ca-certs", str(pki["ca"])])
    with caplog.at_level("WARNING", logger="gigadecode.proxy"):
        warn_if_unused(args, ["http://a:1", "http://b:2"])
    assert "--upstream-ssl-ca-certs: no effect: no server URL is https://" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="gigadecode.proxy"):
        warn_if_unused(args, ["http://a:1", "https://b:2"])
    assert caplog.text == ""
