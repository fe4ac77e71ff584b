"""nag_kernels: fused kernels for the NAG residual stream (DESIGN.md section 2).

Importing this package needs only torch. The Triton module is imported here under a guard, so
CPU machines without triton still import the package and use the pure-PyTorch reference.
(Importing it here rather than on first use matters: importing the submodule `nag_write` binds
that name on the package, which would shadow the function `nag_write` defined below.)

    from nag_kernels import nag_write
    u, rho, theta, h = nag_write(u, f, rho, g, alpha, beta, math.pi / 2, gamma_next)
"""

from __future__ import annotations

import torch

from .reference import BOUNDS, nag_write_reference, tangent_cutoff

__all__ = [
    "BACKENDS", "BOUNDS", "gated_angle", "gated_nag_write", "nag_write", "nag_write_backward_op",
    "nag_write_op", "nag_write_reference", "tangent_cutoff",
]

BACKENDS = ("auto", "triton", "inductor", "torch")
"""auto: the Triton kernel for CUDA tensors of a dtype it takes; on CPU, the write compiled by
inductor for eager writes of at least `compiled.MIN_ELEMENTS` elements in fp32/bf16 (compiled.py),
compiled in the background while the reference runs, else the reference; triton: always the kernel
(CPU tensors only under TRITON_INTERPRET=1); inductor: always the compiled write, compiled before
the first write (the reference where compiling fails); torch: the reference."""


try:
    from . import nag_write as _triton_ops  # imports triton
except ImportError:  # no triton on this machine: the reference still works
    _triton_ops = None

from . import compiled as _compiled  # noqa: E402
from .gated import GatedNagWrite, gated_angle  # noqa: E402
from .ops import TracedNagWrite, nag_write_backward_op, nag_write_op  # noqa: E402  (after the submodule, see above)


def _as_scalar(x: torch.Tensor | float, like: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        return torch.tensor(float(x), dtype=torch.float32, device=like.device)
    if x.numel() != 1:
        raise ValueError(f"{name} must be a scalar (0-dim tensor), got shape {tuple(x.shape)}.")
    return x.reshape(())


def _check_shapes(u, f, rho, g, gamma_next) -> None:
    if u.dim() < 1 or u.shape != f.shape:
        raise ValueError(
            f"u and f must have the same shape (..., d), got {tuple(u.shape)} and {tuple(f.shape)}."
        )
    if rho.shape != u.shape[:-1]:
        raise ValueError(
            f"rho must have shape {tuple(u.shape[:-1])} (u without its last dim), got {tuple(rho.shape)}."
        )
    if g is not None and torch.broadcast_shapes(g.shape, rho.shape) != rho.shape:
        raise ValueError(f"g must broadcast to rho's shape {tuple(rho.shape)}, got {tuple(g.shape)}.")
    if gamma_next is not None and gamma_next.shape != u.shape[-1:]:
        raise ValueError(f"gamma_next must have shape ({u.shape[-1]},), got {tuple(gamma_next.shape)}.")


def _checked(u, f, rho, g, alpha, beta, gamma_next) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(g, alpha, beta) of a write whose shapes are checked: g expanded to rho's shape (autograd
    sums its gradient back to g's own shape), alpha and beta as 0-dim tensors."""
    _check_shapes(u, f, rho, g, gamma_next)
    if g is not None and g.shape != rho.shape:
        g = g.expand(rho.shape)
    return g, _as_scalar(alpha, u, "alpha"), _as_scalar(beta, u, "beta")


def _resolve(backend: str, u: torch.Tensor, f: torch.Tensor, pass_elements: int | None = None) -> str:
    """The backend that `backend` means for a write of u and f in a pass of `pass_elements` (see
    BACKENDS and `_compiled.usable`)."""
    if backend not in BACKENDS:
        raise ValueError(f"Unknown nag_write backend {backend!r}; valid choices: {', '.join(BACKENDS)}.")
    if backend == "auto":
        use_triton = (
            u.is_cuda
            and u.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and f.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and _triton_ops is not None
        )
        backend = "triton" if use_triton else "inductor" if _compiled.usable(u, pass_elements) else "torch"
    if backend == "triton" and _triton_ops is None:
        raise ImportError("backend='triton' needs the triton package, which is not installed.")
    return backend


def _compiled_mode(
    backend: str, u: torch.Tensor, f: torch.Tensor, pass_elements: int | None = None
) -> str | None:
    """How an eager write of u and f runs compiled (compiled.py): "wait" (`inductor`: compiled
    before the first write), "background" (`auto`: the reference until the compiled write is
    ready), or None (not compiled: another backend, or inside torch.compile, which fuses the
    traced write with the model)."""
    if torch.compiler.is_compiling() or _resolve(backend, u, f, pass_elements) != "inductor":
        return None
    return "wait" if backend == "inductor" else "background"


def nag_write(
    u: torch.Tensor,
    f: torch.Tensor,
    rho: torch.Tensor,
    g: torch.Tensor | None,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    theta_max: float,
    gamma_next: torch.Tensor | None = None,
    backend: str = "auto",
    bound: str = "tanh",
    angle: torch.Tensor | None = None,
    pass_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One NAG write: rotate the direction lane u toward f's tangential part, update rho.

    Args:
        u: direction lane, shape (..., d), unit norm per row.
        f: sublayer output, shape (..., d).
        rho: log-norm lane, shape (...,).
        g: per-token gate, broadcastable to (...,); None means 1 (no router).
        alpha: 0-dim tensor (or float), rotation gain of this sublayer.
        beta: 0-dim tensor (or float), log-norm gain of this sublayer.
        theta_max: bound on |theta|, a positive float.
        gamma_next: per-channel gain (d,) of the next sublayer's read; None skips h_next.
        backend: one of BACKENDS ("auto", "triton", "torch").
        bound: how theta is bounded to theta_max, one of BOUNDS ("tanh", "rational").
        angle: the angle each row turns by, shape broadcastable to (...,), given instead of
            bound(g alpha |f_perp| / sqrt(d)) (the gated NAG); alpha and bound are then unused,
            g scales only the update of rho, and rows whose f_perp is rounding noise (|f_perp| <=
            tangent_cutoff(f.dtype) |f|, f parallel to u or zero) do not turn and report theta 0.
        pass_elements: the elements (rows x d) of the model's unrouted write in this pass, by
            which `auto` chooses on CPU (a routed write of fewer rows then runs as the others do);
            None: u's own.

    Returns:
        (u_new, rho_new, theta, h_next): u_new, h_next (None without gamma_next) in u.dtype;
        rho_new and the signed angle theta, shape (...,), in rho.dtype.
    """
    if not theta_max > 0:
        raise ValueError(f"theta_max must be positive, got {theta_max}.")
    if bound not in BOUNDS:
        raise ValueError(f"Unknown bound {bound!r}; valid choices: {', '.join(BOUNDS)}.")
    g, alpha, beta = _checked(u, f, rho, g, alpha, beta, gamma_next)
    if angle is not None:
        if torch.broadcast_shapes(angle.shape, rho.shape) != rho.shape:
            raise ValueError(
                f"angle must broadcast to rho's shape {tuple(rho.shape)}, got {tuple(angle.shape)}."
            )
        angle = angle.expand(rho.shape)

    compiled = _compiled_mode(backend, u, f, pass_elements)
    backend = _resolve(backend, u, f, pass_elements)
    if backend in ("torch", "inductor"):
        # ordinary tensor operations that torch.compile fuses with the sublayer's neighbouring
        # kernels, where the operator would be one opaque node (ops.py); in eager mode, the same
        # formulas compiled on their own (compiled.py)
        u_new, rho_new, theta, h_next = TracedNagWrite.apply(
            u, f, rho, g, alpha, beta, float(theta_max), gamma_next, bound, angle, compiled
        )
        return u_new, rho_new, theta, None if gamma_next is None else h_next
    u_new, rho_new, theta, h_next, _ = nag_write_op(
        u, f, rho, g, alpha, beta, float(theta_max), gamma_next, bound, backend == "triton", angle
    )
    return u_new, rho_new, theta, None if gamma_next is None else h_next


def gated_nag_write(
    u: torch.Tensor,
    f: torch.Tensor,
    rho: torch.Tensor,
    g: torch.Tensor | None,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    theta_max: float,
    gate_w: torch.Tensor,
    gate_b: torch.Tensor,
    gain: float,
    radial: bool = True,
    backend: str = "auto",
    pass_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One NAG write turned by the gated angle, angle = theta_max * sigmoid(gain <u, gate_w> +
    gate_b) * g per row (gated.py), the angle computed inside the compiled write where `nag_write`
    would compile the write (eager, CPU), else in PyTorch and given to `nag_write`.

    Args as in `nag_write`, and:
        gate_w: the gate's weights, shape (d,); gate_b: its bias, a 0-dim tensor.
        gain: the scale of <u, gate_w> (sqrt(d) in the model: u has unit norm).
        radial: angle / theta_max also gates the radial update (rho's), in place of g.
        pass_elements: as `nag_write`'s.

    Returns:
        (u_new, rho_new, theta, angle): as `nag_write`'s without h_next, and the angle each row
        was given (fp32, shape (...,)), which carries gradient to the gate and to g.
    """
    compiled = _compiled_mode(backend, u, f, pass_elements)
    backend = _resolve(backend, u, f, pass_elements)
    if not theta_max > 0:
        raise ValueError(f"theta_max must be positive, got {theta_max}.")
    g, alpha, beta = _checked(u, f, rho, g, alpha, beta, None)
    if gate_w.shape != u.shape[-1:] or gate_b.numel() != 1:
        raise ValueError(
            f"gate_w must have shape ({u.shape[-1]},) and gate_b one element; got {tuple(gate_w.shape)} "
            f"and {tuple(gate_b.shape)}."
        )
    if compiled is not None:
        settings = (float(theta_max), "tanh", float(gain), radial)  # bound: unused with a given angle
        return GatedNagWrite.apply(
            u, f, rho, g, alpha, beta, gate_w, gate_b.reshape(()), *settings, compiled == "wait"
        )
    base = gated_angle(u, gate_w, gate_b, theta_max, gain)
    angle = base if g is None else base * g.float()
    u_new, rho_new, theta, _ = nag_write(
        u, f, rho, angle / theta_max if radial else g, alpha, beta, theta_max, backend=backend, angle=angle,
        pass_elements=pass_elements,
    )
    return u_new, rho_new, theta, angle
