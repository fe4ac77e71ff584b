"""Commands whose options are a function's typed arguments: the parser built from a signature and
its docstring, and errors re-worded to name the flag the user typed. Every command of
`nag-lightning` outside LightningCLI's parses its options here, whichever layer it lives in.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from contextlib import contextmanager


@contextmanager
def flags_named(names: Iterable[str], section: str = "data"):
    """Re-word an error that names a setting `section.X` (as `fit` spells it) to name the running
    command's own flag `--X`, for each X in `names`: the sentence must name what the user typed."""
    try:
        yield
    except (ValueError, FileNotFoundError) as error:
        pattern = rf"\b{re.escape(section)}\.({'|'.join(map(re.escape, names))})\b"
        text = re.sub(pattern, r"--\1", str(error))
        if text == str(error):
            raise
        raise type(error)(text) from None


def summary(function: Callable) -> str:
    """A function's docstring without its Args section, which a parser's option list shows."""
    return (function.__doc__ or "").split("Args:")[0].strip()


def function_parser(function: Callable, prog: str, description: str | None = None,
                    skip: Iterable[str] = ()):
    """The parser of a command whose options are `function`'s typed arguments, each with the help
    its docstring gives it, under `description` (default: the docstring above its Args)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog=prog, description=summary(function) if description is None else description)
    parser.add_function_arguments(function, skip=set(skip))
    return parser
