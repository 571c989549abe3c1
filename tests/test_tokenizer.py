"""The project's tokenizer: deterministic training, exact vocabulary and special ids, byte-level round
trips, the chat template, transformers' AutoTokenizer agreeing with our codec, and streaming decode."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import transformers

from gigadecode import tokenizer as tk
from gigadecode.checkpoint import preset_config
from gigadecode.tokenizer import (CHAT_TEMPLATE, StreamDecoder, TextCodec, build_tiny_tokenizer, special_tokens,
                                  write_tokenizer_files)

TEXTS = [
    "Hello, world! The model reads the prompt.",
    "  leading spaces, tabs\tand\nnew lines\r\n 12345 67.89 $19.99",
    "naïve café, façade, Ærøskøbing, Zürich",
    "中文字符 and 日本語のテキスト, 한국어",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "combining e\u0301 and zero width \u200b and \U0001F600 and \x00\x01 control",
]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What does a GPU do? 🙂"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok_tiny")
    write_tokenizer_files(d, preset_config("tiny"))
    return d


@pytest.fixture(scope="module")
def codec(tiny_dir) -> TextCodec:
    c = TextCodec.from_dir(tiny_dir)
    assert c is not None
    return c


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_deterministic_bytes(tmp_path, tiny_dir):
    tk._trained.cache_clear()  # retrain, not just rebuild from the cached merges
    write_tokenizer_files(tmp_path, preset_config("tiny"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tiny_dir / name).read_bytes()
    # Another process (other hash seeds) trains the same bytes.
    code = ("import hashlib; from gigadecode.tokenizer import build_tiny_tokenizer as b; "
            "print(hashlib.sha256((b(1024, 2, 0, 1).to_str(pretty=True) + '\\n').encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == sha((tiny_dir / "tokenizer.json").read_bytes())


@pytest.mark.parametrize("vocab_size", [300, 1024, 2500])
def test_exact_vocab_size(vocab_size):
    tok = build_tiny_tokenizer(vocab_size, 2, 0, 1)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    assert sorted(tok.get_vocab(with_added_tokens=True).values()) == list(range(vocab_size))


def test_tiny_has_no_fillers(codec):
    vocab = codec.tokenizer.get_vocab()
    assert codec.vocab_size == preset_config("tiny").vocab_size == 1024
    assert not [t for t in vocab if t.startswith("<|reserved_")]


def test_special_ids(codec):
    cfg = preset_config("tiny")
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_ids) == (0, 1, (2,))
    assert (codec.pad_token_id, codec.bos_token_id, codec.eos_token_id) == (0, 1, 2)
    assert codec.tokenizer.id_to_token(0) == "<|pad|>"
    assert codec.tokenizer.id_to_token(1) == "<|startoftext|>"
    assert codec.tokenizer.id_to_token(2) == "<|return|>"
    harmony = {n: codec.token_id(n) for n in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|endoftext|>")}
    assert all(i is not None and 3 <= i < 16 for i in harmony.values()), harmony
    assert set(harmony.values()) | {0, 1, 2} <= codec.special_ids
    # Encoding never adds BOS/EOS; a special token written in the text is parsed as that token.
    assert codec.encode("<|start|>user<|message|>") == [harmony["<|start|>"], *codec.encode("user"),
                                                        harmony["<|message|>"]]


def test_special_ids_at_real_gpt_oss_positions():
    cfg = preset_config("20b-shape")  # o200k_harmony's vocabulary size and ids
    table = special_tokens(cfg.vocab_size, cfg.eos_token_ids, cfg.pad_token_id, cfg.bos_token_id)
    assert table == {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                     200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
                     200008: "<|message|>", 200012: "<|call|>"}
    # Ids that do not agree with o200k_harmony: extras go to the lowest free ids; out-of-range ids drop.
    low = special_tokens(1000, (5, 5000), 7, None)
    assert low[5] == "<|return|>" and low[7] == "<|pad|>" and 5000 not in low
    assert sorted(low)[:3] == [0, 1, 2] and max(low) < 16


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(codec, text):
    ids = codec.encode(text)
    assert all(0 <= i < codec.vocab_size for i in ids)
    assert codec.decode(ids) == text


def test_common_words_are_single_tokens(codec):
    for word in ["the", " the", " and", " of", " to", " is", " model", " token", " tokens", " GPU",
                 " memory", " weather", " answer", "user", "assistant", "system"]:
        assert len(codec.encode(word)) == 1, (word, codec.tokenizer.encode(word).tokens)
    sentence = "The model reads the prompt and the cache holds the tokens."
    assert len(codec.encode(sentence)) <= 16


def test_chat_template(codec):
    text = codec.render_chat(MESSAGES)
    assert text == ("<|start|>system<|message|>You are a helpful assistant.<|end|>"
                    "<|start|>user<|message|>What does a GPU do? 🙂<|end|><|start|>assistant<|message|>")
    prompt = "<|start|>assistant<|message|>"
    assert codec.render_chat(MESSAGES, add_generation_prompt=False) == text.removesuffix(prompt)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What does "},
                                          {"type": "text", "text": "a GPU do? 🙂"}]}]
    assert codec.render_chat(parts) == codec.render_chat(MESSAGES[1:])
    ids = codec.apply_chat_template(MESSAGES)
    start, msg, end = (codec.token_id(n) for n in ("<|start|>", "<|message|>", "<|end|>"))
    assert ids[0] == start and ids[-1] == msg and ids.count(end) == 2 and ids.count(start) == 3
    assert codec.decode(ids, skip_special_tokens=False) == text
    assert codec.decode(ids) == "systemYou are a helpful assistant.userWhat does a GPU do? 🙂assistant"
    # Without a template in tokenizer_config.json: the same harmony-like format, no jinja.
    bare = TextCodec(codec.tokenizer)
    assert bare.chat_template is None and bare.render_chat(MESSAGES) == text
    assert codec.chat_template == CHAT_TEMPLATE


def test_transformers_autotokenizer_agrees(tiny_dir, codec):
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    assert len(hf) == codec.vocab_size
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf.model_max_length == preset_config("tiny").max_position_embeddings
    for text in TEXTS + ["<|start|>user<|message|>hi<|end|>"]:
        ids = codec.encode(text)
        assert hf.encode(text) == ids
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids, skip_special_tokens=True) == codec.decode(ids)
    assert hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == codec.render_chat(MESSAGES)
    out = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    hf_ids = out["input_ids"] if isinstance(out, Mapping) else out
    assert list(hf_ids) == codec.apply_chat_template(MESSAGES)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("byte_level", [True, False])
def test_stream_decoder(codec, skip, byte_level):
    text = "Grüße 🙂 中文 naïve — done " + TEXTS[4]
    ids = codec.apply_chat_template([{"role": "user", "content": text}])
    ids += codec.encode(text) + [codec.eos_token_id]
    stream = StreamDecoder(codec, skip_special_tokens=skip)
    if not byte_level:  # the generic path, for tokenizers whose decoder is not byte-level
        stream.codec = TextCodec(codec.tokenizer, codec.config)
        stream.codec._byte_level = False
    pieces = [stream.push(i) for i in ids]
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some characters span several tokens
    assert "".join(pieces) + stream.flush() == codec.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces).count(text) == 2
    assert "".join(pieces).endswith(text if skip else text + "<|return|>")


def test_stream_decoder_incomplete_tail(codec):
    ids = codec.encode("ok 🙂")
    stream = StreamDecoder(codec)
    out = "".join(stream.push(i) for i in ids[:-1])  # the emoji's last byte never comes
    assert out == "ok "
    assert stream.flush() == codec.decode(ids[:-1])[len("ok "):]


def test_from_dir_without_tokenizer(tmp_path):
    assert TextCodec.from_dir(tmp_path) is None
    assert TextCodec.from_dir(tmp_path / "missing") is None


def test_checkpoint_ships_tokenizer(tiny_ckpt):
    c = TextCodec.from_dir(tiny_ckpt)
    assert c is not None and c.vocab_size == preset_config("tiny").vocab_size
    assert c.decode(c.encode("The weather is cold.")) == "The weather is cold."


def test_long_text_encodes_to_the_same_ids_as_transformers(tiny_dir):
    """Text past `LONG_TEXT_CHARS` takes the batch call (which lets other threads run): the ids are still
    transformers' tokenizer's own, special-token strings and multi-byte characters included."""
    codec = TextCodec.from_dir(tiny_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    text = ("héllo wörld 🙂 <|start|>assistant<|message|>37 + 45 = 82\n\n  " * 1000)[: tk.LONG_TEXT_CHARS * 3]
    assert len(text) > tk.LONG_TEXT_CHARS
    assert codec.encode(text) == hf.encode(text, add_special_tokens=False)
