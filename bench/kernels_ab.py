"""Two builds of the native kernels in one process, alternated: decode steps of the GK program or prefill
chunks of the per-layer model with the kernels of revision A, then of B, A, B, … (medians, and the median of
the pair ratios), so both share the host's noise — on a busy 2-core machine whole runs minutes apart differ by
more than most kernel changes do.

Each revision's `gigadecode/native/csrc` (a git revision, or `worktree` for the files as they are now) is built
under its own op namespace (`gigadecode_ab_a`, `gigadecode_ab_b`) into `~/.cache/gigadecode/ab/`, and the
Python wrappers are pointed at one namespace or the other between steps. Everything else (the Python side,
weights, KV) is the working tree's and shared.

    .venv/bin/python bench/kernels_ab.py --a HEAD~1 --b worktree decode --preset small --batch 8 --context 4096
    .venv/bin/python bench/kernels_ab.py --a HEAD~1 --b worktree prefill --preset small --tokens 512
    .venv/bin/python bench/kernels_ab.py --a HEAD~1 --b worktree attention --batch 8 --context 4096

(`attention`: the decode-attention op alone over packed-FP8 KV in blocks placed at random, `bench/decode_attention.py`'s
case; no checkpoint.)

`--isa-a` / `--isa-b` build a side for another ISA this CPU runs (one revision's AVX-512 build against its
AVX512-BF16 one, say), and `--bf16-gemm-a` / `--bf16-gemm-b` run that side's bf16 prefill projections in
oneDNN's bf16 GEMM or in fp32.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode import CACHE, DecodeBench  # noqa: E402
from gigadecode.config import GptOssConfig  # noqa: E402
from gigadecode.engine_config import DEFAULT_MAX_PREFILL_TOKENS, EngineConfig  # noqa: E402
from gigadecode.gk import model as gk_model  # noqa: E402
from gigadecode.gk.native_blocks import NATIVE_BLOCKS_PER_OP  # noqa: E402
from gigadecode.kv.cache import KVCache  # noqa: E402
from gigadecode.kv.manager import KVCacheManager  # noqa: E402
from gigadecode.model import GptOssModel, SeqChunk  # noqa: E402
from gigadecode import gemm  # noqa: E402
from gigadecode.native import build  # noqa: E402
from gigadecode.weights import load_weights  # noqa: E402

CSRC = "gigadecode/native/csrc"


def sources(rev: str) -> dict[str, bytes]:
    """The kernel sources of a git revision, or of the working tree (`worktree`)."""
    if rev == "worktree":
        return {p.name: p.read_bytes() for p in (ROOT / CSRC).iterdir() if p.is_file()}
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, CSRC], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        return {Path(m.name).name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}


def build_as(rev: str, namespace: str, isa: str | None = None):
    """Build `rev`'s kernels for `isa` (default: this CPU's) with their op namespace renamed; returns
    `torch.ops.<namespace>`."""
    files = sources(rev)
    files["ops.cpp"] = files["ops.cpp"].replace(b"gigadecode_native", namespace.encode())
    # and the C++ namespace: inline functions' static locals (the scratch buffers) are process-wide unique
    # symbols, which two builds loaded together would otherwise share, whatever their layout
    for name in files:
        if name.endswith(".cpp"):
            files[name] = f"#define gd {namespace}_cc\n".encode() + files[name]
    isa = isa or build.cpu_isa()
    if isa is None:
        raise SystemExit("this CPU has neither AVX-512 nor AVX2: no kernels to compare")
    key = hashlib.sha256(b"".join(k.encode() + v for k, v in sorted(files.items())) + isa.encode()).hexdigest()[:16]
    out = CACHE / "ab" / f"{namespace}-{key}"
    src = out / "csrc"
    src.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (src / name).write_bytes(data)
    if not (out / f"{namespace}.so").exists():
        print(f"building {rev} as {namespace} ...", flush=True)
    build.compile_or_load(namespace, src, out, isa)
    return getattr(torch.ops, namespace)


def alternate(kernels: dict, run, rounds: int, bf16_gemm: dict | None = None) -> dict[str, list[float]]:
    """run() timed with each build's kernels in turn, `rounds` times (after one untimed round); `bf16_gemm`
    (per build: True, False or None for this CPU's answer) sets whether bf16 GEMMs run in oneDNN's bf16 or in
    fp32 (`gemm.BF16_GEMM_IN_BF16`) while that build runs."""
    build.load()                                       # the wrappers' state exists; then point it at A or B
    times = {k: [] for k in kernels}
    native_gemm = gemm.BF16_GEMM_IN_BF16
    for i in range(rounds + 1):
        for name, ops in kernels.items():
            build._state["ops"], build._state["isa"] = ops, ops.isa()
            choice = (bf16_gemm or {}).get(name)
            gemm.BF16_GEMM_IN_BF16 = native_gemm if choice is None else choice
            t0 = time.perf_counter()
            run()
            if i:
                times[name].append(time.perf_counter() - t0)
    return times


def report(what: str, times: dict[str, list[float]], unit: float, per: str) -> None:
    a, b = times["A"], times["B"]
    ratio = sorted(x / y for x, y in zip(a, b))[len(a) // 2]
    print(f"{what}: A {statistics.median(a) * unit:.2f} {per}  B {statistics.median(b) * unit:.2f} {per}  "
          f"B/A speed {statistics.median(a) / statistics.median(b):.3f}x (median of pair ratios {ratio:.3f}, "
          f"{len(a)} pairs)")


def attention(kernels: dict, args: argparse.Namespace) -> int:
    """The decode-attention op of each build on the same arguments: outputs compared, then alternated."""
    from decode_attention import case
    g = torch.Generator().manual_seed(0)
    op_args, _ = case(args.batch, args.context, 0, args.kv_heads, args.q_per_kv, args.head_dim, args.block, True, 0, g)
    outs = [ops.paged_decode_attention(*op_args).float() for ops in kernels.values()]
    print(f"A = {args.a} ({kernels['A'].isa()}), B = {args.b} ({kernels['B'].isa()}); {args.kv_heads} kv x "
          f"{args.q_per_kv} q heads of {args.head_dim}, blocks of {args.block}, threads {torch.get_num_threads()}; "
          f"outputs differ by at most {(outs[0] - outs[1]).abs().max().item():.2e}")

    def run() -> None:
        for _ in range(args.calls):
            build._state["ops"].paged_decode_attention(*op_args)
    times = alternate(kernels, run, args.rounds)
    report(f"attention batch {args.batch} context {args.context}", times, 1e3 / args.calls, "ms")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", default="HEAD", help="git revision of the baseline kernels (or 'worktree')")
    ap.add_argument("--b", default="worktree", help="git revision of the kernels to compare (or 'worktree')")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=20)
    for side in ("a", "b"):
        ap.add_argument(f"--isa-{side}", choices=sorted(build.ISA_FLAGS),
                        help=f"build {side.upper()}'s kernels for this ISA (default: this CPU's)")
        ap.add_argument(f"--bf16-gemm-{side}", choices=["auto", "bf16", "fp32"], default="auto",
                        help=f"{side.upper()}'s bf16 GEMMs (prefill projections): oneDNN bf16, fp32, or this CPU's "
                             "default")
    sub = ap.add_subparsers(dest="what", required=True)
    dec = sub.add_parser("decode", help="GK decode steps (random KV, full tables; as bench/decode.py)")
    dec.add_argument("--batch", type=int, default=1)
    dec.add_argument("--context", type=int, default=256)
    pre = sub.add_parser("prefill", help="a prompt's chunked prefill through the per-layer model")
    pre.add_argument("--tokens", type=int, default=512)
    pre.add_argument("--chunk", type=int, default=DEFAULT_MAX_PREFILL_TOKENS,
                     help=f"prompt tokens a prefill step (default {DEFAULT_MAX_PREFILL_TOKENS}, the engine's)")
    att = sub.add_parser("attention", help="the decode-attention op alone (packed-FP8 KV, random blocks)")
    att.add_argument("--batch", type=int, default=8)
    att.add_argument("--context", type=int, default=4096)
    att.add_argument("--kv-heads", type=int, default=8)
    att.add_argument("--q-per-kv", type=int, default=8)
    att.add_argument("--head-dim", type=int, default=64)
    att.add_argument("--block", type=int, default=16)
    att.add_argument("--calls", type=int, default=4, help="calls timed per round and build")
    args = ap.parse_args()

    kernels = {"A": build_as(args.a, "gigadecode_ab_a", args.isa_a),
               "B": build_as(args.b, "gigadecode_ab_b", args.isa_b)}
    bf16_gemm = {k: {"auto": None, "bf16": True, "fp32": False}[v]
                 for k, v in (("A", args.bf16_gemm_a), ("B", args.bf16_gemm_b))}
    if args.what == "attention":
        return attention(kernels, args)
    model_dir = CACHE / args.preset
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"no checkpoint at {model_dir}: run bench/decode.py --preset {args.preset} once")
    cfg = GptOssConfig.from_hf(model_dir)
    dt = getattr(torch, args.dtype)
    w = load_weights(model_dir, cfg, dt)
    model = GptOssModel(cfg, w, dt)
    print(f"A = {args.a} ({kernels['A'].isa()}, bf16 GEMMs {args.bf16_gemm_a}), B = {args.b} ({kernels['B'].isa()}, "
          f"bf16 GEMMs {args.bf16_gemm_b}); {args.preset} {args.dtype}, threads {torch.get_num_threads()}")
    if args.what == "decode":
        if not all(hasattr(k, "gk_decode_layers") for k in kernels.values()):
            gk_model.NATIVE_BLOCKS = NATIVE_BLOCKS_PER_OP    # an older revision: no one-call layer loop to time
            print("one revision has no gk_decode_layers: both run the per-op layer loop")
        bench = DecodeBench(cfg, w, model, args.dtype, args.batch, args.context, 16, ["gk-native"])
        times = alternate(kernels, lambda: bench.step("gk-native"), args.rounds, bf16_gemm)
        report(f"decode batch {args.batch} context {args.context}", times, 1e3, "ms")
    else:
        n = args.tokens
        kv = KVCache(cfg, EngineConfig(dtype=args.dtype, kv_dtype="fp8", block_size=16), -(-n // 16) * 2 + 2)
        mgr = KVCacheManager(kv.config, 16)
        prompt = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()

        def prefill() -> None:
            assert mgr.allocate("p", n, 0)
            for s in range(0, n, args.chunk):
                model.forward([SeqChunk(prompt[s: s + args.chunk], s, mgr.block_tables("p"), "last")], kv)
            mgr.free("p")
        times = alternate(kernels, prefill, max(3, args.rounds // 4), bf16_gemm)
        report(f"prefill of {n} tokens", times, 1e3, "ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
