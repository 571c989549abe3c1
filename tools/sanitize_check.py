"""Run the native kernels' tests with the kernels built under AddressSanitizer and UndefinedBehaviorSanitizer.

    python tools/sanitize_check.py                              # this CPU's ISA and avx2: the kernel tests
    python tools/sanitize_check.py avx2 -- -x -q tests/test_engine.py     # one ISA, other pytest arguments

The twin tests compare each kernel's results with a torch twin, so a read past a buffer's end that happens to
return harmless values, a tail loop touching one vector too many, a misaligned scalar load, a signed overflow or
a shift past the width go unseen. This check compiles the kernels with `-fsanitize=address,undefined` (and
float-cast-overflow; at -O1, with frame pointers and debug lines) and runs pytest in a python with the
sanitizers' runtimes preloaded (python and torch stay uninstrumented: only the kernels' own memory accesses are
checked, against the bounds of each tensor's allocation, not of a view into a larger one, and of the part of a
reused scratch buffer the kernel asked for: `aligned_part` in csrc/common.h poisons the rest in such builds).
The first report stops the process and fails the check: ASan's (also from the servers a test starts) are
collected from `<cache>/reports/`, UBSan's from pytest's stderr.

Each build lives in its own cache root under `~/.cache/gigadecode/sanitize/` (under `GIGADECODE_CACHE` when
set), keyed by the sanitizer flags, never in the one the package loads; the tests run with
`GIGADECODE_NATIVE_ISA=<isa>` pointing at it. Only ISAs this CPU runs natively are built (the emulated AVX-512
paths of tools/isa_check.py compile to different code). A build takes ~15 minutes on 2 cores, the kernel
tests about twice their usual time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gigadecode.native import build  # noqa: E402
from isa_check import host_isa, split_pytest_args  # noqa: E402

SANITIZE_FLAGS = ["-fsanitize=address,undefined,float-cast-overflow", "-fno-omit-frame-pointer", "-g", "-O1"]
BASE = build.CACHE_DIR.parent / "sanitize"
# What torch and OpenMP need under the preloaded runtimes (CPU torch 2.13, libgomp): only detect_leaks=0, as
# python and torch keep allocations until exit (LeakSanitizer would list them). No shadow-gap or link-order
# option: the runtime is preloaded first and nothing maps GPU memory.
ASAN_OPTIONS = "detect_leaks=0:halt_on_error=1"
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"
# written beside the sanitized library once it built and loaded; its presence, not the library's, says the slot
# is done: `gigadecode.native` builds a library that does not load (a link cut short by a kill) again itself,
# without the sanitizers, and the tests would then run uninstrumented
BUILT = "sanitized.built"


def runtimes() -> list[str]:
    """The sanitizer runtimes of the compiler that builds the kernels (to preload into python)."""
    cxx = os.environ.get("CXX", "c++") if shutil.which(os.environ.get("CXX", "c++")) else "g++"
    libs = []
    for name in ("libasan.so", "libubsan.so"):
        path = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not os.path.isabs(path) or not os.path.exists(path):
            sys.exit(f"sanitize_check: {cxx} has no {name} (install the compiler's sanitizer runtimes)")
        libs.append(os.path.realpath(path))
    return libs


def cache_root(isa: str) -> Path:
    return BASE / f"{isa}-{hashlib.sha256(' '.join(SANITIZE_FLAGS).encode()).hexdigest()[:12]}"


def build_sanitized(isa: str, cache: Path) -> None:
    """Compile the kernels for `isa` with the sanitizers into the slot `gigadecode.native` loads for `isa` (run
    in a process of its own with the runtimes preloaded: loading the library registers the op namespace)."""
    from torch.utils import cpp_extension

    out = cache / "native" / f"{isa}-{build.build_key(isa)}"   # the key of the sources, as load() computes it
    with build.build_lock(out):
        if (out / BUILT).exists():                             # built by another check while this one waited
            return
        (out / f"gigadecode_native_{isa.replace('-', '_')}.so").unlink(missing_ok=True)  # one cut short: linked again
        cpp_extension.load(name=f"gigadecode_native_{isa.replace('-', '_')}",
                           sources=[str(build.SRC / s) for s in build.SOURCES], build_directory=str(out),
                           is_python_module=False,
                           extra_cflags=["-fopenmp", "-std=c++17", *build.ISA_FLAGS[isa], *SANITIZE_FLAGS],
                           extra_ldflags=["-fopenmp", *SANITIZE_FLAGS[:1]])
        (out / BUILT).touch()                                  # it built and loaded


def collect_reports(reports: Path) -> list[str]:
    found = []
    for f in sorted(reports.glob("*")):
        text = f.read_text(errors="replace").strip()
        if text:
            found.append(f"--- {f.name}\n{text}")
    return found


def check(isa: str, pytest_args: list[str]) -> int:
    cache = cache_root(isa)
    reports = cache / "reports"
    shutil.rmtree(reports, ignore_errors=True)
    reports.mkdir(parents=True)
    env = {**os.environ, "GIGADECODE_CACHE": str(cache), "GIGADECODE_NATIVE_ISA": isa, "GIGADECODE_NATIVE": "1",
           "GIGADECODE_BF16_GEMM": "0" if isa == "avx2" else "1", "LD_PRELOAD": " ".join(runtimes()),
           "ASAN_OPTIONS": f"{ASAN_OPTIONS}:log_path={reports / 'asan'}",
           "UBSAN_OPTIONS": UBSAN_OPTIONS,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print(f"== {isa}: sanitized ({' '.join(SANITIZE_FLAGS)}) in {cache}", flush=True)
    slot = cache / "native" / f"{isa}-{build.build_key(isa)}"       # as load() finds it
    if not (slot / BUILT).exists():
        subprocess.run([sys.executable, __file__, "--build", isa], env=env, check=True)
    libs = [lib.read_bytes() for lib in slot.glob("*.so")]
    if len(libs) != 1 or b"__asan_init" not in libs[0] or b"__ubsan_handle" not in libs[0]:
        sys.exit(f"sanitize_check: {slot} holds no instrumented library (were the sources edited during the build?)")
    loaded = subprocess.run([sys.executable, "-m", "gigadecode.native"], env=env, capture_output=True, text=True)
    if loaded.returncode != 0 or not (f"native ({isa})" in loaded.stdout or f"native ({isa}, " in loaded.stdout):
        sys.exit(f"sanitize_check: {isa}: expected its sanitized native kernels, got: "
                 f"{(loaded.stdout + loaded.stderr).strip()[-2000:]}")
    # UBSan ignores log_path next to ASan's runtime and writes to fd 2, which pytest's default capture would lose
    # when the report stops the process: pytest captures at the sys level, and its stderr is read here
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--capture=sys", *pytest_args],
                            env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True, errors="replace")
    ubsan = []
    for line in proc.stderr:
        sys.stderr.write(line)
        if "runtime error:" in line:
            ubsan.append(f"--- UBSan\n{line.rstrip()}")
    rc = proc.wait()
    if found := collect_reports(reports) + ubsan:
        print(f"sanitize_check: {isa}: {len(found)} sanitizer report(s):\n" + "\n".join(found), flush=True)
        return rc or 1
    return rc


def main() -> None:
    argv, pytest_args = split_pytest_args(sys.argv[1:])
    p = argparse.ArgumentParser(usage="%(prog)s [ISA ...] [-- PYTEST ARGS]", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("isas", nargs="*", metavar="ISA", help="this CPU's ISA and/or those below it "
                   f"(of {', '.join(build.ISA_FLAGS)}; default: this CPU's and avx2)")
    p.add_argument("--build", metavar="ISA", choices=tuple(build.ISA_FLAGS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.build:
        build_sanitized(args.build, Path(os.environ["GIGADECODE_CACHE"]))
        return
    host = host_isa()
    if host is None:
        sys.exit("sanitize_check: this CPU has no AVX2")
    order = ("avx2", "avx512", "avx512-bf16")
    runnable = order[:order.index(host) + 1]
    if unknown := [isa for isa in args.isas if isa not in runnable]:
        p.error(f"ISA {unknown[0]!r} does not run natively here (choose from {', '.join(runnable)})")
    failed = [isa for isa in (args.isas or dict.fromkeys([host, "avx2"])) if check(isa, pytest_args) != 0]
    print(f"sanitize_check: {'failed: ' + ', '.join(failed) if failed else 'all passed'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
