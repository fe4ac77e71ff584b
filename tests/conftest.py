"""Shared test set-up. Triton runs its interpreter on CPU tensors, so the kernel tests exercise the
real kernel code on machines without a GPU; the variable must be set before triton is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny models: one thread runs them fastest and does not fight other processes
    for the cores (under contention, a second spinning thread made single steps take seconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
