"""The engine as users run it (default decoder: the GK program on the native kernels; fp32, model-dtype KV) on
GPT-OSS configs unlike the presets, against transformers on the same files.

Each case mixes what the presets do not have: a hidden size that is not a multiple of 64 (with bf16 experts, not
even of 8), head dims of 6 to 80 and 1026, 1 to 12 q heads over 1 to 3 kv heads, 2 to 9 experts with top-1 to top-4, odd
vocabularies, sliding windows of 1 to 33 tokens (and one longer than the context), block sizes of 1 to 32, and prefill chunks shorter than the
prompt. Three prompts (1 token, across a window and a few blocks, longer) decode together, greedily. Every
generated token must be transformers' argmax on the same sequence (teacher-forced: its uncached forward over
prompt + our tokens), wherever its top two logits are clear of float noise, and its logprob must be
transformers' to 2e-3 (a config field read wrong often moves the logprobs and leaves the argmax alone).

The oracle is the uncached forward, not `generate`: with a sliding window of 1, transformers' cached `generate`
disagrees with its own forward (its sliding cache keeps no earlier token), while the forward's mask is the
definition (a window of W: the last W positions, the token itself included).
"""

from __future__ import annotations

import random

import pytest
import torch

from gigadecode.checkpoint import make_checkpoint, preset_config
from gigadecode.config import RopeConfig
from gigadecode.engine import build_engine
from gigadecode.engine_config import EngineConfig
from gigadecode.sampling import SamplingParams

from .helpers import assert_teacher_forced_argmax, hf_logits, load_hf

F, S = "full_attention", "sliding_attention"
CASES = {
    # name: (config overrides, experts layout, block size, prefill chunk)
    "window1": (dict(layer_types=(F, S), hidden_size=32, intermediate_size=32, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=24, num_local_experts=9, num_experts_per_tok=3, sliding_window=1,
                     vocab_size=517), "mxfp4", 8, 512),
    "wide-head": (dict(layer_types=(F, S, F, S, F), hidden_size=224, intermediate_size=96, num_attention_heads=6,
                       num_key_value_heads=2, head_dim=72, num_local_experts=9, num_experts_per_tok=1,
                       sliding_window=33, vocab_size=1021), "mxfp4", 8, 16),
    "block1": (dict(layer_types=(F, S, S, F), hidden_size=96, intermediate_size=32, num_attention_heads=3,
                    num_key_value_heads=3, head_dim=72, num_local_experts=9, num_experts_per_tok=4, sliding_window=3,
                    vocab_size=1021), "bf16", 1, 512),
    "gqa4": (dict(layer_types=(F, F, S), hidden_size=32, intermediate_size=96, num_attention_heads=12,
                  num_key_value_heads=3, head_dim=40, num_local_experts=6, num_experts_per_tok=4, sliding_window=3,
                  vocab_size=517), "mxfp4", 32, 7),
    "block3": (dict(layer_types=(S, S, S, S), hidden_size=160, intermediate_size=160, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=80, num_local_experts=5, num_experts_per_tok=2, sliding_window=5,
                    vocab_size=997), "mxfp4", 3, 512),
    "head12": (dict(layer_types=(S,), hidden_size=64, intermediate_size=32, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=12, num_local_experts=3, num_experts_per_tok=3, sliding_window=2,
                    vocab_size=1500), "mxfp4", 2, 512),
    # bf16 experts need no MXFP4 groups: a hidden size of 50 and an intermediate size of 18 (no multiple of 8:
    # every native kernel's tail path), head dim 6
    "odd-hidden": (dict(layer_types=(F, S), hidden_size=50, intermediate_size=18, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=6, num_local_experts=5, num_experts_per_tok=2, sliding_window=4,
                        vocab_size=389), "bf16", 4, 16),
    # no attention biases (attention_bias: false): nothing in the files for the q/k/v/o bias stacks
    "no-attention-bias": (dict(layer_types=(S, F, S), hidden_size=64, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=20, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=9, vocab_size=777, attention_bias=False), "mxfp4", 16, 512),
    # linear RoPE scaling (positions / factor), which transformers runs for GPT-OSS as well
    "linear-rope": (dict(layer_types=(F, S), sliding_window=11, vocab_size=515,
                         rope=RopeConfig(rope_type="linear", theta=500.0, factor=2.5)), "bf16", 8, 32),
    # a head dim past 1024 (nothing in a GPT-OSS config bounds it; the native KV write once did)
    "head-dim-1026": (dict(layer_types=(S, F), hidden_size=32, intermediate_size=32, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=1026, num_local_experts=3, num_experts_per_tok=2,
                           sliding_window=7, vocab_size=499), "mxfp4", 16, 512),
    # config.json fields the presets leave at their defaults, all at once: tied embeddings (no lm_head tensor), no
    # attention biases, a SwiGLU clamp that binds often and another gain, a large RMSNorm eps, YaRN with other
    # betas / factor / original length, truncated
    "hf-fields": (dict(layer_types=(S, F, S), sliding_window=3, vocab_size=301, tie_word_embeddings=True,
                       attention_bias=False, swiglu_limit=2.0, swiglu_alpha=0.7, rms_norm_eps=0.5,
                       rope=RopeConfig(theta=1e4, factor=8.0, beta_fast=8.0, beta_slow=2.0,
                                       original_max_position_embeddings=256, truncate=True)), "bf16", 4, 5),
    # a window longer than the whole context (transformers loads it; it never binds)
    "window-past-context": (dict(layer_types=(S, F), max_position_embeddings=128, sliding_window=200,
                                 vocab_size=1001), "mxfp4", 16, 24),
}
NEW_TOKENS = 8
CLEAR = 1e-4                     # top-2 gap (relative to max |logit|) below which a position is a near-tie
LOGPROB_TOL = 2e-3               # |our logprob - transformers'| of each generated token (fp32: ~1e-5 seen)


@pytest.mark.parametrize("name", CASES)
def test_engine_matches_transformers_on_unusual_configs(tmp_path, name):
    over, experts, block_size, chunk = CASES[name]
    cfg = preset_config("tiny", experts).with_(num_hidden_layers=len(over["layer_types"]), **over)
    ckpt = make_checkpoint(tmp_path / name, cfg=cfg, seed=7, experts=experts)
    rnd = random.Random(name)
    prompts = [[rnd.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (1, 37, 70)]
    eng = build_engine(str(ckpt), EngineConfig(dtype="float32", block_size=block_size, num_blocks=512 // block_size + 64,
                                               max_prefill_tokens=chunk))
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0))
            for p in prompts]
    while not all(eng.requests[r].finished for r in rids):
        eng.step()
    if cfg.hidden_size % 8:
        # transformers' grouped expert GEMM needs 16-byte strides; its eager experts compute the same thing
        from transformers import GptOssForCausalLM
        hf = GptOssForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, experts_implementation="eager").eval()
    else:
        hf = load_hf(str(ckpt), torch.float32)
    outputs = [list(eng.requests[r].output_ids) for r in rids]
    assert all(len(got) == NEW_TOKENS for got in outputs)
    checked = assert_teacher_forced_argmax(hf, prompts, outputs, CLEAR, name)
    assert checked >= 2 * NEW_TOKENS                 # the check is not vacuous
    # and each token's logprob is transformers' (fp32 both: ~1e-5 apart; a config field read wrong, such as the
    # SwiGLU gain or the RMSNorm eps, moves it by far more while often leaving the argmax alone)
    for p, r, got in zip(prompts, rids, outputs):
        ref = hf_logits(hf, p + got).log_softmax(-1)[len(p) - 1:]
        want = [float(ref[j, t]) for j, t in enumerate(got)]
        ours = [lp.logprob for lp in eng.requests[r].output_logprobs]
        assert max(abs(a - b) for a, b in zip(ours, want)) < LOGPROB_TOL, (name, len(p), ours, want)
