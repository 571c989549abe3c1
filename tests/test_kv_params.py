"""The typed, signed kv_transfer_params (connector/params.py): parsing names the bad field, a signature
covers every field, and verification refuses another key, prompt or KV layout; the handshake token
proves the key and goes stale."""

from __future__ import annotations

import time

import pytest

from gigadecode.connector.params import (KVParamsError, check_handshake_token, check_secret, handshake_token,
                                         kv_layout_id, parse_kv_params, prompt_digest, sign, verify)

KEY = b"unit-test-kv-secret-0123456789"
PROMPT = [5, 17, 200, 3, 9]
LAYOUT = kv_layout_id("m0", "float8_e4m3fn", True, 16, 64, 2, 1, 8)


def signed(**over) -> dict:
    p = parse_kv_params({"do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "10.1.2.3",
                         "remote_port": 5555, "remote_request_id": "r1", "remote_block_ids": [[3, 4], [5, 6, 7]],
                         "remote_first_block": [1, 0], "num_computed_tokens": 4, "lease_expires": time.time() + 30,
                         "kv_crc32": 123, "kv_head_start": 0, "kv_crc32_heads": [1, 2], "kv_layout_id": LAYOUT,
                         "prompt_digest": prompt_digest(PROMPT), **over})
    return sign(p, KEY).to_dict()


def test_roundtrip_verifies():
    verify(parse_kv_params(signed()), KEY, PROMPT, LAYOUT)


@pytest.mark.parametrize("field,value", [
    ("remote_block_ids", [[3, 9], [5, 6, 7]]), ("remote_first_block", [0, 0]), ("num_computed_tokens", 3),
    ("kv_crc32", 124), ("remote_host", "10.1.2.4"), ("remote_port", 5556), ("remote_request_id", "r2"),
    ("lease_expires", time.time() + 3600), ("kv_crc32_heads", [1, 3]), ("issued_at", time.time())])
def test_any_altered_field_breaks_the_signature(field, value):
    with pytest.raises(KVParamsError, match="signature does not match"):
        verify(parse_kv_params({**signed(), field: value}), KEY, PROMPT, LAYOUT)


def test_other_key_prompt_layout_refused():
    with pytest.raises(KVParamsError, match="signature"):
        verify(parse_kv_params(signed()), b"another-secret-0123456789", PROMPT, LAYOUT)
    with pytest.raises(KVParamsError, match="another prompt") as e:
        verify(parse_kv_params(signed()), KEY, PROMPT[:-1] + [10], LAYOUT)
    assert e.value.param == "kv_transfer_params.prompt_digest"
    with pytest.raises(KVParamsError, match="KV layout"):
        verify(parse_kv_params(signed()), KEY, PROMPT, kv_layout_id("m0", "bfloat16", False, 16, 64, 2, 1, 8))
    with pytest.raises(KVParamsError, match="not signed"):
        verify(parse_kv_params({k: v for k, v in signed().items() if k != "signature"}), KEY, PROMPT, LAYOUT)


@pytest.mark.parametrize("raw,path", [
    ({"remote_first_block": ["a", "b"]}, "kv_transfer_params.remote_first_block.0"),
    ({"remote_ranks": "x"}, "kv_transfer_params.remote_ranks"),
    ({"kv_crc32": "x"}, "kv_transfer_params.kv_crc32"),
    ({"kv_crc32": 1 << 40}, "kv_transfer_params.kv_crc32"),
    ({"remote_port": 0}, "kv_transfer_params.remote_port"),
    ({"remote_block_ids": [[1, -2]]}, "kv_transfer_params.remote_block_ids.0.1"),
    ({"num_computed_tokens": True}, "kv_transfer_params.num_computed_tokens"),
    ({"lease_expires": float("inf")}, "kv_transfer_params.lease_expires"),
    ({"remote_ranks": [{"remote_engine_id": "e"}]}, "kv_transfer_params.remote_ranks.0.remote_host"),
    ({"signature": "not hex!"}, "kv_transfer_params.signature"),
    ({"surprise": 1}, "kv_transfer_params.surprise"),
])
def test_malformed_fields_are_named(raw, path):
    with pytest.raises(KVParamsError) as e:
        parse_kv_params({"do_remote_prefill": True, **raw})
    assert e.value.param == path and str(e.value).startswith(path)
    with pytest.raises(KVParamsError, match="JSON object"):
        parse_kv_params(["not", "a", "dict"])


def test_handshake_token_and_secret():
    assert check_handshake_token(KEY, handshake_token(KEY))
    assert not check_handshake_token(KEY, handshake_token(b"another-secret-0123456789"))
    assert not check_handshake_token(KEY, handshake_token(KEY, now=time.time() - 3600))
    assert not check_handshake_token(KEY, None) and not check_handshake_token(KEY, "1.2.3")
    with pytest.raises(ValueError, match="GIGADECODE_KV_SECRET"):
        check_secret(None, "kv_consumer")
    with pytest.raises(ValueError, match="at least 16"):
        check_secret("short", "kv_producer")
