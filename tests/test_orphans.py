"""A data preparation killed with SIGKILL leaves no processes running, and the next run removes the
temporary folder it left, but never one that a live process is writing."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nag_lightning.data import orphans, prepare_corpus

LINUX = sys.platform.startswith("linux")

# Tokenizes with a reader that announces itself and then hangs, as a long corpus would.
SLOW_PREPARE = """
import os, sys, time
from pathlib import Path
from nag_lightning import data
from nag_lightning.data import tokenizing

def hanging_reader(piece):
    Path(sys.argv[3], str(os.getpid())).touch()
    time.sleep(600)
    yield from ()

tokenizing._read_tokens = hanging_reader
data.prepare_corpus(sys.argv[1], sys.argv[2])
"""


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not LINUX, reason="processes die with their parent through Linux's prctl")
def test_sigkill_during_tokenization_leaves_no_process_and_the_rerun_cleans_up(tmp_path):
    corpus, cache, markers = tmp_path / "corpus.txt", tmp_path / "cache", tmp_path / "markers"
    corpus.write_bytes(bytes(random.Random(0).choices(range(1, 256), k=5000)))
    markers.mkdir()
    script = tmp_path / "slow_prepare.py"
    script.write_text(SLOW_PREPARE)
    job = subprocess.Popen([sys.executable, str(script), str(corpus), str(cache), str(markers)],
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        deadline = time.monotonic() + 120
        while not any(markers.iterdir()):
            assert job.poll() is None, "the preparation ended before its reader started"
            assert time.monotonic() < deadline, "the reader never started"
            time.sleep(0.2)
        workers = descendants(job.pid)
        assert {int(p.name) for p in markers.iterdir()} <= workers
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    deadline = time.monotonic() + 20
    while any(running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in workers if running(pid)]
    for pid in survivors:  # do not leave them behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "workers outlived their killed parent"

    [stale] = [p for p in cache.iterdir() if ".tmp-" in p.name]
    root = prepare_corpus(str(corpus), cache)
    assert (root / "meta.json").is_file() and not stale.exists()
    assert sorted(p.name for p in cache.iterdir()) == sorted(["CACHEDIR.TAG", root.name])


def test_only_folders_of_dead_owners_on_this_host_are_removed(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()
    me = orphans._process_start(os.getpid()) or 0
    host = orphans._host()
    folders = {
        "mine": orphans.owned_name("abc"),  # this live process
        "dead": f".abc.tmp-{host}-{finished.pid}-0-0123abcd",
        "other_host": f".abc.tmp-elsewhere-{finished.pid}-0-0123abcd",
        "not_ours": "abc.tmp-legacy",
        "cache": "0123456789abcdef",
    }
    if LINUX:  # a live pid that started at another time is a reused pid: its owner died
        folders["reused_pid"] = f".abc.tmp-{host}-{os.getpid()}-{me + 1}-0123abcd"
    for name in folders.values():
        (tmp_path / name).mkdir()
    removed = orphans.remove_orphaned(tmp_path)
    gone = {"dead", "reused_pid"} & folders.keys()
    assert sorted(removed) == sorted(tmp_path / folders[key] for key in gone)
    assert {p.name for p in tmp_path.iterdir()} == {folders[k] for k in folders.keys() - gone}
