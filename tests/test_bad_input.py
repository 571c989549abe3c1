"""Adversarial input, end to end: checkpoints, engine flags and requests that once broke the engine (a
crash mid-request, garbage tokens, a traceback from deep inside) and now get a clear error or the right
answer. Each case runs on the tiny checkpoint in about a second."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gigadecode.engine import build_engine
from gigadecode.engine_config import EngineConfig
from gigadecode.sampling import SamplingParams


def edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of the checkpoint `src` with config.json keys changed."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def greedy(ckpt: Path, prompt: list[int], decoder: str, n: int = 4) -> list[int]:
    kv = "auto" if decoder == "reference" else "fp8"
    eng = build_engine(str(ckpt), EngineConfig(dtype="float32", kv_dtype=kv, decoder=decoder,
                                               gk_decode=decoder != "reference", num_blocks=64, threads=1))
    (req,) = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert req.finish_reason == "length", req.error
    return list(req.output_ids)


@pytest.mark.parametrize("decoder", ["gk-native", "reference"])
def test_a_sliding_window_past_32_bits_never_binds(tiny_ckpt, tmp_path, decoder):
    """transformers loads a sliding_window of 2**33 or 2**63 (a window past the context, which never binds). The
    kernels took it as a 32-bit int: 2**33 gave other tokens than a window of the whole context, 2**63 failed the
    request ("Unable to cast Python instance of type int"), 2**31 - 1 sized the decode's window tables by it
    (0.6 tok/s on tiny)."""
    prompt = list(range(3, 40))                           # longer than tiny's window of 16: it binds there
    whole = greedy(edited(tiny_ckpt, tmp_path / "whole", sliding_window=4096), prompt, decoder)
    assert whole != greedy(tiny_ckpt, prompt, decoder)   # (the window is not moot for this prompt)
    for w in (2**31 - 1, 2**33, 2**63):
        assert greedy(edited(tiny_ckpt, tmp_path / f"w{w}", sliding_window=w), prompt, decoder) == whole, w


def test_threads_past_what_openmp_can_start_are_refused():
    """`--threads 100000` passed the check (>= 1) and OpenMP then killed the process at the first parallel region
    (a segfault; 30,000: "libgomp: Thread creation failed" and exit 1)."""
    import os

    from gigadecode.config import ConfigError
    most = 8 * (os.cpu_count() or 1)
    EngineConfig(threads=most)
    with pytest.raises(ConfigError, match=f"--threads 100000 is more than 8 per CPU of this machine \\({most}\\)"):
        EngineConfig(threads=100_000)


def test_a_row_of_nan_logits_fails_that_row_alone():
    """A NaN or +inf logit raised SamplingError for the whole batch; an all -inf row too. Now each such row is
    reported in `failed` and every other row is drawn as it would be alone."""
    import math

    import torch

    from gigadecode.sampling import NO_TOKEN_LEFT, NON_FINITE, Sampler
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    logits[1, 7], logits[2, 3], logits[3] = math.nan, math.inf, -math.inf
    params = [SamplingParams(temperature=t, logprobs=2) for t in (0.0, 1.0, 0.0, 1.0, 1.0)]
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    res = Sampler().sample(logits, params, gens)
    assert res.failed == {1: NON_FINITE, 2: NON_FINITE, 3: NO_TOKEN_LEFT}
    assert res.logprobs[1] is None and res.logprobs[4] is not None
    alone = Sampler().sample(logits[[0, 4]], [params[0], params[4]], [None, torch.Generator().manual_seed(4)])
    assert res.token_ids[[0, 4]].tolist() == alone.token_ids.tolist() and not alone.failed


def test_a_failed_row_that_min_tokens_leaves_to_its_masks_fails_alone():
    """A +inf row whose hard masks (here allowed_token_ids) allow only stop tokens while min_tokens masks them:
    the masks fell back to the raw row, +inf and all, and torch.multinomial raised for the whole batch."""
    import math

    import torch

    from gigadecode.sampling import NON_FINITE, Sampler
    logits = torch.zeros(2, 8)
    logits[0, 0] = math.inf
    params = [SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[1], allowed_token_ids=[0, 1]),
              SamplingParams(temperature=1.0)]
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    res = Sampler(eos_token_ids=[0]).sample(logits, params, gens, [[3], [3]], [[], []])
    assert res.failed == {0: NON_FINITE}
    alone = Sampler(eos_token_ids=[0]).sample(logits[[1]], params[1:], [torch.Generator().manual_seed(1)])
    assert res.token_ids[1] == alone.token_ids[0]


@pytest.mark.parametrize("decoder,dtype", [("reference", "float32"), ("gk", "bfloat16"), ("gk-native", "float32")])
def test_nan_activations_fail_their_request_and_leave_no_trace(tiny_ckpt, decoder, dtype):
    """A request whose activations turn NaN (its prompt meets a NaN weight) failed every request of its batch
    ("engine step failed: SamplingError: ... rows [1] contain NaN or +inf"), and the NaN it left in its KV blocks
    failed the next requests that reused them: the torch attention paths (fp32 prefill, the eager GK decode)
    multiplied the stale values past a sequence's end by a probability of 0. Now it fails alone, and the
    requests after it get their own tokens. Token 100's embedding row is made NaN in the loaded weights (a
    checkpoint holding a NaN is refused at load), so a prompt holding it gives NaN activations, KV and logits."""
    kv = "auto" if decoder == "reference" else "fp8"

    def engine():
        eng = build_engine(str(tiny_ckpt), EngineConfig(dtype=dtype, kv_dtype=kv, decoder=decoder, num_blocks=12,
                                                         gk_decode=decoder != "reference", threads=1))
        eng.runner.weights.embed[100] = float("nan")    # the stacks every decoder reads (one copy)
        return eng

    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    good, other = [5, 6, 7], [8, 9] * 8
    alone = [list(engine().generate([q], p)[0].output_ids) for q in (good, other)]
    eng = engine()
    a, bad, b = eng.generate([good, [5, 100, 7], good], p)
    assert [list(a.output_ids), list(b.output_ids)] == [alone[0], alone[0]]
    assert bad.finish_reason == "error" and "logits for this request hold NaN" in bad.error
    eng.generate([[100] * 60], p)                       # NaN K/V in most of the pool's blocks, then freed
    assert [list(r.output_ids) for r in eng.generate([good, other], p)] == alone
    assert eng.kv_usage()[0] == 0


@pytest.mark.parametrize("decoder", ["reference", "gk-native"])
def test_a_nan_confined_to_one_head_fails_the_request_in_bf16(tiny_ckpt, decoder):
    """A NaN in one q weight makes one head's scores NaN: in bf16 the native prefill attention's row maximum
    dropped it and the row came out 0, so the request returned tokens (the reference decoder all of them).
    Now it fails at its first token, as in fp32."""
    eng = build_engine(str(tiny_ckpt), EngineConfig(dtype="bfloat16", kv_dtype="auto" if decoder == "reference"
                                                    else "fp8", decoder=decoder, num_blocks=12,
                                                    gk_decode=decoder != "reference", threads=1))
    eng.runner.weights.tensors["qkv_w"][0][0, 0] = float("nan")
    r = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert r.finish_reason == "error" and "logits for this request hold NaN" in r.error and not r.output_ids


@pytest.mark.parametrize("form", ["list", "dict"])
def test_named_chat_templates_render_as_transformers_renders_them(tiny_ckpt, tmp_path, form):
    """tokenizer_config.json may hold several named templates (a list of {"name", "template"}, as transformers
    saves them; a dict after it loads them): transformers renders "tool_use" for a request with tools, else
    "default". Every chat here failed ("TypeError: Can't compile non template nodes", a traceback from
    `generate --chat`)."""
    from transformers import AutoTokenizer

    from gigadecode.tokenizer import TextCodec
    d = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    default = tc["chat_template"]
    tool_use = "{% for t in tools %}TOOL {{ t['function']['name'] }};{% endfor %}" + default
    named = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    tc["chat_template"] = named if form == "list" else {x["name"]: x["template"] for x in named}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    codec, hf = TextCodec.from_dir(d), AutoTokenizer.from_pretrained(str(d))
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kw in ({}, {"tools": tools}):
        assert codec.render_chat(msgs, **kw) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                                       **kw)
    assert codec.render_chat(msgs, tools=tools).startswith("TOOL f;")


@pytest.mark.parametrize("template,message", [
    ("{% for %}", "the checkpoint's chat template does not compile: TemplateSyntaxError"),
    (5, "chat_template must be a string or a list of named templates \\(got int\\)"),
    ([{"name": "tool_use", "template": "x"}], "chat templates are named \\['tool_use'\\], but none 'default'"),
])
def test_a_broken_chat_template_is_named_not_a_traceback(tiny_ckpt, tmp_path, capsys, template, message):
    """`generate --chat` over a template that does not compile printed a jinja2 traceback."""
    from gigadecode.cli import main
    from gigadecode.tokenizer import ChatTemplateError, TextCodec
    d = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    assert main(["generate", "--model", str(d), "--chat", "hi", "--max-tokens", "2", "--no-warmup", "--threads", "1",
                 "--num-blocks", "16"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("gigadecode generate: error: ")
    with pytest.raises(ChatTemplateError, match=message):
        TextCodec.from_dir(d).render_chat([{"role": "user", "content": "hi"}])
    # a server's chat routes: the server's fault (500, the template named), not a 400 blaming the messages
    from gigadecode.server.chat import chat_prompt
    from gigadecode.server.protocol import APIError, ChatBody
    with pytest.raises(APIError, match=message) as e:
        chat_prompt(TextCodec.from_dir(d), ChatBody(model="m", messages=[{"role": "user", "content": "hi"}]))
    assert e.value.status == 500


def test_a_sharded_checkpoint_reads_the_files_transformers_reads(tiny_ckpt, tmp_path, caplog):
    """With a model.safetensors.index.json, transformers reads the shards it names (or model.safetensors when
    that is there too) and nothing else. A stray shard beside them (an earlier download with another shard
    count) failed the load here: "tensor ... appears in both model-00001-of-00009.safetensors and ..."."""
    import torch

    from gigadecode.checkpoint import make_checkpoint
    from gigadecode.weights import load_weights
    from helpers import load_hf
    d = make_checkpoint(tmp_path / "sharded", "tiny", seed=0, experts="mxfp4", shard_bytes=100_000)
    first = sorted(d.glob("model-*.safetensors"))[0]
    shutil.copy(first, d / "model-00001-of-00009.safetensors")          # the stray
    want = load_weights(tiny_ckpt)
    with caplog.at_level("WARNING", logger="gigadecode.safetensors_files"):
        got = load_weights(d)
    assert "not model-00001-of-00009.safetensors" in caplog.text
    assert all(torch.equal(got.tensors[k], v) for k, v in want.tensors.items())
    load_hf(str(d))                                                     # (transformers loads it)
    shutil.copy(tiny_ckpt / "model.safetensors", d / "model.safetensors")
    for f in d.glob("model-*.safetensors"):                            # model.safetensors wins over the index
        f.write_bytes(b"\0" * 8)
    got = load_weights(d)
    assert all(torch.equal(got.tensors[k], v) for k, v in want.tensors.items())


def test_min_tokens_with_every_token_a_stop_token_is_refused(tiny_ckpt):
    """min_tokens masks the stop ids until it is met: with all of them stop ids nothing is left to draw. A sampled
    request failed every request of its step (SamplingError "no token left"), a greedy one drew the masked token
    0 and finished "stop" before its min_tokens. Now it is refused up front, naming min_tokens."""
    from gigadecode.request import RequestError
    eng = build_engine(str(tiny_ckpt), EngineConfig(dtype="float32", num_blocks=64, threads=1))
    every = list(range(eng.cfg.vocab_size))
    for t in (0.0, 1.0):
        with pytest.raises(RequestError, match="min_tokens > 0 with every token id a stop token") as e:
            eng.add_request([5, 6], SamplingParams(temperature=t, max_tokens=3, min_tokens=2, stop_token_ids=every))
        assert e.value.param == "min_tokens"
    eng.add_request([5, 6], SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=every[1:]))   # one left


def test_a_kv_pool_larger_than_the_memory_left_is_refused(tiny_ckpt, monkeypatch):
    """`--num-blocks 8000000 --kv-dtype bf16` on tiny (30.5 GiB) on a machine with 22 GiB free: zeroing the pool
    got the process killed by the OOM killer (exit 137, nothing said). Now the start is refused with the sizes."""
    from gigadecode.config import ConfigError, GptOssConfig
    from gigadecode.kv import cache
    assert cache.available_memory() > 0                        # (read on this machine)
    monkeypatch.setattr(cache, "available_memory", lambda: 2**20)
    cfg, ecfg = GptOssConfig.from_hf(tiny_ckpt), EngineConfig(dtype="float32", kv_dtype="bf16")
    cache.KVCache(cfg, ecfg, num_blocks=8)                     # 8 blocks: 64 KiB
    with pytest.raises(ConfigError, match=r"the KV pool \(1000 blocks of 16 tokens\) needs 3.9 MiB, and this machine "
                                          r"has 1.0 MiB available: lower --num-blocks or --kv-budget-gib"):
        cache.KVCache(cfg, ecfg, num_blocks=1000)


def test_available_memory_counts_a_cgroups_page_cache_free(tmp_path, monkeypatch):
    """Under a cgroup limit the memory left was memory.max - memory.current, and memory.current counts the page
    cache (a checkpoint's file pages, just read), which the kernel drops before it fails an allocation: a pool
    that fits was refused in a container after the load. Its active_file + inactive_file count as free."""
    from gigadecode.kv import cache
    (tmp_path / "meminfo").write_text("MemTotal: 67108864 kB\nMemAvailable: 33554432 kB\n")   # 32 GiB
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text(f"{16 << 30}\n")
    (cg / "memory.current").write_text(f"{14 << 30}\n")
    (cg / "memory.stat").write_text(f"anon {6 << 30}\nfile {8 << 30}\nactive_file {3 << 30}\n"
                                    f"inactive_file {5 << 30}\nshmem 0\n")
    monkeypatch.setattr(cache, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(cache, "CGROUP_DIR", str(cg))
    assert cache.available_memory() == (16 - 14 + 8) << 30
    (cg / "memory.max").write_text("max\n")
    assert cache.available_memory() == 32 << 30


@pytest.mark.parametrize("kw,flag", [
    (dict(kv_budget_gib=float("nan")), "--kv-budget-gib must be > 0 and finite \\(got nan\\)"),
    (dict(kv_budget_gib=float("inf")), "--kv-budget-gib must be > 0 and finite \\(got inf\\)"),
    (dict(device_memory_gib=float("inf")), "--device-memory-gib must be > 0 and finite"),
    (dict(device_memory_gib=80.0, activation_gib=float("nan")), "--activation-gib must be >= 0 and finite"),
    (dict(device_memory_gib=80.0, activation_gib=float("inf")), "--activation-gib must be >= 0 and finite"),
])
def test_plan_names_non_finite_sizes(kw, flag):
    """`gigadecode plan --kv-budget-gib nan` said "cannot convert float NaN to integer"; `--activation-gib inf`
    printed an OverflowError traceback."""
    from gigadecode.checkpoint import preset_config
    from gigadecode.plan import plan_memory
    with pytest.raises(ValueError, match=flag):
        plan_memory(preset_config("tiny"), **kw)


@pytest.mark.parametrize("argv", [["serve", "--model", "M", "--port", "99999"], ["serve", "--model", "M", "--port", "-1"],
                                  ["serve", "--model", "M", "--role", "prefill", "--kv-port", "70000"],
                                  ["proxy", "--prefill", "http://p", "--decode", "http://d", "--port", "65536"]])
def test_ports_out_of_range_are_refused_by_the_parser(argv, capsys):
    """`serve --port 99999` loaded the model, then died in the bind with an OverflowError traceback."""
    from gigadecode.cli import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and "is outside 0-65535" in capsys.readouterr().err


@pytest.mark.parametrize("content", [True, 5, [{"type": "reasoning_text", "text": 5}], "think"])
def test_a_malformed_reasoning_input_item_is_a_400(content):
    """/v1/responses with a reasoning item whose content is not a list of text parts: "TypeError: 'bool' object
    is not iterable", a 500 and a connection reset by the server."""
    from gigadecode.server.protocol import APIError
    from gigadecode.server.responses import ResponsesBody, chat_messages
    req = ResponsesBody.model_validate({"model": "m", "input": [{"role": "user", "content": "hi"},
                                                                {"type": "reasoning", "content": content}]})
    with pytest.raises(APIError, match="a reasoning item's content") as e:
        chat_messages(req)
    assert (e.value.status, e.value.param) == (400, "input.1.content")


def test_template_files_win_over_the_config_entry_as_in_transformers(tiny_ckpt, tmp_path):
    """transformers renders chat_template.jinja when tokenizer_config.json has a chat_template too (the files
    take priority), and reads additional_chat_templates/NAME.jinja as named templates; here the config's entry
    won and the extra files were never read."""
    from transformers import AutoTokenizer

    from gigadecode.tokenizer import TextCodec
    d = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    (d / "chat_template.jinja").write_text("FILE " + tc["chat_template"])
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS " + tc["chat_template"])
    codec, hf = TextCodec.from_dir(d), AutoTokenizer.from_pretrained(str(d))
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kw, head in (({}, "FILE"), ({"tools": tools}, "TOOLS")):
        text = codec.render_chat(msgs, **kw)
        assert text.startswith(head) and text == hf.apply_chat_template(msgs, tokenize=False,
                                                                         add_generation_prompt=True, **kw)
