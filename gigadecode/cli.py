"""The `gigadecode` command line. Its commands and flags are a contract scripts depend on (README § Command
line): extend them, never break them.

Subcommands: make-checkpoint, generate, plan, serve, proxy, demo. Heavy imports happen inside each
command so `gigadecode --help` is instant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .server.http_options import add_http_arguments
from .server.proxy_tls import add_upstream_tls_arguments

DEFAULT_DEMO_DIR = Path(os.environ.get("GIGADECODE_CACHE", Path.home() / ".cache" / "gigadecode")) / "demo"


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", type=dtype_arg, metavar="{auto,bfloat16,float32}",
                   help="compute dtype (default auto: the checkpoint's torch_dtype, bfloat16 for GPT-OSS; float32 "
                        "for float16 or float32 checkpoints)")
    g.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default=None, type=kv_dtype_arg,
                   metavar="{auto,bf16,fp8}",
                   help="KV storage: auto = the model dtype, fp8 = packed FP8 e4m3 (default for GK decode engines); "
                        "vLLM's --kv-cache-dtype spellings fp8_e4m3 and bfloat16 are taken too")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: --max-num-seqs sequences of --max-model-len, "
                        "at most --kv-budget-gib)")
    g.add_argument("--kv-budget-gib", type=float, default=None,
                   help="KV memory cap of the default pool, GiB (default 2)")
    g.add_argument("--decoder", default="gk-native", choices=["gk-native", "gk", "gk-compiled", "reference"],
                   help="gk-native: the GK program on the native kernels (default); gk / gk-compiled: its torch "
                        "forms; reference: the per-layer model")
    g.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together at most (default 64)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (prompt + generated tokens) a request may reach (default: the model's "
                        "max_position_embeddings, or what the KV pool holds if less); the default pool is sized "
                        "for it")
    g.add_argument("--max-prefill-tokens", "--max-num-batched-tokens", dest="max_prefill_tokens", type=int,
                   default=1024,
                   help="prompt tokens one step prefills at most (chunked prefill; default 1024: each chunk "
                        "decodes the experts it uses once, so longer chunks prefill long prompts faster, while "
                        "the decodes sharing a step with a chunk wait for it). Also taken as vLLM's "
                        "--max-num-batched-tokens, whose budget counts the step's decode tokens too; here it "
                        "bounds the prompt tokens alone")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the kernels (default: $OMP_NUM_THREADS when set, else the cores this process "
                        "may use; under torchrun, those cores divided among the local ranks, torchrun's own "
                        "OMP_NUM_THREADS=1 aside)")
    g.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tp", type=int, default=1,
                   help="tensor-parallel size (under torchrun)")
    g.add_argument("--dp", "--data-parallel-size", "-dp", dest="dp", type=int, default=1,
                   help="data-parallel size (under torchrun)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size (under torchrun)")
    g.add_argument("--dcp", "--decode-context-parallel-size", "-dcp", dest="dcp", type=int, default=1,
                   help="decode context parallel: ranks of a TP group that share kv heads and split every "
                        "sequence's tokens (divides --tp; tp/dcp must divide the kv heads)")
    g.add_argument("--dcp-interleave", type=int, default=None,
                   help="DCP: tokens per round-robin chunk (default: --block-size; a multiple of it)")
    g.add_argument("--distributed-timeout-s", type=float, default=300.0, metavar="S",
                   help="parallel engines: once the world has started, the longest one rank waits for a peer in a "
                        "collective (default 300): a rank that hangs then stops the world within it, the open "
                        "requests failing with 'peer rank N did not answer within T s'. With --dp, keep it above "
                        "the longest step (a prefill chunk of --max-prefill-tokens): DP groups no EP group spans "
                        "wait for each other's whole step. Start-up (loading, the warm-up) waits up to 30 minutes")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="keep full KV blocks named by their tokens, so a prompt that starts like an earlier one "
                        "(a system prompt, the turns of a conversation) takes their KV instead of computing it "
                        "again (not with --dcp)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, as vLLM's flag: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3}' (n-gram lookup in the request's own prompt and output; "
                        "optional prompt_lookup_min / prompt_lookup_max, default 2 / 4) or '{\"method\": "
                        "\"suffix\"}' (suffix decoding: also from the outputs of earlier requests; optional "
                        "suffix_decoding_max_tree_depth, _max_cached_requests, _max_spec_factor, _min_token_prob), "
                        "and disable_by_batch_size, adaptive (default true: as many drafts as a request's acceptance "
                        "pays for): drafts are verified in one decode step; outputs are exactly those of plain "
                        "decoding")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: requests are admitted in arrival order, the newest running one is preempted when "
                        "the KV pool is short (default); priority: by each request's `priority` (lower first, "
                        "ties by arrival), the running request of the largest (priority, arrival) is preempted "
                        "(vLLM's flag; under fcfs a non-zero priority is refused)")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up warm-up (one prefill chunk of --max-prefill-tokens and one decode "
                        "step on borrowed KV blocks, so the first request runs at full speed)")


def engine_config(args: argparse.Namespace, **kw):
    """The `EngineConfig` of a command line (`engine_config.engine_config_from_args`, imported here on use:
    the CLI imports torch only after `main` has set the OpenMP environment)."""
    from .engine_config import engine_config_from_args
    return engine_config_from_args(args, **kw)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32, help="default 32")
    g.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="default 0: off")
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


def cmd_generate(args: argparse.Namespace) -> int:
    from .generate import run_generate_command
    return run_generate_command(args)


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
                            max_prefill_tokens=1024, tp=1, dp=1, ep=1)
    print(f"generate on the demo model ({d}): GK decode program, packed-FP8 KV cache")
    return cmd_generate(ns)


# ------------------------------------------------------------------------------------------------------
def dtype_arg(text: str) -> str:
    """A --dtype value, vLLM's spellings included (float, bf16), as auto / bfloat16 / float32."""
    from .engine_config import dtype_name
    try:
        return dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_dtype_arg(text: str) -> str:
    """A --kv-dtype / --kv-cache-dtype value, vLLM's spellings included, as auto / bf16 / fp8."""
    from .engine_config import kv_dtype_name
    try:
        return kv_dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def chat_template_arg(text: str) -> str:
    """A --chat-template value: the Jinja source it names (a file, or the template itself), compiled here, so
    a template that cannot be used fails the command line before the model loads."""
    from .chat_template import ChatTemplateError, ChatTemplates, load_chat_template_arg
    try:
        source = load_chat_template_arg(text)
        ChatTemplates(source, origin="this").compiled()
    except ChatTemplateError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return source


CHAT_TEMPLATE_HELP = ("a Jinja chat template to render chats with instead of the checkpoint's: a file, or the "
                      "template itself (vLLM's flag)")


def tcp_port(text: str) -> int:
    """A --port / --kv-port value: refused by argparse when out of range (it was an OverflowError traceback from
    the bind, after the model had loaded)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"port {n} is outside 0-65535")
    return n


def add(sub, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand whose one-line summary is also the head of its own --help."""
    return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")


def serve_vllm_epilog() -> str:
    """What `serve --help` says about the rest of `vllm serve`'s flags (gigadecode/vllm_flags.py)."""
    import textwrap

    from .vllm_flags import IGNORED, REFUSED, TAKEN_VALUES
    fill = lambda text: textwrap.fill(text, 78, subsequent_indent="  ", break_on_hyphens=False)  # noqa: E731
    return "\n".join([
        "vLLM command lines:",
        fill("  flag names with underscores (--tensor_parallel_size) are read as dashed ones, and --config FILE "
             "(vLLM's YAML of flags) as its flags, before the command line's own."),
        fill("  taken and dropped, since they tune what only a GPU or vLLM's own machinery has and change no "
             "answer: " + ", ".join(IGNORED) + "."),
        fill("  taken with what happens here anyway: " + ", ".join(
            f"{f} {'|'.join(sorted(v))}" for f, (v, _) in TAKEN_VALUES.items()) + " (other values are refused)."),
        fill("  refused, with the reason: " + ", ".join(REFUSED) + "."),
    ])


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
    p.add_argument("--out", required=True, help="the checkpoint's directory")
    p.add_argument("--seed", type=int, default=0, help="random init seed (default 0)")
    p.add_argument("--experts", default="mxfp4", choices=["mxfp4", "bf16"],
                   help="experts stored as MXFP4 (default, as GPT-OSS) or bf16")
    p.set_defaults(func=cmd_make_checkpoint)

    p = add(sub, "generate", "generate from prompts (continuous batching, GK decode)")
    p.add_argument("--model", required=True, help="checkpoint directory or Hugging Face repo id (local cache)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a prompt text (raw, no chat template)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    src.add_argument("--requests", help="JSON lines: {\"prompt_ids\": [...] (or \"prompt\"), \"max_tokens\": N, ...} "
                                         "with sampling fields per line, and \"priority\" (--scheduling-policy "
                                         "priority)")
    src.add_argument("--chat", metavar="MESSAGE",
                     help="a user message through the checkpoint's chat template; the reply is shown as its "
                          "reasoning, answer and tool calls (with --json: reasoning_content, content, tool_calls)")
    p.add_argument("--reasoning-effort", choices=["low", "medium", "high"], default=None,
                   help="with --chat: the reasoning effort the chat template states (GPT-OSS: low|medium|high)")
    p.add_argument("--chat-template", type=chat_template_arg, default=None, metavar="TEMPLATE",
                   help="with --chat: " + CHAT_TEMPLATE_HELP)
    add_sampling_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object per request")
    p.set_defaults(func=cmd_generate)

    p = add(sub, "plan", "the KV memory plan for a config and parallel layout")
    from .plan import add_plan_arguments
    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)

    p = add(sub, "serve", "OpenAI-compatible HTTP server (prefill, decode, or both)")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = serve_vllm_epilog()
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="the checkpoint, as `vllm serve MODEL` takes it (or --model)")
    p.add_argument("--model", default=None, help="checkpoint directory or Hugging Face repo id (local cache)")
    p.add_argument("--role", default="both", choices=["prefill", "decode", "both"],
                   help="DI role: prefill = kv_producer, decode = kv_consumer, both = kv_both (single node)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the API (and a prefill's KV side channel) binds (default 127.0.0.1; 0.0.0.0: "
                        "every interface)")
    p.add_argument("--port", type=tcp_port, default=8000, help="default 8000")
    p.add_argument("--api-key", default=os.environ.get("GIGADECODE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /kv/release "
                        "(/health, /metrics and /version stay open; default $GIGADECODE_API_KEY)")
    p.add_argument("--seed", dest="engine_seed", type=int, default=None,
                   help="vLLM's: sampled requests without a `seed` draw theirs from this, in arrival order, so a "
                        "run is reproducible (default: fresh randomness)")
    p.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="model id in the API (default: the model dir's name); several, as vLLM: requests may name "
                        "any of them and are answered under it (else the first, as /health), /v1/models lists each")
    p.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="request bodies larger than this get 413 before they are parsed (default 4 MiB)")
    p.add_argument("--chat-template", type=chat_template_arg, default=None, metavar="TEMPLATE",
                   help=CHAT_TEMPLATE_HELP + "; the prefill and decode servers of a DI pair need the same one")
    gpt_oss = p.add_argument_group(
        "vLLM's GPT-OSS flags", "taken so that a vLLM command line for GPT-OSS runs unchanged; the harmony "
        "output is always parsed: tool calls come back as tool_calls for a request with tools, the analysis "
        "channel as reasoning_content")
    gpt_oss.add_argument("--enable-auto-tool-choice", action="store_true",
                         help="tool_choice auto (always on)")
    gpt_oss.add_argument("--tool-call-parser", choices=["openai"], default=None,
                         help="harmony tool calls (the only parser)")
    gpt_oss.add_argument("--reasoning-parser", choices=["openai_gptoss"], default=None,
                         help="harmony reasoning (the only parser)")
    gpt_oss.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                         help="vLLM's: experts split over every rank, --ep = --tp x --dp")
    p.add_argument("--shutdown-timeout-s", type=float, default=5.0,
                   help="on SIGTERM / SIGINT, how long requests in flight may run on; the rest then end with "
                        "an error (503, or an error event in a stream; default 5). A prefill server then keeps "
                        "the KV it answered up to this long more, until the decode servers have read it")
    p.add_argument("--engine-stall-timeout-s", type=float, default=300.0, metavar="S",
                   help="/health answers 503 engine_stalled while the engine loop has shown no progress for this "
                        "long (a step that never returns), so a router or readiness probe stops sending it work; "
                        "it reads healthy again when the step returns. Keep it above the longest step (a prefill "
                        "chunk of --max-prefill-tokens); 0 turns the watch off (default 300)")
    add_http_arguments(p)
    di = p.add_argument_group("disaggregated inference")
    di.add_argument("--kv-secret", default=os.environ.get("GIGADECODE_KV_SECRET"), metavar="KEY",
                    help="prefill and decode: the key both sign and check kv_transfer_params with (required for "
                         "those roles; default $GIGADECODE_KV_SECRET, which keeps it out of the process list)")
    di.add_argument("--kv-advertise-host", default=None, metavar="HOST",
                    help="prefill: the address decode engines use to reach this server's KV side channel "
                         "(default: the address each request reached the API on)")
    di.add_argument("--kv-port", type=tcp_port, default=0, help="prefill: side-channel port for the KV handshake (0 = any)")
    di.add_argument("--kv-lease-s", type=float, default=30.0, help="prefill: how long leased KV waits for the decode read (default 30)")
    di.add_argument("--kv-transfer-timeout-s", type=float, default=10.0, help="decode: handshake + read time limit (default 10)")
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
                        "sends them the prompt's token ids less the last one and signs their answer, and the vLLM "
                        "process that gave it (asked of vLLM's NIXL side channel, which the proxy must reach), for "
                        "the decode servers (needs --kv-secret)")
    p.add_argument("--vllm-kv-lease-s", type=float, default=30.0,
                   help="the vLLM prefills' kv_lease_duration: a decode that has not read by then fails "
                        "(default 30)")
    p.add_argument("--kv-secret", default=os.environ.get("GIGADECODE_KV_SECRET"), metavar="KEY",
                   help="with --prefill-vllm: the decode servers' KV secret (default $GIGADECODE_KV_SECRET)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="gigadecode decode servers")
    p.add_argument("--prefill-timeout-s", type=float, default=None,
                   help="how long one prefill server may take to answer before the next is tried, or a 502 "
                        "(default: no limit)")
    p.add_argument("--decode-timeout-s", type=float, default=None,
                   help="how long the decode server may take to start its answer (a stream's first bytes, a "
                        "non-streaming request's whole answer) before a 504 (default: no limit)")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1; 0.0.0.0: every interface")
    p.add_argument("--port", type=tcp_port, default=8000, help="default 8000")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="request bodies larger than this get 413 before they are parsed (default 4 MiB)")
    add_http_arguments(p)
    add_upstream_tls_arguments(p)
    p.set_defaults(func=cmd_proxy)

    p = add(sub, "demo", "the main job: DI (prefill -> decode over NIXL) on the built-in demo model")
    p.add_argument("--model", default=None, help=f"where the demo model lives (default {DEFAULT_DEMO_DIR})")
    p.add_argument("--prompt", default="What is 37 + 45?",
                   help="the demo model answers `What is A + B?` (0 <= A, B <= 99)")
    p.add_argument("--max-tokens", type=int, default=128, help="default 128")
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
    argv = sys.argv[1:] if argv is None else list(argv)
    from .torchrun_rank import stop_with_launcher
    stop_with_launcher()                   # a rank of torchrun's stops when torchrun dies (a no-op elsewhere)
    notes: list[str] = []
    if argv[:1] == ["serve"]:              # vLLM's spellings and --config first (no torch imported by them)
        from .vllm_flags import VllmFlagError, translate_serve_argv
        try:
            rest, notes = translate_serve_argv(argv[1:])
        except VllmFlagError as e:
            print(f"gigadecode serve: error: {e}", file=sys.stderr)
            return 2
        argv = ["serve", *rest]
    set_openmp_env(argv)                   # from the translated line: a --config file's `role: decode` counts
    args = build_parser().parse_args(argv)
    for note in notes:
        print(f"gigadecode serve: note: {note}", file=sys.stderr)
    from .hub import resolve_model
    if args.command == "serve":
        tag = args.__dict__.pop("model_tag")
        if tag is not None and args.model is not None and tag != args.model:
            print(f"gigadecode serve: error: two models given: {tag!r} and --model {args.model!r}", file=sys.stderr)
            return 2
        args.model = args.model or tag
        if args.__dict__.pop("enable_expert_parallel"):
            if args.ep not in (1, args.tp * args.dp):
                print(f"gigadecode serve: error: --enable-expert-parallel splits the experts over all "
                      f"--tp x --dp = {args.tp * args.dp} ranks, but --ep {args.ep} was given", file=sys.stderr)
                return 2
            args.ep = args.tp * args.dp
        if args.model is None:
            print("gigadecode serve: error: a model is required: `gigadecode serve MODEL` or --model MODEL",
                  file=sys.stderr)
            return 2
    try:
        if getattr(args, "model", None) and args.command not in ("demo",):
            args.model = str(resolve_model(args.model))
        return int(args.func(args) or 0)
    except ValueError as e:                # ConfigError, CheckpointError, a layout's: a bad model or flag
        print(f"gigadecode {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of stdout left (`gigadecode plan … | head -1`): stop quietly, and point stdout at
        # /dev/null so the interpreter's last flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
