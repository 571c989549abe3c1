"""The HTTP front's deployment options, shared by `serve` and `proxy`, under vLLM's flag names: TLS
(`--ssl-keyfile`, `--ssl-certfile`, `--ssl-ca-certs`, `--ssl-cert-reqs`), a path prefix for a reverse proxy
that routes by path (`--root-path`), and CORS for browser clients (`--allowed-origins`, `--allowed-methods`,
`--allowed-headers`, `--allow-credentials`). The command line imports this module, so it imports no web
framework at its top.

Each is checked before a model loads (a key file that is not there, a JSON list that is not one: one line
at once, not after minutes of loading). Unlike vLLM, which answers every origin's browser requests unless told
otherwise, CORS is off until `--allowed-origins` names origins: a page from any site the user visits could
otherwise drive a server on their machine that has no API key (`--allowed-origins '["*"]'` is vLLM's default).
`'["*"]'` with `--allow-credentials` is refused: Starlette's CORS (vLLM's too) answers it by echoing back
whichever origin asks, credentials allowed, so any site's page could use its visitor's cookies, HTTP auth or
client certificate on the API and read the answers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import ssl
from typing import Any

log = logging.getLogger("gigadecode.server")


ORIGIN = re.compile(r"\*|[a-z][a-z0-9+.-]*://[^/\s]+")       # a browser's Origin: scheme://host[:port]
TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")               # an HTTP method or header name
EXAMPLES = {"--allowed-origins": '["https://app.example"]', "--allowed-methods": '["GET", "POST"]',
            "--allowed-headers": '["authorization", "content-type"]'}


def json_list(flag: str, item: re.Pattern):
    """An argparse type: a JSON list of strings (vLLM's form, `'["https://a.example"]'`) or one bare value,
    each matching `item`."""
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text) if text.lstrip().startswith(("[", "{", '"')) else [text]
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag}: not a JSON list ({e.msg})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) and item.fullmatch(v) for v in value):
            raise argparse.ArgumentTypeError(f"{flag}: expected a JSON list like {EXAMPLES[flag]} (got {text})")
        return value
    return parse


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP (vLLM's names)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="... and this certificate chain (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates that client certificates are checked against (with --ssl-cert-reqs)")
    g.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[0, 1, 2],
                   help="client certificates: 0 not asked for (default), 1 checked when given, 2 required")
    g.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix a reverse proxy serves this server under and strips before passing "
                        "requests on (e.g. /llm), as FastAPI's root_path: the API's own links (/docs, "
                        "/openapi.json) carry it")
    g.add_argument("--allowed-origins", type=json_list("--allowed-origins", ORIGIN), default=None, metavar="JSON",
                   help="CORS: origins whose browser pages may call the API, a JSON list ('[\"*\"]': any, "
                        "vLLM's default); off unless given")
    g.add_argument("--allowed-methods", type=json_list("--allowed-methods", TOKEN), default=["*"], metavar="JSON",
                   help="CORS: methods allowed (default [\"*\"])")
    g.add_argument("--allowed-headers", type=json_list("--allowed-headers", TOKEN), default=["*"], metavar="JSON",
                   help="CORS: request headers allowed (default [\"*\"])")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")


class EncryptedKey(Exception):
    """`load_cert_chain_unprompted` met a key that needs a passphrase."""


def _no_passphrase() -> str:
    raise EncryptedKey


def load_cert_chain_unprompted(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    """`ctx.load_cert_chain(cert, key)`, raising EncryptedKey for an encrypted key where OpenSSL would ask for
    its passphrase on the terminal (or, with none, fail as 'Invalid argument')."""
    ctx.load_cert_chain(cert, key, password=_no_passphrase)


def check_http_options(args: Any) -> None:
    """The options' values, checked before anything loads: ValueError naming the flag."""
    key, cert = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    if (key is None) != (cert is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    ca, reqs = getattr(args, "ssl_ca_certs", None), getattr(args, "ssl_cert_reqs", 0)
    if reqs and (key is None or ca is None):
        raise ValueError("--ssl-cert-reqs 1 or 2 checks client certificates: give --ssl-ca-certs and the "
                         "server's --ssl-keyfile / --ssl-certfile")
    for flag, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert), ("--ssl-ca-certs", ca)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    if key is not None:                          # a key that does not match its certificate, or not PEM
        try:
            load_cert_chain_unprompted(ssl.create_default_context(ssl.Purpose.CLIENT_AUTH), cert, key)
        except EncryptedKey:
            raise ValueError(f"--ssl-keyfile {key}: the key is encrypted; give it unencrypted (readable by the "
                             f"server's user only)") from None
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-certfile / --ssl-keyfile: {e}") from None
    if "*" in (getattr(args, "allowed_origins", None) or []) and getattr(args, "allow_credentials", False):
        # Starlette (as vLLM) then echoes back whatever origin asks, with credentials allowed: any site's page
        # could call the API with its visitor's cookies, HTTP auth or client certificate and read the answers
        raise ValueError("--allow-credentials with --allowed-origins '[\"*\"]' would let a page from any site "
                         "call the API with its visitor's credentials: name the origins instead "
                         "('[\"https://app.example\"]')")
    if not getattr(args, "allowed_origins", None):
        given = [flag for flag, on in (("--allow-credentials", getattr(args, "allow_credentials", False)),
                                       ("--allowed-methods", getattr(args, "allowed_methods", ["*"]) != ["*"]),
                                       ("--allowed-headers", getattr(args, "allowed_headers", ["*"]) != ["*"]))
                 if on]
        if given:                    # vLLM's CORS is on by default; here these would do nothing, unsaid
            log.warning("%s: no effect without --allowed-origins (CORS is off unless origins are named)",
                        " / ".join(given))
    root = getattr(args, "root_path", "") or ""
    if root and (not root.startswith("/") or root.endswith("/") or any(c in root for c in "?# ")):
        raise ValueError(f"--root-path {root!r}: expected a path like /llm (a leading '/', none at the end)")


def uvicorn_options(args: Any) -> dict[str, Any]:
    """The options uvicorn takes (its Config's keyword arguments)."""
    return {"ssl_keyfile": getattr(args, "ssl_keyfile", None), "ssl_certfile": getattr(args, "ssl_certfile", None),
            "ssl_ca_certs": getattr(args, "ssl_ca_certs", None),
            "ssl_cert_reqs": getattr(args, "ssl_cert_reqs", int(ssl.CERT_NONE)),
            "root_path": getattr(args, "root_path", "") or ""}


def scheme(args: Any) -> str:
    return "https" if getattr(args, "ssl_certfile", None) else "http"


def add_cors(app: Any, args: Any) -> None:
    """CORS on the FastAPI `app` when `--allowed-origins` is given (see the module's note on the default)."""
    origins = getattr(args, "allowed_origins", None)
    if origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_credentials=args.allow_credentials,
                           allow_methods=args.allowed_methods, allow_headers=args.allowed_headers)
