"""nag-lightning: norm-agnostic residual Transformers with Mixture-of-Depths routing.

Importing the package registers the built-in residual strategies and routers. The Lightning parts
(`NAGLanguageModel`, `ByteDataModule`) load on first use, so the plain-PyTorch model imports
without Lightning.
"""

from nag_lightning.model import Transformer, TransformerConfig
from nag_lightning.residuals import RESIDUALS, ResidualStrategy
from nag_lightning.routers import ROUTERS, Route, Router

__version__ = "0.1.0"

_LAZY = {
    "NAGLanguageModel": "nag_lightning.module",
    "ByteDataModule": "nag_lightning.data",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nag_lightning' has no attribute {name!r}")


__all__ = [
    "RESIDUALS", "ROUTERS", "ByteDataModule", "NAGLanguageModel", "ResidualStrategy", "Route",
    "Router", "Transformer", "TransformerConfig",
]
