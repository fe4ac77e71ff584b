"""A tiny registry of plugins by short name (the timm pattern).

Residual strategies and routers each keep one `Registry`. A plugin registers with a decorator that
refuses duplicate names; a lookup accepts a registered short name, a dotted `module.Class` path, or a
YAML-style `{"class_path": ..., "init_args": {...}}` mapping, and an unknown name fails with the list
of names that exist. Third-party packages register through a Python entry-point group, loaded on the
first lookup.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
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
        self._entry_points_loaded = False

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
        self._load_entry_points()
        return sorted(self._classes)

    def knows(self, name: str) -> bool:
        """Whether `name` is a registered short name or the dotted path of a registered class, so
        resolving it imports nothing the package or an installed entry point did not already load."""
        self._load_entry_points()
        return name in self._classes or any(
            name == f"{cls.__module__}.{cls.__qualname__}" for cls in self._classes.values()
        )

    def get(self, name: str) -> type[T]:
        """The class for a short name or a dotted `module.Class` path."""
        self._load_entry_points()
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

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for entry_point in entry_points(group=self.entry_point_group):
            cls = entry_point.load()
            self.register(entry_point.name)(cls)


def _import_class(path: str, kind: str) -> type:
    module_name, _, class_name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Cannot import the {kind} class {path!r} ({error}); check the path.") from None
