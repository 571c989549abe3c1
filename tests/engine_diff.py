"""A randomized differential check of the engine's continuous batching, the oracle being each request run alone.

One seed draws a whole case (`draw_case`): a random GPT-OSS checkpoint of an odd shape (1-3 layers of either
kind, a sliding window shorter than the prompts, an odd vocabulary, head dims that are no power of two, 1-8
experts, MXFP4 or bf16), an engine over it (fp32 compute and KV, `gk-native` or `reference`, blocks of 1-64
tokens, prefill chunks of a few tokens, a pool small enough to preempt, prefix caching, n-gram or suffix drafts,
fcfs or priority scheduling, small batch buckets, a warm-up first) and a mix of requests that arrive over the
steps (greedy and seeded, n > 1, stop strings and stop ids met in their output, min_tokens, an EOS made likely,
allowed_token_ids, logprobs and prompt logprobs, shared prefixes and repetitive prompts, some aborted mid-way,
and now and then one the engine must refuse).

`check_case` runs the mix through the engine (the answers as the step outputs streamed them, which must be the
requests' final state), then every sequence again alone on an engine of the same config with a roomy pool, no
prefix cache and no drafts, and reports each sequence whose answer differs: the same tokens (a greedy one may
take the runner-up where the lone run's top two are a near tie, and is compared no further), finish reason,
logprobs and prompt logprobs within `LP_TOL`; an aborted one is a prefix of its lone run. Afterwards the engine
holds no request, no step failed and every KV block is back in the pool.

`python -m tests.engine_diff FIRST COUNT [ROOT]` sweeps seeds FIRST..FIRST+COUNT-1 (checkpoints under ROOT) and
prints each failing case; `describe(seed)` shows what a seed draws.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from gigadecode.checkpoint import make_checkpoint, preset_config
from gigadecode.config import FULL, SLIDING, GptOssConfig
from gigadecode.engine import LLMEngine, RequestError, Status
from gigadecode.engine_config import EngineConfig
from gigadecode.llm import SamplingParams, _Sequence
from gigadecode.runner import ModelRunner
from gigadecode.sampling import MAX_LOGPROBS, nth_seed
from gigadecode.speculative import SpeculativeConfig
from gigadecode.tokenizer import TextCodec

from .helpers import cdiv

LP_TOL = 1e-4               # fp32: a logprob in a batch vs alone
NEAR_TIE = 2 * LP_TOL       # a greedy pick and its runner-up this close may swap under load (each moved <= LP_TOL)
EOS = 2                     # the tiny preset's (kept by every drawn config)
MAX_STEPS = 20000           # a case takes a few hundred steps, a few thousand at most
NUM_MODELS = 12             # cases share this many checkpoints (each written once per root)


# --------------------------------------------------------------------------------------------------
# Drawing a case
# --------------------------------------------------------------------------------------------------
@dataclass
class Seq:
    """One request of the mix: `n` engine requests (seeded ones: the j-th with seed + j, as `LLM` does)."""

    prompt: list[int]
    params: SamplingParams              # gigadecode.llm's: the engine's plus n and stop strings
    arrive: int                         # the step before which it is added
    abort_after: int | None = None      # aborted after this many steps of its own (None: runs to its end)
    priority: int = 0
    stops_from_output: tuple[bool, bool] = (False, False)   # (stop strings, stop ids): `pick_stops` sets them


@dataclass
class Case:
    seed: int
    model: int                          # which of NUM_MODELS checkpoints
    engine: dict                        # EngineConfig fields of the engine under load
    seqs: list[Seq] = field(default_factory=list)
    bad_steps: tuple[int, ...] = ()     # steps before which a request the engine must refuse is tried
    warm_up: bool = False               # the engine warms up (on borrowed blocks) before the load


def draw_model(model: int) -> tuple[dict, str]:
    """(GptOssConfig fields over the tiny preset, expert layout) of checkpoint `model`."""
    rng = random.Random(7919 * model + 1)
    layers = rng.randint(1, 3)
    types = tuple(rng.choice((SLIDING, FULL)) for _ in range(layers))
    kv_heads = rng.choice((1, 2))
    experts = rng.randint(1, 8)
    over = dict(num_hidden_layers=layers, layer_types=types, sliding_window=rng.randint(1, 12),
                vocab_size=rng.choice((301, 389, 517, 769, 1021, 1103)),   # >= 300: a byte-level tokenizer
                head_dim=rng.choice((8, 12, 16, 20, 24, 40)), num_key_value_heads=kv_heads,
                num_attention_heads=kv_heads * rng.choice((1, 2, 3)), num_local_experts=experts,
                num_experts_per_tok=rng.randint(1, min(4, experts)), hidden_size=rng.choice((32, 64)),
                intermediate_size=rng.choice((32, 64)))
    return over, rng.choice(("mxfp4", "mxfp4", "bf16"))


def checkpoint(root: Path, model: int) -> Path:
    out = Path(root) / f"m{model}"
    if not (out / "config.json").exists():
        over, experts = draw_model(model)
        make_checkpoint(out, cfg=preset_config("tiny", experts).with_(**over), seed=model, experts=experts)
    return out


def draw_engine(rng: random.Random) -> dict:
    """EngineConfig fields (num_blocks is set by `check_case` from the pool one request needs)."""
    decoder = rng.choice(("gk-native", "reference"))
    spec = rng.choice((None, "ngram", "suffix"))
    k = rng.randint(1, 5)
    lookup_min = rng.randint(1, 3)
    speculative = (None if spec is None else
                   SpeculativeConfig(k, method="suffix") if spec == "suffix" else
                   SpeculativeConfig(k, prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_min + rng.randint(0, 2)))
    return dict(dtype="float32", kv_dtype="auto", decoder=decoder, gk_decode=decoder != "reference",
                block_size=rng.choice((1, 1, 2, 3, 4, 5, 7, 8, 16, 32, 64)),
                max_prefill_tokens=rng.choice((1, 2, 3, 5, 8, 13, 24)), max_num_seqs=rng.randint(1, 8),
                max_model_len=rng.choice((rng.randint(24, 72), rng.randint(72, 140))),
                enable_prefix_caching=rng.random() < 0.5,
                speculative=speculative, scheduling_policy=rng.choice(("fcfs", "fcfs", "priority")),
                batch_buckets=rng.choice(((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8, 16, 32, 64), (1, 3), (2, 5, 9))))


def draw_case(seed: int) -> Case:
    """The engine and the mix of `seed` (stop strings and stop ids are picked later, from lone runs' output)."""
    rng = random.Random(seed)
    case = Case(seed, rng.randrange(NUM_MODELS), draw_engine(rng))
    vocab = draw_model(case.model)[0]["vocab_size"]
    mml = case.engine["max_model_len"]
    case.bad_steps = tuple(rng.randint(0, 15) for _ in range(rng.choice((0, 0, 1, 3))))
    case.warm_up = rng.random() < 0.3
    heads = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, mml - 8))] for _ in range(2)]
    for _ in range(rng.randint(3, 10)):
        n = rng.randint(1, mml - 2)
        prompt = [rng.randrange(3, vocab) for _ in range(n)]
        if rng.random() < 0.35:                               # a shared prefix: prefix cache hits
            prompt = (rng.choice(heads) + prompt)[:n]
        if rng.random() < 0.25:                               # repetitive: n-gram drafts accepted
            prompt = (prompt[:rng.randint(1, 6)] * n)[:n]
        room = mml - n
        seeded = rng.random() < 0.35
        kw: dict = dict(max_tokens=rng.randint(1, min(room, 24)), ignore_eos=rng.random() < 0.3)
        if seeded:
            kw.update(temperature=rng.choice((0.6, 1.0, 1.4)), seed=rng.randrange(2**32))
        else:
            kw.update(temperature=0.0)
        if seeded and rng.random() < 0.3:
            kw.update(top_k=rng.randint(1, 30), top_p=rng.choice((0.8, 1.0)), min_p=rng.choice((0.0, 0.05)))
        if seeded and rng.random() < 0.2:
            kw.update(repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3)
        if rng.random() < 0.2:
            kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
        if rng.random() < 0.3:                                # eos likely: min_tokens and eos stops matter
            kw["logit_bias"] = ((EOS, rng.choice((4.0, 8.0, 12.0))),)
        if rng.random() < 0.08:
            kw["allowed_token_ids"] = tuple(sorted(rng.sample(range(3, vocab), 40)))
        if rng.random() < 0.3:
            kw["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.15:
            kw["prompt_logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.15:
            kw["n"] = rng.randint(2, 3)
        arrive = rng.choice((0, 0, rng.randint(0, 12)))
        abort = rng.randint(0, 20) if rng.random() < 0.12 else None
        prio = rng.randint(-2, 2) if case.engine["scheduling_policy"] == "priority" else 0
        stops = (rng.random() < 0.2, rng.random() < 0.15)     # stop strings / ids: picked from its lone run
        case.seqs.append(Seq(prompt, SamplingParams(**kw), arrive, abort, prio, stops))
    return case


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------
@dataclass
class Answer:
    ids: list[int]
    finish: str | None
    logprobs: list              # sampling.TokenLogprobs per token (when asked for)
    prompt_logprobs: list | None
    error: str | None = None
    aborted_running: bool = False       # aborted while it held KV blocks


def make_engine(ckpt: Path, **kw) -> LLMEngine:
    return LLMEngine(ModelRunner(ckpt, EngineConfig(**kw)))


def try_bad(eng: LLMEngine, step: int) -> None:
    """A request the engine must refuse at the door (an id outside the vocabulary, a prompt or max_tokens past
    the context), leaving everything as it was."""
    V, mml = eng.cfg.vocab_size, eng.max_model_len
    prompt, params = [[3, V], [3] * mml, [3, 4]][step % 3], SamplingParams(temperature=0.0, max_tokens=mml)
    before = dict(eng.requests)
    try:
        eng.add_request(prompt, params if step % 3 == 2 else SamplingParams(max_tokens=1), request_id=f"bad{step}")
    except RequestError:
        assert eng.requests == before, "a refused request was kept"
    else:
        raise AssertionError(f"a bad request was taken: prompt of {len(prompt)} tokens, {params}")


def run(eng: LLMEngine, seqs: list[Seq], codec, tag: str = "", bad_steps: tuple[int, ...] = ()
        ) -> dict[tuple[int, int], Answer]:
    """Drive `seqs` through `eng` step by step (arrivals, aborts, stop strings as `LLM` matches them, requests
    to refuse before `bad_steps`) -> (seq, j) -> its answer as the step outputs streamed it (checked against
    the request's final state)."""
    live: dict[str, tuple[tuple[int, int], _Sequence, int]] = {}     # rid -> (key, matcher, its first step)
    streamed: dict[str, Answer] = {}
    step = 0
    pending = sorted(range(len(seqs)), key=lambda i: seqs[i].arrive)
    while pending or eng.has_unfinished():
        if step > MAX_STEPS:
            raise AssertionError(f"not finished after {MAX_STEPS} steps: {[r.status for r in eng.requests.values()]}")
        for _ in range(bad_steps.count(step)):
            try_bad(eng, step)
        while pending and seqs[pending[0]].arrive <= step:
            i = pending.pop(0)
            s = seqs[i]
            for j in range(s.params.n):
                p = s.params if j == 0 or s.params.seed is None else replace(s.params, seed=nth_seed(s.params.seed, j))
                rid = eng.add_request(s.prompt, p, request_id=f"{tag}{i}.{j}", priority=s.priority)
                live[rid] = ((i, j), _Sequence(rid, p, codec), step)
                streamed[rid] = Answer([], None, [], None)
        for out in eng.step():
            if out.request_id not in live:
                continue
            a = streamed[out.request_id]
            if a.finish is not None:
                a.error = f"an output after it finished: {out}"
            a.ids += out.new_token_ids
            a.logprobs += out.new_logprobs
            if out.prompt_logprobs is not None:
                a.prompt_logprobs = (a.prompt_logprobs or []) + [out.prompt_logprobs]
            if out.finished:
                a.finish, a.error = out.finish_reason, a.error or out.error
            if live[out.request_id][1].push(out.new_token_ids, out.finished and out.finish_reason == "stop"):
                eng.abort(out.request_id, "stop")
        step += 1
        for rid, ((i, _), _, first) in live.items():
            if seqs[i].abort_after is not None and step - first == seqs[i].abort_after + 1 and rid in eng.requests:
                running = eng.requests[rid].status == Status.RUNNING
                if eng.abort(rid):
                    streamed[rid].finish, streamed[rid].aborted_running = "abort", running
    answers = {}
    for rid, (key, m, _) in live.items():
        r, a = eng.requests.pop(rid), streamed[rid]
        plp = a.prompt_logprobs
        if plp is not None and len(plp) != 1 or (plp is None) != (r.params.prompt_logprobs is None or not r.output_ids):
            a.error = a.error or f"prompt logprobs delivered {0 if plp is None else len(plp)} times"
        a.prompt_logprobs = None if r.params.prompt_logprobs is None else plp[0] if plp else list(r.prompt_logprobs)
        if (a.ids, a.logprobs) != (r.output_ids, r.output_logprobs) or a.finish not in (r.finish_reason, None):
            a.error = a.error or (f"streamed {a.ids} ({a.finish}), the request holds {r.output_ids} "
                                  f"({r.finish_reason})")
        if m.kept is not None:                 # a stop string ended it: the tokens after it are dropped
            a.ids, a.logprobs, a.finish = a.ids[:m.kept], a.logprobs[:m.kept], "stop"
        a.finish = a.finish or r.finish_reason
        answers[key] = a
    return answers


def solo_engine_config(case: Case, cfg) -> dict:
    """The lone runs' engine: the same, with room for one request of max_model_len, no cache, no drafts."""
    e = case.engine
    blocks = cfg.num_hidden_layers * (cdiv(e["max_model_len"] + e["max_prefill_tokens"], e["block_size"]) + 2) + 1
    return {**e, "enable_prefix_caching": False, "speculative": None, "num_blocks": blocks}


def run_alone(solo: LLMEngine, seq: Seq, j: int, codec, tag: str) -> Answer:
    """seq's j-th sequence alone, with the top MAX_LOGPROBS logprobs (for the near-tie test)."""
    p = replace(seq.params, n=1, logprobs=MAX_LOGPROBS)
    if j and p.seed is not None:
        p = replace(p, seed=nth_seed(p.seed, j))
    return run(solo, [Seq(seq.prompt, p, 0)], codec, tag)[(0, 0)]


def pick_stops(case: Case, solo: LLMEngine, codec, rng: random.Random) -> None:
    """Seqs drawn with stop strings / stop ids get ones their lone output meets (a stretch of its text, one of
    its tokens), so stops do fire."""
    for i, s in enumerate(case.seqs):
        if not any(s.stops_from_output):
            continue
        probe = replace(s.params, stop=(), stop_token_ids=(), n=1)
        out = run(solo, [Seq(s.prompt, probe, 0)], codec, f"probe{i}-")[(0, 0)].ids
        kw: dict = {}
        if s.stops_from_output[0]:
            text = codec.decode(out[rng.randrange(len(out)):], skip_special_tokens=True) if out else ""
            a = rng.randrange(max(1, len(text)))
            kw["stop"] = (text[a: a + rng.randint(1, 3)] or "zz", *(("\n",) if rng.random() < 0.3 else ()))
            kw["include_stop_str_in_output"] = rng.random() < 0.3
        if s.stops_from_output[1]:
            kw["stop_token_ids"] = (rng.choice(out), rng.randrange(3, solo.cfg.vocab_size))
        s.params = replace(s.params, **kw)


# --------------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------------
def _near_tie(params: SamplingParams, want_lp, got_tok: int, generated: int) -> bool:
    """Whether the lone run's pick and `got_tok`, the request's token after `generated` others, are within
    NEAR_TIE of each other there (raw logprobs plus the request's logit_bias, which greedy picks by). Never
    for a token the request's masks forbid there (outside allowed_token_ids, a stop id or EOS under
    min_tokens): the lone pick beat it by the mask, whatever their logprobs, and a batch that lost the mask took it."""
    if params.allowed_token_ids is not None and got_tok not in params.allowed_token_ids:
        return False
    if generated < params.min_tokens and (got_tok in params.stop_token_ids or got_tok == EOS and not params.ignore_eos):
        return False
    top = dict(want_lp.top)
    if got_tok not in top:
        return False
    bias = dict(params.logit_bias)
    ours = top[got_tok] + bias.get(got_tok, 0.0)
    theirs = want_lp.logprob + bias.get(want_lp.token_id, 0.0)
    return theirs - ours < NEAR_TIE


def compare(seq: Seq, got: Answer, want: Answer) -> list[str]:
    """Problems of one sequence's answer under load against its lone run (none: equal up to rounding)."""
    p = seq.params
    if got.error or want.error:
        return [f"error under load {got.error!r}, alone {want.error!r}"]
    problems = []
    aborted = got.finish == "abort"            # its prompt logprobs and tokens: a prefix of the lone run's
    gp, wp = got.prompt_logprobs, want.prompt_logprobs
    if (gp is None) != (wp is None) or gp is not None and (
            len(gp) > len(wp) or len(gp) < len(wp) and not (aborted and not got.ids)
            or any((a is None) != (b is None) or a is not None and not _lp_close(a, b, p.prompt_logprobs)
                   for a, b in zip(gp, wp))):
        problems.append(f"prompt logprobs differ: {_show(gp)}, alone {_show(wp)}")
    part = next((k for k, (a, b) in enumerate(zip(got.ids, want.ids)) if a != b), None)
    if part is not None:
        if p.seed is not None or not _near_tie(p, want.logprobs[part], got.ids[part], part):
            problems.append(f"parts at token {part}: {got.ids} ({got.finish}), alone {want.ids} ({want.finish}); "
                            f"lone top there {want.logprobs[part].top[:3]}")
    elif aborted and len(got.ids) > len(want.ids) or not aborted and (len(got.ids), got.finish) != (
            len(want.ids), want.finish):
        problems.append(f"{got.ids} ({got.finish}), alone {want.ids} ({want.finish})")
    if p.logprobs is not None:
        end = len(got.ids) if part is None else part
        if len(got.logprobs) != len(got.ids):
            problems.append(f"{len(got.logprobs)} logprobs for {len(got.ids)} tokens")
        elif not all(_lp_close(a, b, p.logprobs) for a, b in zip(got.logprobs[:end], want.logprobs[:end])):
            problems.append(f"logprobs differ: {[(a.token_id, a.logprob) for a in got.logprobs[:end]]}, alone "
                            f"{[(b.token_id, b.logprob) for b in want.logprobs[:end]]}")
    return problems


def _show(lps: list | None) -> list | None:
    return None if lps is None else [None if x is None else (x.token_id, round(x.logprob, 6)) for x in lps]


def _lp_close(a, b, n: int) -> bool:
    """One token's logprobs (ours with the top n, the lone run's with at least n): the token's within LP_TOL,
    n top entries, each within LP_TOL of the lone run's for the same token where it lists that token, and no
    likelier than the last it lists where it does not (the lone list is the longer: a token missing from it
    ranks below it)."""
    theirs = dict(b.top)
    return (a.token_id == b.token_id and abs(a.logprob - b.logprob) <= LP_TOL
            and len(a.top) == n
            and all(abs(v - theirs[t]) <= LP_TOL if t in theirs else v <= min(theirs.values(), default=v) + LP_TOL
                    for t, v in a.top))


@dataclass
class Outcome:
    problems: list[str]
    sequences: int = 0
    exercised: set[str] = field(default_factory=set)    # what the case went through (`FEATURES`)


# What a sweep should have gone through (a fixed-seed test checks its cases covered all of it)
FEATURES = {"gk-native", "reference", "ngram drafts accepted", "suffix drafts accepted", "preempted", "prefix hit",
            "aborted", "stop string", "stop id", "eos", "n > 1", "seeded", "prompt logprobs", "logprobs",
            "priority", "warm-up", "refused", "blocks of 1", "blocks of 32+", "chunked", "sliding", "min_tokens"}


def _exercised(case: Case, eng: LLMEngine, got: dict[tuple[int, int], Answer]) -> set[str]:
    e, st, cfg = case.engine, eng.stats, eng.cfg
    spec = e["speculative"]
    seqs = [case.seqs[i] for i, _ in got]
    flags = {e["decoder"]: True,
             f"{spec and spec.method} drafts accepted": st.spec_accepted_tokens > 0,
             "preempted": st.preemptions > 0, "prefix hit": st.prefix_cache_hits > 0,
             "aborted": any(a.aborted_running for a in got.values()),
             "stop string": any(a.finish == "stop" and case.seqs[i].params.stop for (i, _), a in got.items()),
             "stop id": any(a.finish == "stop" and a.ids[-1:] and a.ids[-1] in case.seqs[i].params.stop_token_ids
                            for (i, _), a in got.items()),
             "eos": any(a.finish == "stop" and a.ids[-1:] == [EOS] for a in got.values()),
             "n > 1": any(s.params.n > 1 for s in seqs), "seeded": any(s.params.seed is not None for s in seqs),
             "prompt logprobs": any(a.prompt_logprobs for a in got.values()),
             "logprobs": any(s.params.logprobs for s in seqs), "priority": e["scheduling_policy"] == "priority",
             "warm-up": case.warm_up, "refused": bool(case.bad_steps), "blocks of 1": e["block_size"] == 1,
             "blocks of 32+": e["block_size"] >= 32,
             "chunked": any(len(s.prompt) > e["max_prefill_tokens"] for s in seqs),
             "sliding": any(cfg.is_sliding(i) and len(s.prompt) > cfg.sliding_window
                            for i in range(cfg.num_hidden_layers) for s in seqs),
             "min_tokens": any(s.params.min_tokens for s in seqs)}
    return {k for k, v in flags.items() if v}


def check_case(seed: int, root: Path) -> Outcome:
    """Run case `seed` under load and alone; -> its problems (each naming the sequence) and what it exercised."""
    case = draw_case(seed)
    ckpt = checkpoint(root, case.model)
    codec = TextCodec.from_dir(ckpt)
    rng = random.Random(seed ^ 0x5EED)
    solo = make_engine(ckpt, **solo_engine_config(case, GptOssConfig.from_hf(ckpt)))
    peak = solo._peak_blocks(case.engine["max_model_len"])      # what one request of max_model_len needs
    case.engine["num_blocks"] = 1 + peak + rng.choice((0, rng.randint(0, 2 * peak)))
    pick_stops(case, solo, codec, rng)
    eng = make_engine(ckpt, **case.engine)
    problems = []
    if case.warm_up and eng.warm_up() is None and eng.fits_pool(1):
        problems.append("the warm-up failed")
    got = run(eng, case.seqs, codec, bad_steps=case.bad_steps)
    if eng.kv_manager.num_free_blocks != eng.runner.kv.num_blocks - 1 or eng.has_unfinished() or eng.requests:
        problems.append(f"after the load: {eng.runner.kv.num_blocks - 1 - eng.kv_manager.num_free_blocks} blocks "
                        f"held, unfinished {eng.has_unfinished()}, requests {list(eng.requests)}")
    if eng.stats.step_failures:
        problems.append(f"{eng.stats.step_failures} step failure(s): {eng.last_step_failure}")
    for (i, j), answer in sorted(got.items()):
        want = run_alone(solo, case.seqs[i], j, codec, f"solo{i}.{j}-")
        problems += [f"seq {i}.{j}: {msg}" for msg in compare(case.seqs[i], answer, want)]
    return Outcome(problems, len(got), _exercised(case, eng, got))


def describe(seed: int) -> str:
    case = draw_case(seed)
    lines = [f"case {seed}: model {case.model} {draw_model(case.model)}", f"  engine {case.engine}"]
    lines += [f"  seq {i}: arrive {s.arrive} abort {s.abort_after} prio {s.priority} prompt[{len(s.prompt)}] "
              f"{s.params}" for i, s in enumerate(case.seqs)]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    import tempfile
    import time

    import torch
    torch.set_num_threads(1)
    first, count = int(sys.argv[1]), int(sys.argv[2])
    root = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.mkdtemp(prefix="engdiff-"))
    sequences, seen, bad = 0, set(), []
    t0 = time.time()
    for seed in range(first, first + count):
        try:
            o = check_case(seed, root)
        except Exception as e:  # noqa: BLE001 - a sweep reports every case
            import traceback
            traceback.print_exc()
            o = Outcome([f"raised {type(e).__name__}: {e}"])
        sequences += o.sequences
        seen |= o.exercised
        if o.problems:
            bad.append(seed)
            print(f"FAIL case {seed}:\n  " + "\n  ".join(o.problems[:8]), flush=True)
    print(f"{count} cases, {sequences} sequences, {len(bad)} failing {bad}; {time.time() - t0:.0f} s; not "
          f"exercised: {sorted(FEATURES - seen)}")
