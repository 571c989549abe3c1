"""Speculative decoding, adversarially: configs and request shapes the main tests (test_speculative.py) do not
have — sliding windows shorter than the drafts, block sizes of 1 and 3, one and three layers, odd vocabularies,
top-1 routing, dense bf16 experts — and what a step of several tokens a request means past the engine (the
server's stop strings)."""

from __future__ import annotations

import random

import pytest

from gigadecode.request import RequestOutput
from gigadecode.server.outputs import Choice, StopMatcher, TextRenderer
from gigadecode.tokenizer import TextCodec


class _Stream:
    def __init__(self) -> None:
        self.closed = False

    def close(self, *_a) -> None:
        self.closed = True


def _choice(codec, stops, min_tokens=0) -> Choice:
    return Choice(0, 0, _Stream(), [1, 2], TextRenderer(codec), StopMatcher(stops), min_tokens=min_tokens)


@pytest.mark.parametrize("min_tokens", [0, 2])
def test_a_stop_string_inside_a_steps_tokens_cuts_there(tiny_ckpt, min_tokens):
    """With drafts a step gives a request several tokens at once; a stop string that ends in the first of them
    must leave the choice where plain decoding (one token a step) leaves it: the same token ids, logprobs and
    usage, not the tokens sampled after the stop in the same step."""
    codec = TextCodec.from_dir(tiny_ckpt)
    rng = random.Random(3)
    while True:
        ids = [rng.randrange(3, 1000) for _ in range(6)]
        texts = [codec.decode([t]) for t in ids]
        if all(len(t) >= 2 for t in texts) and texts[2] not in "".join(texts[:2]):
            break
    stop = texts[2][-2:] if len(texts[2]) >= 2 else texts[2]
    lps = [f"lp{i}" for i in range(6)]
    one = _choice(codec, [stop], min_tokens)
    for i, t in enumerate(ids):
        one.absorb(RequestOutput("r", [t], False, new_logprobs=[lps[i]]))
        if one.done:
            break
    assert one.done and one.finish_reason == "stop"
    many = _choice(codec, [stop], min_tokens)
    many.absorb(RequestOutput("r", ids[:1], False, new_logprobs=lps[:1]))
    many.absorb(RequestOutput("r", ids[1:5], False, new_logprobs=lps[1:5]))      # a step with 3 accepted drafts
    assert many.done and many.finish_reason == "stop" and many.stream.closed
    assert (many.token_ids, many.logprobs, many.text()) == (one.token_ids, one.logprobs, one.text())
    # what a streamed chunk sends of that output (its token ids and logprobs): only what the choice kept
    assert (many.new_ids, many.new_logprobs) == (one.token_ids[1:], one.logprobs[1:])


@pytest.mark.parametrize("raw, words", [
    ('{"method": "ngram", "num_speculative_tokens": null}', "num_speculative_tokens"),
    ('{"method": null, "num_speculative_tokens": 2}', "method"),
])
def test_config_nulls_are_refused_with_a_config_error(raw, words):
    """A JSON null for a required field is the flag's error (ConfigError, which the CLI reports), not a
    TypeError from the dataclass, nor a silently assumed method."""
    from gigadecode.config import ConfigError
    from gigadecode.speculative import SpeculativeConfig
    with pytest.raises(ConfigError, match=words):
        SpeculativeConfig.parse(raw)
