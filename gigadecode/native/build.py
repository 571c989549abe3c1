"""Builds and loads the native CPU kernels (`csrc/`) once per machine, cached.

The sources are compiled with `torch.utils.cpp_extension` (ninja) for the best ISA this CPU has —
AVX-512 with BF16 dot products, AVX-512 (F/BW/VL/DQ + F16C/FMA) or AVX2 (+FMA/F16C) — into `~/.cache/gigadecode/native/<key>`, keyed by the
sources, the ISA and the torch version, so the first start builds (about a minute on 2 cores) and every later
start loads the cached library. No build runs inside a timed or request path once `ensure_built()` ran
(`python -m gigadecode.native` does it at install). Where no compiler or ninja is found, or the CPU has
neither ISA, nothing is built and `load()` returns None: callers fall back to the torch twins.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger("gigadecode.native")

SRC = Path(__file__).with_name("csrc")
SOURCES = ("ops.cpp", "moe.cpp", "dequant.cpp", "linear.cpp", "attention.cpp", "attention_tiles.cpp", "rope_norm.cpp",
           "prefill_attention.cpp", "prefill_attention_f32.cpp", "gk_program.cpp", "product_form.cpp")
ISA_FLAGS = {
    "avx512-bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
CACHE_DIR = Path(os.environ.get("GIGADECODE_CACHE", Path.home() / ".cache" / "gigadecode")) / "native"

_state: dict[str, object] = {}


def cpu_isa() -> str | None:
    """'avx512', 'avx2' or None, from the CPU flags (GIGADECODE_NATIVE_ISA overrides, e.g. to test avx2)."""
    forced = os.environ.get("GIGADECODE_NATIVE_ISA")
    if forced:
        return forced if forced in ISA_FLAGS else None
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split())
    except (OSError, IndexError):
        cap = torch.backends.cpu.get_cpu_capability()
        return {"AVX512": "avx512", "AVX2": "avx2"}.get(cap)
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"} <= flags:
        return "avx512-bf16" if "avx512_bf16" in flags else "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return None


def _missing_tool() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return f"no C++ compiler ({cxx} / g++) on PATH"
    try:
        import ninja  # noqa: F401
    except ImportError:
        if shutil.which("ninja") is None:
            return "ninja is not installed (pip install ninja)"
    return None


def build_key(isa: str) -> str:
    h = hashlib.sha256()
    for name in sorted(p.name for p in SRC.iterdir()):
        h.update(name.encode() + (SRC / name).read_bytes())
    h.update(f"{isa}|{torch.__version__}|{sys.version_info[:2]}".encode())
    return h.hexdigest()[:16]


def load(verbose: bool = False):
    """The loaded extension's op namespace (`torch.ops.gigadecode_native`), or None (with one warning)."""
    if "ops" in _state:
        return _state["ops"]
    ops = None
    if os.environ.get("GIGADECODE_NATIVE", "1") == "0":
        reason = "disabled by GIGADECODE_NATIVE=0"
    elif (isa := cpu_isa()) is None:
        reason = "this CPU has neither AVX-512 nor AVX2"
    elif (reason := _missing_tool()) is None:
        try:
            ops = _build(isa, verbose)
        except Exception as e:                       # a failed build: say why once, run the twins
            reason = f"build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
    if ops is None:
        log.warning("gigadecode: native kernels unavailable (%s); using the torch twins (slower)", reason)
        _state["reason"] = reason
    _state["ops"] = ops
    return ops


@contextlib.contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold `out`'s build lock: one process builds into `out` at a time, the others wait for it. The lock is
    an flock, which the kernel drops when its holder dies. torch's own build lock (a `lock` file it creates
    and deletes, waiting forever while one exists) stayed behind when a build was killed (Ctrl-C, an OOM
    kill, a start-up probe's restart during the first start), and every later start hung in it; under this
    lock no other builder is running, so such a file is a dead build's and is removed."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "build.flock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = out / "lock"
            if stale.exists():
                log.warning("gigadecode: removing %s, left by a build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _load_built(lib: Path, quiet: bool = False) -> bool:
    """Load `lib` if it is there and loads: True. False when it is not there, or does not load (a link cut
    short by a kill; said unless `quiet`)."""
    if not lib.exists():
        return False
    try:
        torch.ops.load_library(str(lib))
        return True
    except OSError as e:
        if not quiet:
            log.warning("gigadecode: %s does not load (%s); building it again", lib, e)
        return False


def compile_or_load(name: str, src: Path, out: Path, isa: str, verbose: bool = False) -> None:
    """Load `out/<name>.so`, compiling `src`'s SOURCES into it for `isa` first when it is not there (those
    present: an older revision's sources, as `bench/kernels_ab.py` builds, may lack a later one). A library
    that does not load (a link cut short by a kill) is built again."""
    lib = out / f"{name}.so"
    if _load_built(lib):
        return
    from torch.utils import cpp_extension

    with build_lock(out):
        if _load_built(lib, quiet=True):    # built by another process while this one waited
            return
        lib.unlink(missing_ok=True)         # none, or one cut short
        cpp_extension.load(name=name, sources=[str(src / s) for s in SOURCES if (src / s).exists()],
                           build_directory=str(out), extra_cflags=["-O3", "-fopenmp", "-std=c++17", *ISA_FLAGS[isa]],
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=verbose)


def _build(isa: str, verbose: bool):
    key = build_key(isa)
    out = CACHE_DIR / f"{isa}-{key}"
    out.mkdir(parents=True, exist_ok=True)
    name = f"gigadecode_native_{isa.replace('-', '_')}"
    if not verbose and not (out / f"{name}.so").exists():
        print(f"gigadecode: building the native kernels ({isa}) once into {out} ...", file=sys.stderr, flush=True)
    compile_or_load(name, SRC, out, isa, verbose)
    ops = torch.ops.gigadecode_native
    _state["isa"] = ops.isa()
    from .fakes import register_fakes
    register_fakes()
    return ops


def isa() -> str | None:
    """The ISA of the loaded kernels ('avx512-bf16', 'avx512' or 'avx2'), or None where the twins run."""
    return _state.get("isa") if load() is not None else None


def status() -> str:
    """One line: which kernels run here."""
    ops = load()
    if ops is None:
        return f"torch twins ({_state.get('reason')})"
    form = f", bf16 products in {ops.product_form('')}" if _state["isa"] in ("avx512-bf16", "avx512") else ""
    amx = {"on": ", AMX tiles", "off": ", AMX tiles off"}.get(str(ops.amx_tiles("")), "")
    fp8 = ", FP8 KV read by byte table" if ops.fp8_reads("") == "table" else ""
    return f"native ({_state['isa']}{form}{amx}{fp8})"
