"""Acceptance: our per-layer model reproduces transformers' GptOssForCausalLM (the numeric oracle) in fp32
on the same checkpoint files, for both expert layouts, any paged KV layout, chunking and batching."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gigadecode.model import SeqChunk
from helpers import (build_reference, contiguous_tables, greedy, hf_greedy, hf_logits, load_hf, prefill_logits,
                     random_prompt, rel_err, shuffled_tables)

TOL = 1e-3                      # max |ours - transformers| <= TOL * max |transformers logit|
LENGTHS = (1, 127, 128, 129, 300)
VOCAB = 1024                    # tiny preset


@pytest.fixture(scope="module")
def hf_prompt_logits():
    """(id(hf model), length) -> transformers logits for random_prompt(length, seed=length); computed once."""
    cache: dict[tuple[int, int], torch.Tensor] = {}

    def get(hf, n: int) -> torch.Tensor:
        key = (id(hf), n)
        if key not in cache:
            cache[key] = hf_logits(hf, random_prompt(n, VOCAB, seed=n))
        return cache[key]
    return get


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("n", LENGTHS)
def test_prompt_logits_match_transformers(ckpt_and_hf, hf_prompt_logits, n, block_size):
    ckpt, hf = ckpt_and_hf
    cfg, _, model, kv = build_reference(ckpt, block_size=block_size)
    ids = random_prompt(n, cfg.vocab_size, seed=n)
    ours = prefill_logits(model, kv, contiguous_tables(kv, n), ids)
    ref = hf_prompt_logits(hf, n)
    assert ours.shape == ref.shape == (n, cfg.vocab_size)
    assert rel_err(ours, ref) <= TOL
    # And the argmax agrees wherever transformers' top-1 is clear of float noise.
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 10 * TOL * ref.abs().max()
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_scattered_block_tables_match_transformers(ckpt_and_hf, hf_prompt_logits, block_size):
    """Block ids in random order over the whole pool: the paged layout must not matter."""
    ckpt, hf = ckpt_and_hf
    n = 300
    cfg, _, model, kv = build_reference(ckpt, block_size=block_size, num_blocks=2 * 300 // block_size + 8)
    ours = prefill_logits(model, kv, shuffled_tables(kv, n, seed=block_size), random_prompt(n, cfg.vocab_size, seed=n))
    assert rel_err(ours, hf_prompt_logits(hf, n)) <= TOL


@pytest.mark.parametrize("chunk", [50, 7, 128])
def test_chunked_prefill_logits_match_transformers(ckpt_and_hf, hf_prompt_logits, chunk):
    """Chunk boundaries crossing blocks and the sliding window (W=16 in the tiny preset)."""
    ckpt, hf = ckpt_and_hf
    n = 300
    cfg, _, model, kv = build_reference(ckpt, block_size=16)
    ours = prefill_logits(model, kv, contiguous_tables(kv, n), random_prompt(n, cfg.vocab_size, seed=n), chunk=chunk)
    assert rel_err(ours, hf_prompt_logits(hf, n)) <= TOL


# ---------------------------------------------------------------------------------------------------------
PROMPT_LEN, NEW = 200, 32


@pytest.fixture(scope="module")
def hf_generated():
    cache: dict[int, tuple[list[int], list[int]]] = {}

    def get(hf) -> tuple[list[int], list[int]]:
        if id(hf) not in cache:
            prompt = random_prompt(PROMPT_LEN, VOCAB, seed=1234)
            cache[id(hf)] = prompt, hf_greedy(hf, prompt, NEW)
        return cache[id(hf)]
    return get


@pytest.mark.parametrize("mode,chunk", [("one_prefill", None), ("token_by_token", 1), ("chunked_50", 50)])
def test_greedy_matches_transformers_generate(ckpt_and_hf, hf_generated, mode, chunk):
    ckpt, hf = ckpt_and_hf
    prompt, ref = hf_generated(hf)
    assert len(ref) == NEW
    _, _, model, kv = build_reference(ckpt, block_size=16)
    ours = greedy(model, kv, contiguous_tables(kv, PROMPT_LEN + NEW), prompt, NEW, prefill_chunk=chunk)
    assert ours == ref


def test_greedy_does_not_stop_at_eos(tiny_ckpt_bf16, tmp_path):
    """The eos-ignoring oracle really ignores eos: on a copy of the checkpoint whose eos row of lm_head
    outscores a frequently chosen token, both sides emit eos (id 2) and keep going, token for token."""
    d = tmp_path / "eos"
    shutil.copytree(tiny_ckpt_bf16, d)
    prompt = random_prompt(40, VOCAB, seed=7)
    hf = load_hf(str(tiny_ckpt_bf16))
    first = hf_greedy(hf, prompt, 1)[0]
    t = load_file(d / "model.safetensors")
    t["lm_head.weight"][2] = t["lm_head.weight"][first] * 10
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    hf_eos = load_hf(str(d))
    ref = hf_greedy(hf_eos, prompt, 12)
    assert ref[0] == 2 and len(ref) == 12
    _, _, model, kv = build_reference(d)
    assert greedy(model, kv, contiguous_tables(kv, 60), prompt, 12) == ref


# ---------------------------------------------------------------------------------------------------------
def _alone(ckpt, ids_by_seq, block_size=16):
    out = []
    for ids in ids_by_seq:
        _, _, model, kv = build_reference(ckpt, block_size=block_size)
        out.append(prefill_logits(model, kv, contiguous_tables(kv, len(ids)), ids))
    return out


@pytest.mark.parametrize("block_size", [16, 4])
def test_batch_equals_each_alone(ckpt_and_hf, block_size):
    """Several sequences of different lengths in one forward call == each run alone (and == transformers)."""
    ckpt, hf = ckpt_and_hf
    lens = [1, 17, 130, 45, 129]
    seqs = [random_prompt(n, VOCAB, seed=100 + i) for i, n in enumerate(lens)]
    _, _, model, kv = build_reference(ckpt, block_size=block_size)
    chunks = [SeqChunk(ids, 0, contiguous_tables(kv, 130, seq=i, num_seqs=len(seqs)), "all")
              for i, ids in enumerate(seqs)]
    batched = model.forward(chunks, kv).logits
    alone = _alone(ckpt, seqs, block_size)
    for ids, b, a in zip(seqs, batched, alone):
        assert b.shape == a.shape == (len(ids), VOCAB)
        assert rel_err(b, a) <= 1e-5
        assert rel_err(b, hf_logits(hf, ids)) <= TOL


def test_mixed_batch_decode_and_prefill(tiny_ckpt, hf_model):
    """One step mixing a decode (1 token at position 150), a prefill continuation (chunk at 40..99) and a
    new prompt: every chunk's logits match transformers over the full sequence."""
    full = [random_prompt(151, VOCAB, seed=1), random_prompt(100, VOCAB, seed=2), random_prompt(33, VOCAB, seed=3)]
    _, _, model, kv = build_reference(tiny_ckpt, block_size=8)
    tables = [contiguous_tables(kv, 160, seq=i, num_seqs=3) for i in range(3)]
    # History: sequence 0 up to position 149, sequence 1 up to 39 (sequence 2 is new).
    model.forward([SeqChunk(full[0][:150], 0, tables[0], "none"), SeqChunk(full[1][:40], 0, tables[1], "none")], kv)
    step = [SeqChunk(full[0][150:], 150, tables[0], "all"), SeqChunk(full[1][40:], 40, tables[1], "all"),
            SeqChunk(full[2], 0, tables[2], "last")]
    out = model.forward(step, kv).logits
    refs = [hf_logits(hf_model, ids) for ids in full]
    assert rel_err(out[0], refs[0][150:]) <= TOL
    assert rel_err(out[1], refs[1][40:]) <= TOL
    assert out[2].shape == (1, VOCAB) and rel_err(out[2], refs[2][-1:]) <= TOL
