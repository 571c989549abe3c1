"""The `gigadecode` command line. Its commands and flags are a contract scripts depend on (README § Command
line): extend them, never break them.

Subcommands: make-checkpoint, generate, plan, serve, proxy, demo. Heavy imports happen inside each
command so `gigadecode --help` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_DEMO_DIR = Path(os.environ.get("GIGADECODE_CACHE", Path.home() / ".cache" / "gigadecode")) / "demo"


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (default auto: the checkpoint's torch_dtype, bfloat16 for GPT-OSS; float32 "
                        "for float16 or float32 checkpoints)")
    g.add_argument("--kv-dtype", default=None, choices=["auto", "bf16", "fp8"],
                   help="KV storage: auto = the model dtype, fp8 = packed FP8 (default for GK decode engines)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: from --kv-budget-gib)")
    g.add_argument("--kv-budget-gib", type=float, default=None)
    g.add_argument("--decoder", default="gk-native", choices=["gk-native", "gk", "gk-compiled", "reference"],
                   help="gk-native: the GK program on the native kernels (default); gk / gk-compiled: its torch "
                        "forms; reference: the per-layer model")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (prompt + generated tokens) a request may reach (default: the model's "
                        "max_position_embeddings, or what the KV pool holds if less); the default pool is sized "
                        "for it")
    g.add_argument("--max-prefill-tokens", type=int, default=512)
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the kernels (default: the cores this process may use; under torchrun, "
                        "divided among the local ranks)")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--dp", type=int, default=1)
    g.add_argument("--ep", type=int, default=1)
    g.add_argument("--dcp", type=int, default=1,
                   help="decode context parallel: ranks of a TP group that share kv heads and split every "
                        "sequence's tokens (divides --tp; tp/dcp must divide the kv heads)")
    g.add_argument("--dcp-interleave", type=int, default=None,
                   help="DCP: tokens per round-robin chunk (default: --block-size; a multiple of it)")


def engine_config(args: argparse.Namespace, **kw):
    """The `EngineConfig` of a command line (`engine_config.engine_config_from_args`, imported here on use:
    the CLI imports torch only after `main` has set the OpenMP environment)."""
    from .engine_config import engine_config_from_args
    return engine_config_from_args(args, **kw)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")


# ------------------------------------------------------------------------------------------------------
def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from .checkpoint import make_checkpoint
    t0 = time.perf_counter()
    out = make_checkpoint(args.out, args.preset, seed=args.seed, experts=args.experts)
    print(f"wrote {args.preset} checkpoint ({args.experts} experts) to {out} in {time.perf_counter() - t0:.1f}s")
    return 0


def _base_params(args: argparse.Namespace) -> dict:
    """The sampling flags, which a request's own fields override."""
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos)


def _read_requests(args: argparse.Namespace, codec) -> list[tuple[list[int], dict, str]]:
    """-> (prompt ids, the request's own sampling fields, where it came from) per request. A file that cannot
    be read, a line that is no request or whose sampling fields are invalid: SystemExit naming file:line."""
    if args.requests:
        from dataclasses import fields

        from .sampling import SamplingError, SamplingParams
        known = {f.name for f in fields(SamplingParams)}
        try:
            lines = Path(args.requests).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"gigadecode generate: cannot read --requests {args.requests}: {e}")
        out = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"gigadecode generate: {args.requests}:{n}: not JSON ({e})")
            if not isinstance(d, dict):
                raise SystemExit(f"gigadecode generate: {args.requests}:{n}: a request must be a JSON object")
            d = {k: v for k, v in d.items() if v is not None}     # null: not given (the flag applies)
            unknown = sorted(set(d) - known - {"prompt_ids", "prompt"})
            if unknown:
                raise SystemExit(f"gigadecode generate: {args.requests}:{n}: unknown key(s) {', '.join(unknown)} "
                                 f"(a request has prompt_ids or prompt, and any of {', '.join(sorted(known))})")
            if "prompt_ids" in d:
                ids = d.pop("prompt_ids")
            elif "prompt" in d and codec is not None:
                ids = codec.encode(d.pop("prompt"))
            else:
                raise SystemExit(f"gigadecode generate: {args.requests}:{n}: needs prompt_ids (or prompt with a tokenizer)")
            try:
                SamplingParams.from_dict({**_base_params(args), **d})
            except SamplingError as e:
                raise SystemExit(f"gigadecode generate: {args.requests}:{n}: {e}")
            out.append((ids, d, f"{args.requests}:{n}"))
        if not out:
            raise SystemExit(f"gigadecode generate: {args.requests} has no requests")
        return out
    if args.prompt_ids is not None:
        try:
            return [([int(t) for t in args.prompt_ids.split(",") if t.strip()], {}, "--prompt-ids")]
        except ValueError:
            raise SystemExit("gigadecode generate: --prompt-ids must be comma-separated integers")
    if codec is None:
        raise SystemExit("gigadecode generate: this checkpoint has no tokenizer.json; use --prompt-ids")
    return [(codec.encode(args.prompt), {}, "--prompt")]


def _generate_parallel(args: argparse.Namespace, ecfg) -> int:
    """`generate --tp/--dp/--ep` under torchrun: an engine replica on every rank; rank 0 reads the requests,
    drives the world and prints what one process would print."""
    from .distributed.mesh import build_layout
    started = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else None
    build_layout(ecfg.tp, ecfg.dp, ecfg.ep, started, dcp=ecfg.dcp)  # LayoutError (a ValueError): what is wrong, exit 2
    world = ecfg.tp * ecfg.dp
    if "WORLD_SIZE" not in os.environ:
        print(f"gigadecode generate: --tp {ecfg.tp} × --dp {ecfg.dp} needs {world} ranks: start it with "
              f"torchrun --nproc-per-node {world} -m gigadecode generate …", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from .parallel.engine import DistributedEngine, build_parallel_engine, run_worker
    replica, ctx = build_parallel_engine(args.model, ecfg, progress=not args.json)
    try:
        if ctx.rank != 0:
            run_worker(replica, ctx)
            return 0
        with DistributedEngine(replica, ctx) as engine:
            return _run_generate(args, ecfg, engine, *_codec_and_requests(args),
                                 layout=f"TP{ecfg.tp} × DP{ecfg.dp} × EP{ecfg.ep}, ")
    finally:
        dist.destroy_process_group()


def cmd_generate(args: argparse.Namespace) -> int:
    from .parallel.engine import is_parallel
    ecfg = engine_config(args)
    if is_parallel(ecfg):
        return _generate_parallel(args, ecfg)
    from .engine import LLMEngine
    from .runner import ModelRunner
    codec, reqs = _codec_and_requests(args)                          # a bad file fails before the model loads
    return _run_generate(args, ecfg, LLMEngine(ModelRunner(args.model, ecfg, progress=not args.json)), codec, reqs)


def _codec_and_requests(args: argparse.Namespace):
    """The checkpoint's text codec (None without a tokenizer) and the requests `args` names."""
    from .tokenizer import TextCodec
    codec = TextCodec.from_dir(args.model)
    return codec, _read_requests(args, codec)


def _run_generate(args: argparse.Namespace, ecfg, engine, codec, reqs: list[tuple[list[int], dict, str]],
                  layout: str = "") -> int:
    """Add the requests to `engine` (an LLMEngine, or a parallel engine's rank 0), run them to the end and
    print: the single request streamed, or one line / one JSON object per request in input order. A request
    the engine refuses (a prompt id outside the vocabulary, past the context, ...) is named on stderr by its
    line and the others still run; exit status 2 then, 1 when a request failed in the engine."""
    from .sampling import SamplingParams

    base = _base_params(args)
    ids: list[str | None] = []
    refused: dict[int, str] = {}                  # request index -> why the engine refused it
    for k, (prompt, extra, where) in enumerate(reqs):
        try:
            ids.append(engine.add_request(prompt, SamplingParams.from_dict({**base, **extra})))
        except ValueError as e:                   # RequestError, SamplingError
            if len(reqs) == 1:
                raise                             # main() names it: exit 2
            print(f"gigadecode generate: {where}: {e}", file=sys.stderr)
            refused[k] = str(e)
            ids.append(None)
    stream = not args.json and len(ids) == 1
    decoder = None
    if stream:
        req = engine.requests[ids[0]]
        prompt_text = codec.decode(req.prompt_ids) if codec else None
        print(f"prompt ids: {req.prompt_ids}")
        if prompt_text is not None:
            print(f"prompt: {prompt_text!r}")
        print("output: ", end="", flush=True)
        if codec is not None:
            from .tokenizer import StreamDecoder
            decoder = StreamDecoder(codec)
    while engine.has_unfinished():
        for out in engine.step():
            if stream:
                for t in out.new_token_ids:
                    print(decoder.push(t) if decoder else f"{t} ", end="", flush=True)
    if decoder is not None:
        print(decoder.flush(), end="", flush=True)
    for k, rid in enumerate(ids):
        if rid is None:
            if args.json:
                print(json.dumps({"prompt_ids": reqs[k][0], "token_ids": [], "finish_reason": None,
                                  "error": refused[k]}), flush=True)
            continue
        r = engine.requests[rid]
        n = len(r.output_ids)
        dt = (r.last_token_time or 0) - (r.first_token_time or 0)
        tok_s = (n - 1) / dt if n > 1 and dt > 0 else 0.0
        if args.json:
            d = {"prompt_ids": r.prompt_ids, "token_ids": r.output_ids, "finish_reason": r.finish_reason,
                 "decode_tok_s": round(tok_s, 2), **_prefill_timing(r)}
            if codec is not None:
                d["text"] = codec.decode(r.output_ids)
            if r.params.logprobs is not None:      # raw logprobs of each token, and the top ones asked for
                floor = lambda v: max(float(v), -9999.0)          # noqa: E731 - JSON has no -inf
                d["logprobs"] = [{"token_id": lp.token_id, "logprob": floor(lp.logprob), "rank": lp.rank,
                                  "top_logprobs": [{"token_id": t, "logprob": floor(v)} for t, v in lp.top]}
                                 for lp in r.output_logprobs]
            if r.error:
                d["error"] = r.error
            print(json.dumps(d), flush=True)
        else:
            if not stream:
                print(f"prompt ids: {r.prompt_ids}")
            print(("\n" if stream else "") + f"token ids: {r.output_ids}")
            print(f"finish: {r.finish_reason}  decode: {tok_s:.1f} tok/s ({layout}{ecfg.decoder}, kv {ecfg.kv_dtype})")
    failed = [(k + 1, engine.requests[rid]) for k, rid in enumerate(ids)
              if rid is not None and engine.requests[rid].finish_reason == "error"]
    for n, r in failed:
        print(f"gigadecode generate: request {n} failed: {r.error or 'engine error'}", file=sys.stderr)
    return 2 if refused else 1 if failed else 0


def _prefill_timing(r) -> dict:
    """ttft_s: arrival -> first token; prompt_tok_s: prompt tokens / seconds from its first prefill chunk to its
    first token (the tokens this engine computed; a DI consumer computes only the last one)."""
    if r.first_token_time is None:
        return {"ttft_s": None, "prompt_tok_s": None}
    start = r.prefill_start_time if r.prefill_start_time is not None else r.arrival
    dt = r.first_token_time - start
    computed = len(r.prompt_ids) - r.remote_tokens
    return {"ttft_s": round(r.first_token_time - r.arrival, 4),
            "prompt_tok_s": round(computed / dt, 1) if dt > 0 else None}


def cmd_plan(args: argparse.Namespace) -> int:
    from .plan import run_plan
    return run_plan(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from .server.api import serve
    return serve(args)


def cmd_proxy(args: argparse.Namespace) -> int:
    from .server.proxy import run_proxy
    return run_proxy(args)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: DI on the built-in demo model (prefill server -> decode server via the proxy).
    `--local` runs the single-process generate demo instead."""
    from .checkpoint import make_checkpoint
    d = Path(args.model) if args.model else DEFAULT_DEMO_DIR
    if not (d / "config.json").exists():
        print(f"writing the built-in demo model to {d} ...", flush=True)
        make_checkpoint(d, "demo")
    if not args.local:
        from .demo import run_demo
        return run_demo(d, args.prompt, args.max_tokens)
    from .tokenizer import TextCodec
    ids = TextCodec.from_dir(d).apply_chat_template([{"role": "user", "content": args.prompt}])
    ns = argparse.Namespace(model=str(d), prompt=None, prompt_ids=",".join(map(str, ids)), requests=None,
                            json=False, max_tokens=args.max_tokens, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                            seed=None, ignore_eos=False, dtype="auto", kv_dtype="fp8", block_size=16,
                            num_blocks=None, kv_budget_gib=None, decoder="gk-native", max_num_seqs=64,
                            max_prefill_tokens=512, tp=1, dp=1, ep=1)
    print(f"generate on the demo model ({d}): GK decode program, packed-FP8 KV cache")
    return cmd_generate(ns)


# ------------------------------------------------------------------------------------------------------
def add(sub, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand whose one-line summary is also the head of its own --help."""
    return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gigadecode",
        description="GPT-OSS inference: one fused decode program over every layer, packed-FP8 KV, and prefill "
                    "and decode as separate servers with the KV sent over NIXL. `gigadecode COMMAND --help` "
                    "for a command's flags.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = add(sub, "make-checkpoint", "write a GPT-OSS checkpoint (HF layout) from a seeded random init whose top "
                                     "logit clears the second by far more than float error")
    p.add_argument("--preset", required=True, choices=["tiny", "small", "20b-shape", "120b-shape", "demo"],
                   help="demo: the trained demo model (it adds; --seed and --experts do not apply)")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", default="mxfp4", choices=["mxfp4", "bf16"])
    p.set_defaults(func=cmd_make_checkpoint)

    p = add(sub, "generate", "generate from prompts (continuous batching, GK decode)")
    p.add_argument("--model", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids")
    src.add_argument("--requests", help="JSON lines: {\"prompt_ids\": [...], \"max_tokens\": N, ...}")
    add_sampling_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object per request")
    p.set_defaults(func=cmd_generate)

    p = add(sub, "plan", "the KV memory plan for a config and parallel layout")
    from .plan import add_plan_arguments
    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)

    p = add(sub, "serve", "OpenAI-compatible HTTP server (prefill, decode, or both)")
    p.add_argument("--model", required=True)
    p.add_argument("--role", default="both", choices=["prefill", "decode", "both"],
                   help="DI role: prefill = kv_producer, decode = kv_consumer, both = kv_both (single node)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("GIGADECODE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default $GIGADECODE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the model dir's name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="request bodies larger than this get 413 before they are parsed (default 4 MiB)")
    p.add_argument("--shutdown-timeout-s", type=float, default=5.0,
                   help="on SIGTERM / SIGINT, how long requests in flight may run on; the rest then end with "
                        "an error (503, or an error event in a stream)")
    di = p.add_argument_group("disaggregated inference")
    di.add_argument("--kv-secret", default=os.environ.get("GIGADECODE_KV_SECRET"), metavar="KEY",
                    help="prefill and decode: the key both sign and check kv_transfer_params with (required for "
                         "those roles; default $GIGADECODE_KV_SECRET, which keeps it out of the process list)")
    di.add_argument("--kv-advertise-host", default=None, metavar="HOST",
                    help="prefill: the address decode engines use to reach this server's KV side channel "
                         "(default: the address each request reached the API on)")
    di.add_argument("--kv-port", type=int, default=0, help="prefill: side-channel port for the KV handshake (0 = any)")
    di.add_argument("--kv-lease-s", type=float, default=30.0, help="prefill: how long leased KV waits for the decode read")
    di.add_argument("--kv-transfer-timeout-s", type=float, default=10.0, help="decode: handshake + read time limit")
    di.add_argument("--kv-failure-policy", default="fail", choices=["fail", "recompute"],
                    help="decode: on a failed transfer, fail the request or prefill it locally")
    di.add_argument("--vllm-kv-layout", default="auto", choices=["auto", "vec", "amx"],
                    help="decode behind a vLLM prefill: the order of its CPU KV pages, which its handshake does not "
                         "say (auto: what vLLM picks on this kind of CPU: amx for bf16 KV with AMX tiles, else vec)")
    add_engine_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = add(sub, "proxy", "DI router: prefill on one server, decode on another")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="gigadecode prefill servers")
    p.add_argument("--prefill-vllm", nargs="+", default=[], metavar="URL",
                   help="stock vLLM prefill servers (NixlConnector kv_producer; /v1/completions only): the proxy "
                        "sends them the prompt's token ids less the last one and signs their answer for the decode "
                        "servers (needs --kv-secret)")
    p.add_argument("--vllm-kv-lease-s", type=float, default=30.0,
                   help="the vLLM prefills' kv_lease_duration: a decode that has not read by then fails")
    p.add_argument("--kv-secret", default=os.environ.get("GIGADECODE_KV_SECRET"), metavar="KEY",
                   help="with --prefill-vllm: the decode servers' KV secret (default $GIGADECODE_KV_SECRET)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL")
    p.add_argument("--prefill-timeout-s", type=float, default=None,
                   help="how long one prefill server may take to answer before the next is tried, or a 502 "
                        "(default: no limit)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="request bodies larger than this get 413 before they are parsed (default 4 MiB)")
    p.set_defaults(func=cmd_proxy)

    p = add(sub, "demo", "the main job: DI (prefill -> decode over NIXL) on the built-in demo model")
    p.add_argument("--model", default=None, help=f"where the demo model lives (default {DEFAULT_DEMO_DIR})")
    p.add_argument("--prompt", default="What is 37 + 45?",
                   help="the demo model answers `What is A + B?` (0 <= A, B <= 99)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--local", action="store_true", help="one process (generate) instead of the DI servers")
    p.set_defaults(func=cmd_demo)
    return ap


# A prefill or decode server usually shares its host with its DI peer (the README's recipe, the demo): OpenMP
# workers that spin ~300,000 pauses (~15 ms) after each parallel region, libgomp's default, then hold cores
# the peer is computing on (40 concurrent requests on `tiny`, prefill + decode + proxy on 2 cores: 7-16 s
# against 1.0-1.2 s with this spin); a server alone on its cores loses 3-5% with it
DI_SPIN_COUNT = 3000


def set_openmp_env(argv: list[str]) -> None:
    """A short OpenMP spin for `serve --role prefill|decode`, unless the user chose one. Read from the raw
    arguments: it must be set before anything imports torch (which loads libgomp, which reads it once)."""
    role = next((a.split("=", 1)[1] for a in argv if a.startswith("--role=")), None)
    if role is None and "--role" in argv[:-1]:
        role = argv[argv.index("--role") + 1]
    if argv[:1] == ["serve"] and role in ("prefill", "decode") and "GOMP_SPINCOUNT" not in os.environ \
            and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(DI_SPIN_COUNT)


def main(argv: list[str] | None = None) -> int:
    set_openmp_env(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    from .config import ConfigError
    from .hub import resolve_model
    from .weights import CheckpointError
    try:
        if getattr(args, "model", None) and args.command not in ("demo",):
            args.model = str(resolve_model(args.model))
        return int(args.func(args) or 0)
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"gigadecode {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
