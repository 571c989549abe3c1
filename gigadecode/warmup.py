"""The start-up warm-up of an engine: what a first prefill chunk and a first decode step pay once (memory
touched for the first time, oneDNN's kernels for their shapes) is paid before any request, and with adaptive
speculative decoding what a draft row costs on this machine is measured. `engine` is an `engine.LLMEngine`
(which calls in here from its `warm_up`; this module does not import it back).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .gemm import prime_row_counts
from .model import SeqChunk
from .runner import DecodeSeq
from .speculative import measure_row_cost

log = logging.getLogger("gigadecode.engine")


def warm_up(engine: Any) -> float | None:
    """oneDNN's GEMMs of the prefill projections for every row count a chunk runs them at (`prime_projections`),
    one prefill chunk (`max_prefill_tokens` tokens, fewer where the context or the pool holds less) and,
    unless this engine only prefills (kv_producer), one decode step after it, on KV blocks borrowed from
    the pool and given back. What a first chunk pays once (memory touched for the first time, oneDNN's
    kernels for its shapes) is paid here, so the first request runs at full speed. Nothing else changes:
    no request, no counted tokens, every block free again. Call it on the thread that will step the
    engine: its OpenMP workers, its malloc arena and the kernels' per-thread scratch are that thread's.
    (A parallel engine's replicas warm up together: `DistributedEngine.warm_up`.) A failure is logged and
    costs the first request's speed, nothing more (a `lockstep` replica's raises: see `LLMEngine.lockstep`).
    -> seconds, or None when it failed or the pool cannot hold even a 1-token chunk."""
    n = min(engine.ecfg.max_prefill_tokens, engine.max_model_len - 1)
    while n > 1 and not engine.fits_pool(n + 1):
        n //= 2
    rid = "\0warm-up"                     # held and given back before any request exists
    if n < 1 or not engine.fits_pool(n + 1) or not engine.kv_manager.allocate(rid, n + 1, 0):
        return None
    t0 = time.perf_counter()
    try:
        prime_projections(engine)
        tables = engine.kv_manager.block_tables(rid)
        engine.runner.prefill([SeqChunk(spread_tokens(n, engine.cfg.vocab_size), 0, tables, "last")])
        if engine.ecfg.kv_role != "kv_producer":
            engine.runner.decode([DecodeSeq(0, n, tables)], pad_to=1)
            measure_draft_rows(engine, n, tables)
    except Exception:  # noqa: BLE001 - the requests still run (and fail on their own if the engine is broken)
        if engine.lockstep:              # a peer may wait in the warm-up's collectives: no step may follow
            raise
        log.exception("warm-up failed; going on without it")
        return None
    finally:
        engine.kv_manager.free(rid)
    took = time.perf_counter() - t0
    log.info("warm-up: a %d-token prefill chunk%s in %.2f s", n,
             "" if engine.ecfg.kv_role == "kv_producer" else " and a decode step", took)
    return took


def prime_projections(engine: Any) -> None:
    """oneDNN's bf16 GEMMs of the prefill projections (qkv, o, router; the same shapes in every layer) built for
    each row count a chunk of up to `max_prefill_tokens` tokens runs them at (`gemm.prime_row_counts`), so a
    prompt of a length not seen before builds none."""
    lw = engine.runner.weights.layers[0]
    prime_row_counts([(lw.qkv_w, lw.qkv_b), (lw.o_w, lw.o_b), (lw.router_w, lw.router_b)],
                     engine.ecfg.max_prefill_tokens)


def spread_tokens(n: int, vocab_size: int) -> list[int]:
    """n distinct-looking token ids (a stride through the vocabulary), so the warm-up chunk routes like a prompt:
    over many experts with uneven token counts, whose GEMM calls then take (and oneDNN compiles once) the
    partial blocks of inputs a request's experts will. One token repeated would send the whole chunk to the
    same few experts in whole blocks."""
    return [(1 + 7919 * i) % vocab_size for i in range(n)]


def measure_draft_rows(engine: Any, n: int, tables: list[list[int]]) -> None:
    """Speculative decoding, adaptive: what a draft row costs here (`speculative.measure_row_cost`), on the
    warm-up's borrowed blocks at position n - k - 1 (their KV is garbage and never named). Distinct tokens:
    rows of one token would route to the same experts, which real drafts do not."""
    proposer, spec = engine.scheduler.proposer, engine.ecfg.speculative
    if proposer is None or spec is None or not spec.adaptive or not hasattr(proposer, "row_cost"):
        return
    k = min(spec.num_speculative_tokens, n - 1)
    if k < 1 or engine.runner.parallel is not None:      # a parallel engine's replicas would time apart
        return
    ids = spread_tokens(k + 1, engine.cfg.vocab_size)
    proposer.row_cost = measure_row_cost(
        lambda d: engine.runner.decode([DecodeSeq(ids[0], n - k - 1, tables, tuple(ids[1: 1 + d]))], pad_to=1), k)
    log.info("speculative decoding: a draft row costs %.2f of a 1-row decode step", proposer.row_cost)
