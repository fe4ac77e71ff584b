"""FLOP accounting: training FLOPs per step and in total, from the tokens the model really executed.

DESIGN section 5. After every optimizer step the callback asks the model what its training forward
passes did (`nag_lightning.model.flops.StepFlops`), sums that over all ranks with one all-reduce, and logs:

    flops/step                       training FLOPs of the step, all ranks (3 x forward, routers
                                     aside: `StepFlops.training`)
    flops/total                      training FLOPs so far, all ranks; kept in checkpoints
    flops/tokens                     tokens trained on so far, all ranks; kept in checkpoints
    flops/executed_fraction          layer FLOPs executed over layer FLOPs at full depth (step)
    flops/executed_params_per_token  layer weights one token met on average (step)
    time/train_seconds               wall-clock seconds of training so far, validation left out;
                                     kept in checkpoints, so a resumed run continues the count
    throughput/...                   tokens/s, samples/s, FLOPs/s and MFU, from Lightning's
                                     `lightning.fabric.utilities.throughput.Throughput`

Which model: a LightningModule that defines `flop_counter(self) -> FlopCounter` is asked through
it; a `nag_lightning.model.Transformer` in `pl_module.model` is counted exactly from the tokens it
executed (`TransformerFlopCounter`); any other module is measured with FlopCounterMode, once per
batch shape (`nag_lightning.callbacks.measured`). Other callbacks (the FLOP budget) read the
totals in their own hooks, after asking it to `count` the batch (which it does once, whichever
hook runs first); this one knows none of them. Scripts and tests that watch every counted step
subscribe with `add_listener`.

Rates: `Throughput` keeps a window of `window_size` steps and reports rates once it is full. MFU needs
the device's peak FLOPs; Lightning knows them for common GPUs. Elsewhere (CPU) give `peak_flops`;
without it MFU is left out and the log says so once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from nag_lightning.callbacks.measured import MeasuredFlopCounter
from nag_lightning.model import Transformer
from nag_lightning.model.flops import TRAINING_MULTIPLIER, FlopCounter, StepFlops, TransformerFlopCounter

Listener = Callable[[L.Trainer, "FlopAccounting"], None]


def resolve_counter(pl_module: L.LightningModule) -> FlopCounter:
    """The module's own `flop_counter()`, a `TransformerFlopCounter` of `pl_module.model`, or
    else a `MeasuredFlopCounter` of the module."""
    if hasattr(pl_module, "flop_counter"):
        return pl_module.flop_counter()
    model = getattr(pl_module, "model", None)
    if isinstance(model, Transformer):
        return TransformerFlopCounter(model)
    return MeasuredFlopCounter(pl_module)


def _compute_dtype(trainer: L.Trainer) -> torch.dtype:
    """The dtype matrix products run in, as Lightning's ThroughputMonitor reads it."""
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    return _plugin_to_compute_dtype(trainer.precision_plugin)


class FlopAccounting(L.Callback):
    """Counts, sums across ranks and logs training FLOPs, tokens, executed fraction and MFU.

    Args:
        peak_flops: peak FLOP/s of one device for MFU; None asks Lightning's table of GPUs (CPUs
            are not in it, so on CPU MFU is logged only when this is given).
        window_size: steps over which tokens/s, FLOP/s and MFU are averaged (at least 2).
    """

    def __init__(self, peak_flops: float | None = None, window_size: int = 10) -> None:
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"peak_flops must be positive FLOP/s per device, or null; got {peak_flops}.")
        if window_size < 2:
            raise ValueError(f"window_size must be at least 2 steps; got {window_size}.")
        self.peak_flops = peak_flops
        self.window_size = window_size
        self._listeners: list[Listener] = []
        self.counter: FlopCounter | None = None
        self._reset_totals()

    def _reset_totals(self) -> None:
        # Totals over all ranks and every step of the run, including those before a resume.
        self.forward_flops = 0
        self.training_flops = 0
        self.tokens = 0
        self.samples = 0
        self.steps = 0
        self.saved_seconds = 0.0  # training seconds of the run before this session (a resume)
        self._train_time = 0.0  # training seconds of this session
        # Totals of this rank alone, for checks; not kept in checkpoints.
        self.local_forward_flops = 0
        self.last: dict[str, float] = {}  # the last counted step, all ranks
        self._pending: torch.Tensor | None = None
        self._counted: tuple[int, int] | None = None  # (epoch, batch index) last counted
        self._last_logged = -1

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(trainer, self)` after every counted step, before logging."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    def ensure_counter(self, pl_module: L.LightningModule) -> FlopCounter:
        if self.counter is None:
            self.counter = resolve_counter(pl_module)
        return self.counter

    # ---- hooks --------------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_totals()  # a resumed run gets its totals back from the checkpoint after this
        self.ensure_counter(pl_module)
        peak = self.peak_flops
        if peak is None:
            dtype = _compute_dtype(trainer)
            peak = get_available_flops(trainer.strategy.root_device, dtype)
            if peak is None and trainer.strategy.root_device.type != "cpu":  # no MFU on CPU
                rank_zero_info(
                    f"FlopAccounting: the peak FLOP/s of {trainer.strategy.root_device} in {dtype} "
                    "are unknown, so MFU is not logged; give peak_flops (per device) to log it."
                )
        self._throughput = Throughput(
            available_flops=peak, world_size=trainer.world_size, window_size=self.window_size
        )

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(self.counter, (TransformerFlopCounter, MeasuredFlopCounter)):
            self.counter.remove()
        self.counter = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
                     ) -> None:
        if isinstance(self.counter, MeasuredFlopCounter):
            self.counter.remove()  # a step measured when it failed must not leave its counter on

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen_step = trainer.global_step
        self._train_time = 0.0
        self._clock = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._clock = time.perf_counter()  # validation time is not training time

    # A measured module's step runs under FlopCounterMode from the batch's start to the optimizer
    # step when its batch shape is new (nag_lightning.callbacks.measured).
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if isinstance(self.counter, MeasuredFlopCounter):
            self.counter.start(batch)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if isinstance(self.counter, MeasuredFlopCounter):
            self.counter.forward_done()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if isinstance(self.counter, MeasuredFlopCounter):
            self.counter.finish()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.count(trainer, pl_module, batch_idx)

    def count(self, trainer: L.Trainer, pl_module: L.LightningModule, batch_idx: int) -> None:
        """Count the training batch that just ended, once however often it is asked: a callback
        that reads the totals in the same hook (the FLOP budget) asks first when it runs first."""
        if self._counted == (trainer.current_epoch, batch_idx):
            return
        self._counted = (trainer.current_epoch, batch_idx)
        step = self.counter.step()
        if step.training is None:
            step = step._replace(training=TRAINING_MULTIPLIER * step.forward)
        values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=pl_module.device)
                              for v in step])
        self._pending = values if self._pending is None else self._pending + values
        if trainer.global_step == self._seen_step:
            return  # accumulating gradients: the optimizer step has not happened yet
        self._seen_step = trainer.global_step
        self._commit(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.last and self._last_logged != trainer.global_step:
            self._log(trainer, {})

    # ---- counting -----------------------------------------------------------------------------

    def _commit(self, trainer: L.Trainer) -> None:
        local = self._pending
        self._pending = None
        reduced = trainer.strategy.reduce(local.clone(), reduce_op="sum")  # in place under DDP
        local_forward, *values = torch.cat([local[:1], reduced]).tolist()  # the one synchronisation
        self.local_forward_flops += round(local_forward)
        step = StepFlops(*values)
        step_forward, step_training = round(step.forward), round(step.training)
        self.forward_flops += step_forward
        self.training_flops += step_training
        self.tokens += round(step.tokens)
        self.samples += round(step.samples)
        self.steps += 1
        self.last = {
            "step": step_training,
            "executed_fraction": step.layer / step.full_depth_layer if step.full_depth_layer else 1.0,
            "executed_params_per_token": step.executed_params / step.tokens if step.tokens else 0.0,
        }
        for listener in self._listeners:
            listener(trainer, self)

        now = time.perf_counter()
        self._train_time += now - self._clock
        self._clock = now
        world = trainer.world_size
        self._throughput.update(
            time=self._train_time, batches=self.steps, samples=self.samples / world,
            lengths=self.tokens / world, flops=step_training / world,
        )
        every = max(trainer.log_every_n_steps, 1)
        last_step = trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
        if trainer.global_step % every == 0 or trainer.should_stop or last_step:
            self._log(trainer, self._throughput.compute())

    def _log(self, trainer: L.Trainer, rates: dict[str, float]) -> None:
        metrics: dict[str, float] = {
            "flops/step": self.last["step"],
            "flops/total": self.training_flops,
            "flops/tokens": self.tokens,
            "flops/executed_fraction": self.last["executed_fraction"],
            "flops/executed_params_per_token": self.last["executed_params_per_token"],
            "time/train_seconds": self.train_seconds,
        }
        for key, value in rates.items():
            if key.endswith("_per_sec") or key.endswith("mfu"):
                metrics["throughput/" + key.replace("items", "tokens")] = value
        self._last_logged = trainer.global_step
        # The step Lightning's own logging gives the metrics of this optimizer step.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step - 1)

    @property
    def train_seconds(self) -> float:
        """Wall-clock seconds spent training, from the first step to the last counted one, this
        session and any before a resume; validation is left out, the first steps' compilation is
        in (a user waits for it too)."""
        return self.saved_seconds + self._train_time

    # ---- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"forward_flops": self.forward_flops, "training_flops": self.training_flops,
                "tokens": self.tokens, "samples": self.samples, "steps": self.steps,
                "train_seconds": self.train_seconds}

    def load_state_dict(self, state_dict: dict) -> None:
        self.forward_flops = saved_count(state_dict, "forward_flops", None, self)
        # saved before routers counted their own backward: 3 x forward, as it was counted then
        older = TRAINING_MULTIPLIER * self.forward_flops
        self.training_flops = saved_count(state_dict, "training_flops", older, self)
        self.tokens = saved_count(state_dict, "tokens", None, self)
        self.samples = saved_count(state_dict, "samples", 0, self)
        self.steps = saved_count(state_dict, "steps", 0, self)
        self.saved_seconds = saved_seconds(state_dict, self)


def saved_count(state: object, key: str, default: int | None, callback: object) -> int:
    """`state[key]` (a callback's state read from a checkpoint, untrusted) as a non-negative
    integer, else one sentence; `default` when absent (None: required)."""
    value = state.get(key, default) if isinstance(state, dict) else None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"The checkpoint's {type(callback).__name__} state holds {key}={value!r}, not a count; "
            "give an undamaged checkpoint written by `nag-lightning fit`."
        )
    return value


def saved_seconds(state: object, callback: object) -> float:
    """The training seconds in a checkpoint's callback state (untrusted) as a finite number >= 0;
    0 for a checkpoint written before they were kept; else one sentence."""
    value = state.get("train_seconds", 0.0) if isinstance(state, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(
            f"The checkpoint's {type(callback).__name__} state holds train_seconds={value!r}, not a "
            "number of seconds; give an undamaged checkpoint written by `nag-lightning fit`."
        )
    return float(value)


def find_accounting(trainer: L.Trainer) -> FlopAccounting | None:
    """The trainer's FlopAccounting callback, if it has one."""
    return next((c for c in trainer.callbacks if isinstance(c, FlopAccounting)), None)
