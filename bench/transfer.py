"""Disaggregated-inference TTFT benchmark: prefill (producer process) + NIXL KV transfer + first GK decode.

A producer engine (kv_producer, per-layer prefill of N-1 tokens) runs in a spawned process; a consumer
engine (kv_consumer, GK decode) and a single-node engine (kv_both, same weights) run here. Per prompt
length the DI time to first token is split into

  prefill   the producer engine's time to finish the request (measured there, sent back over the pipe),
  transfer  the consumer connector's `start_load` -> READ landed + CRC32 checked (`connector.stats`
            delta; the handshake is paid once by a warm-up request and reported on its own),
  decode    the consumer's first GK decode step (its `runner.decode` call),

next to the same bytes moved by raw NIXL loopback (two `NixlKVAgent`s over two `KVCache`s in this
process, the target with progress_thread=True, same (remote, local) block pairs), raw NIXL across the
process boundary (the consumer's own agent reading the producer's blocks, no engine around it), a torch
memcpy of as many bytes (contiguous `copy_`) and a per-block gather (`index_select` of the same block ids
in every K/V region), and the single-node TTFT (kv_both: prefill N tokens + sample).

`--reps R`: the transfer and the first decode are measured R times per length; the first is the real
request, the others replay its kv_transfer_params (the producer is idle, so its released blocks still
hold the bytes: the CRC check proves it). The transfer / decode columns are medians over the R; TTFT is
the real request end to end (prefill command sent -> first token sampled); `other` is what of it the
real request's own prefill + transfer + decode do not explain (pipe, scheduling, sampling). `repack` is
what a decode engine behind a vLLM prefill adds after its READ: the prompt's tokens of bf16 vLLM CPU
pages unpacked and written into this engine's cache (`connector.vllm_layout.repack_tokens`), against the
raw READ of the same prompt. Raw / memcpy / gather / repack are the medians of --raw-reps runs, interleaved with each other, after all DI runs. Timings on a shared machine are noisy.

    .venv/bin/python bench/transfer.py [--preset small] [--lengths 128 512 2048] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import secrets
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigadecode.checkpoint import make_checkpoint  # noqa: E402
from gigadecode.engine_config import EngineConfig  # noqa: E402
from gigadecode.connector.nixl_agent import NixlKVAgent  # noqa: E402
from gigadecode.connector import side_channel  # noqa: E402
from gigadecode.connector.kv_crc import kv_crc32  # noqa: E402
from gigadecode.engine import build_engine  # noqa: E402
from gigadecode.kv.cache import KVCache  # noqa: E402
from gigadecode.runner import ModelRunner  # noqa: E402
from gigadecode.sampling import SamplingParams  # noqa: E402

CACHE = Path.home() / ".cache" / "gigadecode"


# -- the producer process ------------------------------------------------------------------------------
def producer_main(conn, model_dir: str, ecfg_kw: dict, threads: int) -> None:
    torch.set_num_threads(threads)
    eng = build_engine(model_dir, EngineConfig(**{"kv_role": "kv_producer", **ecfg_kw}))
    conn.send(("ready", eng.connector.side_port))
    while True:
        if conn.poll(0.002):
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            if cmd == "prefill":
                t0 = time.perf_counter()
                rid = eng.add_request(args[0], SamplingParams(temperature=0.0, max_tokens=1),
                                      kv_transfer_params={"do_remote_decode": True})
                while not eng.requests[rid].finished:
                    eng.step()
                conn.send((eng.requests[rid].kv_transfer_params_out, time.perf_counter() - t0))
        eng.step()                      # notifications, lease expiry (as a server's engine loop does)
    eng.connector.close()


class Producer:
    def __init__(self, model_dir: Path, ecfg_kw: dict, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=producer_main, args=(child, str(model_dir), ecfg_kw, threads), daemon=True)
        self.proc.start()
        if not self.conn.poll(600):
            raise TimeoutError("the producer process did not start")
        tag, self.side_port = self.conn.recv()
        assert tag == "ready"

    def prefill(self, prompt: list[int]) -> tuple[dict, float]:
        self.conn.send(("prefill", list(prompt)))
        if not self.conn.poll(1800):
            raise TimeoutError("the producer did not answer a prefill")
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# -- instrumentation of the consumer (instance attributes only: the package is untouched) ----------------
class ConsumerProbe:
    """Wraps the consumer engine's connector and runner to time the handshake, the READ and the decode."""

    def __init__(self, eng) -> None:
        self.eng, self.conn = eng, eng.connector
        self.handshake_s: list[float] = []
        self.decode_s: list[float] = []
        self.last: dict = {}
        start_load, decode = self.conn.start_load, eng.runner.decode
        fetch = side_channel.fetch_handshake

        def _fetch(*a, **kw):                # runs on the connector's handshake thread
            t0 = time.perf_counter()
            try:
                return fetch(*a, **kw)
            finally:
                self.handshake_s.append(time.perf_counter() - t0)

        def _start_load(rid, params, tables):
            start_load(rid, params, tables)
            self.last = {"load": self.conn.loads.get(rid)}

        side_channel.fetch_handshake = _fetch
        def _decode(seqs, *args):
            t0 = time.perf_counter()
            out = decode(seqs, *args)
            self.decode_s.append(time.perf_counter() - t0)
            return out

        self.conn.start_load, eng.runner.decode = _start_load, _decode

    def run(self, prompt: list[int], params: dict) -> dict:
        """One consumer request (max_tokens=1) -> its transfer / READ / decode seconds and first token."""
        st = self.conn.stats
        self.conn.used.clear()               # replays of one prefill's params are the point here (see above)
        b0, s0, nd = st["kv_bytes_transferred"], st["transfer_seconds"], len(self.decode_s)
        rid = self.eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                   kv_transfer_params=params)
        while not self.eng.requests[rid].finished:
            self.eng.step()
        req = self.eng.requests[rid]
        if req.error:
            raise RuntimeError(f"DI request failed: {req.error}")
        load = self.last["load"]
        h = load.reads[0].handle
        self.last.update(pairs=list(load.pairs), local_ids=[list(x) for x in load.local_ids])
        return {"bytes": st["kv_bytes_transferred"] - b0, "transfer_s": st["transfer_seconds"] - s0,
                "read_s": h.seconds, "decode_s": sum(self.decode_s[nd:]), "token": req.output_ids[0],
                "first_token_time": req.first_token_time, "pairs": self.last["pairs"],
                "local_ids": self.last["local_ids"], "num_descs": h.num_descs}


def single_node_ttft(eng, prompt: list[int]) -> tuple[float, int]:
    t0 = time.monotonic()
    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while not eng.requests[rid].finished:
        eng.step()
    req = eng.requests[rid]
    return req.first_token_time - t0, req.output_ids[0]


# -- raw baselines ------------------------------------------------------------------------------------
def regions(kv: KVCache) -> list[torch.Tensor]:
    """Each K / V region as [num_blocks, block_len] bytes (what NIXL registers)."""
    out = []
    for buf in kv.group_bufs:
        for half in (buf[0], buf[1]):
            out.append(half.view(torch.uint8).reshape(half.shape[0], -1))
    return out


def timed_read(agent: NixlKVAgent, remote: str, pairs) -> float:
    t0 = time.perf_counter()
    h = agent.read(remote, pairs)
    while not agent.poll(h):            # busy-poll, as the engine loop does
        pass
    return time.perf_counter() - t0


class RawBaselines:
    def __init__(self, cfg, ecfg: EngineConfig, num_blocks: int, consumer_agent: NixlKVAgent, producer_name: str):
        self.kv_src, self.kv_dst = KVCache(cfg, ecfg, num_blocks), KVCache(cfg, ecfg, num_blocks)
        for t in self.kv_src.group_bufs:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
        self.target = NixlKVAgent("raw-target", progress_thread=True)
        self.initiator = NixlKVAgent("raw-initiator")
        self.target.register_kv(self.kv_src)
        self.initiator.register_kv(self.kv_dst)
        self.initiator.add_remote("raw-target", self.target.metadata(), self.target.layout())
        self.src_regions, self.dst_regions = regions(self.kv_src), regions(self.kv_dst)
        self.consumer_agent, self.producer_name = consumer_agent, producer_name
        self.cfg = cfg
        self.kv_repack = KVCache(cfg, ecfg, num_blocks)      # the repack's target (not the raw READ's)

    def repack_fn(self, n: int):
        """What a decode engine does with a vLLM producer's pages after its READ: n tokens of bf16 vLLM CPU
        pages (block 32, vec order) of every region unpacked and written into this cache (`repack_tokens`)."""
        from gigadecode.connector.vllm_layout import page_bytes, repack_tokens
        H, D, Br, B = self.cfg.num_key_value_heads, self.cfg.head_dim, 32, self.kv_repack.block_size
        m = -(-n // Br)
        staging = torch.randn(len(self.kv_repack.group_bufs), m, page_bytes(H, Br, D, torch.bfloat16) // 2
                              ).to(torch.bfloat16).view(torch.uint8)
        p = torch.arange(n)
        cols, offs, slots = p // Br, p % Br, (1 + p // B) * B + p % B
        return lambda: _timed(lambda: repack_tokens(self.kv_repack, staging, cols, offs, slots, (0, H), H, D, Br,
                                                    torch.bfloat16, "vec"))

    def measure(self, pairs, nbytes: int, reps: int, n_tokens: int = 0) -> dict[str, float]:
        rb = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        src.random_(0, 256)
        gathered = [torch.empty(len(pairs), r.shape[1], dtype=torch.uint8) for r in self.src_regions]

        def gather() -> None:
            for r, out in zip(self.src_regions, gathered):
                torch.index_select(r, 0, rb, out=out)

        fns = {"raw": lambda: timed_read(self.initiator, "raw-target", pairs),
               "xproc": lambda: timed_read(self.consumer_agent, self.producer_name, pairs),
               "memcpy": lambda: _timed(lambda: dst.copy_(src)),
               "gather": lambda: _timed(gather)}
        if n_tokens:
            fns["repack"] = self.repack_fn(n_tokens)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for k, fn in fns.items():          # warm-up
            fn()
        for _ in range(reps):              # interleaved: all four share the machine's noise
            for k, fn in fns.items():
                times[k].append(fn())
        # the raw read really moved the right bytes
        for s, d in zip(self.src_regions, self.dst_regions):
            lb = torch.tensor([p[1] for p in pairs], dtype=torch.long)
            assert torch.equal(s.index_select(0, rb), d.index_select(0, lb)), "raw NIXL read moved wrong bytes"
        return {k: statistics.median(v) for k, v in times.items()}

    def close(self) -> None:
        self.initiator.close()
        self.target.close()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", default=None, help="checkpoint directory (default ~/.cache/gigadecode/<preset>)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048], help="prompt tokens")
    ap.add_argument("--kv-dtype", default="fp8")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--decoder", default="gk", choices=["gk", "gk-compiled", "reference"])
    ap.add_argument("--reps", type=int, default=3, help="transfers (+ first decodes) per length")
    ap.add_argument("--raw-reps", type=int, default=20, help="raw NIXL / memcpy / gather runs per length")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (2 processes share the CPU)")
    ap.add_argument("--quick", action="store_true", help="tiny preset, lengths 128 512, 2 reps")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.lengths, args.reps, args.raw_reps = "tiny", [128, 512], 2, 10
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else CACHE / args.preset
    if not (model_dir / "config.json").exists():
        print(f"writing the {args.preset} checkpoint to {model_dir} ...", flush=True)
        make_checkpoint(model_dir, args.preset, seed=0)

    B = args.block_size
    per_req = 2 * (-(-(max(args.lengths) + 2 * B) // B)) + 4
    kw = dict(kv_dtype=args.kv_dtype, block_size=B, num_blocks=3 * per_req + 8, decoder=args.decoder,
              kv_secret=secrets.token_hex(16))
    t_setup = time.perf_counter()
    producer = Producer(model_dir, {**kw, "kv_lease_s": 600.0}, args.threads)
    try:
        c_ecfg = EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=120.0, **kw)
        c_runner = ModelRunner(model_dir, c_ecfg)
        consumer = build_engine(model_dir, c_ecfg, runner=c_runner)
        s_ecfg = EngineConfig(**kw)
        single = build_engine(model_dir, s_ecfg, runner=ModelRunner(model_dir, s_ecfg, cfg=c_runner.cfg,
                                                                    weights=c_runner.weights))
        probe = ConsumerProbe(consumer)
        cfg = c_runner.cfg
        g = torch.Generator().manual_seed(0)

        # Warm-up: pays the handshake (timed on its own) and the first-call costs of both engines.
        warm = torch.randint(3, cfg.vocab_size, (3 * B + 1,), generator=g).tolist()
        params, _ = producer.prefill(warm)
        w = probe.run(warm, params)
        single_node_ttft(single, warm)
        handshake_ms = probe.handshake_s[0] * 1e3
        print(f"model {model_dir}  kv {args.kv_dtype}  block {B}  decoder {args.decoder}  threads/process "
              f"{args.threads}  setup {time.perf_counter() - t_setup:.0f}s", flush=True)
        print(f"handshake (first request only, excluded below): {handshake_ms:.1f} ms; its transfer incl. "
              f"handshake {w['transfer_s'] * 1e3:.1f} ms", flush=True)
        layout = consumer.connector.agent.layout()

        rows = []
        for n in args.lengths:
            prompt = torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
            t_send = time.monotonic()
            params, prefill_s = producer.prefill(prompt)
            runs = [probe.run(prompt, params)]
            ttft = runs[0]["first_token_time"] - t_send
            for _ in range(args.reps - 1):           # replays of the same params (see the docstring)
                runs.append(probe.run(prompt, params))
            single_s, single_tok = single_node_ttft(single, prompt)
            r0 = runs[0]
            crc_s = min(_timed(lambda: kv_crc32(c_runner.kv, r0["local_ids"])) for _ in range(3))
            rows.append(dict(n=n, bytes=r0["bytes"], pairs=r0["pairs"], descs=r0["num_descs"], prefill=prefill_s,
                             transfer=statistics.median(r["transfer_s"] for r in runs),
                             read=statistics.median(r["read_s"] for r in runs),
                             decode=statistics.median(r["decode_s"] for r in runs), ttft=ttft, single=single_s,
                             crc=crc_s, other=ttft - prefill_s - r0["transfer_s"] - r0["decode_s"],
                             same_token=all(r["token"] == single_tok for r in runs)))
            print(f"  {n} tokens: prefill {prefill_s:.2f}s, transfers "
                  f"{[round(r['transfer_s'] * 1e3, 2) for r in runs]} ms, decodes "
                  f"{[round(r['decode_s'] * 1e3, 1) for r in runs]} ms, single-node TTFT {single_s:.2f}s",
                  flush=True)

        # The raw baselines come last: the loopback target's progress thread costs CPU even when idle
        # (as does the producer's), which would slow the engines' prefill and decode above.
        raw = RawBaselines(cfg, c_ecfg, c_runner.kv.num_blocks, consumer.connector.agent,
                           params["remote_engine_id"])
        for row in rows:
            row.update(raw.measure(row["pairs"], row["bytes"], args.raw_reps, row["n"]))
            row["pairs"] = len(row["pairs"])
        raw.close()
    finally:
        producer.close()

    print(f"\nKV layout: {layout.num_regions} regions (K+V of {layout.num_buffers} buffers), block_len "
          f"{layout.block_len} B, {layout.dtype}")
    hdr = (f"{'prompt':>6} {'KV bytes':>10} {'prefill ms':>10} {'transfer ms':>11} {'1st decode ms':>13} "
           f"{'TTFT ms':>9} {'DI GB/s':>8} {'raw NIXL GB/s':>13} {'memcpy GB/s':>11} {'DI/raw':>7} {'DI/memcpy':>9}")
    print(hdr)
    for r in rows:
        di, rw, mc = gbs(r["bytes"], r["transfer"]), gbs(r["bytes"], r["raw"]), gbs(r["bytes"], r["memcpy"])
        print(f"{r['n']:>6} {r['bytes']:>10} {r['prefill'] * 1e3:>10.1f} {r['transfer'] * 1e3:>11.2f} "
              f"{r['decode'] * 1e3:>13.1f} {r['ttft'] * 1e3:>9.1f} {di:>8.3f} {rw:>13.3f} {mc:>11.3f} "
              f"{di / rw:>7.3f} {di / mc:>9.4f}")
    print("\ntransfer breakdown and the other baselines (medians; ms unless noted)")
    print(f"{'prompt':>6} {'pairs':>5} {'descs':>6} {'READ ms':>8} {'CRC ms':>7} {'xproc NIXL GB/s':>15} "
          f"{'gather GB/s':>11} {'other ms':>8} {'DI TTFT ms':>10} {'single TTFT ms':>14} {'DI/single':>9} "
          f"{'same 1st tok':>12}")
    for r in rows:
        print(f"{r['n']:>6} {r['pairs']:>5} {r['descs']:>6} {r['read'] * 1e3:>8.2f} {r['crc'] * 1e3:>7.2f} "
              f"{gbs(r['bytes'], r['xproc']):>15.3f} {gbs(r['bytes'], r['gather']):>11.3f} {r['other'] * 1e3:>8.1f} "
              f"{r['ttft'] * 1e3:>10.1f} "
              f"{r['single'] * 1e3:>14.1f} {r['ttft'] / r['single']:>9.3f} {str(r['same_token']):>12}")
    print("\nbehind a vLLM prefill: the repack of its CPU pages (bf16, block 32, vec) after the READ")
    print(f"{'prompt':>6} {'raw READ ms':>11} {'repack ms':>9} {'repack us/token':>15} {'repack/READ':>11}")
    for r in rows:
        print(f"{r['n']:>6} {r['raw'] * 1e3:>11.2f} {r['repack'] * 1e3:>9.2f} {r['repack'] / r['n'] * 1e6:>15.2f} "
              f"{r['repack'] / r['raw']:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
