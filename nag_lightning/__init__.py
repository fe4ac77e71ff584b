"""nag-lightning: norm-agnostic residual Transformers with Mixture-of-Depths routing.

Every public name loads on first use, so `import nag_lightning` (and with it the `nag-lightning`
command's help) costs no torch or Lightning import; the plain-PyTorch model imports without
Lightning. Using `RESIDUALS` or `ROUTERS` (or the model) registers the built-in residual strategies
and routers.
"""

__version__ = "0.1.0"

_LAZY = {
    "Transformer": "nag_lightning.model",
    "TransformerConfig": "nag_lightning.model",
    "RESIDUALS": "nag_lightning.residuals",
    "ResidualStrategy": "nag_lightning.residuals",
    "ROUTERS": "nag_lightning.routers",
    "Route": "nag_lightning.routers",
    "Router": "nag_lightning.routers",
    "NAGLanguageModel": "nag_lightning.module",
    "TextDataModule": "nag_lightning.data",
    "ByteDataModule": "nag_lightning.data",  # the name of earlier releases, kept for their configs
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nag_lightning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "RESIDUALS", "ROUTERS", "NAGLanguageModel", "ResidualStrategy", "Route", "Router",
    "TextDataModule", "Transformer", "TransformerConfig",
]
