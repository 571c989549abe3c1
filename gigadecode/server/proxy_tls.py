"""The TLS of `gigadecode proxy`'s own connections to its upstream servers (nginx's `proxy_ssl_certificate`,
`proxy_ssl_certificate_key` and `proxy_ssl_trusted_certificate`): the client certificate it presents to
servers that require one (`serve --ssl-cert-reqs 2`, mutual TLS) and the CA bundle it checks their
certificates against.

`--upstream-ssl-ca-certs FILE` replaces the system's CAs (as curl's `--cacert` and nginx's trusted
certificate do): a deployment that names its private CA trusts that CA alone for its servers, not every
public CA as well (concatenate the bundles to trust both). Without it the proxy trusts the system's CAs
(OpenSSL's default paths, which honour `SSL_CERT_FILE` / `SSL_CERT_DIR`). The context built here is the one
`proxy.py` gives its single HTTP client, which sends every upstream request: prefills, decodes (streamed or
not), `/kv/release`, `/tokenize`, `/v1/models` and the `/health` probes.

Each flag is checked at start (a file that is not there, not PEM, an encrypted key, a key that is not the
certificate's): one line naming the flag, before the proxy listens. `failure` words a request's failure
with what an HTTPS server's refusal most likely means, since a server that requires a client certificate
(uvicorn's, for one) just closes the connection after the handshake, with no alert the client can read.
The command line imports this module: no web framework or HTTP client at its top.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
from collections.abc import Sequence
from typing import Any

from .http_options import EncryptedKey, load_cert_chain_unprompted

log = logging.getLogger("gigadecode.proxy")

CERT_FLAG, KEY_FLAG, CA_FLAG = "--upstream-ssl-certfile", "--upstream-ssl-keyfile", "--upstream-ssl-ca-certs"
PEM_CERT, PEM_KEY_END = "-----BEGIN CERTIFICATE-----", "PRIVATE KEY-----"
# TLS alerts a server sends when it refuses the client's certificate (or the lack of one)
CLIENT_CERT_ALERTS = ("CERTIFICATE", "UNKNOWN_CA", "HANDSHAKE_FAILURE", "ACCESS_DENIED")
CLIENT_CERT_HINT = (f" (an HTTPS server that requires a client certificate drops the connection so when the "
                    f"proxy presents none, or one it does not accept: {CERT_FLAG} / {KEY_FLAG})")
CA_HINT = f" (name the CA that signed the servers' certificates with {CA_FLAG})"
NAME_HINT = " (the server's certificate does not name the host of its URL: give a name or address it lists)"


def add_upstream_tls_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS to the upstream servers (https:// URLs)")
    g.add_argument(CERT_FLAG, default=None, metavar="FILE",
                   help="the client certificate (PEM, its chain after it) the proxy presents to servers that "
                        "require one (serve --ssl-cert-reqs 2); with " + KEY_FLAG)
    g.add_argument(KEY_FLAG, default=None, metavar="FILE", help="... and its private key (PEM, unencrypted)")
    g.add_argument(CA_FLAG, default=None, metavar="FILE",
                   help="the CA certificates (PEM) the servers' certificates are checked against, instead of "
                        "the system's (default: the system's CAs; SSL_CERT_FILE names another bundle)")


def _read(flag: str, path: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file")
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None


def upstream_tls_context(args: Any) -> ssl.SSLContext:
    """The context the proxy checks its `https://` servers with and presents its client certificate from;
    ValueError naming the flag for a value that cannot work."""
    cert, key, ca = (getattr(args, a, None) for a in ("upstream_ssl_certfile", "upstream_ssl_keyfile",
                                                      "upstream_ssl_ca_certs"))
    if (cert is None) != (key is None):
        raise ValueError(f"{CERT_FLAG} and {KEY_FLAG} go together (a client certificate needs its key)")
    if ca is None:
        ctx = ssl.create_default_context()
    else:
        if PEM_CERT not in _read(CA_FLAG, ca):
            raise ValueError(f"{CA_FLAG} {ca}: no PEM certificate in it")
        try:
            ctx = ssl.create_default_context(cafile=ca)       # this bundle only, not the system's
        except ssl.SSLError as e:
            raise ValueError(f"{CA_FLAG} {ca}: {e}") from None
    if cert is not None:
        if PEM_CERT not in _read(CERT_FLAG, cert):
            raise ValueError(f"{CERT_FLAG} {cert}: no PEM certificate in it")
        text = _read(KEY_FLAG, key)
        if PEM_KEY_END not in text:
            raise ValueError(f"{KEY_FLAG} {key}: no PEM private key in it")
        try:
            load_cert_chain_unprompted(ctx, cert, key)
        except ssl.SSLError as e:
            if e.reason == "KEY_VALUES_MISMATCH":
                raise ValueError(f"{KEY_FLAG} {key} is not the key of {CERT_FLAG} {cert}") from None
            raise ValueError(f"{CERT_FLAG} {cert} / {KEY_FLAG} {key}: {e}") from None
        except EncryptedKey:
            raise ValueError(f"{KEY_FLAG} {key}: the key is encrypted; give it unencrypted (readable by the "
                             f"proxy's user only)") from None
    return ctx


def warn_if_unused(args: Any, urls: Sequence[str]) -> None:
    """The flags do nothing when no server is reached over HTTPS: said at start (an `http://` typo would
    otherwise send the requests unencrypted, unsaid)."""
    given = [flag for flag, attr in ((CERT_FLAG, "upstream_ssl_certfile"), (CA_FLAG, "upstream_ssl_ca_certs"))
             if getattr(args, attr, None) is not None]
    if given and not any(u.lower().startswith("https://") for u in urls):
        log.warning("%s: no effect: no server URL is https://", " / ".join(given))


def failure(e: BaseException, url: str) -> str:
    """`e` (an httpx error of a request to the server at `url`) in words, with what an HTTPS server's refusal
    most likely means."""
    import httpx
    why = f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} (no details)"
    if not url.lower().startswith("https://"):
        return why
    if "CERTIFICATE_VERIFY_FAILED" in why:
        return why + (NAME_HINT if "mismatch" in why else CA_HINT)
    alert = "ALERT" in why.upper() and any(a in why.upper() for a in CLIENT_CERT_ALERTS)
    if alert or isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return why + CLIENT_CERT_HINT
    return why
