"""`gigadecode generate` as a user runs it: the fast defaults (GK program on the native kernels, packed-FP8
KV, all cores), the per-request timing fields of `--json`, a chat message (`--chat`), and refused bad flags."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

from gigadecode import plan
from gigadecode.cli import build_parser, engine_config, main
from gigadecode.engine_config import EngineConfig
from gigadecode.llm import LLM
from gigadecode.generate import _codec_and_requests, _read_requests, _run_generate
from gigadecode.config import ConfigError
from gigadecode.engine import LLMEngine
from gigadecode.runner import ModelRunner
from gigadecode.sampling import SamplingParams


def _generate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gigadecode", "generate", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_defaults_are_the_fast_decoder_fp8_kv_and_all_cores(tiny_ckpt, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ecfg = engine_config(build_parser().parse_args(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1"]))
    assert ecfg.decoder == "gk-native" and ecfg.kv_dtype == "fp8"
    # one prefill budget everywhere: the command line's, EngineConfig's, `LLM`'s and the memory plan's
    assert ecfg.max_prefill_tokens == EngineConfig().max_prefill_tokens == plan.DEFAULT_PREFILL_CHUNK == 1024
    assert inspect.signature(LLM).parameters["max_num_batched_tokens"].default == 1024
    assert ecfg.threads == len(os.sched_getaffinity(0))
    ref = engine_config(build_parser().parse_args(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1",
                                                   "--decoder", "reference"]))
    assert ref.kv_dtype == "auto"                  # the per-layer model keeps the model dtype
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert engine_config(build_parser().parse_args(["generate", "--model", str(tiny_ckpt), "--prompt-ids",
                                                    "1"])).threads == 1


def test_default_threads_under_torchrun(monkeypatch):
    # torchrun sets OMP_NUM_THREADS=1 for each of several ranks when it is unset: the default stays the cores
    # shared among the local ranks; another value, or one rank per node, is the user's
    from gigadecode.engine_config import default_threads
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads() == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_threads() == 1                      # not torchrun: OMP_NUM_THREADS is a choice


def test_json_reports_ttft_and_prompt_throughput(tiny_ckpt):
    r = _generate("--model", str(tiny_ckpt), "--prompt-ids", "1,2,3,4,5", "--max-tokens", "4", "--json",
                  "--threads", "1")
    assert r.returncode == 0, r.stderr
    (d,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(d["token_ids"]) == 4
    assert 0 < d["ttft_s"] < 60 and d["prompt_tok_s"] > 0 and d["decode_tok_s"] > 0


@pytest.mark.parametrize("flag", [[], ["--no-warmup"]])
def test_generate_warms_up_unless_told_not_to(tiny_ckpt, monkeypatch, capsys, caplog, flag):
    """generate runs a warm-up prefill chunk before its requests (`LLMEngine.warm_up`), unless --no-warmup; a
    warm-up that fails (here its prefill) is logged and the request still runs."""
    chunks, real_prefill = [], ModelRunner.prefill

    def prefill(self, c):
        chunks.append(len(c[0].token_ids))
        if len(chunks) == 1 and not flag:
            raise RuntimeError("injected warm-up failure")
        return real_prefill(self, c)

    monkeypatch.setattr(ModelRunner, "prefill", prefill)
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--json",
                 "--threads", "1", *flag]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2
    if flag:
        assert chunks == [3]
    else:
        assert len(chunks) == 2 and chunks[0] > 3 and chunks[1] == 3      # the warm-up's chunk, then the prompt
        assert "warm-up failed" in caplog.text and "injected warm-up failure" in caplog.text


def test_fast_defaults_give_the_reference_tokens_in_fp32(tiny_ckpt):
    """gk-native + FP8 KV (the default decoder and KV) against the per-layer model on the same FP8 KV, in fp32
    (the tiny checkpoint says bfloat16, which `--dtype auto` would pick: bf16 paths agree only within the
    bound test_gk checks, not token for token)."""
    ids = "5,6,7,8,9,10,11,12,13"
    fast = _generate("--model", str(tiny_ckpt), "--prompt-ids", ids, "--max-tokens", "12", "--json",
                     "--ignore-eos", "--dtype", "float32")
    ref = _generate("--model", str(tiny_ckpt), "--prompt-ids", ids, "--max-tokens", "12", "--json",
                    "--ignore-eos", "--dtype", "float32", "--decoder", "reference", "--kv-dtype", "fp8")
    assert fast.returncode == 0 and ref.returncode == 0, fast.stderr + ref.stderr
    assert json.loads(fast.stdout)["token_ids"] == json.loads(ref.stdout)["token_ids"]


@pytest.mark.parametrize("flag", [["--threads", "0"], ["--threads", "-2"]])
def test_bad_threads_are_refused(tiny_ckpt, flag):
    with pytest.raises(ConfigError, match="--threads"):
        engine_config(build_parser().parse_args(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1",
                                                 *flag]))


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_distributed_timeout_flag(tiny_ckpt, cmd):
    """--distributed-timeout-s (serve and generate) reaches the engine config (default 300 s); a wait under a
    second, or one that is not a finite number, is refused."""
    args = ["--prompt-ids", "1"] if cmd == "generate" else []
    parse = build_parser().parse_args
    assert engine_config(parse([cmd, "--model", str(tiny_ckpt), *args])).distributed_timeout_s == 300.0
    assert engine_config(parse([cmd, "--model", str(tiny_ckpt), *args, "--distributed-timeout-s", "2.5"])
                         ).distributed_timeout_s == 2.5
    for bad in ("0", "0.5", "-3", "nan", "inf"):
        with pytest.raises(ConfigError, match="--distributed-timeout-s"):
            engine_config(parse([cmd, "--model", str(tiny_ckpt), *args, "--distributed-timeout-s", bad]))


def test_without_native_kernels_the_twins_give_the_same_tokens(tiny_ckpt):
    """No kernels (no compiler, or GIGADECODE_NATIVE=0): one warning line, then the torch twins, same tokens."""
    ids = "3,1,4,1,5,9,2,6"
    fast = _generate("--model", str(tiny_ckpt), "--prompt-ids", ids, "--max-tokens", "10", "--json", "--ignore-eos")
    twins = _generate("--model", str(tiny_ckpt), "--prompt-ids", ids, "--max-tokens", "10", "--json",
                      "--ignore-eos", env={"GIGADECODE_NATIVE": "0"})
    assert fast.returncode == 0 and twins.returncode == 0, fast.stderr + twins.stderr
    assert json.loads(fast.stdout)["token_ids"] == json.loads(twins.stdout)["token_ids"]
    warnings = [line for line in twins.stderr.splitlines() if "native kernels unavailable" in line]
    assert len(warnings) == 1 and "GIGADECODE_NATIVE=0" in warnings[0]


def test_serve_prefill_or_decode_needs_a_kv_secret(tiny_ckpt):
    env = {k: v for k, v in os.environ.items() if k != "GIGADECODE_KV_SECRET"}
    for role in ("prefill", "decode"):
        r = subprocess.run([sys.executable, "-m", "gigadecode", "serve", "--model", str(tiny_ckpt), "--role", role,
                            "--port", "0"], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2 and "GIGADECODE_KV_SECRET" in r.stderr and "--kv-secret" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "gigadecode", "serve", "--model", str(tiny_ckpt), "--role", "decode",
                        "--kv-secret", "short"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "at least 16" in r.stderr


@pytest.mark.parametrize("content, message", [
    (None, "cannot read --requests"),
    ("\n\n", "has no requests"),
    ('[1, 2]\n', ":1: a request must be a JSON object"),
    ('{"prompt_ids": [1, 2]}\n{"prompt_ids": [3], "max_token": 4}\n', ":2: unknown key(s) max_token"),
    ('{"prompt_ids": [1, 2]}\n{"prompt_ids": [3], "temperature": -1}\n', ":2: invalid sampling parameter temperature"),
    ('{"prompt_ids": [1, 2], "priority": 1}\n', ":1: priority must be an integer, and 0 unless --scheduling-policy"),
    ('{"prompt_ids": [1, 2], "priority": 0.0}\n', ":1: priority must be an integer"),
])
def test_bad_requests_files_are_refused_before_the_model_loads(tmp_path, content, message):
    """A --requests file that cannot be read, holds no request, a line that is not an object, a key that is
    no request field (a typo would otherwise be ignored) or an invalid sampling value: one line naming the
    file, the line and the problem.
    The model directory does not exist: the file is read first."""
    path = tmp_path / "requests.jsonl"
    if content is not None:
        path.write_text(content)
    args = build_parser().parse_args(["generate", "--model", str(tmp_path / "no-model"), "--requests", str(path)])
    with pytest.raises(SystemExit) as e:
        _read_requests(args, None)
    assert str(e.value).startswith("gigadecode generate: ") and message in str(e.value)
    assert str(path) in str(e.value)


def test_a_prompt_id_that_is_not_an_integer_is_named_so(tiny_ckpt, tmp_path, capsys):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt_ids": [5, 6.5], "max_tokens": 2}\n')
    assert main(["generate", "--model", str(tiny_ckpt), "--requests", str(path), "--threads", "1"]) == 2
    assert "prompt token id 6.5 is not an integer" in capsys.readouterr().err


def test_requests_the_engine_refuses_are_named_by_line_and_the_others_run(tiny_ckpt, tmp_path, capsys):
    """A prompt id outside the vocabulary or a request past the context fails that line only: named on stderr
    with its line, a JSON line with its error in its place, the other requests answered; exit status 2."""
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt_ids": [5, 6, 7], "max_tokens": 3}\n{"prompt_ids": [5, 99999], "max_tokens": 3}\n'
                    '{"prompt_ids": [8, 9], "max_tokens": 1000000}\n{"prompt_ids": [8, 9], "max_tokens": 2}\n')
    assert main(["generate", "--model", str(tiny_ckpt), "--requests", str(path), "--json", "--threads", "1",
                 "--ignore-eos"]) == 2
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [len(d["token_ids"]) for d in lines] == [3, 0, 0, 2]
    assert "outside the vocabulary" in lines[1]["error"] and "maximum context length" in lines[2]["error"]
    assert f"{path}:2: " in err and f"{path}:3: " in err and f"{path}:1: " not in err


def test_generate_requests_take_a_priority(tiny_ckpt, tmp_path, capsys):
    """`"priority"` in a request line under --scheduling-policy priority: one sequence at a time, the first
    tokens come in (priority, line) order; every output is fcfs's; under fcfs a non-zero priority is refused
    with its line, before the model loads."""
    def run(prios: list[int], *flags: str) -> list[dict]:
        path = tmp_path / "requests.jsonl"
        path.write_text("".join(f'{{"prompt_ids": [{5 + i}, 6, 7], "max_tokens": 4, "priority": {p}}}\n'
                                for i, p in enumerate(prios)))
        assert main(["generate", "--model", str(tiny_ckpt), "--requests", str(path), "--json", "--threads", "1",
                     "--ignore-eos", "--max-num-seqs", "1", *flags]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    got = run([3, 1, 2, 1], "--scheduling-policy", "priority")
    assert sorted(range(4), key=lambda i: got[i]["ttft_s"]) == [1, 3, 2, 0]
    assert [d["token_ids"] for d in got] == [d["token_ids"] for d in run([0, 0, 0, 0])]
    with pytest.raises(SystemExit, match=":1: priority must be an integer, and 0 unless"):
        run([1, 0, 0, 0])


def test_generate_json_has_logprobs_and_a_null_field_leaves_the_flag(tiny_ckpt, tmp_path, capsys):
    """`"logprobs": N` in a request gives each token's raw logprob and the top N (equal to the engine's own);
    `"temperature": null` means not given, so --temperature 0 still holds (it sampled at 1.0)."""
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt_ids": [5, 6, 7], "max_tokens": 4, "logprobs": 2, "temperature": null}\n'
                    '{"prompt_ids": [5, 6, 7], "max_tokens": 4, "seed": null}\n')
    assert main(["generate", "--model", str(tiny_ckpt), "--requests", str(path), "--json", "--threads", "1",
                 "--ignore-eos", "--temperature", "0"]) == 0
    a, b = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert a["token_ids"] == b["token_ids"] and "logprobs" not in b
    engine = LLMEngine(ModelRunner(tiny_ckpt, engine_config(build_parser().parse_args(
        ["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1", "--threads", "1"])), progress=False))
    want = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True))[0]
    assert a["token_ids"] == want.output_ids
    for got, lp in zip(a["logprobs"], want.output_logprobs, strict=True):
        assert (got["token_id"], got["rank"], len(got["top_logprobs"])) == (lp.token_id, lp.rank, 2)
        assert abs(got["logprob"] - lp.logprob) < 1e-6
        assert [t["token_id"] for t in got["top_logprobs"]] == [t for t, _ in lp.top]


def test_a_failed_request_makes_generate_exit_1_and_says_why(tiny_ckpt, tmp_path, capsys):
    """The engine fails only the request whose step raised (an injected decode failure here); generate prints
    every request, adds `error` to the failed one's JSON, names it on stderr and exits 1, not 0."""
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt_ids": [5, 6, 7], "max_tokens": 3}\n{"prompt_ids": [8, 9], "max_tokens": 3}\n')
    args = build_parser().parse_args(["generate", "--model", str(tiny_ckpt), "--requests", str(path), "--json",
                                      "--threads", "1", "--ignore-eos"])
    ecfg = engine_config(args)
    engine = LLMEngine(ModelRunner(args.model, ecfg, progress=False))
    assert _run_generate(args, ecfg, engine, *_codec_and_requests(args)) == 0
    capsys.readouterr()
    real_decode, calls = engine.runner.decode, {"n": 0}

    def fails_once(seqs, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected decode failure")
        return real_decode(seqs, *a, **kw)

    engine.runner.decode = fails_once
    assert _run_generate(args, ecfg, engine, *_codec_and_requests(args)) == 1
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 2 and all(d["finish_reason"] == "error" for d in lines)   # one decode batch held both
    assert all("injected decode failure" in d["error"] for d in lines)
    assert "request 1 failed: " in err and "request 2 failed: " in err and "injected decode failure" in err


def test_di_servers_get_a_short_openmp_spin(monkeypatch, tmp_path):
    # set before torch loads libgomp (which reads GOMP_SPINCOUNT once): importing the CLI must not load torch,
    # and the role is read from the raw arguments
    from gigadecode.cli import DI_SPIN_COUNT, set_openmp_env
    code = "import sys, gigadecode.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"
    for argv, want in ((["serve", "--model", "m", "--role", "decode"], str(DI_SPIN_COUNT)),
                       (["serve", "--role=prefill", "--model", "m"], str(DI_SPIN_COUNT)),
                       (["serve", "--model", "m", "--role", "both"], None), (["serve", "--model", "m"], None),
                       (["generate", "--model", "m", "--role", "decode"], None)):
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        set_openmp_env(argv)
        assert os.environ.get("GOMP_SPINCOUNT") == want, argv
    # the role of a vLLM --config file (or an underscore spelling) counts too: main reads the translated line
    import gigadecode.cli as cli
    monkeypatch.setattr(cli, "cmd_serve", lambda args: 0)
    cfg = tmp_path / "decode.yaml"
    cfg.write_text("role: decode\n")
    for argv in (["serve", str(tmp_path), "--config", str(cfg)], ["serve", str(tmp_path), "--role=decode"]):
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        assert cli.main(argv) == 0
        assert os.environ.get("GOMP_SPINCOUNT") == str(DI_SPIN_COUNT), argv
    monkeypatch.setenv("GOMP_SPINCOUNT", "77")                   # the user's choice stands
    set_openmp_env(["serve", "--model", "m", "--role", "decode"])
    assert os.environ["GOMP_SPINCOUNT"] == "77"
    monkeypatch.delenv("GOMP_SPINCOUNT")


def test_generate_under_a_world_of_the_wrong_size_says_so(tiny_ckpt, monkeypatch, capsys):
    """torchrun started 2 processes for `--ep 2` alone (tp × dp = 1): the world size is what is wrong, not ep."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2", "--ep", "2"]) == 2
    err = capsys.readouterr().err
    assert "world size 2 != tp*dp = 1*1 = 1" in err and "does not divide" not in err


@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory):
    from gigadecode.checkpoint import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("demo") / "demo", "demo")


def test_chat_shows_the_reply_as_reasoning_and_answer(demo_ckpt, capsys):
    """`--chat MESSAGE` sends the message through the chat template (with --reasoning-effort in it) and shows
    the harmony reply as its reasoning and its answer; with --json, those fields parsed from the same tokens."""
    from gigadecode.harmony import HarmonyTokens, parse_harmony
    from gigadecode.tokenizer import TextCodec
    codec = TextCodec.from_dir(demo_ckpt)
    q = "What is 37 + 45?"
    common = ["generate", "--model", str(demo_ckpt), "--chat", q, "--threads", "1", "--max-tokens", "80"]
    assert main([*common, "--json", "--reasoning-effort", "low"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["prompt_ids"] == codec.apply_chat_template([{"role": "user", "content": q}], reasoning_effort="low")
    assert got["prompt_ids"] != codec.apply_chat_template([{"role": "user", "content": q}], reasoning_effort="high")
    m = parse_harmony(codec, HarmonyTokens.from_codec(codec), got["token_ids"])
    assert (got["reasoning_content"], got["content"], got["tool_calls"]) == (m.reasoning_content, m.content, [])
    assert got["content"] == "37 + 45 = 82" and "82" in got["reasoning_content"]
    assert main([*common, "--reasoning-effort", "low"]) == 0
    out = capsys.readouterr().out
    assert f"user: {q}" in out and f"\nreasoning: {m.reasoning_content}\nanswer: 37 + 45 = 82\n" in out, out


def test_reasoning_effort_needs_chat(tiny_ckpt):
    r = _generate("--model", str(tiny_ckpt), "--prompt-ids", "1,2", "--reasoning-effort", "low")
    assert r.returncode != 0 and "--reasoning-effort goes with --chat" in r.stderr
    r = _generate("--model", str(tiny_ckpt), "--chat", "hi", "--prompt-ids", "1,2")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_a_reader_that_stops_early_gets_no_traceback():
    # `gigadecode plan … | head -1`: the reader has gone when the plan is printed; the command stops quietly
    # (exit 1), as a shell tool does, instead of a BrokenPipeError traceback
    p = subprocess.Popen([sys.executable, "-m", "gigadecode", "plan", "--preset", "tiny", "--kv-budget-gib", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()                                    # before the command has written a byte
    err = p.stderr.read()
    assert p.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_every_flag_the_readme_names_exists():
    # the README stays true: each `--flag` it names is one of some command's (torchrun's and vLLM's own aside)
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    from gigadecode.vllm_flags import IGNORED, REFUSED, TAKEN_VALUES
    theirs = {"--nproc-per-node", "--kv-transfer-config"}          # torchrun's, vLLM's api_server's
    theirs |= {*IGNORED, *REFUSED, *TAKEN_VALUES, "--config"}       # vLLM's, which serve takes or refuses by name
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    ours = {o for p in sub.choices.values() for a in p._actions for o in a.option_strings}
    # (serve reads vLLM's underscore spellings as the dashed names)
    named = {f.replace("_", "-") for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", readme)} - theirs
    assert named - ours == set()


def test_every_module_is_named_in_the_architecture_doc():
    # docs/architecture.md's table of rooms stays whole: every source file of the package is named there
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "architecture.md").read_text()
    files = [p for ext in ("*.py", "*.cpp", "*.h") for p in (root / "gigadecode").rglob(ext)
             if p.name != "__init__.py"]
    assert len(files) > 50
    missing = sorted(str(p.relative_to(root)) for p in files if f"`{p.name}`" not in doc and p.name not in doc)
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_serve_reads_a_vllm_command_line(monkeypatch):
    """`vllm serve MODEL -tp N --kv-cache-dtype fp8 --max-num-batched-tokens T` and the GPT-OSS recipe's
    tool and reasoning parser flags parse to our own settings; a model given twice, none, or a parser or KV
    dtype we do not have is an error that names it."""
    import gigadecode.cli as cli
    seen = []
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.append(args) or 0)
    monkeypatch.setattr("gigadecode.hub.resolve_model", lambda m: m)
    assert main(["serve", "/ckpt", "-tp", "2", "--data-parallel-size", "3", "--kv-cache-dtype", "fp8_e4m3",
                 "--max-num-batched-tokens", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "openai",
                 "--reasoning-parser", "openai_gptoss"]) == 0
    a = seen[-1]
    assert (a.model, a.tp, a.dp, a.kv_dtype, a.max_prefill_tokens) == ("/ckpt", 2, 3, "fp8", 1024)
    assert not hasattr(a, "model_tag")
    assert main(["serve", "--model", "/ckpt", "--tensor-parallel-size", "4", "--kv-dtype", "bfloat16"]) == 0
    assert (seen[-1].model, seen[-1].tp, seen[-1].kv_dtype) == ("/ckpt", 4, "bf16")
    assert main(["serve", "/ckpt", "--model", "/ckpt"]) == 0 and seen[-1].model == "/ckpt"
    assert len(seen) == 3
    for given, dtype in (("float", "float32"), ("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("auto", "auto")):
        assert main(["serve", "/ckpt", "--dtype", given]) == 0 and seen[-1].dtype == dtype


@pytest.mark.parametrize("argv,message", [
    (["serve", "/a", "--model", "/b"], "two models given: '/a' and --model '/b'"),
    (["serve"], "a model is required"),
    (["serve", "/a", "--tool-call-parser", "hermes"], "argument --tool-call-parser: invalid choice: 'hermes'"),
    (["serve", "/a", "--kv-cache-dtype", "fp8_e5m2"], "invalid KV dtype 'fp8_e5m2' \\(the FP8 KV cache stores e4m3\\)"),
    (["serve", "/a", "--dtype", "half"], "--dtype half: float16 compute is not supported .* use bfloat16, or auto"),
    (["serve", "/a", "--dtype", "int8"], "invalid --dtype 'int8': choose from auto, bfloat16, float32"),
    (["serve", "/a", "--chat-template", "/no/such/template.jinja"], "'/no/such/template.jinja': no such file"),
    (["serve", "/a", "--chat-template", "{% if %}"], "this chat template does not compile"),
    (["generate", "--model", "/a", "--chat", "hi", "--chat-template", "{{ x + }}"], "does not compile"),
])
def test_bad_vllm_style_flags_are_named(argv, message, capsys):
    """Each refusal exits 2 (argparse's own or ours) with a line that says what was wrong."""
    import re
    try:
        rc = main(argv)
    except SystemExit as e:                         # argparse refuses the value itself
        rc = e.code
    assert rc == 2
    assert re.search(message, capsys.readouterr().err)


TEMPLATE = ("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")


def test_chat_template_flag_renders_chats_with_it(tiny_ckpt, tmp_path, capsys):
    """--chat-template (a file for generate, the template itself for serve) replaces the checkpoint's: the
    prompt is the given template's rendering, written out here by hand, through `generate --chat`, and through
    a `serve MODEL` started with vLLM's flags (its /tokenize and a chat completion)."""
    import httpx
    import openai

    from gigadecode.ports import free_port
    from gigadecode.tokenizer import TextCodec

    from .helpers import stop_process_tree
    from .test_server import wait_health
    codec = TextCodec.from_dir(tiny_ckpt)
    want = codec.encode("<<user>>hi there<<assistant>>")
    assert want != codec.apply_chat_template([{"role": "user", "content": "hi there"}])   # not the checkpoint's
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert main(["generate", "--model", str(tiny_ckpt), "--chat", "hi there", "--chat-template",
                 str(tmp_path / "t.jinja"), "--json", "--max-tokens", "2", "--no-warmup", "--threads", "1",
                 "--num-blocks", "16"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["prompt_ids"] == want

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gigadecode", "serve", str(tiny_ckpt), "--port", str(port),
                             "--chat-template", TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser",
                             "openai", "--reasoning-parser", "openai_gptoss", "--kv-cache-dtype", "fp8",
                             "--max-num-batched-tokens", "64", "--num-blocks", "32", "--no-warmup",
                             "--log-level", "warning"],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "GIGADECODE_API_KEY": ""},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc)
        msgs = [{"role": "user", "content": "hi there"}]
        assert httpx.post(url + "/tokenize", json={"messages": msgs}, timeout=30).json()["tokens"] == want
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=tiny_ckpt.name, messages=msgs, max_tokens=2,
                                           extra_body={"return_token_ids": True})
        assert r.model_extra["prompt_token_ids"] == want
    finally:
        stop_process_tree(proc)


# -- vLLM's serve command lines (gigadecode/vllm_flags.py) -----------------------------------------------
def serve_args(monkeypatch, argv: list[str]):
    """`main(["serve", *argv])` up to the server's start -> (exit code, the parsed args or None)."""
    import gigadecode.cli as cli
    seen = []
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.append(args) or 0)
    rc = main(["serve", *argv])
    return rc, (seen[0] if seen else None)


def test_vllms_gpt_oss_recipe_command_lines_start(tiny_ckpt, tmp_path, monkeypatch, capsys):
    # the recipe's evaluation command line: underscore spelling, a GPU memory share, no prefix caching
    rc, args = serve_args(monkeypatch, [str(tiny_ckpt), "--tensor_parallel_size", "1", "--max-model-len", "512",
                                        "--max-num-batched-tokens", "256", "--max-num-seqs", "4",
                                        "--gpu-memory-utilization", "0.85", "--no-enable-prefix-caching",
                                        "--async-scheduling"])
    assert rc == 0 and args is not None
    assert (args.tp, args.max_model_len, args.max_prefill_tokens, args.max_num_seqs) == (1, 512, 256, 4)
    assert args.enable_prefix_caching is False
    err = capsys.readouterr().err
    assert "--gpu-memory-utilization is taken and changes nothing here" in err and "--async-scheduling" in err
    # its Hopper config file, with a flag on the command line that wins over the file's
    cfg = tmp_path / "GPT-OSS_Hopper.yaml"
    cfg.write_text("no-enable-prefix-caching: true\nmax-cudagraph-capture-size: 2048\n"
                   "max-num-batched-tokens: 8192\nstream-interval: 20\nmax_num_seqs: 3\n")
    rc, args = serve_args(monkeypatch, [str(tiny_ckpt), "--config", str(cfg), "--max-num-seqs", "5"])
    assert rc == 0 and (args.max_prefill_tokens, args.max_num_seqs) == (8192, 5)
    rc, args = serve_args(monkeypatch, ["--config", str(cfg), "--model", str(tiny_ckpt), "--uvicorn-log-level",
                                        "warning", "--enable-expert-parallel"])
    assert rc == 0 and (args.max_num_seqs, args.log_level, args.ep) == (3, "warning", 1)


def test_serve_seed_is_the_engines(tiny_ckpt, monkeypatch):
    """vLLM's `serve --seed N` seeds the engine (its unseeded sampled requests), not one request: `generate
    --seed` stays the requests' own seed."""
    from gigadecode.engine_config import engine_config_from_args
    rc, args = serve_args(monkeypatch, [str(tiny_ckpt), "--seed", "5"])
    assert rc == 0 and engine_config_from_args(args).seed == 5
    g = build_parser().parse_args(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2", "--seed", "7"])
    assert g.seed == 7 and engine_config_from_args(g).seed is None


@pytest.mark.parametrize("flags, reason", [
    (["--max-logprobs", "50"], "is not configurable"),
    (["--tokenizer", "x"], "tokenizer.json is always used"),
    (["--tool-server", "demo"], "built-in tools"),
    (["--generation-config", "vllm"], "generation_config.json is always read"),
    (["--quantization", "fp8"], "as the checkpoint stores them"),
    (["--pipeline_parallel_size", "2"], "pipeline parallelism is not implemented"),
])
def test_vllm_flags_that_would_change_answers_are_refused_with_the_reason(tiny_ckpt, monkeypatch, capsys,
                                                                          flags, reason):
    rc, args = serve_args(monkeypatch, [str(tiny_ckpt), *flags])
    assert rc == 2 and args is None
    err = capsys.readouterr().err
    assert "gigadecode serve: error: vLLM's" in err and reason in err


def test_enable_expert_parallel_is_ep_over_every_rank(tiny_ckpt, monkeypatch, capsys):
    rc, args = serve_args(monkeypatch, [str(tiny_ckpt), "-tp", "2", "--dp", "2", "--enable-expert-parallel"])
    assert rc == 0 and args.ep == 4
    # vLLM's short spellings: -ep, and -dcp / --decode-context-parallel-size for --dcp
    rc, args = serve_args(monkeypatch, [str(tiny_ckpt), "-tp", "4", "-ep", "-dcp", "2"])
    assert rc == 0 and (args.ep, args.dcp) == (4, 2)
    rc, args = serve_args(monkeypatch, [str(tiny_ckpt), "-tp", "2", "--decode_context_parallel_size", "2"])
    assert rc == 0 and args.dcp == 2
    rc, args = serve_args(monkeypatch, [str(tiny_ckpt), "-tp", "2", "--ep", "2", "--enable-expert-parallel", "-dp", "2"])
    assert rc == 2 and "--ep 2 was given" in capsys.readouterr().err


def test_serve_help_lists_the_vllm_flags_it_takes_and_refuses(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    from gigadecode.vllm_flags import IGNORED, REFUSED
    flat = " ".join(out.split())
    assert all(f in flat for f in [*IGNORED, *REFUSED, "--config FILE", "--tensor_parallel_size"])
