"""Helpers shared by the tests that run the command in-process."""

from __future__ import annotations

from pathlib import Path

from nag_lightning.cli import main

DEBUG = str(Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml")


def fit_args(text: Path, *extra: str) -> list[str]:
    """`fit` of the debug recipe on the corpus `text` for 3 steps, its cache beside it."""
    return ["fit", "--config", DEBUG, f"--data.source={text}", f"--data.cache_dir={text.parent / 'cache'}",
            "--trainer.enable_progress_bar=false", "--trainer.max_steps=3", *extra]


def run_command(args: list[str], capsys) -> tuple[int, str, str]:
    """Run `nag-lightning ARGS` in-process; return its exit status, stdout and stderr. Give
    `capsysbinary` for a command whose output need not be UTF-8 (generate writes bytes)."""
    try:
        main(args)
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    if isinstance(out, bytes):
        out, err = out.decode("utf-8", errors="replace"), err.decode("utf-8", errors="replace")
    return status, out, err


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """Run `nag-lightning ARGS` in-process; return its exit status and stderr."""
    status, _, err = run_command(args, capsys)
    return status, err
