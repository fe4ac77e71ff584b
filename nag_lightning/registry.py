"""A tiny registry of plugins by short name (the timm pattern).

Residual strategies and routers each keep one `Registry`. A plugin registers with a decorator that
refuses duplicate names; a lookup accepts a registered short name, a dotted `module.Class` path, or a
YAML-style `{"class_path": ..., "init_args": {...}}` mapping, and an unknown name fails with the list
of names that exist. Third-party packages register through a Python entry-point group; an entry
point is imported when its name is looked up, so a broken or clashing plugin fails the commands
that use it, with a sentence naming its distribution, and no other.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps short names to plugin classes of one kind.

    Args:
        kind: what the plugins are, used in error messages ("residual strategy").
        entry_point_group: the `importlib.metadata` group third-party plugins register under.
    """

    def __init__(self, kind: str, entry_point_group: str) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self._classes: dict[str, type[T]] = {}
        self._entry_points: dict[str, EntryPoint] | None = None  # found on first lookup

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: `@RESIDUALS.register("nag")`. A name can be registered only once."""

        def decorator(cls: type[T]) -> type[T]:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(
                    f"A {self.kind} named {name!r} is already registered "
                    f"({self._classes[name].__module__}.{self._classes[name].__qualname__}); "
                    "pick another name."
                )
            self._classes[name] = cls
            cls.registry_name = name  # type: ignore[attr-defined]
            return cls

        return decorator

    def names(self) -> list[str]:
        """The registered short names, built-in and third-party."""
        return sorted({*self._classes, *self._find_entry_points()})

    def knows(self, name: str) -> bool:
        """Whether `name` is a registered short name or the dotted path of a registered class, so
        resolving it imports nothing the package or an installed entry point did not already load."""
        return name in self._classes or name in self._find_entry_points() or any(
            name == f"{cls.__module__}.{cls.__qualname__}" for cls in self._classes.values()
        )

    def get(self, name: str) -> type[T]:
        """The class for a short name or a dotted `module.Class` path."""
        entry_point = self._find_entry_points().get(name)
        if entry_point is not None:
            return self._load(entry_point)
        if name in self._classes:
            return self._classes[name]
        if "." in name:
            return _import_class(name, self.kind)
        raise ValueError(
            f"Unknown {self.kind} {name!r}; registered: {', '.join(self.names())}. "
            "Register a new one with its decorator, an entry point in the "
            f"{self.entry_point_group!r} group, or give its dotted class path."
        )

    def resolve(self, spec: str | Mapping[str, Any]) -> tuple[type[T], dict[str, Any]]:
        """Turn a YAML spec (a name, or `{class_path, init_args}`) into a class and its options."""
        if isinstance(spec, str):
            return self.get(spec), {}
        if isinstance(spec, Mapping) and "class_path" in spec:
            unknown = set(spec) - {"class_path", "init_args"}
            if unknown:
                raise ValueError(
                    f"A {self.kind} given by class_path takes only 'class_path' and 'init_args'; "
                    f"remove {sorted(unknown)}."
                )
            return self.get(spec["class_path"]), dict(spec.get("init_args") or {})
        raise ValueError(
            f"A {self.kind} must be a registered name or a mapping with 'class_path'; got {spec!r}."
        )

    def check_options(
        self, cls: type, options: Mapping[str, Any], supplied: tuple[str, ...], setting: str
    ) -> None:
        """Refuse, listing the accepted names, an option `cls`'s constructor does not take
        (`supplied`: the arguments the builder passes itself; `setting`: where options come from)."""
        parameters = inspect.signature(cls).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return  # takes anything; it will say so itself
        accepted = [
            name for name, p in parameters.items()
            if name not in supplied
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            name = getattr(cls, "registry_name", cls.__qualname__)
            raise ValueError(
                f"{setting} has {', '.join(map(repr, unknown))}, which the {self.kind} {name!r} "
                f"does not take; it accepts: {', '.join(accepted) or 'no options'}."
            )

    def _find_entry_points(self) -> dict[str, EntryPoint]:
        if self._entry_points is None:
            self._entry_points = {ep.name: ep for ep in entry_points(group=self.entry_point_group)}
        return self._entry_points

    def _load(self, entry_point: EntryPoint) -> type[T]:
        """Import an entry point's class and register it, or say in one sentence why not."""
        dist = entry_point.dist.name if entry_point.dist is not None else "an unknown distribution"
        taken = self._classes.get(entry_point.name)
        if taken is not None and _path(taken) != entry_point.value.replace(":", "."):
            raise ValueError(
                f"The {self.kind} name {entry_point.name!r} is taken twice: by {_path(taken)} and by "
                f"the entry point {entry_point.value!r} of the package {dist!r} (group "
                f"{self.entry_point_group!r}); uninstall {dist} or rename its entry point."
            )
        try:
            cls = entry_point.load()
        except Exception as error:  # any import-time failure of someone else's package
            raise ValueError(
                f"The {self.kind} {entry_point.name!r} of the package {dist!r} failed to import "
                f"({type(error).__name__}: {error}); reinstall or fix {dist}, or use another "
                f"{self.kind}."
            ) from None
        return self.register(entry_point.name)(cls)


def plugin_name(cls: type) -> str:
    """What messages and tables call a plugin class: its registered name, else its class name (a
    plugin named by class path registers nowhere)."""
    return getattr(cls, "registry_name", cls.__qualname__)


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _import_class(path: str, kind: str) -> type:
    """Import `module.Class`. A module not found on sys.path is looked for in the working directory
    too, as `python -m` would: a plugin in a .py file next to the recipe needs no PYTHONPATH."""
    if not all(part.isidentifier() for part in path.split(".")):
        raise ValueError(
            f"{path!r} is neither a registered {kind} nor the dotted path of a class "
            "(package.module.Class); give one of these."
        )
    module_name, _, class_name = path.rpartition(".")
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            cwd = os.getcwd()
            if error.name != module_name.split(".")[0] or cwd in sys.path or "" in sys.path:
                raise
            sys.path.append(cwd)  # last: an installed package of the same name still wins
            module = importlib.import_module(module_name)
        return getattr(module, class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Cannot import the {kind} class {path!r} ({error}); check the path.") from None
