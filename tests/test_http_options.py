"""The HTTP front's deployment flags (vLLM's names), as an operator runs them: `serve` and `proxy` over HTTPS
with a certificate the client trusts (the official openai client), client certificates when asked for, a
path prefix (`--root-path`), CORS for browser pages only when `--allowed-origins` names them, and each bad
value refused at start with the flag's name."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest

from gigadecode.cli import build_parser
from gigadecode.server.api import serve
from gigadecode.server.proxy import run_proxy

from .helpers import stop_process_tree
from .test_serve_di import start_gigadecode
from .test_server import free_port


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 signed by it, a client certificate signed by it, and a
    certificate signed by nobody the server trusts (openssl's command line: no Python package needed)."""
    d = tmp_path_factory.mktemp("pki")
    p = {k: d / f"{k}.pem" for k in ("ca_key", "ca", "key", "csr", "cert", "ckey", "ccsr", "ccert", "okey", "ocert")}
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(p["ca_key"]), "-out", str(p["ca"]),
             "-days", "2", "-subj", "/CN=test-ca")
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for key, csr, cert, cn in (("key", "csr", "cert", "127.0.0.1"), ("ckey", "ccsr", "ccert", "client")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(p[key]), "-out", str(p[csr]),
                 "-subj", f"/CN={cn}")
        _openssl("x509", "-req", "-in", str(p[csr]), "-CA", str(p["ca"]), "-CAkey", str(p["ca_key"]),
                 "-CAcreateserial", "-out", str(p[cert]), "-days", "2", "-extfile", str(ext))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(p["okey"]), "-out", str(p["ocert"]),
             "-days", "2", "-subj", "/CN=other")
    p["ekey"] = d / "ekey.pem"                      # the server's key, encrypted with a passphrase
    _openssl("pkey", "-in", str(p["key"]), "-aes256", "-passout", "pass:secret", "-out", str(p["ekey"]))
    return p


def _wait_up(url: str, proc: subprocess.Popen, verify=True, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", verify=verify, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy in {timeout}s")


def test_serve_and_proxy_over_https_with_cors_and_a_root_path(tiny_ckpt, pki):
    """`serve` with a certificate: the openai client that trusts its CA gets the same tokens as over plain
    HTTP; a client that does not trust it, or speaks plain HTTP, gets nothing. The proxy serves HTTPS too.
    CORS: a browser's preflight from a listed origin is allowed, from another not, and a server without
    --allowed-origins sends no CORS headers at all. --root-path: the prefix a path-routing proxy strips shows
    in the API's links."""
    ca = ssl.create_default_context(cafile=str(pki["ca"]))
    tls = ["--ssl-keyfile", str(pki["key"]), "--ssl-certfile", str(pki["cert"])]
    common = ["--model", str(tiny_ckpt), "--dtype", "float32", "--no-warmup"]
    ports = [free_port() for _ in range(3)]
    plain = start_gigadecode(["serve", *common, "--port", str(ports[0])])
    secure = start_gigadecode(["serve", *common, "--port", str(ports[1]), *tls, "--root-path", "/llm",
                               "--allowed-origins", '["https://app.example"]'])
    procs = [plain, secure]
    try:
        _wait_up(f"http://127.0.0.1:{ports[0]}", plain)
        url = f"https://127.0.0.1:{ports[1]}"
        _wait_up(url, secure, verify=ca)
        body = dict(model=tiny_ckpt.name, prompt=[5, 6, 7], max_tokens=6, temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True})
        want = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key="x").completions.create(**body)
        with httpx.Client(verify=ca) as hc:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", http_client=hc)
            got = client.completions.create(**body)
            assert got.choices[0].token_ids == want.choices[0].token_ids
            # behind a proxy that strips the prefix: the paths as they were, the API's links under it
            assert hc.get(url + "/v1/models").status_code == 200
            assert hc.get(url + "/openapi.json").json()["servers"] == [{"url": "/llm"}]
            allowed = hc.options(url + "/v1/completions", headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            assert allowed.status_code == 200
            assert allowed.headers["access-control-allow-origin"] == "https://app.example"
            other = hc.options(url + "/v1/completions", headers={
                "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
            assert "access-control-allow-origin" not in other.headers
        with pytest.raises(httpx.ConnectError):                      # a client that does not trust the CA
            httpx.get(url + "/health", timeout=5)
        with pytest.raises(httpx.HTTPError):                         # plain HTTP to the TLS port
            httpx.get(f"http://127.0.0.1:{ports[1]}/health", timeout=5)
        r = httpx.options(f"http://127.0.0.1:{ports[0]}/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"}, timeout=5)
        assert "access-control-allow-origin" not in r.headers                 # no CORS unless asked for

        proxy = start_gigadecode(["proxy", "--prefill", f"http://127.0.0.1:{ports[0]}", "--decode",
                                  f"http://127.0.0.1:{ports[0]}", "--port", str(ports[2]), *tls])
        procs.append(proxy)
        _wait_up(f"https://127.0.0.1:{ports[2]}", proxy, verify=ca, timeout=60)
        r = httpx.get(f"https://127.0.0.1:{ports[2]}/health", verify=ca, timeout=5)
        assert r.status_code == 200
    finally:
        for p in procs:
            stop_process_tree(p)


def test_client_certificates_when_required(tiny_ckpt, pki):
    """--ssl-cert-reqs 2 with --ssl-ca-certs: a client with a certificate the CA signed is served, one without
    a certificate or with one the CA did not sign is refused in the handshake."""
    port = free_port()
    proc = start_gigadecode(["serve", "--model", str(tiny_ckpt), "--dtype", "float32", "--no-warmup",
                             "--port", str(port), "--ssl-keyfile", str(pki["key"]), "--ssl-certfile",
                             str(pki["cert"]), "--ssl-ca-certs", str(pki["ca"]), "--ssl-cert-reqs", "2"])
    url = f"https://127.0.0.1:{port}"
    try:
        ctx = ssl.create_default_context(cafile=str(pki["ca"]))
        ctx.load_cert_chain(str(pki["ccert"]), str(pki["ckey"]))
        _wait_up(url, proc, verify=ctx)
        assert httpx.get(url + "/health", verify=ctx, timeout=5).status_code == 200
        for cert in (None, (pki["ocert"], pki["okey"])):
            c = ssl.create_default_context(cafile=str(pki["ca"]))
            if cert is not None:
                c.load_cert_chain(str(cert[0]), str(cert[1]))
            with pytest.raises(httpx.HTTPError):
                httpx.get(url + "/health", verify=c, timeout=5)
    finally:
        stop_process_tree(proc)


@pytest.mark.parametrize("flags, match", [
    (["--ssl-keyfile", "KEY"], "go together"),
    (["--ssl-certfile", "CERT"], "go together"),
    (["--ssl-keyfile", "/nonexistent/key.pem", "--ssl-certfile", "CERT"], "no such file"),
    (["--ssl-keyfile", "OKEY", "--ssl-certfile", "CERT"], "--ssl-certfile / --ssl-keyfile"),   # not its key
    (["--ssl-keyfile", "EKEY", "--ssl-certfile", "CERT"], "--ssl-keyfile .* is encrypted"),      # no prompt
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "CERT", "--ssl-cert-reqs", "2"], "--ssl-ca-certs"),
    (["--root-path", "llm"], "--root-path"),
    (["--root-path", "/llm/"], "--root-path"),
])
def test_bad_http_options_are_refused_at_start(flags, match, pki, tiny_ckpt):
    """Each before anything loads (serve) or listens (proxy), with the flag's name."""
    files = {"KEY": pki["key"], "CERT": pki["cert"], "OKEY": pki["okey"], "EKEY": pki["ekey"]}
    flags = [str(files.get(f, f)) for f in flags]
    for argv, run in ((["serve", "--model", str(tiny_ckpt)], serve),
                      (["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"], run_proxy)):
        args = build_parser().parse_args([*argv, *flags])
        with pytest.raises(ValueError, match=match):
            run(args)


def test_only_the_rank_that_serves_http_checks_its_files(pki, tiny_ckpt, monkeypatch):
    """Under torchrun only world rank 0 serves HTTP: the other ranks (on other nodes, without the certificate
    files) start as they would without the flags, instead of refusing a file they never open."""
    argv = ["serve", "--model", str(tiny_ckpt), "--ssl-keyfile", "/nonexistent/key.pem", "--ssl-certfile",
            str(pki["cert"]), "--engine-stall-timeout-s", "0.5"]         # refused right after the HTTP options
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="--engine-stall-timeout-s"):
        serve(build_parser().parse_args(argv))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="--ssl-keyfile /nonexistent/key.pem: no such file"):
        serve(build_parser().parse_args(argv))


@pytest.mark.parametrize("value", ['["a", 1]', "[broken", '{"a": 1}', '[""]', "app.example", '["https://a.example/x"]'])
def test_cors_lists_must_be_json_lists_of_strings(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["proxy", "--decode", "http://x:1", "--allowed-origins", value])
    assert "--allowed-origins" in capsys.readouterr().err


def test_cors_lists_as_vllm_writes_them():
    args = build_parser().parse_args(["proxy", "--decode", "http://x:1", "--allowed-origins", '["*"]',
                                      "--allowed-methods", '["GET", "POST"]'])
    assert args.allowed_origins == ["*"] and args.allowed_methods == ["GET", "POST"]
    args = build_parser().parse_args(["proxy", "--decode", "http://x:1", "--allowed-origins", "https://a.example:8443"])
    assert args.allowed_origins == ["https://a.example:8443"] and args.allowed_headers == ["*"]


@pytest.mark.parametrize("command", [["serve", "--model", "M"], ["proxy", "--decode", "http://x:1"]])
def test_any_origin_with_credentials_is_refused(command):
    """`'["*"]'` with --allow-credentials: Starlette's CORS answers every origin's preflight with that origin
    and credentials allowed (the spec forbids `*` with credentials, so it echoes the origin instead): any
    site's page could call the API with its visitor's cookies or client certificate and read the answer.
    Refused at start; named origins with credentials, and `*` without, are accepted."""
    from gigadecode.server.http_options import check_http_options
    parse = build_parser().parse_args
    with pytest.raises(ValueError, match="--allow-credentials"):
        check_http_options(parse([*command, "--allowed-origins", '["https://a.example", "*"]', "--allow-credentials"]))
    check_http_options(parse([*command, "--allowed-origins", '["https://a.example"]', "--allow-credentials"]))
    check_http_options(parse([*command, "--allowed-origins", '["*"]']))


def _in_own_mount_namespace() -> bool:
    return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _in_own_mount_namespace(), reason="needs unshare -m (root) to stand in a CA for the system's")
def test_the_proxy_trusts_the_systems_cas(pki, tmp_path):
    """A deployment's own CA installed in the system's store (what the README says the proxy trusts): the
    proxy's health probe reaches `https://` servers whose certificates it signed. The proxy runs in a mount
    namespace of its own whose system bundle (OpenSSL's default CA file) is the test CA, with SSL_CERT_FILE /
    SSL_CERT_DIR unset. httpx's default trust (certifi's bundle) refused them, so both servers stayed out of
    rotation and the proxy answered 503."""
    system_bundle = os.path.realpath(ssl.get_default_verify_paths().openssl_cafile)
    if not os.path.isfile(system_bundle):
        pytest.skip(f"no system CA bundle at {system_bundle}")

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:          # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a) -> None:
            pass
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(str(pki["cert"]), str(pki["key"]))
    upstream.socket = tls.wrap_socket(upstream.socket, server_side=True)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    url, port = f"https://127.0.0.1:{upstream.server_address[1]}", free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    proxy = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"',
         "sh", str(pki["ca"]), system_bundle, sys.executable, "-m", "gigadecode", "proxy", "--prefill", url, "--decode",
         url, "--port", str(port), "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, r = time.monotonic() + 30, None
        while time.monotonic() < deadline and proxy.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert r is not None and r.status_code == 200, r.text if r is not None else proxy.stdout.read()
    finally:
        stop_process_tree(proxy)
        upstream.shutdown()


def test_cors_flags_without_origins_are_said_to_do_nothing(caplog):
    """vLLM's CORS is on by default, ours only with --allowed-origins: the other CORS flags alone would do
    nothing, and the server says so at start."""
    from gigadecode.server.http_options import check_http_options
    args = build_parser().parse_args(["proxy", "--decode", "http://x:1", "--allow-credentials",
                                      "--allowed-methods", '["POST"]'])
    with caplog.at_level("WARNING", logger="gigadecode.server"):
        check_http_options(args)
    assert "--allow-credentials / --allowed-methods: no effect without --allowed-origins" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="gigadecode.server"):
        check_http_options(build_parser().parse_args(["proxy", "--decode", "http://x:1"]))
    assert caplog.text == ""
