"""Disaggregated inference across TP layouts: prefill on one TP size, decode on another (greedy, lockstep).

A prefill rank and a decode rank with different TP sizes hold different kv heads (`head_ratio != 1`). Each
decode rank reads, from every prefill rank whose kv heads overlap its own, exactly the shared heads of each
block (`NixlKVAgent.read` maps heads from the two layouts: `connector.base.head_byte_range`), and checks
each head it received against the producer's per-head CRC32 (`kv_crc32_heads`) before anything decodes.

- prefill tp=1 -> decode tp=2: each decode rank reads its head slice of every remote (whole) block;
- prefill tp=2 -> decode tp=1: the decode rank reads each prefill rank's blocks into its head slice.

Pieces (every rank of a world calls its job with the same arguments; `spawn.run_world` runs them):
- `prefill_rank_job`: the sharded per-layer model prefills N-1 tokens of every prompt (the N-1 rule, as
  `connector.nixl_connector`), registers its KV with its own `NixlKVAgent` (kv head range in the layout),
  publishes `{"handshake": {layout, agent_metadata}, "params": [kv_transfer_params per prompt]}` as
  `prefill{rank}.json` in a rendezvous folder and keeps its agent progressing until `done` appears there.
  A normal producer engine (`kv_producer`, tp=1) is an equivalent source: `source_from_producer`.
- `decode_rank_job`: the sharded GK program; pairs with the sources whose heads overlap its own, reads,
  verifies, notifies the sources (after every decode rank's reads are done and intact), then decodes
  token N-1 on and on in lockstep; rank 0 returns what `run_parallel_generate` returns.
- `run_di`: both worlds on this machine (prefill world in a thread) -> rank 0's results.

This is a lockstep test-level runner (greedy, one batch), not the serving engine (`parallel.engine`).
"""

from __future__ import annotations

import base64
import json
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import EngineConfig, GptOssConfig
from ..connector.base import KVLayout, TransferError, model_identity
from ..connector.nixl_agent import NixlKVAgent
from ..connector.nixl_connector import crc_matches, kv_crc32, kv_crc32_heads, pair_remote_blocks
from ..gk.attn_control import build_attention_control
from ..gk.model import GptOssGKDecodeModel
from ..kv.cache import KVCache
from ..kv.manager import KVCacheManager
from ..kv.spec import SlidingWindowSpec, cdiv, get_kv_spec, make_kv_cache_config
from ..model import GptOssModel, SeqChunk
from ..weights import Shard, load_weights, shard_ranges
from .context import make_parallel_context



def _num_blocks(cfg: GptOssConfig, ecfg: EngineConfig, nkv: int, lengths: list[int], max_tokens: int) -> int:
    """A KV pool that holds every prompt plus max_tokens (+1 block per group for a partly filled one)."""
    itemsize = torch.empty((), dtype=ecfg.kv_storage_dtype()).element_size()
    groups = make_kv_cache_config(get_kv_spec(cfg, ecfg.block_size, itemsize, nkv), 1).groups
    return 2 + sum(len(groups) * (cdiv(n + max_tokens, ecfg.block_size) + 1) for n in lengths)

def _setup(model_dir: str | Path, tp: int, ep: int, prompts: list[list[int]], max_tokens: int, dtype: str,
           kv_dtype: str, block_size: int):
    cfg = GptOssConfig.from_hf(Path(model_dir))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != tp:
        raise ValueError(f"a DI world must have tp ranks (world {world}, tp {tp})")
    ctx = make_parallel_context(cfg, tp, 1, ep) if world > 1 else None
    shard = ctx.shard if ctx is not None else Shard()
    ecfg = EngineConfig(dtype=dtype, kv_dtype=kv_dtype, block_size=block_size)
    weights = load_weights(model_dir, cfg, ecfg.torch_dtype, shard)
    model = GptOssModel(cfg, weights, ecfg.torch_dtype, parallel=ctx)
    nb = _num_blocks(cfg, ecfg, model.num_kv_heads, [len(p) for p in prompts], max_tokens)
    kv = KVCache(cfg, ecfg, nb, model.num_kv_heads)
    mgr = KVCacheManager(kv.config, block_size)
    kv0 = shard_ranges(cfg, shard)["kv_heads"][0]
    return cfg, ctx, weights, model, kv, mgr, kv0


def _live(request_id: str, tables: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Per group: the index of the first live block and the live block ids (as `request_finished`)."""
    first, ids = [], []
    for table in tables:
        j = next((i for i, b in enumerate(table) if b != 0), len(table))
        if any(b == 0 for b in table[j:]):
            raise TransferError(f"request {request_id}: a null block inside the live window {table}")
        first.append(j)
        ids.append(table[j:])
    return first, ids


# -- prefill ---------------------------------------------------------------------------------------------
def prefill_rank_job(rank: int, model_dir: str, prompts: list[list[int]], tp: int, rdv_dir: str,
                     kwargs: dict) -> dict:
    """One prefill rank (see the module docstring) -> {"notifs": READ notifications received}."""
    ep, block_size = kwargs.get("ep", 1), kwargs.get("block_size", 16)
    wait_s = kwargs.get("serve_s", 300.0)
    cfg, ctx, _, model, kv, mgr, kv0 = _setup(model_dir, tp, ep, prompts, 1, kwargs.get("dtype", "float32"),
                                              kwargs.get("kv_dtype", "auto"), block_size)
    name = f"di-prefill-{kwargs.get('tag', uuid.uuid4().hex[:8])}-r{rank}"
    agent = NixlKVAgent(name, model_id=model_identity(cfg), progress_thread=True)
    try:
        agent.register_kv(kv, kv_head_start=kv0, total_kv_heads=cfg.num_key_value_heads)
        chunks = []
        for i, p in enumerate(prompts):
            n = len(p) - 1                                       # the N-1 rule
            if not mgr.allocate(f"p{i}", n, 0):
                raise RuntimeError("KV pool too small for the prompts")
            if n:
                chunks.append(SeqChunk(list(p[:n]), 0, mgr.block_tables(f"p{i}"), want_logits="none"))
        model.forward(chunks, kv)                                # every rank: the same chunks (TP collectives)
        params = []
        for i, p in enumerate(prompts):
            rid, n = f"p{i}", len(p) - 1
            mgr.remove_skipped_blocks(rid, n)
            first, ids = _live(rid, mgr.block_tables(rid))
            params.append({"do_remote_prefill": True, "remote_engine_id": name, "remote_request_id": rid,
                           "remote_block_ids": ids, "remote_first_block": first, "num_computed_tokens": n,
                           "kv_crc32": kv_crc32(kv, ids), "kv_head_start": kv0,
                           "kv_crc32_heads": kv_crc32_heads(kv, ids)})
        out = {"handshake": {"layout": agent.layout().to_dict(),
                             "agent_metadata": base64.b64encode(agent.metadata()).decode()},
               "params": params}
        tmp = Path(rdv_dir, f".prefill{rank}.json")
        tmp.write_text(json.dumps(out))
        tmp.rename(Path(rdv_dir, f"prefill{rank}.json"))
        notifs, deadline = 0, time.monotonic() + wait_s
        while not Path(rdv_dir, "done").exists() and time.monotonic() < deadline:
            notifs += sum(len(v) for v in agent.get_notifs().values())
            time.sleep(0.005)
        return {"notifs": notifs}
    finally:
        agent.close()


def source_from_producer(host: str, port: int, params: list[dict]) -> dict:
    """A producer engine (`kv_producer`) as a DI source: its handshake (side channel) + one params per prompt."""
    from ..connector.nixl_connector import fetch_handshake
    return {"handshake": fetch_handshake(host, port), "params": list(params)}


# -- decode ----------------------------------------------------------------------------------------------
def decode_rank_job(rank: int, model_dir: str, prompts: list[list[int]], tp: int, sources: list[dict],
                    kwargs: dict) -> list[dict] | None:
    """One decode rank (see the module docstring) -> on rank 0 one dict per prompt
    `{"prompt_ids", "token_ids", "finish_reason", "kv_bytes"}`; None on other ranks."""
    ep, block_size = kwargs.get("ep", 1), kwargs.get("block_size", 16)
    max_tokens, ignore_eos = kwargs.get("max_tokens", 16), kwargs.get("ignore_eos", False)
    timeout_s = kwargs.get("timeout_s", 30.0)
    cfg, ctx, weights, model, kv, mgr, kv0 = _setup(model_dir, tp, ep, prompts, max_tokens,
                                                    kwargs.get("dtype", "float32"), kwargs.get("kv_dtype", "auto"),
                                                    block_size)
    gk = GptOssGKDecodeModel(cfg, weights, kv.config, block_size, kv.k_scale, kv.v_scale, parallel=ctx)
    gk.bind_kv_cache(kv.bind_map())
    sliding = [isinstance(g.spec, SlidingWindowSpec) for g in kv.config.groups]
    agent = NixlKVAgent(f"di-decode-{kwargs.get('tag', uuid.uuid4().hex[:8])}-r{rank}",
                        model_id=model_identity(cfg))
    try:
        local = agent.register_kv(kv, kv_head_start=kv0, total_kv_heads=cfg.num_key_value_heads)
        l0, l1 = local.head_range
        # -- pair with the sources holding our heads -------------------------------------------------------
        used: list[tuple[str, tuple[int, int], dict]] = []
        covered = torch.zeros(cfg.num_key_value_heads, dtype=torch.bool)
        for src in sources:
            lay = KVLayout.from_dict(src["handshake"]["layout"])
            h0, h1 = max(l0, lay.head_range[0]), min(l1, lay.head_range[1])
            if h0 >= h1 or covered[h0:h1].all():
                continue                                           # none (or only already covered) of our heads
            agent.add_remote(lay.agent_name, base64.b64decode(src["handshake"]["agent_metadata"]), lay)
            covered[h0:h1] = True
            used.append((lay.agent_name, (h0, h1), src))
        if not covered[l0:l1].all():
            raise TransferError(f"decode rank {rank}: kv heads [{l0}, {l1}) are not all held by the prefill ranks")
        # -- allocate as if N-1 tokens were computed, read, verify -----------------------------------------
        handles, checks, nbytes = [], [], [0] * len(prompts)
        for i, p in enumerate(prompts):
            n = len(p) - 1
            if not mgr.allocate(f"r{i}", n + 1, n):
                raise RuntimeError("KV pool too small for the prompts")
            tables = mgr.block_tables(f"r{i}")
            for name, heads, src in used:
                params = src["params"][i]
                if int(params["num_computed_tokens"]) != n:
                    raise TransferError(f"prompt {i}: the prefill computed {params['num_computed_tokens']} "
                                        f"tokens, expected {n}")
                pairs, local_ids = pair_remote_blocks(params, tables, block_size)
                handles.append((i, agent.read(name, pairs)))
                checks.append((i, local_ids, params, heads))
        errors: list[str] = []
        for i, h in handles:
            try:
                agent.wait(h, timeout_s)
                nbytes[i] += h.nbytes
            except TransferError as e:
                errors.append(f"prompt {i}: {e}")
        if not errors:
            for i, local_ids, params, heads in checks:
                if not crc_matches(kv, local_ids, params, (l0, l1), heads):
                    errors.append(f"prompt {i}: KV heads [{heads[0]}, {heads[1]}) from "
                                  f"{params['remote_engine_id']} arrived corrupted or stale (CRC32 mismatch)")
        bad = torch.tensor([1 if errors else 0])
        if ctx is not None:
            bad = ctx.all_reduce_world(bad)                    # every decode rank agrees; also a barrier
        if int(bad):
            raise TransferError("; ".join(errors) or f"decode rank {rank}: another decode rank's KV transfer failed")
        for name, _, src in used:                              # all reads are done and intact: release the leases
            for params in src["params"]:
                agent.send_notif(name, str(params["remote_request_id"]).encode())
    finally:
        agent.close()

    # -- decode token N-1 on, in lockstep  -------------------------------
    eos = set(cfg.eos_token_ids)
    bucket = max(1, len(prompts))
    reqs = [{"rid": f"r{i}", "prompt": list(p), "out": [], "done": None} for i, p in enumerate(prompts)]

    def accept(r: dict, tok: int) -> None:
        r["out"].append(tok)
        if not ignore_eos and tok in eos:
            r["done"] = "stop"
        elif len(r["out"]) >= max_tokens:
            r["done"] = "length"
        if r["done"]:
            mgr.free(r["rid"])
        else:
            mgr.remove_skipped_blocks(r["rid"], len(r["prompt"]) + len(r["out"]) - 1)

    while True:
        live = [r for r in reqs if r["done"] is None]
        if not live:                                           # the same on every rank (one DP group)
            break
        pos = [len(r["prompt"]) + len(r["out"]) - 1 for r in live]
        for r, p in zip(live, pos):
            if not mgr.allocate(r["rid"], p + 1, p):
                raise RuntimeError("KV pool too small")
        tables = [mgr.block_tables(r["rid"]) for r in live]
        ctl = build_attention_control(pos, tables, sliding, model.rope, block_size, cfg.sliding_window,
                                      batch_bucket=bucket)
        ids = torch.zeros(bucket, dtype=torch.long)
        ids[: len(live)] = torch.tensor([(r["out"] or r["prompt"])[-1] for r in live], dtype=torch.long)
        logits = gk.decode(ids, ctl)[: len(live)]
        nxt = (ctx.greedy(logits) if ctx is not None else logits.argmax(-1)).tolist()
        for r, t in zip(live, nxt):
            accept(r, t)
    if rank != 0:
        return None
    return [{"prompt_ids": r["prompt"], "token_ids": r["out"], "finish_reason": r["done"], "kv_bytes": nbytes[i]}
            for i, r in enumerate(reqs)]


# -- both worlds -----------------------------------------------------------------------------------------
def run_di(model_dir: str | Path, prompts: list[list[int]], prefill_tp: int, decode_tp: int, max_tokens: int = 16,
           *, ignore_eos: bool = False, dtype: str = "float32", kv_dtype: str = "auto", block_size: int = 16,
           timeout_s: float = 300.0) -> dict[str, Any]:
    """A prefill world of `prefill_tp` ranks (in a thread) and a decode world of `decode_tp` ranks on this
    machine -> {"results": decode rank 0's results, "prefill": each prefill rank's report}."""
    from .spawn import run_world

    tag = uuid.uuid4().hex[:8]
    common = dict(dtype=dtype, kv_dtype=kv_dtype, block_size=block_size, tag=tag)
    with tempfile.TemporaryDirectory(prefix="gigadecode-di-") as rdv:
        box: dict[str, Any] = {}

        def prefill() -> None:
            try:
                box["prefill"] = run_world(prefill_tp, prefill_rank_job, str(model_dir), prompts, prefill_tp, rdv,
                                           dict(common, serve_s=timeout_s))
            except BaseException as e:                      # reported below
                box["error"] = e

        th = threading.Thread(target=prefill, daemon=True, name="di-prefill-world")
        th.start()
        try:
            files = [Path(rdv, f"prefill{r}.json") for r in range(prefill_tp)]
            deadline = time.monotonic() + timeout_s
            while not all(f.exists() for f in files):
                if "error" in box or not th.is_alive():
                    raise RuntimeError(f"the prefill world failed: {box.get('error')}")
                if time.monotonic() > deadline:
                    raise TimeoutError("the prefill world did not publish its KV in time")
                time.sleep(0.02)
            sources = [json.loads(f.read_text()) for f in files]
            res = run_world(decode_tp, decode_rank_job, str(model_dir), prompts, decode_tp, sources,
                            dict(common, max_tokens=max_tokens, ignore_eos=ignore_eos))
        finally:
            Path(rdv, "done").touch()
            th.join(60)
        if "error" in box:
            raise RuntimeError(f"the prefill world failed: {box['error']}")
        return {"results": res[0], "prefill": box.get("prefill")}


__all__ = ["decode_rank_job", "prefill_rank_job", "run_di", "source_from_producer"]
