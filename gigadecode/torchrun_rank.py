"""A process that torchrun started (a rank of a parallel `serve` or `generate`) stops when torchrun dies.

torchrun starts every rank in a session of its own (`start_new_session`), so killing torchrun's process group
misses them, and a torchrun that is SIGKILLed cannot forward anything: its ranks would serve on, holding the
port, with nobody left to stop them. `stop_with_launcher` asks Linux to send this process SIGTERM when its
parent dies (prctl PR_SET_PDEATHSIG), which each command handles as it handles torchrun's own forwarded
SIGTERM (`serve`: rank 0 shuts the server down gracefully, failing the open requests with "the server is
shutting down", and tells the other ranks to stop). The parent is torchrun itself: its agent runs in the
torchrun process and starts the ranks from its main thread (the death signal follows the thread that forked
the process), so it fires when torchrun exits, however it exits.

No torch here: it runs first thing, before the imports that take seconds.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1            # <linux/prctl.h>


def started_by_torchrun(environ: dict | None = None) -> bool:
    """Whether torchrun's agent started this process (it sets TORCHELASTIC_RUN_ID for every rank)."""
    return "TORCHELASTIC_RUN_ID" in (os.environ if environ is None else environ)


def command_of(pid: int) -> list[str]:
    """A process's command line (empty where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def init_is_not_the_launcher() -> bool:
    """Whether pid 1 is surely not torchrun: its command line reads and runs no python (torchrun is a python
    process: `python .../torchrun`, `python -m torch.distributed.run`, a launcher script of one's own). pid 1
    may well be torchrun: a container's entrypoint, every rank its child while it lives."""
    argv = command_of(1)
    return bool(argv) and not os.path.basename(argv[0]).startswith(("python", "torchrun"))


def stop_with_launcher(sig: int = signal.SIGTERM) -> bool:
    """Under torchrun on Linux: have the kernel send `sig` to this process when its parent (torchrun) dies, and
    send it now if the parent died while this was armed, or before (this process then belongs to an init, pid 1,
    that is no python; a re-parenting to another subreaper before the call goes unseen). -> whether the signal is
    armed (False: not under torchrun, not Linux, or prctl refused; nothing changes then)."""
    if not started_by_torchrun() or not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:
        log.warning("cannot ask to be stopped when torchrun dies (prctl: %s): this rank outlives a killed torchrun", e)
        return False
    # the parent may have died between reading its pid and the prctl: this process was re-parented then, and no
    # death signal will ever come (the one that died is no longer its parent); or before reading it: a parent
    # of pid 1 is then an init (torchrun as pid 1, a container's entrypoint, is the parent alive)
    if os.getppid() != parent or parent == 1 and init_is_not_the_launcher():
        os.kill(os.getpid(), sig)
    return True
