"""Checkpoints of every earlier NAG default and formulation family, written before NAG was built
from parts (`tests/fixtures/make_nag_fixtures.py`), load through the checkpoint reader and give the
logits they gave then."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nag_lightning.checkpoints.loading import load_model
from tests.fixtures.make_nag_fixtures import FIXTURES

HERE = Path(__file__).resolve().parent / "fixtures" / "nag"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return load_file(str(HERE / "expected.safetensors"))


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_a_saved_nag_checkpoint_gives_its_logits(name, expected):
    model = load_model(str(HERE / f"{name}.pt")).model
    with torch.no_grad():
        logits = model(expected["ids"]).logits
    torch.testing.assert_close(logits, expected[name], atol=1e-6, rtol=0)


def test_the_lightning_module_loads_the_earlier_default_with_its_logits(expected):
    """The path `validate`, `test` and resumed runs take: Lightning's loader, through the reader."""
    from nag_lightning.training.module import LanguageModel

    module = LanguageModel.load_from_checkpoint(str(HERE / "earlier_default.pt")).eval()
    with torch.no_grad():
        logits = module.model(expected["ids"]).logits
    torch.testing.assert_close(logits, expected["earlier_default"], atol=1e-6, rtol=0)
