"""Decode-step benchmark: the per-layer loop vs the GK program (eager and compiled), side by side.

Prints ms/step and tok/s at each batch size for the three decoders, their ratio to the per-layer loop
(measured in the same run, interleaved to share the machine's noise), and the achieved GB/s of weights
read per step against this machine's measured streaming-read bandwidth.

    .venv/bin/python bench/decode.py [--preset small] [--batch 1 8] [--steps 16] [--context 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigadecode.checkpoint import make_checkpoint  # noqa: E402
from gigadecode.config import EngineConfig, GptOssConfig  # noqa: E402
from gigadecode.gk.attn_control import build_attention_control  # noqa: E402
from gigadecode.gk.model import GptOssGKDecodeModel  # noqa: E402
from gigadecode.kv.cache import KVCache  # noqa: E402
from gigadecode.kv.manager import KVCacheManager  # noqa: E402
from gigadecode.kv.spec import SlidingWindowSpec  # noqa: E402
from gigadecode.model import GptOssModel, SeqChunk  # noqa: E402
from gigadecode.weights import load_weights  # noqa: E402

CACHE = Path.home() / ".cache" / "gigadecode"


def memory_bandwidth_gbs(mib: int = 512, reps: int = 5) -> float:
    x = torch.ones(mib * 1024 * 1024 // 4)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(reps))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes_per_step(cfg: GptOssConfig, w, batch: int) -> float:
    """Bytes of weights one decode step must read: all attention/router/norm stacks, the lm_head, and the
    expected number of distinct experts hit per layer (E·(1-(1-k/E)^B)) at their stored size."""
    t = w.tensors
    dense = sum(t[n].numel() * t[n].element_size() for n in
                ("qkv_w", "qkv_b", "o_w", "o_b", "sinks", "router_w", "router_b", "input_norm", "post_norm",
                 "norm", "lm_head"))
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    names = ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales") if w.mxfp4 else ("gate_up", "down")
    per_expert = sum(t[n][0, 0].numel() * t[n].element_size() for n in names + ("gate_up_bias", "down_bias"))
    hit = E * (1 - (1 - k / E) ** batch)
    return dense + cfg.num_hidden_layers * hit * per_expert + batch * cfg.hidden_size * t["embed"].element_size()


class Bench:
    def __init__(self, model_dir: Path, batch: int, context: int, kv_dtype: str, block: int) -> None:
        self.cfg = GptOssConfig.from_hf(model_dir)
        self.w = load_weights(model_dir, self.cfg, torch.float32)
        self.model = GptOssModel(self.cfg, self.w, torch.float32)
        ecfg = EngineConfig(kv_dtype=kv_dtype, block_size=block)
        nb = batch * 2 * (-(-(context + 256) // block)) + 8
        self.kv = KVCache(self.cfg, ecfg, nb)
        self.mgr = KVCacheManager(self.kv.config, block)
        self.batch, self.block = batch, block
        g = torch.Generator().manual_seed(0)
        self.rids = [f"r{i}" for i in range(batch)]
        prompts = [torch.randint(3, self.cfg.vocab_size, (context,), generator=g).tolist() for _ in range(batch)]
        for r in self.rids:
            self.mgr.allocate(r, context + 256, 0)
        self.model.forward([SeqChunk(p, 0, self.mgr.block_tables(r), "none") for r, p in zip(self.rids, prompts)],
                           self.kv)
        self.pos = context
        self.sliding = [isinstance(gr.spec, SlidingWindowSpec) for gr in self.kv.config.groups]
        self.gk = {}
        for name, compiled in (("gk", False), ("gk-compiled", True)):
            m = GptOssGKDecodeModel(self.cfg, self.w, self.kv.config, block, self.kv.k_scale, self.kv.v_scale,
                                    compiled=compiled)
            m.bind_kv_cache(self.kv.bind_map())
            self.gk[name] = m
        self.full_width = 1 << (-(-(context + 256) // block) - 1).bit_length()

    def step(self, decoder: str) -> None:
        # Every decoder re-writes the same position each step: same work, no growth between samples.
        tables = [self.mgr.block_tables(r) for r in self.rids]
        ids = [7] * self.batch
        if decoder == "per-layer":
            self.model.forward([SeqChunk([t], self.pos, tb) for t, tb in zip(ids, tables)], self.kv)
            return
        ctl = build_attention_control([self.pos] * self.batch, tables, self.sliding, self.model.rope, self.block,
                                      self.cfg.sliding_window, batch_bucket=self.batch, full_width=self.full_width)
        self.gk[decoder].decode(torch.tensor(ids), ctl)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--kv-dtype", default="fp8")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else CACHE / args.preset
    if not (model_dir / "config.json").exists():
        print(f"writing the {args.preset} checkpoint to {model_dir} ...", flush=True)
        make_checkpoint(model_dir, args.preset, seed=0)
    bw = memory_bandwidth_gbs()
    print(f"model {model_dir}  threads {torch.get_num_threads()}  measured read bandwidth {bw:.1f} GB/s")
    decoders = ["per-layer", "gk", "gk-compiled"]
    print(f"{'batch':>5} {'decoder':<12} {'ms/step':>9} {'tok/s':>8} {'x per-layer':>11} {'GB/s':>7} {'% bw':>6}")
    for batch in args.batch:
        b = Bench(model_dir, batch, args.context, args.kv_dtype, args.block_size)
        t0 = time.perf_counter()
        for d in decoders:                                    # warm-up (compiles once; Inductor caches on disk)
            b.step(d)
        print(f"      (warm-up incl. compile {time.perf_counter() - t0:.0f}s)", flush=True)
        times: dict[str, list[float]] = {d: [] for d in decoders}
        for _ in range(args.steps):                           # interleaved: the three share the same noise
            for d in decoders:
                times[d].append(_timed(lambda: b.step(d)))
        wbytes = weight_bytes_per_step(b.cfg, b.w, batch)
        base = statistics.median(times["per-layer"])
        for d in decoders:
            med = statistics.median(times[d])
            gbs = wbytes / med / 1e9
            print(f"{batch:>5} {d:<12} {med * 1e3:>9.2f} {batch / med:>8.1f} {base / med:>11.2f} {gbs:>7.2f} "
                  f"{100 * gbs / bw:>5.0f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
