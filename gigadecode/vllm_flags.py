"""vLLM `serve` command lines read as gigadecode's: what `vllm serve` takes that gigadecode's own parser does
not define, before argparse sees it.

- Flag names with underscores (`--tensor_parallel_size 8`, as vLLM's GPT-OSS recipe writes it) are vLLM's
  dashed names, as vLLM's own parser reads them.
- `--config FILE` (a YAML mapping of flag names to values, vLLM's `--config`) becomes those flags, placed
  before the rest of the command line so that a flag given there wins, as in vLLM.
- Flags that tune what only a GPU or vLLM's own machinery has (`--gpu-memory-utilization`,
  `--async-scheduling`, CUDA graphs, `--stream-interval`, ...) are taken and dropped with a one-line note:
  none of them changes a token, a logprob or a field of an answer.
- Flags whose effect a user would see in the answers, and which this server does not have, are refused
  with the reason (`--seed`, `--tokenizer`, `--tool-server`, ...), never silently ignored.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


class VllmFlagError(ValueError):
    """A vLLM flag this server cannot honour, with the reason."""


# flag -> (takes a value, what it does in vLLM): taken and dropped, since nothing it tunes exists here and no
# answer depends on it
IGNORED: dict[str, tuple[bool, str]] = {
    "--gpu-memory-utilization": (True, "sets a GPU's memory share (the KV pool here: --num-blocks / --kv-budget-gib)"),
    "--async-scheduling": (False, "overlaps GPU work with scheduling"),
    "--no-async-scheduling": (False, "turns that overlap off"),
    "--enforce-eager": (False, "turns CUDA graphs off"),
    "--max-cudagraph-capture-size": (True, "sizes CUDA graphs"),
    "--cuda-graph-sizes": (True, "sizes CUDA graphs"),
    "--compilation-config": (True, "configures its torch.compile of the GPU model"),
    "--stream-interval": (True, "sends streamed tokens N to a chunk (here each token is a chunk: the same text)"),
    "--trust-remote-code": (False, "runs a checkpoint's own Python code (GPT-OSS has none)"),
    "--disable-log-requests": (False, "switches its request logging"),
    "--enable-log-requests": (False, "switches its request logging"),
    "--disable-log-stats": (False, "switches its stats logging"),
    "--swap-space": (True, "sizes a CPU swap space for a GPU's KV"),
    "--distributed-executor-backend": (True, "picks its worker processes (ranks here run under torchrun)"),
    "--attention-backend": (True, "picks a GPU attention kernel"),
    "--load-format": (True, "picks a weight loader (the checkpoint's safetensors are read as they are)"),
}

# flag -> why it is refused: each changes what a request gets back, and this server does not do it
REFUSED: dict[str, str] = {
    "--tokenizer": "the checkpoint's own tokenizer.json is always used",
    "--tool-server": "built-in tools (browser, python, MCP) are not served; function tools are",
    "--kv-transfer-config": "disaggregated serving is --role prefill | decode | both (kv_producer / "
                            "kv_consumer / kv_both) with --kv-secret, behind `gigadecode proxy`",
    "--pipeline-parallel-size": "pipeline parallelism is not implemented (--tp, --dp, --ep, --dcp are)",
    "-pp": "pipeline parallelism is not implemented (--tp, --dp, --ep, --dcp are)",
    "--max-logprobs": "the most logprobs a request may ask for is 20 (vLLM's default) and is not configurable",
    "--enable-lora": "LoRA adapters are not served",
    "--lora-modules": "LoRA adapters are not served",
}

# flag -> the values taken (what happens here anyway), anything else refused with the reason
TAKEN_VALUES: dict[str, tuple[set[str], str]] = {
    "--generation-config": ({"auto"}, "the checkpoint's generation_config.json is always read (vLLM's `auto`)"),
    "--quantization": ({"mxfp4"}, "GPT-OSS's experts are read as the checkpoint stores them (MXFP4 or bf16)"),
    "-q": ({"mxfp4"}, "GPT-OSS's experts are read as the checkpoint stores them (MXFP4 or bf16)"),
}

LONG_FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")


def dashed(arg: str) -> str:
    """`--tensor_parallel_size` / `--tensor_parallel_size=8` as `--tensor-parallel-size[=8]` (values kept)."""
    name, eq, value = arg.partition("=")
    if LONG_FLAG.fullmatch(name):
        name = "--" + name[2:].replace("_", "-")
    return name + eq + value


def config_file_args(path: str) -> list[str]:
    """vLLM's `--config FILE`: a YAML mapping {flag name: value} as command-line arguments (true: the bare
    flag, false: left out, a list: its values, a mapping: JSON)."""
    import yaml
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise VllmFlagError(f"--config: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise VllmFlagError(f"--config: {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise VllmFlagError(f"--config: {path} must hold a mapping of flag names to values")
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def translate_serve_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """`serve`'s arguments (after the word `serve`) with vLLM's spellings made ours -> (arguments, notes to
    print at start: one per vLLM flag taken and dropped). Raises VllmFlagError for a flag refused."""
    args = [dashed(a) if a.startswith("--") else a for a in argv]
    if "--" in args:                                # nothing after a bare `--` is an option
        cut = args.index("--")
        args, rest = args[:cut], args[cut:]
    else:
        rest = []
    # --config FILE: its flags go first, so that the command line's own win
    for i, a in enumerate(args):
        if a == "--config" or a.startswith("--config="):
            if a == "--config" and i + 1 >= len(args):
                raise VllmFlagError("--config: expected a YAML file")
            path = a.split("=", 1)[1] if "=" in a else args[i + 1]
            args = args[:i] + args[i + (1 if "=" in a else 2):]
            lead = 1 if args and not args[0].startswith("-") else 0      # the positional MODEL stays first
            args = args[:lead] + [dashed(x) for x in config_file_args(path)] + args[lead:]
            break
    out, notes, i = [], [], 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if name in IGNORED:
            takes_value, what = IGNORED[name]
            if takes_value and not eq:
                i += 1                              # its value
            notes.append(f"vLLM's {name} is taken and changes nothing here: in vLLM it {what}")
        elif name in REFUSED:
            raise VllmFlagError(f"vLLM's {name} is not supported: {REFUSED[name]}")
        elif name in TAKEN_VALUES:
            if not eq:
                if i + 1 >= len(args):
                    raise VllmFlagError(f"{name}: expected a value")
                i += 1
                value = args[i]
            ok, why = TAKEN_VALUES[name]
            if value not in ok:
                raise VllmFlagError(f"vLLM's {name} {value} is not supported: {why}")
        else:
            out.append(a)
        i += 1
    return out + rest, notes
