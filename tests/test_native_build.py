"""The native build's cache after a build that was killed: torch's build lock (a `lock` file it waits on for
as long as it exists) and a library cut short no longer stop every later start. A one-op library stands in
for the kernels (the same `compile_or_load`, a build of seconds)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
