"""Shared test set-up. Triton runs its interpreter on CPU tensors, so the kernel tests exercise the
real kernel code on machines without a GPU; the variable must be set before triton is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
if "PYTEST_XDIST_WORKER" in os.environ:
    # Workers run side by side, one per core: each (and every process a test starts) takes one
    # thread, since threads that spin for a core another worker holds slow both down many times.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys  # noqa: E402
from importlib.metadata import PackageNotFoundError, distribution  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


def import_pypi_kernels() -> None:
    """Import PyPI's `kernels` package, which transformers 5 imports, from where it is installed.
    pytest puts the checkout's root first on sys.path, and there the folder kernels/ (installed as
    nag_kernels) would shadow it: transformers would then fail to import its models."""
    try:
        distribution("kernels")
    except PackageNotFoundError:
        return
    root = Path(__file__).resolve().parents[1]
    path = sys.path[:]
    sys.path[:] = [p for p in path if Path(p or ".").resolve() != root]
    try:
        import kernels  # noqa: F401
    except ImportError:  # broken where it is installed: only the tests that use transformers fail
        pass
    finally:
        sys.path[:] = path


import_pypi_kernels()

WORDS = "def class return self import for in if else print value index".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, request) -> Path:
    """A small text corpus of repeated keywords, one per test module that asks for it (a module
    may define its own `corpus`)."""
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]) / "corpus.txt"
    path.write_text(" ".join(WORDS[i * 5 % len(WORDS)] for i in range(4000)))
    return path


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny models: one thread runs them fastest and does not fight other processes
    for the cores (under contention, a second spinning thread made single steps take seconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_plugins(monkeypatch):
    """The registries with only this package's plugins, whatever else is installed: a test that
    names an unknown plugin or lists the registered names must not depend on the environment."""
    from nag_lightning.residuals import RESIDUALS
    from nag_lightning.routers import ROUTERS

    for registry in (RESIDUALS, ROUTERS):
        built_in = {k: v for k, v in registry._classes.items() if v.__module__.startswith("nag_lightning.")}
        monkeypatch.setattr(registry, "_classes", built_in)
        monkeypatch.setattr(registry, "_entry_points", {})
