"""The native build's cache after a build that was killed: torch's build lock (a `lock` file it waits on for
as long as it exists) and a library cut short no longer stop every later start. A one-op library stands in
for the kernels (the same `compile_or_load`, a build of seconds)."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gigadecode.native import build

ONE_OP = textwrap.dedent("""\
    #include <torch/library.h>
    at::Tensor twice(const at::Tensor& x) { return x.add(x); }
    TORCH_LIBRARY(gigadecode_build_test, m) { m.def("twice(Tensor x) -> Tensor", &twice); }
""")


@pytest.mark.skipif(build._missing_tool() is not None, reason="no C++ compiler or ninja")
def test_a_killed_build_leaves_nothing_that_stops_the_next(tmp_path):
    """A build killed mid-way leaves torch's `lock` file (torch waited on it forever: every later start hung)
    and possibly a library cut short; the next start removes the one, builds the other again and loads it.
    In a fresh process, so the op namespace is its own."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "ops.cpp").write_text(ONE_OP)
    out.mkdir()
    (out / "lock").write_text("")                                # what a killed build leaves
    (out / "gigadecode_build_test.so").write_bytes(b"\x7fELF cut short")
    code = textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from gigadecode.native import build
        build.compile_or_load("gigadecode_build_test", Path({str(src)!r}), Path({str(out)!r}), "avx2")
        print(torch.ops.gigadecode_build_test.twice(torch.tensor([1.0, 2.0])).tolist())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[2.0, 4.0]"
    assert "left by a build that was killed" in r.stderr and "building it again" in r.stderr
    assert not (out / "lock").exists()
    # the next start loads what the first built, with nothing to say
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[2.0, 4.0]" and "gigadecode:" not in r.stderr


def _isa_check():
    spec = importlib.util.spec_from_file_location("isa_check", Path(__file__).parents[1] / "tools" / "isa_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_emulated_build_prepares_its_sources_under_the_build_lock(tmp_path, monkeypatch):
    """tools/isa_check.py's emulated builds: two checks building the same slot at once (two clones' `make
    test-isas` sharing a cache) each copied and rewrote `<cache>/csrc` before taking the lock, under the other's
    compiler (a source gone or changed mid-build), and the second then built the whole library again. Now the
    sources are prepared under the lock, and a library the other built meanwhile is kept. The lock stands in
    for the other check: it finds that check's sources in place, and that check's library done."""
    isa_check = _isa_check()
    theirs = tmp_path / "csrc" / "ops.cpp"                     # the other check's sources, being compiled
    theirs.parent.mkdir()
    theirs.write_text("// theirs")
    at_lock = []

    @contextlib.contextmanager
    def held_by_the_other_first(out):
        at_lock.append(theirs.read_text() if theirs.exists() else None)
        out.mkdir(parents=True, exist_ok=True)
        (out / isa_check.BUILT).touch()                        # the other built the library meanwhile
        yield

    monkeypatch.setattr(build, "build_lock", held_by_the_other_first)
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("built again"))
    isa_check.build_emulated("avx512-bf16", tmp_path, None, amx=True)
    assert at_lock == ["// theirs"] and theirs.read_text() == "// theirs"


def _record_runs(monkeypatch, tool, stdout: str) -> list:
    """`tool.subprocess.run` replaced by one that records its command lines (returned, filled as it runs)
    and answers `stdout` with success: what the tool decides to build, without building it."""
    runs = []

    def run(argv, **kw):
        runs.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=stdout)
    monkeypatch.setattr(tool.subprocess, "run", run)
    return runs


def test_an_emulated_library_cut_short_is_built_again_emulated(tmp_path, monkeypatch):
    """An emulated build killed during its link leaves a library that does not load. isa_check took any .so in
    the slot as built, and `gigadecode.native`, finding it broken, built it again itself from the real sources
    with the real instructions (on a CPU without them the tests then die of SIGILL; without AMX the tiles are
    off), for every later run. The slot counts as built only once the emulated build finished."""
    isa_check = _isa_check()
    monkeypatch.setattr(isa_check, "BASE", tmp_path)
    cache = tmp_path / f"{isa_check.AMX}-emulated-{isa_check.emulation_key(['amx_emulation.h'])}"
    slot = cache / "native" / f"avx512-bf16-{build.build_key('avx512-bf16')}"     # where gigadecode.native loads
    slot.mkdir(parents=True)
    (slot / "gigadecode_native_avx512_bf16.so").write_bytes(b"\x7fELF cut short")
    runs = _record_runs(monkeypatch, isa_check, "gigadecode kernels: native (avx512-bf16, AMX tiles)")
    assert isa_check.check(isa_check.AMX, ["-q"], "avx512-bf16") == 0
    assert "--build-emulated" in runs[0] and "--amx" in runs[0]
    (slot / "emulated.built").touch()                         # once built: loaded as it is
    runs.clear()
    isa_check.check(isa_check.AMX, ["-q"], "avx512-bf16")
    assert not any("--build-emulated" in argv for argv in runs)


def test_a_sanitized_library_cut_short_is_built_again_sanitized(tmp_path, monkeypatch):
    """tools/sanitize_check.py, as isa_check above: a library cut short that still holds the sanitizer symbols
    passed its check, and `gigadecode.native` then built it again without the sanitizers: the tests ran
    uninstrumented and reported nothing. The slot counts as built only once the sanitized build finished."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "tools"))     # it imports isa_check
    spec = importlib.util.spec_from_file_location("sanitize_check",
                                                  Path(__file__).parents[1] / "tools" / "sanitize_check.py")
    sanitize_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sanitize_check)
    monkeypatch.setattr(sanitize_check, "BASE", tmp_path)
    monkeypatch.setattr(sanitize_check, "runtimes", lambda: [])
    slot = sanitize_check.cache_root("avx2") / "native" / f"avx2-{build.build_key('avx2')}"
    slot.mkdir(parents=True)
    (slot / "gigadecode_native_avx2.so").write_bytes(b"\x7fELF __asan_init __ubsan_handle, then cut short")
    runs = _record_runs(monkeypatch, sanitize_check, "gigadecode kernels: native (avx2)")
    monkeypatch.setattr(sanitize_check.subprocess, "Popen", lambda *a, **kw: pytest.skip("got to the tests"))
    with contextlib.suppress(pytest.skip.Exception):
        sanitize_check.check("avx2", ["-q"])
    assert runs and "--build" in runs[0]


def test_the_emulated_builds_cache_key_covers_isa_checks_own_rules(tmp_path, monkeypatch):
    """An emulated library is shaped by isa_check.py's substitution rules as much as by the emulation headers:
    a rule changed (here one macro renamed differently) must key a new slot, or the cache serves the old build."""
    isa_check = _isa_check()
    headers = ["isa_emulation.h", "amx_emulation.h"]
    before = isa_check.emulation_key(headers)
    changed = tmp_path / "isa_check.py"
    changed.write_text(Path(isa_check.__file__).read_text().replace('"__AVX512F__"', '"__AVX512F__ "', 1))
    monkeypatch.setattr(isa_check, "__file__", str(changed))
    assert isa_check.emulation_key(headers) != before
    monkeypatch.setattr(isa_check, "__file__", str(Path(__file__).parents[1] / "tools" / "isa_check.py"))
    assert isa_check.emulation_key(headers) == before                  # and it is stable otherwise
