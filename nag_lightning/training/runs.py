"""Run folders: one run writes into one `<save_dir>/<name>/version_N`, claimed atomically, and
`--ckpt_path last` finds that folder again.

Lightning's CSV and TensorBoard loggers each pick "the next free version" on their own, lazily, so
the two loggers of one run split it over version_0 and version_1 (the first creates its folder
before the second looks), and two runs started together in one folder could pick the same one.
Here the version is chosen once per run, before any logger exists, by creating the folder:
`os.mkdir` either creates it or fails, so two processes never claim the same version. Every CSV and
TensorBoard logger of the run gets that version, and with the first logger's folder come the
checkpoints, config.yaml and the depth diagnostics.

`--ckpt_path last` means "continue this run": the newest version folder under the first logger's
`<save_dir>/<name>` whose `checkpoints/last.ckpt` exists (with `checkpoint.dirpath` set, that
folder's `last.ckpt`; without loggers, `<default_root_dir>/checkpoints/last.ckpt`). `fit` then
continues in that same version folder: the loggers append to it, and the metrics logged after the
checkpoint's step by the interrupted run are dropped, since the resumed run logs those steps again.
When no such checkpoint exists, one line says so and a new run starts, which is what the first
submission of a requeued cluster job needs.

A run being trained is locked: `fit` holds an exclusive lock on `.lock` in its folder for as long
as it runs (the operating system drops it when the process ends, crashed or not), so a second
`--ckpt_path last` of the same run is refused instead of writing the same steps into it again.
A command refused for bad input removes the folder it claimed, unless something worth keeping
(a checkpoint, a logged metric, a training step) was written into it.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nag_lightning.inputs import output_folder

_VERSION = re.compile(r"version_(\d+)")
# Environment variables through which launchers (torchrun, SLURM, Lightning's own) give a process
# its rank; only the first process of a job claims a folder.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "NODE_RANK", "GROUP_RANK")
LOCK_NAME = ".lock"


def versions(root: Path) -> list[int]:
    """The N of every `version_N` folder directly under `root`."""
    if not root.is_dir():
        return []
    return [int(m.group(1)) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name)) and p.is_dir()]


def claim_version(roots: list[Path]) -> int:
    """Create `version_N` under every root, N one more than any existing there, and return N.

    `mkdir` is the claim: it fails if another process made the folder first, and then the next N
    is tried (folders made for a lost N are empty and removed again).
    """
    roots = list(dict.fromkeys(roots))
    n = max((v for root in roots for v in versions(root)), default=-1) + 1
    while True:
        made: list[Path] = []
        try:
            for root in roots:
                root.mkdir(parents=True, exist_ok=True)
                (root / f"version_{n}").mkdir()
                made.append(root / f"version_{n}")
            return n
        except FileExistsError:
            for path in made:
                path.rmdir()
            n += 1


def latest_run(root: Path) -> tuple[int, Path] | None:
    """(N, checkpoint) of the highest `version_N` under `root` holding `checkpoints/last.ckpt`."""
    for n in sorted(versions(root), reverse=True):
        last = root / f"version_{n}" / "checkpoints" / "last.ckpt"
        if last.is_file():
            return n, last
    return None


def checkpoint_step(path: Path) -> int:
    """The global step a checkpoint holds, read by the one checkpoint reader."""
    from nag_lightning.checkpoints.reader import read_saved

    return read_saved(path).global_step


def _is_first_process() -> bool:
    return all(os.environ.get(name, "0") == "0" for name in _RANK_VARIABLES)


def _folder_loggers(logger_config: Any) -> list[Any]:
    """The `init_args` of the configured loggers that write into `<save_dir>/<name>/version_N`."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    entries = logger_config if isinstance(logger_config, list) else [logger_config]
    found = []
    for entry in entries:
        class_path = getattr(entry, "class_path", None)
        if not isinstance(class_path, str) or "." not in class_path:
            continue
        module, _, name = class_path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue  # LightningCLI reports it when it instantiates the logger
        if isinstance(cls, type) and issubclass(cls, (CSVLogger, TensorBoardLogger)):
            found.append(entry.init_args)
    return found


def _root(init_args: Any) -> Path:
    return Path(init_args.save_dir).expanduser() / (init_args.name or "")


@dataclass
class RunFolder:
    """The version folder this run writes into, and what resuming in it needs."""

    version: int | None = None
    claimed: list[Path] = field(default_factory=list)  # version folders this process created
    new_parents: list[Path] = field(default_factory=list)  # and the folders made to hold them
    resume_step: int | None = None  # set when `fit` continues an existing version folder
    kept_metrics: dict[Path, list[dict[str, str]]] = field(default_factory=dict)
    lock: Any = None  # the open lock file of the folder `fit` writes into, while it runs

    def release(self, trained: bool = False) -> None:
        """Remove the folders this command created, and what it wrote into them, when it is
        refused: unless it `trained` a step, or wrote a checkpoint or a row of metrics there."""
        self.unlock()
        if trained or any(_holds_results(path) for path in self.claimed if path.is_dir()):
            return
        for path in self.claimed:
            shutil.rmtree(path, ignore_errors=True)
        for path in reversed(self.new_parents):  # innermost first
            try:
                path.rmdir()
            except OSError:
                pass  # another run's folder is in it now

    def unlock(self) -> None:
        """Let another process resume the run (the lock also goes when the process ends)."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def attach(self, trainer: Any) -> None:
        """After the loggers exist: give the CSV logger of a resumed run its earlier metrics back.

        Lightning's CSV logger deletes an existing metrics.csv in a folder that holds other files
        (and warns so); the rows logged before the checkpoint's step are written back at once. In a
        new run's folder the only other file is the run's lock, so there is nothing to warn of.
        """
        from lightning.pytorch.loggers import CSVLogger

        fresh = {path.resolve() for path in self.claimed}
        for logger in trainer.loggers:
            if not isinstance(logger, CSVLogger):
                continue
            log_dir = Path(logger.log_dir).resolve()
            rows = self.kept_metrics.get(log_dir)
            if rows is None and log_dir not in fresh:
                continue
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", ".*Previous log files in this directory will be deleted.*")
                experiment = logger.experiment
            if rows is not None:
                experiment.metrics[:0] = [{k: v for k, v in row.items() if v != ""} for row in rows]
                experiment.save()


def _holds_results(folder: Path) -> bool:
    """Whether `folder` holds a checkpoint, or a metrics.csv with a row beneath its header."""
    if any(folder.rglob("*.ckpt")):
        return True
    for metrics in folder.rglob("metrics.csv"):
        with open(metrics, "rb") as file:
            file.readline()  # the header
            if file.readline():
                return True
    return False


def lock_run(folder: Path) -> Any:
    """Take the exclusive lock of the run in `folder` and return its open file; one sentence if
    another process holds it. Where the platform has no `fcntl` (Windows), or the folder takes no
    new file (the run then fails on its first write, and says so), runs are not locked."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        handle = open(folder / LOCK_NAME, "a")
    except OSError:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ValueError(
            f"The run in {folder} is being trained by another process, which holds {folder / LOCK_NAME}; "
            "wait until it ends (or stop it) before resuming it, or start a new run without "
            "--ckpt_path last."
        ) from None
    return handle


def _new_parents(paths: list[Path]) -> list[Path]:
    """The folders above `paths` that do not exist yet, each after the folders above it."""
    missing = [parent for path in paths for parent in reversed(path.parents) if not parent.exists()]
    return list(dict.fromkeys(missing))


def _run_of(checkpoint: Path) -> Path:
    """The folder of the run a checkpoint belongs to: the version folder above `checkpoints/`,
    else the checkpoint's own folder (`checkpoint.dirpath`)."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent


def _metrics_before(folder: Path, step: int) -> list[dict[str, str]] | None:
    from nag_lightning.training.metrics import metric_step, metrics_rows

    path = folder / "metrics.csv"
    if not path.is_file():
        return None
    return [row for line, row in metrics_rows(path)
            if row.get("step", "") != "" and metric_step(row["step"], path, line) < step]


def _resolve_last(config: Any, loggers: list[Any]) -> tuple[Path | None, int | None]:
    """The checkpoint `--ckpt_path last` names, and the version folder it lies in (if a logger's)."""
    dirpath = getattr(config.checkpoint, "dirpath", None) if "checkpoint" in config else None
    if dirpath:
        last = Path(dirpath).expanduser() / "last.ckpt"
        return (last if last.is_file() else None), None
    if not loggers:
        last = Path(config.trainer.default_root_dir or ".").expanduser() / "checkpoints" / "last.ckpt"
        return (last if last.is_file() else None), None
    first = loggers[0]
    if first.version is not None:  # the user named the version: continue that one
        name = first.version if isinstance(first.version, str) else f"version_{first.version}"
        last = _root(first) / name / "checkpoints" / "last.ckpt"
        return (last if last.is_file() else None), None
    found = latest_run(_root(first))
    return (found[1], found[0]) if found else (None, None)


def check_output_folders(config: Any, loggers: list[Any]) -> None:
    """One sentence, before any folder is made, if a local folder the run writes into (a logger's
    save_dir, trainer.default_root_dir, checkpoint.dirpath) lies inside a file or is not writable."""
    folders = [(args.save_dir, "trainer.logger save_dir") for args in loggers]
    if "trainer" in config:
        folders.append((config.trainer.get("default_root_dir"), "trainer.default_root_dir"))
    if "checkpoint" in config:
        folders.append((config.checkpoint.get("dirpath"), "checkpoint.dirpath"))
    for path, option in folders:
        if path and "://" not in str(path):
            output_folder(path, option)


def prepare_run_folder(config: Any, subcommand: str | None,
                       step_of: Callable[[str], int] = checkpoint_step) -> RunFolder:
    """Resolve `ckpt_path: last` and give every folder logger of the run one claimed version.

    `config` is the parsed configuration of the subcommand (LightningCLI's namespace); it is
    edited in place: `ckpt_path` becomes a file path (or None), and each CSV/TensorBoard logger
    without a version of its own gets the run's version. `step_of(path)` gives the step of the
    checkpoint resumed from (the command line passes its own reader, so the file is read once).
    """
    folder = RunFolder()
    loggers = _folder_loggers(config.trainer.logger) if "trainer" in config else []
    check_output_folders(config, loggers)
    first_process = _is_first_process()
    resume_version = None
    if subcommand and config.get("ckpt_path") == "last":
        last, resume_version = _resolve_last(config, loggers)
        if last is None:
            config.ckpt_path = None
            if first_process:
                where = _root(loggers[0]) if loggers else "the checkpoint folder"
                print(f"nag-lightning: no last.ckpt of an earlier run in {where}; starting a new run.",
                      file=sys.stderr)
        else:
            config.ckpt_path = str(last)
            if first_process and subcommand == "fit":
                folder.lock = lock_run(_run_of(last))
            if first_process:
                print(f"nag-lightning: resuming from {last}.", file=sys.stderr)
        if subcommand != "fit":
            resume_version = None  # validate/test/predict log into a folder of their own
    unversioned = [args for args in loggers if args.version is None]
    if not unversioned:
        return folder
    if resume_version is not None:
        folder.version = resume_version
        folder.resume_step = step_of(config.ckpt_path)
        for args in unversioned:
            path = _root(args) / f"version_{resume_version}"
            path.mkdir(parents=True, exist_ok=True)
            rows = _metrics_before(path, folder.resume_step) if first_process else None
            if rows is not None:
                folder.kept_metrics[path.resolve()] = rows
            if "purge_step" in args and args.purge_step is None:  # TensorBoard drops later events
                args.purge_step = folder.resume_step
    elif first_process:
        roots = [_root(args) for args in unversioned]
        folder.new_parents = _new_parents([root / "version_0" for root in roots])
        folder.version = claim_version(roots)
        folder.claimed = [root / f"version_{folder.version}" for root in dict.fromkeys(roots)]
        if subcommand == "fit":
            folder.lock = lock_run(folder.claimed[0])
    else:
        return folder  # other ranks: rank 0's folder reaches them through Lightning's broadcasts
    for args in unversioned:
        args.version = folder.version
    return folder
