"""Shared test set-up. Triton runs its interpreter on CPU tensors, so the kernel tests exercise the
real kernel code on machines without a GPU; the variable must be set before triton is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
