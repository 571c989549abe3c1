"""Run the native kernels' tests against every ISA build, on any x86-64 CPU with AVX2.

    python tools/isa_check.py                        # avx2, avx512, avx512-bf16, avx512-bf16-amx: the kernel tests
    python tools/isa_check.py avx512-bf16 -- -q tests/test_engine.py     # one ISA, other pytest arguments

`gigadecode.native` compiles its kernels for the best ISA the CPU has (AVX-512 with BF16 dot products,
AVX-512 or AVX2), so a developer's machine runs one of the three code paths and CI another. This check builds
all three and runs the tests against each. An ISA this CPU has is compiled as the package compiles it; one it
lacks is compiled for AVX2 with the AVX-512 intrinsics supplied by SIMDe (header-only, PyPI `simde-py`,
downloaded once into the cache) and `tools/isa_emulation.h` (the few SIMDe lacks), so the AVX-512 paths'
results are checked on an AVX2 machine (their speed is not: emulated, they are only correct). Each build lives
in its own cache root under `~/.cache/gigadecode/isa-check/` (under `GIGADECODE_CACHE` when set), never in
the one the package loads (an emulated one keyed by the emulation's headers, SIMDe's version and this file's substitution rules as well), and its tests run with `GIGADECODE_NATIVE_ISA=<isa>` pointing at it and with
`GIGADECODE_BF16_GEMM` set as on a CPU of that kind (bf16 products in oneDNN on AVX-512, in fp32 on AVX2).

`avx512-bf16-amx` is the avx512-bf16 build (native or emulated as above) with the AMX tiles emulated
(`tools/amx_emulation.h`, bit for bit as an Emerald Rapids Xeon's tiles and PyTorch's oneDNN GEMM on them sum:
tests/test_amx_emulation.py) and AMX reported present, so a CPU without AMX runs the kernels' AMX paths
(`amx_tiles.h`: our own tile code, the oneDNN GEMM of experts, projections and prefill attention) and their
tests; the sources' `at::native::cpublas::` calls are renamed to the emulation's (PyTorch's own GEMM runs on
AVX512-BF16 without AMX, but sums in another order, fails on AVX-512 without BF16 and refuses AVX2). Its
GEMMs are plain loops: slower than the tiles, the kernel tests still take about a minute.
`--host avx2` (or avx512) checks as a CPU with only that ISA would: the builds above it emulated.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gigadecode.native import build  # noqa: E402

ISAS = ("avx2", "avx512", "avx512-bf16")                  # each a superset of the one before
AMX = "avx512-bf16-amx"                                    # avx512-bf16 with the AMX tiles emulated
CHECKS = (*ISAS, AMX)
KERNEL_TESTS = ["tests/test_native_dense.py", "tests/test_native_moe.py", "tests/test_native_attention.py",
                "tests/test_gk.py", "tests/test_prefill_attention.py", "tests/test_shapes.py",
                "tests/test_fp8_kv_oracle.py"]
SIMDE = "simde-py==0.8.2.post1"
BASE = build.CACHE_DIR.parent / "isa-check"
# the source's ISA tests, renamed so that only the emulation defines them (GCC's own macros would pull in the
# real intrinsics, which do not compile for an AVX2 target)
EMULATED_MACROS = {"__AVX512F__": "GD_EMULATED_AVX512F", "__AVX512BW__": "GD_EMULATED_AVX512BW",
                   "__AVX512BF16__": "GD_EMULATED_AVX512BF16"}
# the AMX build's changes to the sources, each required to apply: AMX present without asking Linux for the tile
# data (a CPU without AMX refuses), then every PyTorch GEMM call the emulation's
AMX_PRESENT = ("product_form.cpp",
               'could_pack(at::kBFloat16) && tile_data_permitted() &&\n         __builtin_cpu_supports("avx512vbmi")',
               "could_pack(at::kBFloat16)")
AMX_RENAME = ("at::native::cpublas::", "gd_amx_emu::")
# written beside an emulated library once it built and loaded. Its presence, not the library's, says the slot is
# done: `gigadecode.native` builds a library that does not load (a link cut short by a kill) again itself, from
# the real sources with the ISA's real instructions (SIGILL on a CPU without them, the AMX tiles off without AMX)
BUILT = "emulated.built"


def host_isa() -> str | None:
    saved = os.environ.pop("GIGADECODE_NATIVE_ISA", None)
    try:
        return build.cpu_isa()
    finally:
        if saved is not None:
            os.environ["GIGADECODE_NATIVE_ISA"] = saved


def simde_include() -> Path:
    """SIMDe's include directory, downloaded (an sdist: headers only) the first time."""
    root = BASE / SIMDE.replace("==", "-")
    inc = root / "include"
    if not (inc / "simde" / "x86" / "avx512.h").exists():
        tmp = root / "download"
        shutil.rmtree(root, ignore_errors=True)
        tmp.mkdir(parents=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", str(tmp), SIMDE], check=True)
        (sdist,) = tmp.glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (headers,) = tmp.glob("*/simde_py/simde")
        shutil.move(str(headers), inc)
        shutil.rmtree(tmp)
    return inc


def emulation_key(headers: list[str]) -> str:
    """The emulated builds' cache key: SIMDe's version, the emulation headers and this file, whose substitution
    rules (`EMULATED_MACROS`, `AMX_PRESENT`, `AMX_RENAME`, the flags of `emulated_sources`) shape the library as
    much as the headers do (the package's own key covers the kernel sources only)."""
    parts = [f"{SIMDE}|".encode(), Path(__file__).read_bytes(), *((ROOT / "tools" / h).read_bytes() for h in headers)]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]


def build_emulated(isa: str, cache: Path, simde: Path | None, amx: bool) -> None:
    """Compile the kernels' `isa` paths (for AVX2 with SIMDe where `simde` is given, else natively; with the AMX
    tiles emulated where `amx`) into the slot `gigadecode.native` loads for `isa` (run in a process of its own:
    loading the library registers the op namespace). Under the slot's build lock from the sources' copy on:
    another check building the same slot (two clones' `make test-isas` sharing a cache) neither rewrites the
    sources under this one's compiler nor builds it again."""
    from torch.utils import cpp_extension

    out = emulated_slot(isa, cache)
    name = f"gigadecode_native_{isa.replace('-', '_')}"
    with build.build_lock(out):                                # (a killed build's torch lock removed)
        if (out / BUILT).exists():                             # built by another check while this one waited
            return
        (out / f"{name}.so").unlink(missing_ok=True)           # one cut short by a kill: linked again
        src = cache / "csrc"
        flags = emulated_sources(isa, src, simde, amx)
        cpp_extension.load(name=name, sources=[str(src / s) for s in build.SOURCES], build_directory=str(out),
                           is_python_module=False, extra_ldflags=["-fopenmp"],
                           extra_cflags=["-O2", "-fopenmp", "-std=c++17", *flags])
        (out / BUILT).touch()                                  # it built and loaded


def emulated_slot(isa: str, cache: Path) -> Path:
    """Where `gigadecode.native` loads `isa`'s library from under `cache`: the key of the real sources."""
    return cache / "native" / f"{isa}-{build.build_key(isa)}"


def emulated_sources(isa: str, src: Path, simde: Path | None, amx: bool) -> list[str]:
    """Copy the kernels' sources into `src`, changed as `build_emulated` says, -> the compiler flags."""
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(build.SRC, src)
    flags = [*build.ISA_FLAGS[isa]]
    if simde is not None:
        for f in src.iterdir():
            text = f.read_text()
            for real, emulated in EMULATED_MACROS.items():
                text = text.replace(real, emulated)
            f.write_text(text.replace("#include <immintrin.h>", '#include "isa_emulation.h"'))
        shutil.copy(ROOT / "tools" / "isa_emulation.h", src)
        defines = [f"-D{EMULATED_MACROS[m]}" for m in ("__AVX512F__", "__AVX512BW__")]
        if isa == "avx512-bf16":
            defines.append(f"-D{EMULATED_MACROS['__AVX512BF16__']}")
        # -fno-tree-sra: GCC 12 stops with an internal error in SRA on the emulated vector types of linear.cpp
        flags = [*build.ISA_FLAGS["avx2"], "-Wno-psabi", "-fno-tree-sra", f"-I{simde}", *defines]
    if amx:
        name, real, emulated = AMX_PRESENT
        renamed = [(src / name).read_text().count(real)]
        (src / name).write_text((src / name).read_text().replace(real, emulated))
        for f in src.iterdir():
            renamed.append(f.read_text().count(AMX_RENAME[0]))
            f.write_text(f.read_text().replace(*AMX_RENAME))
        if renamed[0] == 0 or sum(renamed[1:]) == 0:
            sys.exit("isa_check: the sources no longer hold the texts of isa_check.AMX_PRESENT / AMX_RENAME")
        shutil.copy(ROOT / "tools" / "amx_emulation.h", src)
        flags += ["-include", str(src / "amx_emulation.h")]     # ahead of each source: its tiles replace the real
    return flags


def check(name: str, pytest_args: list[str], host: str | None) -> int:
    if host is None:
        sys.exit("isa_check: this CPU has no AVX2")
    amx = name == AMX
    isa = "avx512-bf16" if amx else name
    emulated = ISAS.index(isa) > ISAS.index(host)
    headers = ["isa_emulation.h"] * emulated + ["amx_emulation.h"] * amx
    cache = BASE / (f"{name}-emulated-{emulation_key(headers)}" if headers else isa)
    # and the torch side as such a CPU runs it: oneDNN has bf16 GEMMs on every AVX-512 CPU, none on AVX2
    env = {**os.environ, "GIGADECODE_CACHE": str(cache), "GIGADECODE_NATIVE_ISA": isa, "GIGADECODE_NATIVE": "1",
           "GIGADECODE_BF16_GEMM": "0" if isa == "avx2" else "1"}
    print(f"== {name}: {'emulated on ' + host if emulated else 'native'}{', AMX emulated' * amx}", flush=True)
    if headers and not (emulated_slot(isa, cache) / BUILT).exists():
        simde = ["--simde", str(simde_include())] if emulated else []
        subprocess.run([sys.executable, __file__, "--build-emulated", isa, *["--amx"] * amx, *simde], env=env, check=True)
    loaded = subprocess.run([sys.executable, "-m", "gigadecode.native"], env=env, check=True,
                            capture_output=True, text=True).stdout.strip()
    if f"native ({isa})" not in loaded and f"native ({isa}, " not in loaded:   # the twins would pass the tests
        sys.exit(f"isa_check: {name}: expected its native kernels, got: {loaded}")
    if amx and ", AMX tiles)" not in loaded and ", AMX tiles, " not in loaded:   # (FP8 table reads may follow)
        sys.exit(f"isa_check: {name}: expected the AMX tiles on, got: {loaded}")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args],
                          env=env, cwd=ROOT).returncode


def split_pytest_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """A check's command line `[ISA ...] [-- PYTEST ARGS]` -> (its own arguments, pytest's: the kernel tests
    unless given)."""
    if "--" not in argv:
        return argv, ["-q", *KERNEL_TESTS]
    return argv[:argv.index("--")], argv[argv.index("--") + 1:]


def main() -> None:
    argv, pytest_args = split_pytest_args(sys.argv[1:])
    p = argparse.ArgumentParser(usage="%(prog)s [ISA ...] [-- PYTEST ARGS]", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("isas", nargs="*", metavar="ISA", help=f"one or more of {', '.join(CHECKS)} (default: all)")
    p.add_argument("--build-emulated", metavar="ISA", choices=ISAS, help=argparse.SUPPRESS)
    p.add_argument("--simde", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--amx", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--host", choices=ISAS, help="check as on a CPU with this ISA at best (those above it emulated: "
                   "--host avx2 checks what an AVX2 machine checks)")
    args = p.parse_args(argv)
    if unknown := [isa for isa in args.isas if isa not in CHECKS]:
        p.error(f"unknown ISA {unknown[0]!r} (choose from {', '.join(CHECKS)})")
    if args.build_emulated:
        build_emulated(args.build_emulated, Path(os.environ["GIGADECODE_CACHE"]), args.simde, args.amx)
        return
    host = host_isa()
    if host is not None and args.host is not None:
        host = min(host, args.host, key=ISAS.index)
    failed = [isa for isa in (args.isas or CHECKS) if check(isa, pytest_args, host) != 0]
    print(f"isa_check: {'failed: ' + ', '.join(failed) if failed else 'all passed'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
