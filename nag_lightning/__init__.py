"""nag-lightning: norm-agnostic residual Transformers with Mixture-of-Depths routing.

Every public name loads on first use, so `import nag_lightning` (and with it the `nag-lightning`
command's help) costs no torch or Lightning import; the plain-PyTorch model imports without
Lightning. Using `RESIDUALS` or `ROUTERS` (or the model) registers the built-in residual strategies
and routers.

The package, by job: `model/` (the network and what runs it), `residuals/` and `routers/` (its
plugins, found through `registry`), `data/` (text to token batches, tokenizers), `tasks/`
(synthetic labelled data), `training/` (the LightningModule and run folders), `callbacks/`,
`checkpoints/` (the one reader, trust and earlier formats), `analysis/` (studies, sweeps,
evaluation and generation, reports), `api` (`load`: a trained model from Python) and `cli` (the
command table). Imports only point down the package's layers (docs/usage.md, "Layout";
tests/test_layers.py). Module paths of earlier releases still import
(`checkpoints.compat.MOVED_MODULES`), so the class paths saved in their checkpoints resolve.
"""

from nag_lightning.checkpoints.compat import install_moved_modules

__version__ = "0.1.0"
install_moved_modules()

_LAZY = {
    "Transformer": "nag_lightning.model",
    "TransformerConfig": "nag_lightning.model",
    "RESIDUALS": "nag_lightning.residuals",
    "ResidualStrategy": "nag_lightning.residuals",
    "ROUTERS": "nag_lightning.routers",
    "Route": "nag_lightning.routers",
    "Router": "nag_lightning.routers",
    "LanguageModel": "nag_lightning.training.module",
    "NAGLanguageModel": "nag_lightning.training.module",  # the name of earlier releases
    "TextDataModule": "nag_lightning.data",
    "ByteDataModule": "nag_lightning.data",  # the name of earlier releases, kept for their configs
    "load": "nag_lightning.api",
    "TrainedModel": "nag_lightning.api",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nag_lightning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "RESIDUALS", "ROUTERS", "LanguageModel", "ResidualStrategy", "Route", "Router",
    "TextDataModule", "TrainedModel", "Transformer", "TransformerConfig", "load",
]
