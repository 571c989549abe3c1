"""The packed-FP8 KV cache against an independent oracle: transformers' GptOssForCausalLM with its post-RoPE K
and its V rounded to FP8 e4m3 by torch's own float8 type (x / scale, clamped to ±448, times scale) — what
the cache stores — before its attention reads them.

The engine (fp32, `--kv-dtype fp8`, the default GK decoder on the native kernels, and the per-layer model as
decoder) generates greedily; every token must be the oracle's argmax on the same sequence (teacher-forced)
wherever its top two logits are clear of float noise. FP8 moves these random models' logits by up to ~15% of
their range, so an unrounded oracle would not do: the engine's FP8 path (KV write, packed layout, scales,
prefill and decode attention) is checked against rounding done by other code than ours.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from gigadecode.checkpoint import make_checkpoint, preset_config
from gigadecode.engine import build_engine
from gigadecode.engine_config import EngineConfig
from gigadecode.sampling import SamplingParams

from .helpers import assert_teacher_forced_argmax, load_hf

F, S = "full_attention", "sliding_attention"
NEW_TOKENS = 8
CLEAR = 1e-3        # top-2 gap (relative to max |logit|) below which a position is a near-tie: a K value that
                    # lands on an FP8 midpoint can round either way between two fp32 computations of it

# name: (config overrides or None for tiny, block size, k_scale, v_scale, decoder)
CASES = {
    "tiny-block16": (None, 16, 1.0, 1.0, "gk-native"),
    "tiny-block4-scaled": (None, 4, 0.5, 2.0, "gk-native"),
    "tiny-per-layer": (None, 8, 1.0, 0.25, "reference"),
    "gqa3-window3-block2": (dict(layer_types=(S, F, S), hidden_size=96, intermediate_size=64, num_attention_heads=9,
                                 num_key_value_heads=3, head_dim=40, num_local_experts=5, num_experts_per_tok=2,
                                 sliding_window=3, vocab_size=997), 2, 0.25, 4.0, "gk-native"),
}


@contextlib.contextmanager
def fp8_rounded_kv(hf, k_scale: float, v_scale: float):
    """transformers' attention reading K and V as an FP8 cache with these per-tensor scales holds them."""
    import transformers.models.gpt_oss.modeling_gpt_oss as gpt_oss

    def fp8(t: torch.Tensor, scale: float) -> torch.Tensor:
        return ((t.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).to(t.dtype)

    rope = gpt_oss.apply_rotary_pos_emb

    def rope_then_round(q, k, *args, **kwargs):
        q, k = rope(q, k, *args, **kwargs)
        return q, fp8(k, k_scale)

    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda mod, inp, out: fp8(out, v_scale))
             for layer in hf.model.layers]
    gpt_oss.apply_rotary_pos_emb = rope_then_round
    try:
        yield hf
    finally:
        gpt_oss.apply_rotary_pos_emb = rope
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("name", CASES)
def test_fp8_kv_engine_matches_transformers_with_fp8_rounded_kv(tmp_path, tiny_ckpt, name):
    over, block, k_scale, v_scale, decoder = CASES[name]
    if over is None:
        ckpt, vocab = str(tiny_ckpt), preset_config("tiny").vocab_size
    else:
        cfg = preset_config("tiny").with_(num_hidden_layers=len(over["layer_types"]), **over)
        ckpt, vocab = str(make_checkpoint(tmp_path / name, cfg=cfg, seed=11, experts="mxfp4")), cfg.vocab_size
    rnd = random.Random(name)
    prompts = [[rnd.randrange(3, vocab) for _ in range(n)] for n in (1, block + 1, 37, 70)]
    eng = build_engine(ckpt, EngineConfig(dtype="float32", kv_dtype="fp8", block_size=block, k_scale=k_scale,
                                          v_scale=v_scale, decoder=decoder, num_blocks=4 * (100 // block + 2) + 8))
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)) for p in prompts]
    while not all(eng.requests[r].finished for r in rids):
        eng.step()
    outputs = [list(eng.requests[r].output_ids) for r in rids]
    assert all(len(got) == NEW_TOKENS for got in outputs)
    with fp8_rounded_kv(load_hf(ckpt, torch.float32), k_scale, v_scale) as hf:
        checked = assert_teacher_forced_argmax(hf, prompts, outputs, CLEAR, name)
    assert checked >= 3 * NEW_TOKENS                 # the check is not vacuous
