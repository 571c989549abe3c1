"""Answer accuracy of the demo model (`make-checkpoint --preset demo`) on held-out sums, per serving
configuration — the way real engines check quantization and parallelism: accuracy on a task, not only
token identity.

The demo model was trained on `What is A + B?` (0 <= A, B <= 99) with a seeded 10% of the pairs held out
(`training_report.json` lists them). Each configuration answers the same held-out questions greedily, the
reply is parsed by harmony channel (`gigadecode.harmony`), and a question counts as right when the final
channel is exactly `A + B = C`. With the `add` tool offered, a reply counts when it is exactly one call
`add({"a": A, "b": B})`. Configurations:

  fp32             single node, fp32 compute, KV in the model dtype (the reference)
  bf16             bf16 compute and KV
  fp32 + fp8 KV    fp32 compute, packed-FP8 KV (the GK decode path's default KV)
  bf16 + fp8 KV    what `serve` runs by default
  DI               prefill engine -> KV over NIXL -> GK decode engine (in one process, loopback), bf16 + fp8
  TP2 x EP2        `torchrun --nproc-per-node 2 -m gigadecode generate --tp 2 --ep 2`, bf16 + fp8

    .venv/bin/python bench/quality.py [--n 1000] [--skip-parallel]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gigadecode.checkpoint import make_checkpoint  # noqa: E402
from gigadecode.engine_config import EngineConfig  # noqa: E402
from gigadecode.engine import build_engine  # noqa: E402
from gigadecode.harmony import HarmonyTokens, parse_harmony  # noqa: E402
from gigadecode.sampling import SamplingParams  # noqa: E402
from gigadecode.tokenizer import TextCodec  # noqa: E402

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
MAX_TOKENS = 128                           # the longest reply (working + answer) is ~75 tokens
CONFIGS = {"fp32": dict(dtype="float32", kv_dtype="auto"), "bf16": dict(dtype="bfloat16", kv_dtype="auto"),
           "fp32 + fp8 KV": dict(dtype="float32", kv_dtype="fp8"), "bf16 + fp8 KV": dict(dtype="bfloat16", kv_dtype="fp8")}


def heldout(model_dir: Path, n: int | None) -> list[tuple[int, int]]:
    """The held-out (A, B) pairs; `n` of them spread evenly over the (sorted) list."""
    pairs = [tuple(p) for p in json.loads((model_dir / "training_report.json").read_text())["heldout_pairs"]]
    return pairs[::max(1, len(pairs) // n)][:n] if n else pairs


def prompts(codec: TextCodec, pairs, tools: bool) -> list[list[int]]:
    kw = {"tools": [ADD_TOOL]} if tools else {}
    return [codec.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}], **kw) for a, b in pairs]


def score(codec: TextCodec, pairs, outputs: list[list[int]], tools: bool) -> float:
    """Fraction right: the final channel is `A + B = C` (or, with the tool, one exact call of add)."""
    tokens = HarmonyTokens.from_codec(codec)
    ok = 0
    for (a, b), ids in zip(pairs, outputs):
        msg = parse_harmony(codec, tokens, ids)
        if tools:
            ok += (len(msg.tool_calls) == 1 and msg.tool_calls[0].name == "add"
                   and json.loads(msg.tool_calls[0].arguments) == {"a": a, "b": b})
        else:
            ok += (msg.content or "").strip() == f"{a} + {b} = {a + b}"
    return ok / max(1, len(pairs))


def run_engine(model_dir: Path, ecfg: EngineConfig, batch: list[list[int]]) -> list[list[int]]:
    eng = build_engine(model_dir, ecfg)
    reqs = eng.generate(batch, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [r.output_ids for r in reqs]


def run_di(model_dir: Path, batch: list[list[int]], **kw) -> list[list[int]]:
    """Prefill (kv_producer) -> NIXL READ -> GK decode (kv_consumer), both engines in this process (one
    thread each: they share the cores): all prompts prefilled as one batch, then decoded as one batch.
    The transfer time limit is generous (60 s, not the serving default of 10 s): this scores accuracy, and on a
    busy 2-core host the side channel's threads share the GIL with both engines' step loops."""
    key = secrets.token_hex(16)
    prod = build_engine(model_dir, EngineConfig(kv_role="kv_producer", kv_secret=key, threads=1, **kw))
    cons = build_engine(model_dir, EngineConfig(kv_role="kv_consumer", kv_secret=key, threads=1,
                                                kv_transfer_timeout_s=60.0, **kw))
    try:
        pids = [prod.add_request(p, SamplingParams(temperature=0.0, max_tokens=1),
                                 kv_transfer_params={"do_remote_decode": True}) for p in batch]
        while prod.has_unfinished():
            prod.step()
        cids = [cons.add_request(p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                 kv_transfer_params=prod.requests[rid].kv_transfer_params_out)
                for p, rid in zip(batch, pids)]
        while cons.has_unfinished():
            cons.step()
            prod.step()                            # the producer's loop: READ notifications, leases
        failed = [cons.requests[c].error for c in cids if cons.requests[c].error]
        if failed:
            raise RuntimeError(f"{len(failed)} DI requests failed: {failed[0]}")
        return [cons.requests[c].output_ids for c in cids]
    finally:
        cons.connector.close()
        prod.connector.close()


def run_parallel(model_dir: Path, batch: list[list[int]]) -> list[list[int]]:
    """`torchrun --nproc-per-node 2 -m gigadecode generate --tp 2 --ep 2 --json` over the prompts."""
    with tempfile.TemporaryDirectory() as tmp:
        reqs = Path(tmp) / "reqs.jsonl"
        reqs.write_text("".join(json.dumps({"prompt_ids": p, "max_tokens": MAX_TOKENS, "temperature": 0.0}) + "\n"
                                for p in batch))
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        cmd = [torchrun, "--nproc-per-node", "2", "-m", "gigadecode", "generate", "--model", str(model_dir),
               "--requests", str(reqs), "--json", "--tp", "2", "--ep", "2", "--dtype", "bfloat16",
               "--kv-dtype", "fp8", "--decoder", "gk"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode != 0:
            raise RuntimeError(f"torchrun failed ({r.returncode}):\n{r.stderr[-2000:]}")
        return [json.loads(line)["token_ids"] for line in r.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a demo checkpoint (default: written to a temp dir)")
    ap.add_argument("--n", type=int, default=1000, help="held-out questions per configuration")
    ap.add_argument("--n-tools", type=int, default=200, help="held-out questions with the add tool")
    ap.add_argument("--skip-parallel", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else make_checkpoint(Path(tmp) / "demo", "demo")
        codec = TextCodec.from_dir(model_dir)
        pairs, tool_pairs = heldout(model_dir, args.n), heldout(model_dir, args.n_tools)
        plain, tooled = prompts(codec, pairs, False), prompts(codec, tool_pairs, True)
        rows = []

        def record(name, fn):
            t0 = time.perf_counter()
            acc = score(codec, pairs, fn(plain), False)
            tool = score(codec, tool_pairs, fn(tooled), True)
            rows.append({"config": name, "answer_accuracy": round(acc, 4), "tool_call_accuracy": round(tool, 4),
                         "n": len(pairs), "n_tools": len(tool_pairs), "seconds": round(time.perf_counter() - t0, 1)})
            print(f"{name:16s} answers {acc:7.2%}  tool calls {tool:7.2%}  ({rows[-1]['seconds']} s)", flush=True)

        for name, kw in CONFIGS.items():
            record(name, lambda b, kw=kw: run_engine(model_dir, EngineConfig(**kw), b))
        record("DI (bf16 + fp8)", lambda b: run_di(model_dir, b, dtype="bfloat16", kv_dtype="fp8"))
        if not args.skip_parallel:
            record("TP2 x EP2", lambda b: run_parallel(model_dir, b))
    print()
    print("| configuration | held-out answers | tool calls |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['answer_accuracy']:.1%} ({r['n']}) | {r['tool_call_accuracy']:.1%} ({r['n_tools']}) |")
    if args.json:
        print(json.dumps(rows))
    return 0 if rows[0]["answer_accuracy"] >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
