"""Helpers shared by the tests that run the command in-process."""

from __future__ import annotations

from nag_lightning.cli import main


def run_command(args: list[str], capsys) -> tuple[int, str, str]:
    """Run `nag-lightning ARGS` in-process; return its exit status, stdout and stderr."""
    try:
        main(args)
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """Run `nag-lightning ARGS` in-process; return its exit status and stderr."""
    status, _, err = run_command(args, capsys)
    return status, err
