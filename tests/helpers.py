"""Reusable helpers for tests: build our reference model over a checkpoint, lay out block tables, run
prompts through it (whole, chunked, token by token), greedy decode, and the transformers oracle.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from gigadecode.config import GptOssConfig
from gigadecode.engine_config import EngineConfig
from gigadecode.kv.cache import KVCache
from gigadecode.model import GptOssModel, SeqChunk
from gigadecode.weights import ModelWeights, load_weights

# The DI deployment key of every prefill / decode engine the tests start (in-process via EngineConfig, and in
# subprocesses through $GIGADECODE_KV_SECRET, which conftest sets).
KV_SECRET = "gigadecode-tests-kv-secret-0123456789"

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def load_script(relpath: str, name: str):
    """A script of this repository (tools/, bench/) imported as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / relpath)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=16)
def _cached_weights(ckpt_dir: str, dtype: torch.dtype) -> tuple[GptOssConfig, ModelWeights]:
    cfg = GptOssConfig.from_hf(ckpt_dir)
    return cfg, load_weights(ckpt_dir, cfg, dtype)


def build_reference(ckpt_dir: str | Path, dtype: torch.dtype = torch.float32, kv_dtype: str = "auto",
                    block_size: int = 16, num_blocks: int = 512
                    ) -> tuple[GptOssConfig, ModelWeights, GptOssModel, KVCache]:
    """(cfg, weights, model, kv) over a checkpoint. Weights are loaded once per (dir, dtype) and shared
    (the model only reads them); every call gets a fresh, zeroed KV cache."""
    cfg, weights = _cached_weights(str(ckpt_dir), dtype)
    model = GptOssModel(cfg, weights, dtype)
    ecfg = EngineConfig(dtype=DTYPE_NAMES[dtype], kv_dtype=kv_dtype, block_size=block_size)
    kv = KVCache(cfg, ecfg, num_blocks=num_blocks)
    return cfg, weights, model, kv


def contiguous_tables(kv: KVCache, max_tokens: int, seq: int = 0, num_seqs: int = 1) -> list[list[int]]:
    """Block tables (one per KV group) for sequence `seq` of `num_seqs`: every (sequence, group) pair
    gets its own contiguous range of block ids, never block 0 (the null block)."""
    n_groups = len(kv.config.groups)
    per = cdiv(max_tokens, kv.block_size)
    first = 1 + seq * n_groups * per
    tables = [list(range(first + g * per, first + (g + 1) * per)) for g in range(n_groups)]
    last = first + n_groups * per - 1
    if last >= kv.num_blocks or seq >= num_seqs:
        raise ValueError(f"KV cache of {kv.num_blocks} blocks is too small for {num_seqs} x {max_tokens} tokens")
    return tables


def shuffled_tables(kv: KVCache, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Like `contiguous_tables` for one sequence, but the block ids (all groups together, never 0) are a
    random permutation of 1..num_blocks-1: a scattered paged layout."""
    n_groups = len(kv.config.groups)
    per = cdiv(max_tokens, kv.block_size)
    if n_groups * per >= kv.num_blocks:
        raise ValueError("KV cache too small")
    perm = (torch.randperm(kv.num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    return [perm[g * per: (g + 1) * per] for g in range(n_groups)]


def random_prompt(n: int, vocab_size: int, seed: int = 0, low: int = 3) -> list[int]:
    """n token ids in [low, vocab) (ids below 3 are pad/bos/eos in the tiny presets)."""
    return torch.randint(low, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_logits(model: GptOssModel, kv: KVCache, tables: list[list[int]], ids: list[int],
                   chunk: int | None = None, start: int = 0) -> torch.Tensor:
    """Feed `ids` at positions start.. in chunks of `chunk` tokens (None = one chunk) -> logits [len(ids), V]."""
    chunk = chunk or len(ids)
    outs = []
    for s in range(0, len(ids), chunk):
        part = ids[s: s + chunk]
        outs.append(model.forward([SeqChunk(part, start + s, tables, "all")], kv).logits[0])
    return torch.cat(outs)


def greedy(model: GptOssModel, kv: KVCache, tables: list[list[int]], prompt: list[int], new_tokens: int,
           prefill_chunk: int | None = None) -> list[int]:
    """Greedy decode ignoring eos: prefill in chunks of `prefill_chunk` (None = one chunk, 1 = token by
    token), then `new_tokens - 1` single-token decode steps. Returns the new tokens."""
    chunk = prefill_chunk or len(prompt)
    last = None
    for s in range(0, len(prompt), chunk):
        last = model.forward([SeqChunk(prompt[s: s + chunk], s, tables, "last")], kv).logits[0]
    out = [int(last[-1].argmax())]
    while len(out) < new_tokens:
        pos = len(prompt) + len(out) - 1
        logits = model.forward([SeqChunk([out[-1]], pos, tables, "last")], kv).logits[0]
        out.append(int(logits[-1].argmax()))
    return out


@functools.lru_cache(maxsize=4)
def load_hf(ckpt_dir: str, dtype: torch.dtype = torch.float32):
    """transformers' GptOssForCausalLM over the same files (eval mode), loaded once per (dir, dtype)."""
    import transformers
    from transformers import GptOssForCausalLM

    transformers.logging.set_verbosity_error()
    model = GptOssForCausalLM.from_pretrained(ckpt_dir, dtype=dtype)
    model.eval()
    return model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logits for one sequence: [len(ids), V] fp32."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def assert_teacher_forced_argmax(hf, prompts: list[list[int]], outputs: list[list[int]], clear: float,
                                 what: str = "") -> int:
    """Each generated token is transformers' argmax on prompt + the tokens before it (its uncached forward over
    the whole sequence), wherever its top two logits are more than `clear` × max |logit| apart; -> how many
    positions were that clear (the caller checks the comparison was not vacuous)."""
    checked = 0
    for p, got in zip(prompts, outputs):
        ref = hf_logits(hf, p + got)[len(p) - 1: len(p) - 1 + len(got)]
        top2 = ref.topk(2, -1).values
        ok = (top2[:, 0] - top2[:, 1]) > clear * ref.abs().max()
        assert ref.argmax(-1)[ok].tolist() == torch.tensor(got)[ok].tolist(), (what, len(p), got)
        checked += int(ok.sum())
    return checked


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy `generate` with eos disabled, so exactly `new_tokens` tokens come out.

    (`eos_token_id=-1` as a generate kwarg overrides the checkpoint's generation_config; a
    GenerationConfig object with eos None would be merged back with the default eos.)"""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                          eos_token_id=-1, pad_token_id=hf.config.pad_token_id)
    new = out[0, len(prompt):].tolist()
    if len(new) != new_tokens:
        raise AssertionError(f"transformers generated {len(new)} tokens, expected {new_tokens}")
    return new


# fp32 GEMMs round a row differently by how many rows share the call (torch's M=1 path is not its M>1 one), so a
# stream batched with others can pick the other side of a near-tie many tokens in. Greedy streams from different
# batchings are equal, or equal up to a step where the reference's top two logprobs are this close and the
# other stream took the runner-up (vLLM's tests allow the same).
NEAR_TIE_NATS = 0.01


def assert_greedy_matches(got: list[int], want: list[int], want_logprobs: list, what: str = "",
                          near_tie: float = NEAR_TIE_NATS) -> None:
    """`got` == `want` (greedy ids), or equal until a step where `want`'s logprobs (top >= 2, from the reference
    run) show a near-tie (within `near_tie` nats) that `got` resolved the other way; nothing after that step is
    compared."""
    assert len(got) == len(want), (what, len(got), len(want))
    d = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if d is None:
        return
    top = want_logprobs[d].top
    assert len(top) >= 2 and top[0][0] == want[d], (what, d, top)
    assert top[1][0] == got[d] and top[0][1] - top[1][1] < near_tie, \
        f"{what}: diverges at token {d}: got {got[d]}, reference {want[d]} (top logprobs {top})"


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


# The gpt-oss-20b config.json as published (old rope_scaling + rope_theta form).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (read from /proc; torchrun starts each rank in its own session, so
    killing torchrun's process group misses them)."""
    import os
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def stop_process_tree(proc, timeout: float = 30.0) -> None:
    """SIGTERM `proc` (a server, or torchrun: it forwards the signal and waits for its ranks), then SIGKILL
    whatever of its tree is still alive after `timeout`."""
    import os
    import signal
    import subprocess
    if proc.poll() is not None:
        return
    tree = descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class VllmSideChannel:
    """vLLM's NIXL side channel as a router or decode engine sees it: a ZMQ ROUTER on loopback answering every
    handshake with the agent metadata of engine `engine_id` as process `process` (set `process` to stand for a
    restart under the same engine id), on its own thread until `close()`; `requests` counts the handshakes."""

    def __init__(self, engine_id: str, process: str = "first") -> None:
        import threading
        self.engine_id, self.process, self.requests = engine_id, process, 0
        self._stop, ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10)

    def payload(self) -> bytes:
        return self.payload_of(self.engine_id, self.process)

    @staticmethod
    def payload_of(engine_id: str, process: str) -> bytes:
        """The handshake answer of `process` of engine `engine_id`."""
        import msgspec
        inner = {"engine_id": engine_id, "agent_metadata": f"agent of {process}".encode(),
                 "kv_caches_base_addr": [1 << 20, 2 << 20], "num_blocks": 64, "block_lens": [16384] * 2,
                 "block_strides": [16384] * 2, "kv_cache_layout": "LBHNC", "block_size": 32,
                 "attn_backend_name": "CPU_ATTN"}
        return msgspec.msgpack.encode({"compatibility_hash": "fake",
                                       "agent_metadata_bytes": msgspec.msgpack.encode(inner)})

    def _serve(self, ready) -> None:
        import msgspec
        import zmq
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.port = sock.bind_to_random_port("tcp://127.0.0.1")
        ready.set()
        while not self._stop.is_set():
            if sock.poll(20):
                frames = sock.recv_multipart()
                self.requests += 1
                sock.send_multipart((frames[0], b"", self.payload(), msgspec.msgpack.encode(0.0)))
        sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
