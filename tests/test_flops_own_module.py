"""FlopAccounting and FlopBudget on LightningModules of a user's own, written here and subclassing
nothing of the package: their step FLOPs measured (once per batch shape) against FlopCounterMode
with math attention, the budget's stop step, and a learning-rate schedule driven by the budget."""

from __future__ import annotations

import logging
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from nag_lightning.callbacks import FlopAccounting, FlopBudget, find_budget
from nag_lightning.callbacks.measured import MeasuredFlopCounter
from nag_lightning.model.flops import flop_counter_mode

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, WIDTH, BATCH = 64, 32, 4
LENGTHS = [8, 12, 8, 12, 8, 12]  # the batch shape changes from step to step
LR = 1e-2


class MLPLanguageModel(L.LightningModule):
    """Each token's next token from an MLP over its embedding; batches are (B, T + 1) token ids."""

    def __init__(self, decay_over_budget: bool = False) -> None:
        super().__init__()
        self.decay_over_budget = decay_over_budget
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.lrs: list[float] = []

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        h = self.embed(inputs)
        h = h + self.mlp(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        if not self.decay_over_budget:
            return optimizer
        budget = find_budget(self.trainer)  # opting in: linear decay to 0 at the end of the budget
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - budget.progress)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


class TransformerLanguageModel(L.LightningModule):
    """A causal `nn.TransformerEncoder`; batches are (inputs, targets) pairs of (B, T) token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=2 * WIDTH, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        mask = nn.Transformer.generate_square_subsequent_mask(inputs.shape[1])
        h = self.encoder(self.embed(inputs), mask=mask, is_causal=True)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def batches(module: L.LightningModule) -> list:
    """One batch per entry of LENGTHS, in the layout the module reads."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, VOCAB, (BATCH, T + 1), generator=g) for T in LENGTHS]
    if isinstance(module, MLPLanguageModel):
        return ids
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def math_step_flops(module: L.LightningModule, batch) -> int:
    """FlopCounterMode's count of one training step's forward and backward, attention in math form."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        module.loss(batch).backward()
    module.zero_grad()
    return counter.get_total_flops()


def fit(module: L.LightningModule, callbacks: list, max_steps: int = 1000) -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=1, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(batches(module), batch_size=None))


MODULES = [MLPLanguageModel, TransformerLanguageModel]


@pytest.mark.parametrize("make", MODULES, ids=lambda m: m.__name__)
def test_counted_flops_are_flop_counter_mode_with_math_attention_per_step(make):
    module = make()
    expected = [math_step_flops(module, b) for b in batches(module)]
    assert expected[0] != expected[1]  # the two shapes really cost differently
    accounting = FlopAccounting()
    totals: list[int] = []
    counters: list[object] = []
    accounting.add_listener(lambda trainer, acc: (totals.append(acc.training_flops),
                                                  counters.append(acc.counter)))
    fit(module, [accounting])
    steps = [b - a for a, b in zip([0, *totals], totals)]
    assert steps == pytest.approx(expected, rel=0.01)
    assert accounting.tokens == sum(BATCH * T for T in LENGTHS)
    counter = counters[-1]
    assert isinstance(counter, MeasuredFlopCounter)
    assert counter.measured_steps == len(set(LENGTHS))  # once per shape, not every step


@pytest.mark.parametrize("make", MODULES, ids=lambda m: m.__name__)
def test_budget_stops_at_the_step_it_predicts(make):
    module = make()
    cumulative = torch.tensor([math_step_flops(module, b) for b in batches(module)]).cumsum(0).tolist()
    accounting = FlopAccounting()
    budget = FlopBudget(budget=(cumulative[2] + cumulative[3]) / 2)  # reached by step 4, not 3
    fit(module, [budget, accounting])  # the budget first: it asks the accounting to count
    assert module.trainer.global_step == 4 and budget.stopped_at == 4
    assert budget.spent == accounting.training_flops == pytest.approx(cumulative[3], rel=0.01)


def test_the_budget_drives_the_learning_rate_of_a_module_that_opts_in():
    module = MLPLanguageModel(decay_over_budget=True)
    cumulative = torch.tensor([math_step_flops(module, b) for b in batches(module)]).cumsum(0).tolist()
    accounting = FlopAccounting()
    totals: list[int] = []
    accounting.add_listener(lambda trainer, acc: totals.append(acc.training_flops))
    budget = FlopBudget(budget=cumulative[4])
    fit(module, [accounting, budget])
    assert module.trainer.global_step == 5
    # Lightning steps the scheduler before the step's FLOPs are counted, so the rate of step k
    # follows the FLOPs spent before step k - 1.
    spent_read = [0, 0, *totals[:3]]
    assert module.lrs == pytest.approx([LR * (1 - spent / cumulative[4]) for spent in spent_read])


class MLPWithBaseline(MLPLanguageModel):
    """Says what it spends per token at full depth, so a budget can be given in its tokens."""

    def full_depth_forward_flops_per_token(self) -> float:
        batch = batches(self)[0]
        with FlopCounterMode(display=False) as counter:
            self.loss(batch)
        return counter.get_total_flops() / (BATCH * LENGTHS[0])


def test_reference_tokens_budget_needs_a_baseline_the_module_gives():
    tokens = sum(BATCH * T for T in LENGTHS[:3]) - 7  # reached by the third batch
    budget = FlopBudget(reference_tokens=tokens)
    fit(MLPWithBaseline(), [FlopAccounting(), budget])
    assert budget.stopped_at == 3

    with pytest.raises(ValueError, match="full_depth_forward_flops_per_token.*on the module"):
        fit(TransformerLanguageModel(), [FlopAccounting(), FlopBudget(reference_tokens=tokens)])


def test_tokens_are_read_from_the_target_part_of_the_batch_or_the_modules_hook():
    counter = MeasuredFlopCounter(MLPLanguageModel())
    ids = torch.zeros(3, 11, dtype=torch.long)
    assert counter.tokens(ids) == 3 * 10  # (B, T + 1): targets are ids[:, 1:]
    assert counter.tokens((ids[:, :-1], ids[:, 1:5])) == 3 * 4
    assert counter.tokens({"input_ids": ids, "labels": ids[:, :7]}) == 3 * 7
    with pytest.raises(ValueError, match=r"tokens_in_batch\(self, batch\)"):
        counter.tokens({"input_ids": ids})

    class Counted(MLPLanguageModel):
        def tokens_in_batch(self, batch) -> int:
            return int((batch["labels"] >= 0).sum())

    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    assert MeasuredFlopCounter(Counted()).tokens({"labels": labels}) == 3


@pytest.mark.parametrize("op", ["_scaled_dot_product_flash_attention_backward",
                                "_scaled_dot_product_efficient_attention_backward",
                                "_scaled_dot_product_cudnn_attention_backward",
                                "_scaled_dot_product_flash_attention_for_cpu_backward"])
def test_fused_attention_backward_is_counted_as_math_attention(op):
    """The GPU kernels' backward, whose torch formula adds a recomputation of the scores, is
    counted as the math form's four matrix products (checked against math attention on CPU)."""
    q = torch.randn(2, 3, 5, 8, requires_grad=True)
    k, v = torch.randn(2, 3, 7, 8, requires_grad=True), torch.randn(2, 3, 7, 6, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v)
        with FlopCounterMode(display=False) as counter:
            out.backward(torch.ones_like(out))
    formula = flop_counter_mode().flop_registry[getattr(torch.ops.aten, op)]
    assert formula(out, q, k, v) == counter.get_total_flops() > 0


def test_a_step_that_fails_while_measured_leaves_no_counter_running():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    class Failing(MLPLanguageModel):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        fit(Failing(), [FlopAccounting()])
    assert _get_current_dispatch_mode_stack() == []
