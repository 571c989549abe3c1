"""A lockstep harness for the GK tests: prefill a batch of prompts with the per-layer model through the
real block manager, then decode greedily step by step with a chosen decoder (the per-layer model, the GK
program eager/compiled, per-buffer or stacked KV), freeing out-of-window sliding blocks as the engine does.
"""

from __future__ import annotations

import torch

from gigadecode.config import GptOssConfig
from gigadecode.engine_config import EngineConfig
from gigadecode.gk.attn_control import build_attention_control
from gigadecode.gk.model import GptOssGKDecodeModel
from gigadecode.kv.cache import KVCache
from gigadecode.kv.manager import KVCacheManager
from gigadecode.kv.spec import SlidingWindowSpec
from gigadecode.model import GptOssModel, SeqChunk
from gigadecode.weights import ModelWeights


def run_lockstep(cfg: GptOssConfig, weights: ModelWeights, prompts: list[list[int]], steps: int, *,
                 decoder: str = "reference", kv_dtype: str = "fp8", block_size: int = 4, bucket: int | None = None,
                 stacked: bool = False, num_blocks: int = 600, full_width: int | None = None,
                 gk_model: GptOssGKDecodeModel | None = None,
                 expect_kv_dtype: torch.dtype | None = None) -> list[list[int]]:
    ecfg = EngineConfig(kv_dtype=kv_dtype, block_size=block_size)
    model = GptOssModel(cfg, weights, torch.float32)
    kv = KVCache(cfg, ecfg, num_blocks)
    if expect_kv_dtype is not None:       # what the run really stores its K and V in
        got = {t.dtype for b in range(kv.config.group_size) for t in (kv.k_buf(b), kv.v_buf(b))}
        assert got == {expect_kv_dtype}, f"KV stored as {got}, expected {expect_kv_dtype}"
    mgr = KVCacheManager(kv.config, block_size)
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        assert mgr.allocate(rid, len(p), 0)
    out = model.forward([SeqChunk(p, 0, mgr.block_tables(rid)) for rid, p in zip(rids, prompts)], kv)
    toks = [[int(l[-1].argmax())] for l in out.logits]
    computed = [len(p) for p in prompts]
    for rid, c in zip(rids, computed):
        mgr.remove_skipped_blocks(rid, c)

    gk = None
    if decoder != "reference":
        gk = gk_model or GptOssGKDecodeModel(cfg, weights, kv.config, block_size, kv.k_scale, kv.v_scale,
                                              compiled=decoder == "gk-compiled", native=decoder == "gk-native")
        if stacked:
            K = torch.stack([kv.k_buf(i) for i in range(kv.config.group_size)])
            V = torch.stack([kv.v_buf(i) for i in range(kv.config.group_size)])
            gk.use_stacked_kv_cache(K, V)
        else:
            gk.bind_kv_cache(kv.bind_map())
    sliding = [isinstance(g.spec, SlidingWindowSpec) for g in kv.config.groups]

    for _ in range(steps):
        for rid, c in zip(rids, computed):
            assert mgr.allocate(rid, c + 1, c)
        tables = [mgr.block_tables(rid) for rid in rids]
        if gk is None:
            o = model.forward([SeqChunk([t[-1]], c, tb) for t, c, tb in zip(toks, computed, tables)], kv)
            nxt = [int(l[-1].argmax()) for l in o.logits]
        else:
            bt = bucket or len(prompts)
            ctl = build_attention_control(computed, tables, sliding, model.rope, block_size, cfg.sliding_window,
                                          batch_bucket=bt, full_width=full_width)
            ids = torch.zeros(bt, dtype=torch.long)
            ids[: len(prompts)] = torch.tensor([t[-1] for t in toks])
            logits = gk.decode(ids, ctl)
            nxt = [int(x) for x in logits[: len(prompts)].argmax(-1)]
        for i, t in enumerate(nxt):
            toks[i].append(t)
            computed[i] += 1
            mgr.remove_skipped_blocks(rids[i], computed[i])
    for rid in rids:
        mgr.free(rid)
    assert mgr.num_free_blocks == num_blocks - 1
    return toks
