"""The built-in demo model answers: through gigadecode's own engine (fp32, greedy) it adds held-out pairs,
calls the `add` tool in the exact harmony format when a request offers it, and answers after the tool's
result. The checkpoint is the committed one (gigadecode/assets/demo, tools/train_demo_model.py)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from gigadecode.checkpoint import DEMO_FILES, make_checkpoint, preset_config
from gigadecode.config import FULL, SLIDING, GptOssConfig
from gigadecode.engine_config import EngineConfig
from gigadecode.engine import LLMEngine
from gigadecode.runner import ModelRunner
from gigadecode.sampling import SamplingParams
from gigadecode.tokenizer import HARMONY_CHAT_TEMPLATE, TextCodec

from .helpers import load_script

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
N_HELDOUT = 40


def _script():
    return load_script("tools/train_demo_model.py", "train_demo_model")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp("demo") / "demo", "demo")
    codec = TextCodec.from_dir(d)
    engine = LLMEngine(ModelRunner(d, EngineConfig(dtype="float32", kv_dtype="auto", decoder="gk-native")))
    report = json.loads((d / "training_report.json").read_text())
    return d, codec, engine, [tuple(p) for p in report["heldout_pairs"]]


def complete(engine: LLMEngine, codec: TextCodec, prompts: list[list[int]]) -> list[str]:
    """Greedy completions, decoded with their special tokens (the harmony structure)."""
    reqs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=128))
    return [codec.decode(r.output_ids, skip_special_tokens=False) for r in reqs]


def ask(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} + {b}?"}]


def test_files_and_format(demo):
    d, codec, _, held = demo
    assert {p.name for p in d.iterdir()} == set(DEMO_FILES)
    cfg = GptOssConfig.from_hf(d)
    assert cfg == preset_config("demo")
    assert cfg.experts_mxfp4 and set(cfg.layer_types) == {SLIDING, FULL}
    assert cfg.layer_types[0] == SLIDING and cfg.layer_types[1] == FULL
    assert [codec.token_id(n) for n in ("<|return|>", "<|call|>")] == list(cfg.eos_token_ids)
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == list(cfg.eos_token_ids)
    assert codec.chat_template == HARMONY_CHAT_TEMPLATE == (d / "chat_template.jinja").read_text()
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        x = "model.layers.0.mlp.experts."
        assert f.get_slice(x + "gate_up_proj_blocks").get_dtype() == "U8"
        assert f.get_slice(x + "gate_up_proj_blocks").get_shape() == [
            cfg.num_local_experts, 2 * cfg.intermediate_size, cfg.hidden_size // 32, 16]
        assert f.get_slice(x + "down_proj_scales").get_shape() == [
            cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size // 32]
    assert "model.layers.0.self_attn.sinks" in names and x + "gate_up_proj" not in names
    assert (d / "model.safetensors").stat().st_size < 8 * 2**20
    # digits are single tokens; the prompt is the harmony system + user messages + `<|start|>assistant`
    assert len(codec.encode("1234567890")) == 10
    text = codec.render_chat(ask(3, 4), reasoning_effort="low")
    assert text.startswith("<|start|>system<|message|>") and "\nReasoning: low\n" in text
    assert text.endswith("<|start|>user<|message|>What is 3 + 4?<|end|><|start|>assistant")
    tools = codec.render_chat(ask(3, 4), tools=[ADD])
    assert "namespace functions {\n\n// Add two integers.\ntype add = (_: {\na: number,\nb: number,\n}) => any;" in tools
    # the held-out pairs recorded with the model are the script's seeded split (never trained on)
    script = _script()
    train, heldout = script.split_pairs(json.loads((d / "training_report.json").read_text())["seed"])
    assert [tuple(p) for p in heldout] == held and not set(held) & set(train) and len(held) == 1000


def test_heldout_sums(demo):
    _, codec, engine, held = demo
    pairs = held[:N_HELDOUT]
    texts = complete(engine, codec, [codec.apply_chat_template(ask(a, b)) for a, b in pairs])
    right = 0
    for (a, b), t in zip(pairs, texts):
        analysis, sep, final = t.partition("<|end|><|start|>assistant<|channel|>final<|message|>")
        assert analysis.startswith("<|channel|>analysis<|message|>ones: ") and sep, t
        right += final == f"{a} + {b} = {a + b}<|return|>"
    assert right / len(pairs) >= 0.95, list(zip(pairs, texts))
    a, b = 37, 45   # a training pair: the whole completion, working included
    (text,) = complete(engine, codec, [codec.apply_chat_template(ask(a, b))])
    assert text == ("<|channel|>analysis<|message|>ones: 7 + 5 = 12, write 2 carry 1. tens: 3 + 4 + 1 = 8. so 37 + 45 = 82.<|end|>"
                    "<|start|>assistant<|channel|>final<|message|>37 + 45 = 82<|return|>")


def test_tool_call(demo):
    _, codec, engine, held = demo
    pairs = held[N_HELDOUT:N_HELDOUT + 4]
    texts = complete(engine, codec, [codec.apply_chat_template(ask(a, b), tools=[ADD]) for a, b in pairs])
    for (a, b), t in zip(pairs, texts):
        assert t == f'<|channel|>commentary to=functions.add <|constrain|>json<|message|>{{"a": {a}, "b": {b}}}<|call|>'


def test_tool_result(demo):
    _, codec, engine, held = demo
    pairs = held[N_HELDOUT + 4:N_HELDOUT + 8]
    prompts = []
    for i, (a, b) in enumerate(pairs):
        call = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "add", "arguments": json.dumps({"a": a, "b": b})}}]}
        result = json.dumps({"result": a + b}) if i % 2 else str(a + b)
        prompts.append(codec.apply_chat_template(ask(a, b) + [call, {"role": "tool", "tool_call_id": "call_1",
                                                                    "content": result}], tools=[ADD]))
    texts = complete(engine, codec, prompts)
    for (a, b), t in zip(pairs, texts):
        assert t == f"<|channel|>final<|message|>{a} + {b} = {a + b}<|return|>"


def test_transformers_renders_the_same(demo):
    """transformers' tokenizer over the same files: the same prompt text and ids (tools, reasoning effort,
    an earlier call and its result), so a client that renders with transformers gets the same answers."""
    import transformers
    d, codec, _, _ = demo
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add",
                                                                                   "arguments": {"a": 3, "b": 4}}}]}
    chats = [(ask(3, 4), None, {}), (ask(3, 4), [ADD], {"reasoning_effort": "high"}),
             ([{"role": "system", "content": "Be brief."}, *ask(3, 4), call, {"role": "tool", "content": "7"}], [ADD], {})]
    for messages, tools, kw in chats:
        ours = codec.render_chat(messages, tools=tools, **kw)
        assert hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kw) == ours
        assert hf.encode(ours) == codec.encode(ours)
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<|startoftext|>", "<|return|>", "<|endoftext|>")
