"""Benchmark the fused NAG write against the eager and torch.compile'd reference.

    python3 benchmarks/bench_nag_write.py                 # all d in {1024, 2048, 4096, 8192}, bf16 + fp32
    python3 benchmarks/bench_nag_write.py --d 4096 --dtype bf16 --rows 8192

On a CUDA device it times the forward and forward+backward of (a) the Triton kernel, (b) the eager
reference, (c) torch.compile of the reference, with triton.testing.do_bench, and reports achieved
bandwidth: the bytes the op must move (counted in `bytes_moved`, the same for all three: an
implementation that moves more just scores lower) divided by the time. The device's copy
bandwidth (a large tensor copy_) is measured in the same run as the ceiling.

Without a GPU it runs a tiny correctness sanity check (the reference, and the kernel in Triton's
CPU interpreter) and says so: CPU timings say nothing about GPU bandwidth.

The setting mirrors a training step: u, f, h_next in the given dtype; rho, theta, the gate g and
gamma in fp32; gradients arrive for u', rho' and h_next (theta is usually not in the loss).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

if not torch.cuda.is_available():
    # The interpreter must be chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.testing  # noqa: E402

import nag_kernels  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
THETA_MAX = math.pi / 2


def make_inputs(rows: int, d: int, dtype: torch.dtype, device: str, requires_grad: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    u = torch.randn(rows, d, device=device, generator=gen)
    u = (u / u.norm(dim=-1, keepdim=True)).to(dtype)
    f = torch.randn(rows, d, device=device, generator=gen).to(dtype)
    x = dict(
        u=u,
        f=f,
        rho=torch.randn(rows, device=device, generator=gen),
        g=torch.rand(rows, device=device, generator=gen),
        alpha=torch.tensor(0.5, device=device),
        beta=torch.tensor(0.1, device=device),
        gamma_next=torch.ones(d, device=device),
    )
    for v in x.values():
        v.requires_grad_(requires_grad)
    return x


def bytes_moved(rows: int, d: int, dtype: torch.dtype, backward: bool) -> int:
    """Minimum bytes to and from memory for one call (forward, or forward + backward).

    Forward: read u, f (rows x d, dtype), rho, g (rows, fp32), gamma (d, fp32); write u', h_next
    (rows x d, dtype), rho', theta (rows, fp32). Backward: read u, f, du', dh (rows x d), drho', g
    (rows); write du, df (rows x d), dg (rows); gamma and the alpha/beta/gamma reductions are
    O(d), negligible next to rows x d but counted.
    """
    e, s = torch.empty((), dtype=dtype).element_size(), 4
    fwd = 4 * rows * d * e + 4 * rows * s + d * s
    if not backward:
        return fwd
    bwd = 6 * rows * d * e + 3 * rows * s + 2 * d * s
    return fwd + bwd


def copy_bandwidth_gbs(device: str, nbytes: int = 2**30, bench=triton.testing.do_bench) -> float:
    """GB/s of a device-to-device copy_ of `nbytes` (1 GiB): one read and one write per byte.
    `bench(fn)` returns milliseconds per call (triton's do_bench; another timer off CUDA)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def implementations() -> dict:
    compiled = torch.compile(nag_kernels.nag_write_reference, dynamic=False)
    return {
        "triton": lambda x: nag_kernels.nag_write(**x, theta_max=THETA_MAX, backend="triton"),
        "eager": lambda x: nag_kernels.nag_write_reference(**x, theta_max=THETA_MAX),
        "compile": lambda x: compiled(**x, theta_max=THETA_MAX),
    }


def time_one(
    impl, rows: int, d: int, dtype: torch.dtype, backward: bool, device: str = "cuda",
    bench=triton.testing.do_bench,
) -> float:
    """Milliseconds per call of `impl` (forward, or forward + backward), timed by `bench`."""
    x = make_inputs(rows, d, dtype, device, requires_grad=backward)
    if not backward:
        with torch.no_grad():
            return bench(lambda: impl(x))
    gen = torch.Generator(device=device).manual_seed(1)
    gu = torch.randn(rows, d, device=device, generator=gen).to(dtype)
    gh = torch.randn(rows, d, device=device, generator=gen).to(dtype)
    grho = torch.randn(rows, device=device, generator=gen)

    def step():
        u_new, rho_new, _, h_next = impl(x)
        torch.autograd.backward([u_new, rho_new, h_next], [gu, grho, gh])

    return bench(step, grad_to_none=list(x.values()))


def run_gpu(rows: int, dims: list[int], dtypes: list[str], device: str = "cuda") -> None:
    # One compiled graph per (d, dtype, pass): let dynamo keep them all.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"# nag_write on {name}, rows = {rows}, torch {torch.__version__}, triton {triton.__version__}\n")
    print(f"Device copy bandwidth (1 GiB copy_): {copy_gbs:.0f} GB/s\n")
    print("| dtype | d | pass | impl | ms | GB/s | of copy BW | speed-up vs eager |")
    print("|---|---|---|---|---|---|---|---|")
    impls = implementations()
    for dt in dtypes:
        for d in dims:
            for backward in (False, True):
                nbytes = bytes_moved(rows, d, DTYPES[dt], backward)
                times = {k: time_one(fn, rows, d, DTYPES[dt], backward, device) for k, fn in impls.items()}
                for k, ms in times.items():
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    pass_name = "fwd+bwd" if backward else "fwd"
                    print(
                        f"| {dt} | {d} | {pass_name} | {k} | {ms:.3f} | {gbs:.0f} | "
                        f"{gbs / copy_gbs:.0%} | {times['eager'] / ms:.2f}x |",
                        flush=True,
                    )


def run_cpu_sanity() -> None:
    print("No CUDA device: GPU bandwidth numbers need a GPU. Running a CPU sanity check instead")
    print("(reference in eager PyTorch, kernel in Triton's interpreter; timings are not meaningful).\n")
    rows, d = 8, 64
    for dt in ("fp32", "bf16"):
        dtype = DTYPES[dt]
        x = make_inputs(rows, d, dtype, "cpu", requires_grad=False)
        nag_kernels.nag_write(**x, theta_max=THETA_MAX, backend="torch")  # warm-up
        t0 = time.perf_counter()
        ref = nag_kernels.nag_write(**x, theta_max=THETA_MAX, backend="torch")
        t_ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        ker = nag_kernels.nag_write(**x, theta_max=THETA_MAX, backend="triton")
        t_ker = time.perf_counter() - t0
        # Largest difference relative to each output's own size (bf16: ~ one ulp, 2^-8).
        err = max(
            ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(ref, ker)
        )
        norm_err = (ker[0].float().norm(dim=-1) - 1).abs().max().item()
        print(
            f"{dt}: rows={rows} d={d}  max |kernel - reference| / max |reference| = {err:.1e}  "
            f"max | ||u'|| - 1 | = {norm_err:.2e}  (reference {t_ref * 1e3:.1f} ms, "
            f"interpreter {t_ker * 1e3:.1f} ms)"
        )
    print("\nBytes the GPU benchmark counts per call, rows = 16384:")
    for d in (1024, 4096):
        for dt in ("bf16", "fp32"):
            fwd = bytes_moved(16384, d, DTYPES[dt], False) / 1e6
            both = bytes_moved(16384, d, DTYPES[dt], True) / 1e6
            print(f"  {dt} d={d}: forward {fwd:.1f} MB, forward+backward {both:.1f} MB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16384, help="tokens per call")
    p.add_argument("--d", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="model widths")
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES), help="u/f dtypes")
    args = p.parse_args()
    if torch.cuda.is_available():
        run_gpu(args.rows, args.d, args.dtype)
    else:
        run_cpu_sanity()


if __name__ == "__main__":
    main()
