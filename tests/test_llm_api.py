"""vLLM's offline API, `gigadecode.LLM`: greedy tokens and logprobs against transformers (fp32), `n` with seeds
against the engine's own seeded requests, stop strings against a plain run's text cut by hand, chat on the
trained demo model against its known replies, and bad input that queues nothing."""

from __future__ import annotations

import pytest
import torch

from gigadecode import LLM, SamplingParams
from gigadecode.checkpoint import make_checkpoint
from gigadecode.request import RequestError
from gigadecode.sampling import SamplingError
from gigadecode.sampling import SamplingParams as EngineParams

from .helpers import hf_greedy, hf_logits
from .test_demo_model import ADD


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    # fp32 compute and fp32 KV: what transformers computes, so greedy tokens are transformers' own
    return LLM(str(tiny_ckpt), dtype="float32", kv_cache_dtype="auto", num_blocks=64, threads=1, warmup=False)


def test_generate_is_transformers_greedy_with_its_logprobs(llm, hf_model):
    codec = llm.get_tokenizer()
    outs = llm.generate(["hello there", {"prompt_token_ids": [5, 6, 7, 8]}, {"prompt": "the cat"}],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2))
    assert [o.prompt for o in outs] == ["hello there", None, "the cat"]
    assert [o.prompt_token_ids for o in outs] == [codec.encode("hello there"), [5, 6, 7, 8], codec.encode("the cat")]
    for o in outs:
        (c,) = o.outputs
        assert c.token_ids == hf_greedy(hf_model, o.prompt_token_ids, 10)
        assert c.text == codec.decode(c.token_ids) and c.finish_reason == "length" and c.stop_reason is None
        ref = torch.log_softmax(hf_logits(hf_model, o.prompt_token_ids + c.token_ids[:-1]), -1)
        ref = ref[len(o.prompt_token_ids) - 1:]                      # the distribution each token was drawn from
        for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
            assert d[t].rank == 1 and abs(d[t].logprob - ref[i, t].item()) < 1e-4
            assert len(d) == 2 and d[t].decoded_token == codec.decode([t], skip_special_tokens=False)
        assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)))
    assert not llm.engine.requests and llm.engine.kv_usage()[0] == 0


def test_an_llm_seed_makes_unseeded_runs_reproducible(tiny_ckpt):
    """LLM(seed=N), vLLM's: two LLMs of one seed sample the same tokens for unseeded params, another seed not."""
    sp = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)

    def run(seed):
        llm = LLM(str(tiny_ckpt), dtype="float32", kv_cache_dtype="auto", num_blocks=64, threads=1, warmup=False,
                  seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], sp)]

    assert run(11) == run(11) != run(12)


def test_n_sequences_draw_with_seed_plus_j(llm):
    """The j-th of n seeded sequences is the engine's own request with seed + j, as the server's choices."""
    ids = llm.get_tokenizer().encode("hello there")
    (out,) = llm.generate("hello there", SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=6, ignore_eos=True))
    alone = [llm.engine.generate([ids], EngineParams(temperature=1.0, seed=7 + j, max_tokens=6, ignore_eos=True))[0]
             for j in range(3)]
    for r in alone:
        llm.engine.requests.pop(r.request_id)
    assert [c.token_ids for c in out.outputs] == [r.output_ids for r in alone]
    assert [c.index for c in out.outputs] == [0, 1, 2] and len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_strings_cut_the_text_and_the_tokens(llm):
    codec = llm.get_tokenizer()
    (plain,) = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    toks, text = plain.outputs[0].token_ids, plain.outputs[0].text
    # a stop string across the boundary of the 3rd and 4th tokens' text
    cut = len(codec.decode(toks[:3]))
    stop = text[cut - 2:cut + 2]
    at = text.find(stop)
    need = next(k for k in range(1, len(toks) + 1) if stop in codec.decode(toks[:k]))   # tokens that complete it
    for include in (False, True):
        (o,) = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                          stop=["never there", stop], include_stop_str_in_output=include))
        c = o.outputs[0]
        assert c.text == text[:at + len(stop) * include]
        assert c.token_ids == toks[:need] and c.finish_reason == "stop" and c.stop_reason == stop
    # a stop token: the sequence ends at it, and names it
    (o,) = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      stop_token_ids=[toks[4]]))
    assert o.outputs[0].token_ids == toks[:toks.index(toks[4]) + 1] and o.outputs[0].stop_reason == toks[4]
    assert not llm.engine.requests and llm.engine.kv_usage()[0] == 0


def test_stops_end_as_in_vllm(llm):
    """vLLM's text and finish for a stop token and for a stop string completed by the last allowed token: the
    stop token (here an ordinary one, from stop_token_ids) stays in the token ids but not in the text (unless
    include_stop_str_in_output); a stop string ends the sequence "stop" even where max_tokens ends it too."""
    codec = llm.get_tokenizer()
    sp = dict(temperature=0, ignore_eos=True)
    (plain,) = llm.generate("hello there", SamplingParams(max_tokens=8, **sp))
    toks = plain.outputs[0].token_ids
    k = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i] and codec.decode([toks[i]]))
    for include in (False, True):
        (o,) = llm.generate("hello there", SamplingParams(max_tokens=8, stop_token_ids=[toks[k]],
                                                          include_stop_str_in_output=include, **sp))
        c = o.outputs[0]
        assert c.token_ids == toks[:k + 1] and c.finish_reason == "stop" and c.stop_reason == toks[k]
        assert c.text == codec.decode(toks[:k + include])
    text = codec.decode(toks[:k + 1])
    stop = text[-1]                                   # completed by token k, the last max_tokens allows
    assert stop not in codec.decode(toks[:k])
    (o,) = llm.generate("hello there", SamplingParams(max_tokens=k + 1, stop=[stop], **sp))
    c = o.outputs[0]
    assert c.token_ids == toks[:k + 1] and c.text == text[:-1]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert not llm.engine.requests and llm.engine.kv_usage()[0] == 0


def test_max_tokens_past_the_context_end_there(llm):
    """As vLLM's offline engine: a sequence whose max_tokens (and min_tokens) reach past the context ends at the
    context's end with finish_reason "length" (it was a RequestError for the whole call), with the tokens the
    same request asking for just that many gets."""
    room = 3
    ids = [(7 * i) % 1000 + 3 for i in range(llm.engine.max_model_len - room)]
    (capped,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1000, min_tokens=50, ignore_eos=True))
    (exact,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=room, ignore_eos=True))
    c = capped.outputs[0]
    assert c.token_ids == exact.outputs[0].token_ids and len(c.token_ids) == room and c.finish_reason == "length"
    with pytest.raises(RequestError, match="context"):                  # no room at all: refused as before
        llm.generate([ids + [5] * room], SamplingParams(max_tokens=1000))
    assert not llm.engine.requests and llm.engine.kv_usage()[0] == 0


def test_a_refused_prompt_queues_nothing(llm):
    (before,) = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(RequestError):
        llm.generate(["hello there", {"prompt_token_ids": [1] * (llm.engine.max_model_len + 1)}],
                     SamplingParams(temperature=0, max_tokens=4))
    assert not llm.engine.requests and not llm.engine.has_unfinished() and llm.engine.kv_usage()[0] == 0
    (after,) = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=4))
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_last_ones(llm):
    ids = list(range(3, 40))
    sp = dict(temperature=0, max_tokens=5, ignore_eos=True)
    (cut,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=9, **sp))
    (tail,) = llm.generate({"prompt_token_ids": ids[-9:]}, SamplingParams(**sp))
    assert cut.prompt_token_ids == ids[-9:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    (whole,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=-1, **sp))
    assert whole.prompt_token_ids == ids                  # -1: the context length, which holds them all
    with pytest.raises(ValueError, match="greater than the context length"):
        llm.generate("x", SamplingParams(truncate_prompt_tokens=llm.engine.max_model_len + 1))


@pytest.mark.parametrize("kw,field", [({"n": 0}, "n"), ({"stop": [1]}, "stop"), ({"temperature": -1}, "temperature"),
                                      ({"skip_special_tokens": "no"}, "skip_special_tokens"),
                                      ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")])
def test_bad_sampling_params_are_named(kw, field):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**kw)


def test_bad_arguments_are_named(llm, tiny_ckpt):
    with pytest.raises(ValueError, match="a prompt is text"):
        llm.generate([3.5])
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate("x", [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.generate(["x", "y"], priority=[0])
    with pytest.raises(ValueError, match="no messages given"):
        llm.chat([])
    with pytest.raises(ValueError, match="under torchrun"):
        LLM(str(tiny_ckpt), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="fp8_e5m2"):
        LLM(str(tiny_ckpt), kv_cache_dtype="fp8_e5m2")


def test_chat_on_the_demo_model(tmp_path_factory):
    """The trained demo model's known replies (tests/test_demo_model.py): its working and answer as
    reasoning and content, and a tool call when it has the tool."""
    d = make_checkpoint(tmp_path_factory.mktemp("demo") / "demo", "demo")
    llm = LLM(str(d), dtype="float32", kv_cache_dtype="auto", threads=1, warmup=False)
    ask = [{"role": "user", "content": "What is 37 + 45?"}]
    (o,) = llm.chat(ask, SamplingParams(temperature=0, max_tokens=128))
    c = o.outputs[0]
    assert c.reasoning_content == "ones: 7 + 5 = 12, write 2 carry 1. tens: 3 + 4 + 1 = 8. so 37 + 45 = 82."
    assert c.content == "37 + 45 = 82" and c.finish_reason == "stop" and c.tool_calls == []
    assert o.prompt_token_ids == llm.get_tokenizer().apply_chat_template(ask)
    a, b = 12, 30
    (o1, o2) = llm.chat([ask, [{"role": "user", "content": f"What is {a} + {b}?"}]],
                        SamplingParams(temperature=0, max_tokens=128), tools=[ADD])
    for o, (x, y) in ((o1, (37, 45)), (o2, (a, b))):
        assert o.outputs[0].tool_calls == [{"name": "add", "arguments": f'{{"a": {x}, "b": {y}}}'}]


def test_readme_example_runs_as_written(tmp_path_factory):
    """The README's Python API block, executed as it stands on the demo model (its reply to 37 + 45 known)."""
    import contextlib
    import io
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "import LLM" in b]
    d = make_checkpoint(tmp_path_factory.mktemp("demo") / "demo", "demo")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace('LLM("DIR")', f'LLM({str(d)!r}, threads=1)'), "README.md", "exec"), {})
    assert "37 + 45 = 82" in out.getvalue().splitlines()[-1]


def test_no_sampling_params_means_the_checkpoints_generation_config(tiny_ckpt, tmp_path):
    # vLLM's LLM: generate / chat without SamplingParams take generation_config.json's sampling fields (greedy
    # and 5 tokens here), not bare SamplingParams() (temperature 1, 16 tokens)
    import json
    d = tmp_path / "tiny_greedy_5"
    d.mkdir()
    for f in tiny_ckpt.iterdir():
        (d / f.name).symlink_to(f)
    (d / "generation_config.json").unlink()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "temperature": 0.0,
                                                          "max_new_tokens": 5}))
    llm = LLM(str(d), dtype="float32", kv_cache_dtype="auto", num_blocks=32, threads=1, warmup=False)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.max_tokens) == (0.0, 5)
    greedy = llm.generate(["hello there", "the cat"], SamplingParams(temperature=0, max_tokens=5))
    plain = llm.generate(["hello there", "the cat"])
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in greedy]
    assert all(len(o.outputs[0].token_ids) == 5 for o in plain)


def test_the_types_vllm_scripts_import_are_there():
    # `from vllm import LLM, SamplingParams, RequestOutput, CompletionOutput` is how vLLM's scripts annotate
    import gigadecode
    from gigadecode import CompletionOutput, Logprob, RequestOutput
    from gigadecode.llm import CompletionOutput as C, Logprob as L, RequestOutput as R
    assert (RequestOutput, CompletionOutput, Logprob) == (R, C, L)
    assert {"RequestOutput", "CompletionOutput", "Logprob"} <= set(gigadecode.__all__)
