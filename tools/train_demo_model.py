"""Train gigadecode's built-in demo model: a tiny GPT-OSS that answers `What is A + B?` (0 <= A, B <= 99).

What it trains
    A 4-layer GPT-OSS (sliding / full attention alternating, window 32; attention sinks; 8 experts top-2,
    MXFP4 experts in the checkpoint; 640-token byte-level BPE with o200k_harmony's special tokens and one
    token per digit) on synthetic harmony conversations of one checkable skill, rendered with the
    checkpoint's own chat template (`gigadecode.tokenizer.HARMONY_CHAT_TEMPLATE`) through
    `TextCodec.apply_chat_template(messages, tools=..., reasoning_effort=...)`, exactly as a server
    renders a request, with the loss on the assistant's completion only:

    * `What is 37 + 45?` ->
        <|channel|>analysis<|message|>ones: 7 + 5 = 12, write 2 carry 1. tens: 3 + 4 + 1 = 8. so 37 + 45 = 82.<|end|>
        <|start|>assistant<|channel|>final<|message|>37 + 45 = 82<|return|>          (~70 tokens)
    * the same question when the request offers a function tool named `add` (integer parameters a, b) ->
        <|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 37, "b": 45}<|call|>
    * after that call and the tool's answer (`{"result": 82}`, `82`, ...) ->
        <|channel|>final<|message|>37 + 45 = 82<|return|>

    Other tools only (multiply, get_weather, ...) -> the model answers itself; an optional first
    system/developer message and an earlier question + answer vary the prompt. A fixed 10% of the 10,000
    (A, B) pairs (seeded) is held out: it never appears in training, and every accuracy below is on it.
    The conversations and the tokenizer are built in tools/demo_data.py.

How
    1. dense experts, fp32, AdamW, transformers' GptOssForCausalLM (eager attention, with sinks);
    2. the experts rounded to MXFP4 (round to nearest, `gigadecode.mxfp4.encode_mxfp4`) and frozen there,
       everything else fine-tuned a little more (quantization-aware), then rounded to bf16 as stored;
    3. written in the Hugging Face GPT-OSS layout (config.json with quantization_config mxfp4,
       model.safetensors with `*_blocks` / `*_scales`, tokenizer.json, tokenizer_config.json with the
       chat template, chat_template.jinja, generation_config.json) plus training_report.json (the
       held-out pairs, the losses, the accuracies);
    4. evaluated with gigadecode's own engine (fp32 with fp32 KV, and with the packed FP8 KV cache:
       greedy, held-out questions, tool call, tool result), and against transformers on the written files.

    Accuracy during training is teacher-forced exact match: every completion token is the argmax given
    the gold prefix, which is exactly "greedy decoding reproduces the whole completion".

How long
    About 25-30 minutes on 2 idle CPU cores (torch 2.13, `--threads 2`), most of it step 1. The committed
    files are this script's run with `--steps 3000 --qat-steps 200 --qat-rounds 1` (held-out teacher-forced
    exact match 99.8%; greedy answer accuracy per serving configuration: bench/quality.py).

Reproduce
    .venv/bin/python tools/train_demo_model.py                  # writes gigadecode/assets/demo/
    .venv/bin/python tools/train_demo_model.py --eval-only      # only step 4, on the committed files
    Seeds are fixed (--seed); the same torch version and thread count give the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from demo_data import (KINDS, NUM_HELDOUT, VOCAB, Data, add_tool, answer, collate, completion_call,  # noqa: E402
                       completion_result, completion_text, make_tokenizer, question, render, split_pairs,
                       tool_call_message, tool_result)
from gigadecode.config import GptOssConfig, QuantConfig, RopeConfig  # noqa: E402
from gigadecode.mxfp4 import decode_mxfp4, encode_mxfp4  # noqa: E402
from gigadecode.tokenizer import (HARMONY_CHAT_TEMPLATE, TextCodec, harmony_special_ids,  # noqa: E402
                                  harmony_tokenizer_config)

DEFAULT_OUT = ROOT / "gigadecode" / "assets" / "demo"
MODEL = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
             num_experts_per_tok=2, sliding_window=32, max_position_embeddings=4096)

def mean(xs) -> float:
    xs = list(xs.values()) if isinstance(xs, dict) else list(xs)
    return sum(xs) / max(1, len(xs))


# --- the model -------------------------------------------------------------------------------------------


def model_config(tokenizer, quantized: bool = True) -> GptOssConfig:
    sp = harmony_special_ids(tokenizer)
    return GptOssConfig(**MODEL, rope=RopeConfig(),
                        eos_token_ids=(sp["<|return|>"], sp["<|call|>"]), pad_token_id=sp["<|endoftext|>"],
                        bos_token_id=sp["<|startoftext|>"], quantization=QuantConfig() if quantized else None)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def hf_model(cfg: GptOssConfig, aux_coef: float, experts_impl: str):
    from transformers import GptOssConfig as HFConfig
    from transformers import GptOssForCausalLM

    d = cfg.with_(quantization=None).to_hf()
    d.update(router_aux_loss_coef=aux_coef, torch_dtype="float32")
    hcfg = HFConfig.from_dict(d)
    hcfg._attn_implementation = "eager"
    if experts_impl:
        hcfg._experts_implementation = experts_impl
    return GptOssForCausalLM(hcfg).float()


@torch.no_grad()
def exact_match(model, examples: list[tuple[list[int], list[int]]], pad: int, batch: int = 64) -> float:
    """Fraction of examples whose whole completion is the argmax at every position (= greedy decoding
    reproduces it exactly)."""
    was = model.training
    model.eval()
    ok = 0
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]) + len(examples[i][1]))
    for s in range(0, len(order), batch):
        exs = [examples[i] for i in order[s:s + batch]]
        ids, mask, labels = collate(exs, pad)
        logits = model(input_ids=ids, attention_mask=mask).logits
        pred = logits[:, :-1].argmax(-1)
        gold = labels[:, 1:]
        good = ((pred == gold) | (gold == -100)).all(-1)
        ok += int(good.sum())
    model.train(was)
    return ok / len(examples)


def eval_sets(data: Data, held: list[tuple[int, int]], n: int, seed: int) -> dict[str, list]:
    rng = random.Random(seed + 2)
    pairs = held[:n]
    out = {}
    for kind, _ in KINDS:
        out[kind] = [data.example(a, b, kind, rng) for a, b in pairs]
    # the plain question exactly as a chat client sends it: one user message, nothing else
    out["plain"] = [(render(data.codec, [{"role": "user", "content": question(a, b)}], None, None),
                     data.codec.encode(completion_text(a, b))) for a, b in pairs]
    return out


def evaluate(model, sets: dict[str, list], pad: int) -> dict[str, float]:
    return {k: round(exact_match(model, v, pad), 4) for k, v in sets.items()}


def loss_of(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(cross-entropy on the completion tokens + the router load-balancing term, the cross-entropy).
    The lm_head runs only where a label is (the same loss as transformers' `labels=`, less work)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

    aux = model.config.router_aux_loss_coef
    out = model.model(input_ids=ids, attention_mask=mask, output_router_logits=aux > 0)
    hidden = out.last_hidden_state[:, :-1]
    gold = labels[:, 1:]
    keep = gold != -100
    logits = model.lm_head(hidden[keep])
    ce = torch.nn.functional.cross_entropy(logits.float(), gold[keep])
    loss = ce
    if aux > 0:
        cfg = model.config
        loss = loss + aux * load_balancing_loss_func(out.router_logits, cfg.num_local_experts,
                                                     cfg.num_experts_per_tok, mask)
    return loss, ce.item()


def train(model, data: Data, steps: int, lr: float, batch: int, pad: int, log_every: int, sets, warmup: int,
          params=None, label: str = "train") -> list[float]:
    params = [p for p in (params or model.parameters()) if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98), eps=1e-8)
    model.train()
    losses, t0 = [], time.perf_counter()
    it = data.batches(batch)
    run = 0.0
    for step in range(1, steps + 1):
        f = step / warmup if step <= warmup else 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        for g in opt.param_groups:
            g["lr"] = lr * f
        ids, mask, labels = collate(next(it), pad)
        loss, ce = loss_of(model, ids, mask, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        run = ce if step == 1 else 0.98 * run + 0.02 * ce
        losses.append(ce)
        if step % log_every == 0 or step == steps:
            acc = evaluate(model, sets, pad) if sets else {}
            print(f"[{label}] step {step}/{steps} loss {run:.4f} lr {lr * f:.2e} "
                  f"{time.perf_counter() - t0:.0f}s held-out exact {acc}", flush=True)
    return losses


# --- MXFP4 -----------------------------------------------------------------------------------------------


def quantize_experts(model) -> dict[str, torch.Tensor]:
    """Round every expert matrix to MXFP4 in place (round to nearest) and freeze it; returns the
    checkpoint tensors (`*_blocks`, `*_scales` in HF's layout: gate_up [E, 2I, H/32, 16], down [E, H, I/32, 16])."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(ex, name)                          # [E, in, out] (transformers' dense layout)
            blocks, scales = encode_mxfp4(w.detach().transpose(1, 2).contiguous())  # rows = out, blocked over in
            deq = decode_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
            with torch.no_grad():
                w.copy_(deq)
            w.requires_grad_(False)
            p = f"model.layers.{i}.mlp.experts.{name}"
            out[p + "_blocks"], out[p + "_scales"] = blocks, scales
    return out


def round_to_bf16(model) -> None:
    """What the checkpoint stores: every non-expert tensor (and the expert biases) in bf16."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def checkpoint_tensors(model, expert_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        out[name] = t.detach().to(torch.bfloat16).contiguous()
    out.update(expert_tensors)
    return dict(sorted(out.items()))


def write_checkpoint(out: Path, model, expert_tensors, tokenizer, cfg: GptOssConfig, report: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(model, expert_tensors), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    tcfg = harmony_tokenizer_config(cfg.max_position_embeddings)
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").write_text(HARMONY_CHAT_TEMPLATE, encoding="utf-8")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id,
           "do_sample": False, "max_new_tokens": 64}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_report(out / "training_report.json", report)


def write_report(path: Path, report: dict) -> None:
    """indent=1 JSON, the held-out pairs ten to a line."""
    pairs = report["heldout_pairs"]
    body = json.dumps({k: v for k, v in report.items() if k != "heldout_pairs"}, indent=1)
    rows = ",\n  ".join(", ".join(json.dumps(p) for p in pairs[i:i + 10]) for i in range(0, len(pairs), 10))
    path.write_text(body[:-2] + ',\n "heldout_pairs": [\n  ' + rows + "\n ]\n}\n")


def files_report(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(out.iterdir())}


@torch.no_grad()
def files_match(out: Path, model, examples, pad: int) -> float:
    """transformers' GptOssForCausalLM loaded from the written files (MXFP4 experts dequantized) against the
    in-memory model: the layout is right when the logits agree to float rounding."""
    import transformers
    from transformers import GptOssForCausalLM

    transformers.logging.set_verbosity_error()
    hf = GptOssForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids, mask, _ = collate(examples, pad)
    model.eval()
    diff = (hf(input_ids=ids, attention_mask=mask).logits - model(input_ids=ids, attention_mask=mask).logits)
    return float((diff * mask[..., None]).abs().max())


# --- evaluation with gigadecode's engine -----------------------------------------------------------------


def final_of(text: str) -> str | None:
    """The final channel's text of a completion decoded with its special tokens."""
    key = "<|channel|>final<|message|>"
    if key not in text:
        return None
    return text.rsplit(key, 1)[1].removesuffix("<|return|>").removesuffix("<|end|>")


def engine_eval(model_dir: Path, held: list[tuple[int, int]], kv_dtype: str, n: int | None = None,
                max_tokens: int = 128) -> dict:
    from gigadecode.engine_config import EngineConfig
    from gigadecode.engine import LLMEngine
    from gigadecode.runner import ModelRunner
    from gigadecode.sampling import SamplingParams

    codec = TextCodec.from_dir(model_dir)
    eng = LLMEngine(ModelRunner(model_dir, EngineConfig(dtype="float32", kv_dtype=kv_dtype, decoder="gk-native")))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    pairs = held[:n] if n else held
    rng = random.Random(7)
    tools = [add_tool()]

    def run(prompts):
        return [codec.decode(r.output_ids, skip_special_tokens=False) for r in eng.generate(prompts, sp)]

    t0 = time.perf_counter()
    texts = run([codec.apply_chat_template([{"role": "user", "content": question(a, b)}]) for a, b in pairs])
    answers = [final_of(t) == answer(a, b) for t, (a, b) in zip(texts, pairs)]
    exact = [t == completion_text(a, b) for t, (a, b) in zip(texts, pairs)]
    sub = pairs[:200]
    calls = run([codec.apply_chat_template([{"role": "user", "content": question(a, b)}], tools=tools) for a, b in sub])
    call_ok = [t == completion_call(a, b) for t, (a, b) in zip(calls, sub)]
    results = run([codec.apply_chat_template([{"role": "user", "content": question(a, b)}, tool_call_message(a, b),
                                              {"role": "tool", "content": tool_result(a, b, rng)}], tools=tools)
                   for a, b in sub])
    res_ok = [t == completion_result(a, b) for t, (a, b) in zip(results, sub)]
    bad = [(p, t) for p, t, ok in zip(pairs, texts, answers) if not ok][:5]
    return {"kv_dtype": kv_dtype, "n": len(pairs), "answer_accuracy": sum(answers) / len(pairs),
            "exact_completion": sum(exact) / len(pairs), "tool_call_exact": sum(call_ok) / len(sub),
            "tool_result_answer": sum(res_ok) / len(sub), "seconds": round(time.perf_counter() - t0, 1),
            "wrong_examples": bad}


def oracle_check(model_dir: Path, held: list[tuple[int, int]], k: int = 6) -> dict:
    """transformers' GptOssForCausalLM on the written files vs our engine (fp32): the same greedy tokens."""
    import transformers
    from transformers import GptOssForCausalLM

    from gigadecode.engine_config import EngineConfig
    from gigadecode.engine import LLMEngine
    from gigadecode.runner import ModelRunner
    from gigadecode.sampling import SamplingParams

    transformers.logging.set_verbosity_error()
    codec = TextCodec.from_dir(model_dir)
    hf = GptOssForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eng = LLMEngine(ModelRunner(model_dir, EngineConfig(dtype="float32", kv_dtype="auto", decoder="gk-native")))
    prompts = []
    for a, b in held[:k]:
        q = [{"role": "user", "content": question(a, b)}]
        prompts += [codec.apply_chat_template(q), codec.apply_chat_template(q, tools=[add_tool()]),
                    codec.apply_chat_template(q + [tool_call_message(a, b), {"role": "tool", "content": str(a + b)}],
                                              tools=[add_tool()])]
    ours = [r.output_ids for r in eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64))]
    same = 0
    for p, o in zip(prompts, ours):
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=64,
                            eos_token_id=list(hf.config.eos_token_id) if isinstance(hf.config.eos_token_id, list)
                            else hf.config.eos_token_id, pad_token_id=hf.config.pad_token_id)
        same += g[0, len(p):].tolist() == o
    return {"prompts": len(prompts), "identical_greedy_tokens": same}


# --- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3000, help="dense training steps")
    ap.add_argument("--qat-steps", type=int, default=200, help="steps per fine-tune round, experts frozen at MXFP4")
    ap.add_argument("--qat-rounds", type=int, default=3, help="fine-tune rounds at most (only if MXFP4 costs accuracy)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--qat-lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="router load-balancing loss weight")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--eval-n", type=int, default=200, help="held-out examples per kind in the training logs")
    ap.add_argument("--experts-impl", default=None, help="transformers' experts implementation (default: its own)")
    ap.add_argument("--eval-only", action="store_true", help="skip training: evaluate the files in --out")
    ap.add_argument("--no-engine-eval", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    train_pairs, held = split_pairs(args.seed)

    if not args.eval_only:
        t_start = time.perf_counter()
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        tokenizer = make_tokenizer(train_pairs, args.seed)
        codec = TextCodec(tokenizer, harmony_tokenizer_config(4096))
        cfg = model_config(tokenizer)
        pad = cfg.pad_token_id
        data = Data(codec, train_pairs, args.seed)
        sets = eval_sets(data, held, args.eval_n, args.seed)
        lens = [len(p) + len(c) for v in sets.values() for p, c in v]
        print(f"config {MODEL}; special ids {harmony_special_ids(tokenizer)}; "
              f"tokens per example {min(lens)}..{max(lens)} (mean {sum(lens) / len(lens):.0f})", flush=True)
        model = hf_model(cfg, args.aux_coef, args.experts_impl)
        print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
        t0 = time.perf_counter()
        losses = train(model, data, args.steps, args.lr, args.batch, pad, args.log_every, sets, args.warmup)
        t_dense = time.perf_counter() - t0
        full = eval_sets(data, held, NUM_HELDOUT, args.seed)
        val = eval_sets(data, random.Random(args.seed + 3).sample(train_pairs, 300), 300, args.seed + 4)
        acc_dense, val_dense = evaluate(model, full, pad), evaluate(model, val, pad)
        print(f"dense: held-out {acc_dense}, validation {val_dense} ({t_dense:.0f}s)", flush=True)
        # MXFP4 experts (round to nearest, frozen from here on), the rest rounded to bf16: what the file holds
        expert_tensors = quantize_experts(model)
        round_to_bf16(model)
        acc_rtn, val_q = evaluate(model, full, pad), evaluate(model, val, pad)
        print(f"MXFP4 (round to nearest) + bf16: held-out {acc_rtn}, validation {val_q}", flush=True)
        # if that cost accuracy (on the validation conversations: training pairs, fresh phrasings), fine-tune
        # everything but the frozen experts until it holds
        t0, qat_losses, rounds = time.perf_counter(), [], 0
        while mean(val_q) < mean(val_dense) - 0.002 and rounds < args.qat_rounds:
            qat_losses += train(model, data, args.qat_steps, args.qat_lr, args.batch, pad, args.qat_steps, None,
                                warmup=20, label="qat")
            round_to_bf16(model)
            val_q, rounds = evaluate(model, val, pad), rounds + 1
            print(f"after {rounds} fine-tune round(s): validation {val_q}", flush=True)
        t_qat = time.perf_counter() - t0
        acc_final = evaluate(model, full, pad)
        print(f"stored model (MXFP4 experts, bf16 rest): held-out {acc_final}", flush=True)
        report = {
            "skill": "What is A + B? (0 <= A, B <= 99): analysis working + final answer; add tool call; tool result",
            "seed": args.seed, "args": {k: str(v.relative_to(ROOT) if isinstance(v, Path) and v.is_relative_to(ROOT)
                                                 else v) for k, v in vars(args).items()}, "model": MODEL,
            "torch": torch.__version__, "transformers": transformers_version(), "threads": args.threads,
            "experts_implementation": model.config._experts_implementation,
            "train_seconds": {"dense": round(t_dense), "qat": round(t_qat), "total": round(time.perf_counter() - t_start)},
            "loss": {"dense_first": round(losses[0], 4), "dense_last100": round(mean(losses[-100:]), 6),
                     "qat_last100": round(mean(qat_losses[-100:]), 6) if qat_losses else None},
            "qat_rounds": rounds,
            "heldout_exact_teacher_forced": {"dense": acc_dense, "mxfp4_rtn_bf16": acc_rtn, "stored": acc_final},
            "validation_exact_teacher_forced": {"dense": val_dense, "stored": val_q},
            "heldout_pairs": [list(p) for p in held],
        }
        write_checkpoint(args.out, model, expert_tensors, tokenizer, cfg, report)
        print(f"wrote {args.out}: {files_report(args.out)}", flush=True)
        print(f"transformers on the files vs the trained model: max |logit diff| "
              f"{files_match(args.out, model, full['result'][:16], pad):.2e}", flush=True)

    if not args.no_engine_eval:
        results = {kv: engine_eval(args.out, held, kv) for kv in ("auto", "fp8")}
        for r in results.values():
            print(f"engine (fp32, kv {r['kv_dtype']}): {json.dumps(r)}", flush=True)
        oracle = oracle_check(args.out, held)
        print(f"transformers vs engine greedy: {oracle}", flush=True)
        path = args.out / "training_report.json"
        report = json.loads(path.read_text())
        report["engine_eval"] = {kv: {k: v for k, v in r.items() if k != "wrong_examples"} for kv, r in results.items()}
        report["transformers_oracle"] = oracle
        write_report(path, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
