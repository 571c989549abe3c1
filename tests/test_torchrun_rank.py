"""A rank that torchrun started stops when torchrun dies (`gigadecode.torchrun_rank`), on real processes: a
launcher process starts a "rank" (torchrun's environment) and is SIGKILLed; the rank gets SIGTERM. Also: the
launcher already gone when the rank arms the signal, and nothing armed outside torchrun. (The whole server
under a SIGKILLed torchrun: tests/test_serve_parallel.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the "rank": arms the death signal, says whether it did, then waits for SIGTERM (exit 42) or gives up (exit 1)
RANK = """
import signal, sys, time
from gigadecode.torchrun_rank import stop_with_launcher
signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
print("armed" if stop_with_launcher() else "not armed", flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(1)
"""

# the "launcher": starts the rank (its pid and first line on stdout), then waits to be killed
LAUNCHER = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
print(rank.pid, rank.stdout.readline().strip(), flush=True)
time.sleep(60)
"""

_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _gone_within(pid: int, timeout: float) -> bool:
    """Whether `pid` (not our child: once its launcher died, init's) has exited within `timeout` seconds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except OSError:
            return True                      # reaped already
        time.sleep(0.05)
    return False


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    return {**env, "PYTHONPATH": str(ROOT), **kw}


@_linux
def test_a_rank_gets_sigterm_when_its_launcher_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, "30"], stdout=subprocess.PIPE, text=True,
                                env=_env(TORCHELASTIC_RUN_ID="t"))
    try:
        pid, state = launcher.stdout.readline().split(" ", 1)
        assert state.strip() == "armed"
        launcher.kill()
        launcher.wait(5)
        assert _gone_within(int(pid), 5), "the rank outlived its launcher"
    finally:
        launcher.kill()
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, NameError, ValueError):
            pass


@_linux
def test_a_rank_whose_launcher_died_before_it_armed_stops_at_once():
    """The launcher dies between the rank reading its parent and the prctl (no death signal would ever come):
    the rank sees its parent changed and signals itself."""
    code = ("import os, itertools\n"
            "real = os.getppid\n"
            "calls = itertools.count()\n"
            "os.getppid = lambda: 999999 if next(calls) == 0 else real()    # the launcher, then init\n" + RANK)
    r = subprocess.run([sys.executable, "-c", code, "30"], capture_output=True, text=True, timeout=20,
                       env=_env(TORCHELASTIC_RUN_ID="t"))
    assert r.stdout.strip() == "" and r.returncode == 42, (r.returncode, r.stdout, r.stderr)


@_linux
def test_a_rank_whose_launcher_was_gone_before_it_read_its_parent_stops_at_once():
    """The launcher died before the rank started arming: the rank already belongs to init (pid 1), its parent
    looks unchanged across the prctl, and no death signal would ever come: it signals itself."""
    code = ("import os\nos.getppid = lambda: 1    # re-parented to init\n"
            "import gigadecode.torchrun_rank as t\nt.command_of = lambda pid: ['/sbin/tini', '--', 'sh']\n" + RANK)
    r = subprocess.run([sys.executable, "-c", code, "30"], capture_output=True, text=True, timeout=20,
                       env=_env(TORCHELASTIC_RUN_ID="t"))
    assert r.stdout.strip() == "" and r.returncode == 42, (r.returncode, r.stdout, r.stderr)


@_linux
@pytest.mark.parametrize("pid1", [["/usr/bin/python3", "/usr/local/bin/torchrun", "--nproc-per-node=2", "serve"],
                                  ["python", "-m", "torch.distributed.run", "serve"], []])
def test_a_rank_whose_launcher_is_pid_1_runs_on(pid1):
    """torchrun as a container's entrypoint is pid 1, every rank its child: a parent of pid 1 is the launcher
    alive, not init after it died (the rank signalled itself at once, so no parallel server started in such a
    container). Where pid 1's command cannot be read the rank runs on as well."""
    code = ("import os\nos.getppid = lambda: 1\n"
            f"import gigadecode.torchrun_rank as t\nt.command_of = lambda pid: {pid1!r}\n" + RANK)
    r = subprocess.run([sys.executable, "-c", code, "0.2"], capture_output=True, text=True, timeout=20,
                       env=_env(TORCHELASTIC_RUN_ID="t"))
    assert r.stdout.strip() == "armed" and r.returncode == 1, (r.returncode, r.stdout, r.stderr)


def test_nothing_is_armed_outside_torchrun():
    r = subprocess.run([sys.executable, "-c", RANK, "0"], capture_output=True, text=True, timeout=20, env=_env())
    assert r.stdout.strip() == "not armed" and r.returncode == 1, (r.returncode, r.stdout, r.stderr)
