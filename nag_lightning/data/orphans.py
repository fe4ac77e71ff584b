"""What an interrupted data preparation must not leave behind: processes and temporary folders.

Tokenizing runs litdata `optimize` in a child process, which forks litdata's own workers. Killed
with SIGKILL, the parent cannot stop them, and they went on for minutes holding hundreds of MB. On
Linux the child and every process it forks ask the kernel for SIGKILL when their parent dies
(`prctl(PR_SET_PDEATHSIG)`), so the whole tree goes with the parent.

Work goes into a temporary folder renamed into place at the end. Its name carries its owner (host,
pid, process start time), so a later run can tell a folder whose owner died, and delete it, from a
folder another live process is still writing, which it leaves alone.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import sys
import threading
import uuid
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# `.<anything>.tmp-<host>-<pid>-<start>-<random>`: hidden, so nothing mistakes it for a result.
_OWNED = re.compile(r"\..+\.tmp-(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-(?P<start>\d+)-[0-9a-f]{8}")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "localhost"


def _process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, Linux), None if unknown or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return None if fields[0] == "Z" else int(fields[19])


def owned_name(name: str) -> str:
    """A fresh temporary folder name for `name`, `.<name>.tmp-<host>-<pid>-<start>-<random>`."""
    start = _process_start(os.getpid()) or 0
    return f".{name}.tmp-{_host()}-{os.getpid()}-{start}-{uuid.uuid4().hex[:8]}"


def _owner_alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    if sys.platform.startswith("linux"):
        actual = _process_start(pid)
        return actual is not None and (start == 0 or actual == start)  # else the pid was reused
    return True


def remove_orphaned(folder: Path) -> list[Path]:
    """Delete the `owned_name` folders in `folder` whose owner on this host died; return them.

    Folders of other hosts (a shared file system) and of live processes are left alone.
    """
    removed = []
    host = _host()
    for path in folder.iterdir() if folder.is_dir() else []:
        match = _OWNED.fullmatch(path.name)
        if not match or match["host"] != host or not path.is_dir():
            continue
        if not _owner_alive(int(match["pid"]), int(match["start"])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def die_with_parent(parent_pid: int) -> None:
    """Process initializer: SIGKILL this process when `parent_pid` dies, and every process it
    forks when that one dies (Linux; elsewhere nothing is done).

    The kernel sends the signal when the *thread* that forked a process ends, so processes forked
    from other threads than the main one are not armed: they would be killed when that thread
    finishes, not when their parent does.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)

    def arm(expected_parent: int) -> None:
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() != expected_parent:
            os._exit(1)  # the parent died before the signal was armed

    arm(parent_pid)
    forking: dict[str, object] = {}

    def before() -> None:
        forking["pid"] = os.getpid()
        forking["main"] = threading.current_thread() is threading.main_thread()

    def after_in_child() -> None:
        if forking.get("main"):
            arm(forking["pid"])

    os.register_at_fork(before=before, after_in_child=after_in_child)
