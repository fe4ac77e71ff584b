"""Checkpoints are untrusted input: what loading one may do, and what it may not.

Reading: a checkpoint is unpickled with `torch.load(weights_only=True)` wherever it lives (a local
file, an http(s) URL, an fsspec URI such as s3:// or file://), so loading builds tensors and plain
data and never calls code. A file that is not a readable checkpoint fails with one sentence, and
torch's own message (which suggests `weights_only=False`) is never passed on.

Plugins: plain data can still name code. A checkpoint's `residual` and `router` settings may hold a
class path (`{class_path: ..., init_args: ...}` or a dotted string) that building the model would
import and call with the saved arguments. Read from a checkpoint, such a setting resolves only
through the registries (built-ins and installed entry points); any other class path is refused
unless the user trusts the checkpoint (`--trust_checkpoint`) or configured that same class path
themselves (their own YAML or command line, as at fit time).
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

import torch

from nag_lightning.checkpoints.settings import ARCH, saved_architecture
from nag_lightning.inputs import shorten
from nag_lightning.registry import Registry
from nag_lightning.residuals import RESIDUALS
from nag_lightning.routers import ROUTERS

TRUST_FLAG = "--trust_checkpoint"
TRUST_HELP = (
    "Let a checkpoint's residual or router setting import and call a class path outside the "
    "registered plugins (built-ins and installed entry points); only for checkpoints whose origin "
    "you trust."
)
PLUGIN_SETTINGS: dict[str, Registry] = {"residual": RESIDUALS, "router": ROUTERS}
# Lightning builds a model from all three (the last two are names of old Lightning releases), so a
# check must look at each.
HPARAM_KEYS = ("hyper_parameters", "hparams", "module_arguments")


def is_remote(path: str | Path) -> bool:
    return "://" in str(path)


def read_checkpoint(path: str | Path | IO[bytes], map_location: Any = "cpu") -> dict:
    """The checkpoint at `path` (a local file or a URL), loaded with weights_only=True.

    Raises one sentence (FileNotFoundError or ValueError) when it is missing, cannot be fetched,
    is not a checkpoint, or holds objects other than tensors and plain data.
    """
    if hasattr(path, "read"):  # an open file or buffer, left where it was found for the next reader
        start = path.tell()
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
        path.seek(start)
        return checkpoint
    path = str(path)
    if not is_remote(path) and Path(path).is_dir():
        raise ValueError(
            f"The checkpoint {path} is a folder, a sharded checkpoint, which this command does not "
            "read (torch.distributed.checkpoint would unpickle its non-tensor entries in full); "
            "train with a strategy that writes one file (ModelParallelStrategy with "
            "save_distributed_checkpoint: false, FSDPStrategy with state_dict_type: full)."
        )
    if not is_remote(path) and not Path(path).is_file():
        raise FileNotFoundError(
            f"The checkpoint {path} does not exist; give the path of a .ckpt file written by an "
            "earlier run (e.g. <run dir>/checkpoints/last.ckpt)."
        )
    try:
        source = _fetch(path)
    except ValueError:
        raise
    except Exception as error:  # not found, refused, no network, no credentials, no fsspec driver
        raise _inaccessible(path, error) from None
    try:
        with warnings.catch_warnings():
            # torch warns about pickle protocols of files it then refuses; the refusal is what counts
            warnings.simplefilter("ignore")
            checkpoint = torch.load(source, map_location=map_location, weights_only=True)
    except PermissionError as error:
        raise _inaccessible(path, error) from None
    except pickle.UnpicklingError as error:
        _forget(path, source)
        if "global" in str(error).lower():  # the weights-only unpickler met a class or function
            raise ValueError(
                f"The checkpoint {path} holds objects other than tensors and plain data, which "
                "could run code when loaded, so it was not loaded; give a checkpoint written by "
                "`nag-lightning fit`."
            ) from None
        raise _unreadable(path) from None
    except Exception:  # truncated, empty or random bytes: torch's message would only mislead
        _forget(path, source)
        raise _unreadable(path) from None
    finally:
        if hasattr(source, "close"):
            source.close()
    if not isinstance(checkpoint, dict):
        raise _unreadable(path)
    return checkpoint


def _fetch(path: str) -> str | IO[bytes]:
    """A local path to load, or an open remote file."""
    if path.startswith(("http://", "https://")):
        return _download(path)
    if is_remote(path):
        from lightning.fabric.utilities.cloud_io import get_filesystem

        return get_filesystem(path).open(path, "rb")
    return path


def _download(url: str) -> str:
    """Fetch `url` afresh into the file Lightning's loader reads it from (torch.hub's checkpoint
    cache), so the Trainer restores the very bytes checked here, never an older file that happens
    to share the name."""
    name = urlparse(url).path.rpartition("/")[2]
    if name in ("", ".", ".."):  # the download would land in the cache folder itself
        raise ValueError(
            f"The checkpoint address {url} names no file (it ends in '/', '.' or '..'); give the "
            "address of a .ckpt file, e.g. .../checkpoints/last.ckpt."
        )
    cached = Path(torch.hub.get_dir(), "checkpoints", name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    torch.hub.download_url_to_file(url, str(cached), progress=False)
    return str(cached)


def _forget(path: str, source: str | IO[bytes]) -> None:
    """Delete a refused download, so no later loader (one that trusts URLs) finds it in the cache."""
    if isinstance(source, str) and source != path:
        Path(source).unlink(missing_ok=True)


def _inaccessible(path: str, error: Exception) -> ValueError:
    reason = getattr(error, "reason", None) or error
    return ValueError(
        f"The checkpoint {path} could not be read ({type(error).__name__}: {reason}); check the "
        "path or address and your access to it, or download the file and give its path."
    )


class UnreadableCheckpoint(ValueError):
    """A checkpoint file that is empty, truncated or not a torch file."""


def _unreadable(path: str) -> ValueError:
    return UnreadableCheckpoint(
        f"The checkpoint {path} is not a readable checkpoint (empty, truncated or not a torch "
        "file); give a .ckpt file written by `nag-lightning fit`, or copy it again."
    )


def plugin_class_path(spec: object) -> str | None:
    """The class path a residual or router setting names (a dotted string, or a mapping's
    `class_path`), or None for a short name, which the registry resolves or refuses by itself."""
    path = spec.get("class_path") if isinstance(spec, Mapping) else spec
    return path if isinstance(path, str) and "." in path else None


def untrusted_plugins(settings: Mapping, configured: Mapping | None = None) -> list[str]:
    """`model.arch.<setting>='<class path>'` for each plugin in `settings` (a checkpoint's saved
    settings, in any layout `nag_lightning.checkpoints.settings` reads) named by a class path that neither
    a registry knows nor `configured` (the user's own model settings) names too."""
    found = []
    own = saved_architecture(configured or {})
    arch = settings.get(ARCH)
    # the architecture where it is saved now, and flat where checkpoints saved it before: both
    for saved in (settings, arch if isinstance(arch, Mapping) else {}):
        for key, registry in PLUGIN_SETTINGS.items():
            path = plugin_class_path(saved.get(key))
            if path is None or registry.knows(path):
                continue
            if plugin_class_path(own.get(key)) == path:
                continue  # the user wrote this class path in their own config: their code, their call
            found.append(f"model.arch.{key}={shorten(repr(path))}")
    return found


def check_plugins(
    checkpoint: Mapping,
    source: str | Path,
    trusted: bool,
    configured: Mapping | None = None,
    replaced: Iterable[str] = (),
) -> None:
    """Refuse, in one sentence, a checkpoint whose saved settings name code outside the registries,
    unless `trusted`. Settings in `replaced` are overridden by the caller and never built."""
    if trusted:
        return
    replaced = set(replaced)
    found: list[str] = []
    for key in HPARAM_KEYS:
        settings = checkpoint.get(key)
        if isinstance(settings, Mapping):
            found += untrusted_plugins(
                {k: v for k, v in settings.items() if k not in replaced}, configured
            )
    if found:
        raise ValueError(
            f"The checkpoint {source} names code by class path ({', '.join(dict.fromkeys(found))}) "
            "that no registry knows, and a checkpoint's settings may come from anyone; install "
            f"that plugin with an entry point, or pass {TRUST_FLAG} if you trust the checkpoint's "
            "origin."
        )
