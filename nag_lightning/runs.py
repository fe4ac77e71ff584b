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
"""

from __future__ import annotations

import csv
import importlib
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_VERSION = re.compile(r"version_(\d+)")
# Environment variables through which launchers (torchrun, SLURM, Lightning's own) give a process
# its rank; only the first process of a job claims a folder.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "NODE_RANK", "GROUP_RANK")


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
    from nag_lightning.checkpoint import read_saved

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
    claimed: list[Path] = field(default_factory=list)  # folders this process created
    resume_step: int | None = None  # set when `fit` continues an existing version folder
    kept_metrics: dict[Path, list[dict[str, str]]] = field(default_factory=dict)

    def release(self) -> None:
        """Remove the claimed folders again if nothing was written into them (e.g. bad input)."""
        for path in self.claimed:
            try:
                path.rmdir()
            except OSError:
                pass

    def attach(self, trainer: Any) -> None:
        """After the loggers exist: give the CSV logger of a resumed run its earlier metrics back.

        Lightning's CSV logger deletes an existing metrics.csv in a folder that holds other files;
        the rows logged before the checkpoint's step are written back at once.
        """
        from lightning.pytorch.loggers import CSVLogger

        for logger in trainer.loggers:
            if not isinstance(logger, CSVLogger):
                continue
            rows = self.kept_metrics.get(Path(logger.log_dir).resolve())
            if rows is None:
                continue
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", ".*Previous log files in this directory will be deleted.*")
                experiment = logger.experiment
            experiment.metrics[:0] = [{k: v for k, v in row.items() if v != ""} for row in rows]
            experiment.save()


def _metrics_before(folder: Path, step: int) -> list[dict[str, str]] | None:
    path = folder / "metrics.csv"
    if not path.is_file():
        return None
    with open(path, newline="") as file:
        return [row for row in csv.DictReader(file) if row.get("step", "") != "" and int(row["step"]) < step]


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
        folder.version = claim_version(roots)
        folder.claimed = [root / f"version_{folder.version}" for root in dict.fromkeys(roots)]
    else:
        return folder  # other ranks: rank 0's folder reaches them through Lightning's broadcasts
    for args in unversioned:
        args.version = folder.version
    return folder
