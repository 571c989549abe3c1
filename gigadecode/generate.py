"""`gigadecode generate`: prompts (text, token ids, a JSON-lines file of requests, or one chat message) through
one engine, run to the end, printed as they come for a single request (a chat reply as its reasoning, answer
and tool calls) or as one line / one JSON object per request."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


class ChatPrinter:
    """A harmony reply, token by token, as text: `reasoning:` and `answer:` sections as they stream, the tool
    calls when they end. Without harmony tokens in the vocabulary: the plain text."""

    def __init__(self, codec) -> None:
        from .harmony import HarmonyStreamParser, HarmonyTokens
        from .tokenizer import StreamDecoder
        tokens = HarmonyTokens.from_codec(codec)
        self.parser = HarmonyStreamParser(codec, tokens) if tokens is not None else None
        self.plain = StreamDecoder(codec) if tokens is None else None
        self.kind: str | None = None

    def push(self, token_id: int) -> str:
        if self.plain is not None:
            return self.plain.push(token_id)
        return self._text(self.parser.push(token_id))

    def flush(self) -> str:
        if self.plain is not None:
            return self.plain.flush()
        text = self._text(self.parser.finish())
        calls = "".join(f"\ntool call: {c.name}({c.arguments})" for c in self.parser.result().tool_calls)
        return text + calls

    def _text(self, deltas) -> str:
        out = []
        for d in deltas:
            if d.kind == "tool_call" or not d.text:
                continue
            if d.kind != self.kind:
                out.append(("\n" if self.kind else "") + ("reasoning: " if d.kind == "reasoning" else "answer: "))
                self.kind = d.kind
            out.append(d.text)
        return "".join(out)


def parse_reply(codec, token_ids: list[int]) -> dict[str, Any]:
    """A chat reply's reasoning, content and tool calls (`--json` with `--chat`)."""
    from .harmony import HarmonyTokens, parse_harmony
    tokens = HarmonyTokens.from_codec(codec)
    if tokens is None:
        return {"content": codec.decode(token_ids)}
    m = parse_harmony(codec, tokens, token_ids)
    return {"reasoning_content": m.reasoning_content, "content": m.content,
            "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in m.tool_calls]}


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
            unknown = sorted(set(d) - known - {"prompt_ids", "prompt", "priority"})
            if unknown:
                raise SystemExit(f"gigadecode generate: {args.requests}:{n}: unknown key(s) {', '.join(unknown)} "
                                 f"(a request has prompt_ids or prompt, and any of priority, "
                                 f"{', '.join(sorted(known))})")
            priority = d.get("priority", 0)
            if type(priority) is not int or (priority and getattr(args, "scheduling_policy", "fcfs") != "priority"):
                raise SystemExit(f"gigadecode generate: {args.requests}:{n}: priority must be an integer, and 0 "
                                 f"unless --scheduling-policy priority (got {priority!r})")
            if "prompt_ids" in d:
                ids = d.pop("prompt_ids")
            elif "prompt" in d and codec is not None:
                ids = codec.encode(d.pop("prompt"))
            else:
                raise SystemExit(f"gigadecode generate: {args.requests}:{n}: needs prompt_ids (or prompt with a tokenizer)")
            try:
                SamplingParams.from_dict({**_base_params(args), **{k: v for k, v in d.items() if k != "priority"}})
            except SamplingError as e:
                raise SystemExit(f"gigadecode generate: {args.requests}:{n}: {e}")
            out.append((ids, d, f"{args.requests}:{n}"))
        if not out:
            raise SystemExit(f"gigadecode generate: {args.requests} has no requests")
        return out
    if getattr(args, "chat", None) is not None:
        if codec is None:
            raise SystemExit("gigadecode generate: --chat needs the checkpoint's tokenizer and chat template")
        extra = {"reasoning_effort": args.reasoning_effort} if args.reasoning_effort else {}
        return [(codec.apply_chat_template([{"role": "user", "content": args.chat}], **extra), {}, "--chat")]
    if getattr(args, "reasoning_effort", None):
        raise SystemExit("gigadecode generate: --reasoning-effort goes with --chat")
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
            codec_and_requests = _codec_and_requests(args)
            _warm_up(args, engine)
            return _run_generate(args, ecfg, engine, *codec_and_requests,
                                 layout=f"TP{ecfg.tp} × DP{ecfg.dp} × EP{ecfg.ep}, ")
    finally:
        dist.destroy_process_group()


def run_generate_command(args: argparse.Namespace) -> int:
    """`gigadecode generate`: one engine in this process, or a parallel one under torchrun."""
    from .engine_config import engine_config_from_args
    from .parallel.engine import is_parallel
    ecfg = engine_config_from_args(args)
    if is_parallel(ecfg):
        return _generate_parallel(args, ecfg)
    from .engine import LLMEngine
    from .runner import ModelRunner
    codec, reqs = _codec_and_requests(args)                          # a bad file fails before the model loads
    engine = LLMEngine(ModelRunner(args.model, ecfg, progress=not args.json))
    _warm_up(args, engine)
    return _run_generate(args, ecfg, engine, codec, reqs)


def _warm_up(args: argparse.Namespace, engine) -> None:
    """The start-up warm-up (`LLMEngine.warm_up`; every rank of a parallel engine) unless --no-warmup, on this
    thread, which steps the engine."""
    if not getattr(args, "no_warmup", False):
        engine.warm_up()


def _codec_and_requests(args: argparse.Namespace):
    """The checkpoint's text codec (None without a tokenizer) and the requests `args` names."""
    from .tokenizer import TextCodec
    codec = TextCodec.from_dir(args.model, getattr(args, "chat_template", None))
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
        extra = dict(extra)
        priority = extra.pop("priority", 0)       # the scheduler's, not a sampling field
        try:
            ids.append(engine.add_request(prompt, SamplingParams.from_dict({**base, **extra}), priority=priority))
        except ValueError as e:                   # RequestError, SamplingError
            if len(reqs) == 1:
                raise                             # main() names it: exit 2
            print(f"gigadecode generate: {where}: {e}", file=sys.stderr)
            refused[k] = str(e)
            ids.append(None)
    stream = not args.json and len(ids) == 1
    chat = getattr(args, "chat", None) is not None
    decoder = None
    if stream:
        req = engine.requests[ids[0]]
        if chat:
            print(f"user: {args.chat}  ({len(req.prompt_ids)} prompt tokens, chat template)")
            decoder = ChatPrinter(codec)
        else:
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
            if chat:
                d.update(parse_reply(codec, r.output_ids))
            floor = lambda v: max(float(v), -9999.0)              # noqa: E731 - JSON has no -inf
            entry = lambda lp: lp and {"token_id": lp.token_id, "logprob": floor(lp.logprob), "rank": lp.rank,  # noqa: E731
                                       "top_logprobs": [{"token_id": t, "logprob": floor(v)} for t, v in lp.top]}
            if r.params.logprobs is not None:      # raw logprobs of each token, and the top ones asked for
                d["logprobs"] = [entry(lp) for lp in r.output_logprobs]
            if r.params.prompt_logprobs is not None:   # the same per prompt token (the first: null)
                d["prompt_logprobs"] = [entry(lp) for lp in r.prompt_logprobs]
            if r.error:
                d["error"] = r.error
            print(json.dumps(d), flush=True)
        else:
            if not stream:
                print(f"prompt ids: {r.prompt_ids}")
            print(("\n" if stream else "") + ("" if chat else f"token ids: {r.output_ids}\n"), end="")
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
