"""Threshold Mixture-of-Depths router, the interpretable NAG MoD of arXiv 2606.16112 (Figliolia &
Millidge, "Scaling Adaptive Depth with Norm-Agnostic Residual Networks"), DESIGN section 4. The
capacity-based router it is compared with is Raposo et al. 2024, arXiv 2404.02258 (`topk`).

A sublayer's contribution to a token is the angle, in radians, by which it turns the token's state
direction (DESIGN section 3). A linear probe on the read input predicts it, and the sublayer runs
only where the predicted angle reaches a threshold tau:

    h.detach() ──> theta_hat = softplus(<w, h> + b) ──> executed = theta_hat >= tau,  g = 1
    after the write: MSE(theta_hat, theta) on the executed tokens   (theta detached)

With `predictor: angle` there is no probe: the router reads the angle the residual strategy will
turn the token by, when the strategy knows it before the sublayer runs (NAG's gated angle,
`ResidualStrategy.planned_angle`), and skips where it is below tau. It then skips exactly the
tokens the oracle of a post-training sweep would, at no extra cost, and its decisions are the
gate's, which the language-model loss trains; nothing is regressed or calibrated.

The decision reads only the token's own state, so it is causal by construction, in training,
evaluation and generation alike, and a post-training sweep of tau traces the accuracy/compute
curve. tau is fixed, or, with `target_rate`, adapted during training so the sublayer skips that
fraction of tokens. Training then decides with a live threshold that a controller moves after
every training forward pass (computed in `observe`, written by `apply_update`),
tau_live *= exp(gain * spread * (target_rate - rate)), rate being the fraction of the batch
predicted below it and spread the batch's standard deviation of log theta_hat (a
Robbins-Monro estimate of the quantile: right on average over batches, not fitted to any one).
Evaluation and generation decide with `tau`, a running average of each training batch's own
target threshold (where the target share of it lies), not of tau_live: the controller is right on
average over batches, but the rate at the average of its swinging thresholds is not the average
rate (see `_track_tau`). A forward pass decides with
thresholds from before it, so a batch's own later tokens never influence an earlier token. All of
these are buffers: checkpoints keep them.

Choices:
  - g = 1 on executed tokens: the write of an executed token is exactly the unrouted model's, so a
    model trained without a router can be thresholded after training, and the regression target is
    the angle the sublayer really produces. A hard threshold is not differentiable, so a soft gate
    would not teach the router anything; the probe learns from its own loss only.
  - Start-up: an untrained probe could otherwise skip everything (and then never see a
    contribution to learn from) or nothing. For the first `warmup_steps` training forwards every
    token runs and supervises the probe. b = a learned bias + an offset (a buffer) that the first
    training batch sets so the mean prediction equals the mean measured angle, and that later
    batches keep correcting by a share `calibration` of the gap: angles grow by orders of
    magnitude early in training, far faster than gradient steps can move a bias, and a
    miscalibrated probe would skip the wrong tokens. An adapting threshold moves with the offset.
    With `target_rate` the controller cannot skip everything (it skips the lowest-predicted share
    only); a fixed tau above every predicted angle does skip everything, as it asks.
  - Block 0's attention reads only the token's byte, so its predictions take at most 256 values
    and its skipped share moves in steps of one byte's frequency (a space is ~15% of source code);
    in small models the tokens it skips tend to skip the later sublayers too. The controller then
    alternates around the target, right on average over training; evaluation's threshold is put
    in a gap between predictions near the target share (`_batch_threshold`), so that it does not
    sit on such a cluster, and one evaluation lands within a few points of the training rate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nag_lightning.routers import ROUTERS, Route, Router, ramped, shares_of_training
from nag_lightning.routers.quantile import SPLIT_BAND, split_threshold

PREDICTORS = ("probe", "angle")
"""Where theta_hat comes from: a probe on the read input, or the residual strategy's own angle."""

EVAL_SETTLING_STEPS = 200
"""Training forwards before evaluation's tau follows the predictions: it averages training batches'
thresholds, which lag predictions that still move fast, and the model moves on after each batch
(docs/routing.md: per sublayer 8-83% for a 25% target after 15 steps, 28% after 200-400)."""


def inverse_softplus(y: Tensor) -> Tensor:
    """x with softplus(x) = y, for y > 0."""
    return y + torch.log(-torch.expm1(-y))


@ROUTERS.register("threshold")
class ThresholdRouter(Router):
    """Skip a token when its predicted contribution angle is below tau radians.

    Args:
        d_model: width of the sublayer's read input.
        tau: threshold in radians: a token runs the sublayer when its predicted contribution angle
            is at least tau. Fixed, or the starting value when target_rate is set.
        target_rate: adapt tau during training so this sublayer skips this fraction of tokens, in
            [0, 1) (its MoD rate); None keeps tau fixed.
        tau_gain: how fast the training threshold adapts: each training forward multiplies it by
            exp(tau_gain * s * (target_rate - the fraction of the batch below it)), s the spread
            (standard deviation) of log theta_hat in the batch.
        tau_average: weight of the newest training batch's own target threshold (the one that
            would have skipped the target share of it) in the running average that evaluation
            and generation use. The predictions drift as the model trains, and a long average
            lags them, so evaluation skips more than training did (docs/routing.md).
        calibration: weight of each batch in the running correction of b that keeps the mean
            predicted angle on the measured one.
        warmup_steps: training forward passes at the start during which every token runs, so the
            predictor first learns from all of them.
        predictor: "probe" (a linear probe on h, learned by regression on the measured angle) or
            "angle" (the residual strategy's own angle, known before the sublayer runs: NAG with
            the gated angle; nothing to learn, and no parameters).
        full_depth_share: share of training (of its steps, or of its FLOP budget) at the start
            during which every token runs: the skip-rate warm-up (`Router.set_rate_warmup`).
        ramp_share: share of training after that over which the skip rate rises linearly to its
            target. Evaluation routes at the rate training has reached (tau follows it).
        always_run_above: a floor under the tokens the predictor rates as needing the sublayer:
            a token predicted at or above this angle (radians) runs however high the target rate
            pushes tau, so the sublayer may skip fewer than target_rate. None: no floor.
        angle_cost: with the angle predictor, a price on the planned angle in training: angle_cost
            times its mean over the tokens (radians), times the warm-up's share of the skip rate,
            joins the loss, so the gate turns a token, and keeps it from skipping, only where the
            language loss pays for the turn. 0: unpriced; the residual's own angle_cost prices
            every sublayer's angle, this one the routed sublayers' only.
        price_start, price_ramp: a late price: none for the first `price_start` of training (a share,
            as full_depth_share), then rising linearly to angle_cost over the next `price_ramp`, so
            the model learns the skill unpriced before the price reorders which tokens skip.
    """

    needs_contribution = True

    def __init__(
        self,
        d_model: int,
        tau: float = 0.0,
        target_rate: float | None = None,
        tau_gain: float = 2.0,
        tau_average: float = 0.2,
        calibration: float = 0.1,
        warmup_steps: int = 10,
        predictor: str = "probe",
        full_depth_share: float = 0.0,
        ramp_share: float = 0.0,
        always_run_above: float | None = None,
        angle_cost: float = 0.0,
        price_start: float = 0.0,
        price_ramp: float = 0.0,
    ) -> None:
        super().__init__(d_model)
        if predictor not in PREDICTORS:
            raise ValueError(f"router_options.predictor must be one of {PREDICTORS}; got {predictor!r}.")
        if not tau >= 0:
            raise ValueError(
                f"router_options.tau is an angle threshold in radians and cannot be negative; got {tau}."
            )
        if target_rate is not None and not 0 <= target_rate < 1:
            raise ValueError(
                "router_options.target_rate is the fraction of tokens that skip the sublayer and must "
                f"be in [0, 1) (e.g. 0.25), or null for a fixed tau; got {target_rate}."
            )
        for name, value in (("tau_average", tau_average), ("calibration", calibration)):
            if not 0 < value <= 1:
                raise ValueError(f"router_options.{name} must be in (0, 1]; got {value}.")
        if not tau_gain > 0:
            raise ValueError(f"router_options.tau_gain must be positive; got {tau_gain}.")
        if warmup_steps < 0:
            raise ValueError(f"router_options.warmup_steps must be 0 or more; got {warmup_steps}.")
        if always_run_above is not None and not always_run_above > 0:
            raise ValueError(
                "router_options.always_run_above is the predicted angle (radians) from which a token "
                f"always runs and must be positive, or null for no floor; got {always_run_above}."
            )
        self.always_run_above = None if always_run_above is None else float(always_run_above)
        if angle_cost and predictor != "angle" or not angle_cost >= 0:
            raise ValueError("router_options.angle_cost prices the planned angle: a number >= 0, with "
                             f"predictor: angle; got {angle_cost} with predictor {predictor!r}.")
        self.angle_cost = float(angle_cost)
        if (price_start or price_ramp) and not angle_cost:
            raise ValueError("router_options.price_start and price_ramp schedule the router's price, and "
                             "this router has none: set angle_cost, or leave them at 0.")
        self.price_start, self.price_ramp = shares_of_training(price_start=price_start, price_ramp=price_ramp)
        self.price_scale = 1.0  # the share of angle_cost charged now: see set_progress
        self._price: Tensor | None = None  # this training forward's price, for observe
        # floats: a YAML `0` or `1` arrives as an int, and int tensor maths overflows (target 0)
        self.target_rate = None if target_rate is None else float(target_rate)
        self.tau_gain = float(tau_gain)
        self.tau_average = float(tau_average)
        self.calibration = float(calibration)
        self.warmup_steps = warmup_steps
        self.set_rate_warmup(full_depth_share, ramp_share)
        if ramp_share > 0 and target_rate is None:
            raise ValueError(
                "router_options.ramp_share ramps the skip rate up to target_rate, and this router has "
                "a fixed tau instead: set target_rate, or leave ramp_share at 0."
            )
        self._full_depth_now = False  # training in the warm-up's full-depth share: every token runs
        self.predictor = predictor
        self.reads_planned_angle = predictor == "angle"
        self.needs_contribution = predictor == "probe"  # the regression target
        self.probe: nn.Linear | None = None
        if predictor == "probe":
            self.probe = nn.Linear(d_model, 1)
            # h has per-channel scale ~1: <w, h> starts at ~N(0, 0.1^2), so predictions differ per token.
            nn.init.normal_(self.probe.weight, std=0.1 / math.sqrt(d_model))
            nn.init.zeros_(self.probe.bias)
        # Buffers, so checkpoints keep them. `tau` is the threshold of evaluation and generation
        # (and of training when fixed); `tau_live` is the controller's training threshold, whose
        # running average `tau` is. `bias_offset` is the calibrated part of b. `steps` counts
        # training forwards (warm-up, first updates).
        self.register_buffer("tau", torch.tensor(float(tau)))
        self.register_buffer("tau_live", torch.tensor(float(tau)))
        self.register_buffer("bias_offset", torch.tensor(0.0))
        self.register_buffer("steps", torch.tensor(0, dtype=torch.long))
        # The skip rate the controller aims at now (target_rate x the warm-up's rate_scale): a
        # tensor, so a rate that moves every step recompiles nothing; set again each step.
        self.register_buffer("rate_now", torch.tensor(self.target_rate or 0.0), persistent=False)
        self._steps_seen: int | None = None  # host copy of `steps`: routing needs no device sync
        self._theta_hat: Tensor | None = None
        self.last_prediction: Tensor | None = None  # the last forward's theta_hat, detached
        self._pending: dict[str, Tensor] | None = None  # computed by observe, not yet applied
        self._stats: dict[str, Tensor] = {}

    def set_progress(self, progress: float) -> None:
        """The warm-up's share of the target rate (`Router.set_progress`), into `rate_now`."""
        super().set_progress(progress)
        self._full_depth_now = self.rate_scale == 0.0
        self.price_scale = ramped(progress, self.price_start, self.price_ramp)  # of angle_cost, now
        self.rate_now.fill_((self.target_rate or 0.0) * self.rate_scale)

    def _steps(self) -> int:
        if self._steps_seen is None:
            self._steps_seen = int(self.steps)
        return self._steps_seen

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._steps_seen = None  # re-read the loaded buffer
        self._pending = None  # an update of the state replaced

    def predict(self, h: Tensor, bias_offset: Tensor | None = None) -> Tensor:
        """theta_hat (...) in radians from the read input h (..., d); no gradient reaches h.
        `bias_offset` replaces the calibrated offset (the one a pending update computed)."""
        offset = self.bias_offset if bias_offset is None else bias_offset
        z = self.probe(h.detach()).squeeze(-1).float() + offset
        return F.softplus(z)

    def threshold(self, values: dict[str, Tensor] | None = None) -> Tensor:
        """The tau this forward pass decides with (of `values`, an update, when given)."""
        adapting = self.training and self.target_rate is not None
        values = values or {"tau": self.tau, "tau_live": self.tau_live}
        tau = values["tau_live"] if adapting else values["tau"]
        # the floor caps the decision only: the controller keeps its own threshold, so the
        # sublayer skips the target share again wherever the floor lets it
        return tau if self.always_run_above is None else tau.clamp(max=self.always_run_above)

    def forward(self, h: Tensor, planned_angle: Tensor | None = None) -> Route:
        if self.predictor == "probe":
            theta_hat = self.predict(h)  # (B, T)
        elif planned_angle is None:
            raise ValueError(
                "router_options.predictor 'angle' reads the angle the residual strategy knows before "
                "the sublayer runs, and this model's has none (only nag with angle: gate has one): "
                "use predictor: probe, or the gated NAG."
            )
        else:
            theta_hat = planned_angle.detach().float()
            if self.angle_cost and self.training and planned_angle.requires_grad:
                scale = self.angle_cost * self.rate_scale * self.price_scale
                self._price = scale * planned_angle.float().mean()
        self._theta_hat = theta_hat
        self.last_prediction = theta_hat.detach()
        if self.training and (self._steps() < self.warmup_steps or self._full_depth_now):
            return Route()
        return Route(executed=theta_hat.detach() >= self.threshold())

    def observe(self, h: Tensor, route: Route, contribution: Tensor | None) -> None:
        """Regress theta_hat on the executed tokens' measured angle; compute the move of tau toward
        the target and of the calibration, and apply it unless `defer_updates` (`apply_update`)."""
        theta_hat, self._theta_hat = self._theta_hat, None
        executed = route.executed
        learns = self.predictor == "probe"
        self.aux_loss = h.new_zeros((), dtype=torch.float)
        price, self._price = self._price, None
        if not self.training or theta_hat is None or (learns and contribution is None):
            self._record(theta_hat, contribution, executed, None, self.threshold())
            return
        # The new buffer values, computed from the current ones without touching them, so a
        # forward pass run again (activation checkpointing) computes the same update.
        update = {"tau": self.tau, "tau_live": self.tau_live, "bias_offset": self.bias_offset}
        if learns:
            target = contribution.detach().float()
            mask = torch.ones_like(target, dtype=torch.bool) if executed is None else executed
            self._calibrate(update, theta_hat.detach(), target, mask)
            theta_hat = self.predict(h, update["bias_offset"])
            error = (theta_hat - target).square()
            self.aux_loss = (error * mask).sum() / mask.sum().clamp_min(1)
        if self.target_rate is not None:
            self._track_tau(update, theta_hat.detach())
        self._pending = update
        loss = self.aux_loss if learns else None
        self._record(theta_hat, contribution, executed, loss, self.threshold(update))
        if price is not None:
            self.aux_loss = self.aux_loss + price
            self._stats["angle_price"] = price.detach()
        if not self.defer_updates:
            self.apply_update()

    @torch.no_grad()
    def apply_update(self) -> None:
        """Write the thresholds and calibration the last training forward computed; count the step."""
        if self._pending is None:
            return
        for name, value in self._pending.items():
            getattr(self, name).copy_(value)
        self.steps += 1
        self._steps_seen = self._steps() + 1
        self._pending = None

    @torch.no_grad()
    def _calibrate(self, update: dict[str, Tensor], theta_hat: Tensor, target: Tensor, mask: Tensor) -> None:
        """Move b's offset so the mean prediction on executed tokens approaches their mean
        measured angle, in softplus-inverse space; the first batch sets it outright. An adapting
        threshold moves with it, so calibration alone leaves the skipped fraction unchanged.
        Writes the new values into `update`."""
        count = mask.sum().clamp_min(1)  # no executed token: both means clamp alike, no shift
        measured = ((target * mask).sum() / count).clamp_min(1e-6)
        predicted = ((theta_hat * mask).sum() / count).clamp_min(1e-6)
        weight = 1.0 if self._steps() == 0 else self.calibration
        shift = weight * (inverse_softplus(measured) - inverse_softplus(predicted))
        update["bias_offset"] = update["bias_offset"] + shift
        if self.target_rate is not None and self._steps() > 0:
            for name in ("tau_live", "tau"):
                update[name] = F.softplus(inverse_softplus(update[name].clamp_min(1e-12)) + shift)

    @torch.no_grad()
    def _track_tau(self, update: dict[str, Tensor], theta_hat: Tensor) -> None:
        """One Robbins-Monro step of `tau_live` toward the target quantile of theta_hat, in log
        space and scaled by the batch's spread of log theta_hat, so a step moves the same share of
        the distribution however wide it is. `tau` averages (in log space) the batch's own target
        quantile (`_batch_threshold`), the threshold that would have skipped the target share of
        it. The first update starts both there. Writes the new values into `update`.

        Why `tau` does not average `tau_live`: the controller is right on average over batches,
        not at any one threshold. Where theta_hat is narrow or has gaps (tokens at theta_max, a
        sublayer whose predictions barely vary), its steps, scaled by the spread of the whole
        batch, swing the sublayer's rate between a few percent and most tokens, and the rate at the
        average of those thresholds is not their average rate: evaluating with it skipped 13%
        or 34% where training skipped 25%. The batch quantile sits where the target share is,
        however the distribution is shaped, so evaluation routes at the rate training did."""
        values = theta_hat.flatten()
        quantile = self._batch_threshold(values)
        if self._steps() == 0:
            update["tau_live"] = update["tau"] = quantile
            return
        rate = (values < update["tau_live"]).float().mean()
        spread = values.clamp_min(1e-12).log().std().nan_to_num(0.0)
        step = torch.exp(self.tau_gain * spread * (self.rate_now - rate))
        update["tau_live"] = (update["tau_live"] * step).clamp(min=1e-12)
        weight = max(self.tau_average, 1.0 / (self._steps() + 1))
        log_tau = torch.lerp(update["tau"].clamp_min(1e-12).log(), quantile.log(), weight)
        update["tau"] = log_tau.exp()

    def _batch_threshold(self, values: Tensor) -> Tensor:
        """The threshold that skips the warm-up's rate (target_rate once ramped) of this batch."""
        return split_threshold(values, self.rate_now, SPLIT_BAND)

    @torch.no_grad()
    def _record(
        self, theta_hat: Tensor | None, angle: Tensor | None, executed: Tensor | None,
        loss: Tensor | None, tau: Tensor,
    ) -> None:
        self._stats = {"tau": tau.clone()}
        if loss is not None:
            self._stats["predictor_mse"] = loss.detach()
        if theta_hat is not None and angle is not None:
            mask = torch.ones_like(angle) if executed is None else executed.to(angle.dtype)
            count = mask.sum().clamp_min(1)
            self._stats["theta_hat_mean"] = (theta_hat * mask).sum() / count
            self._stats["theta_mean"] = (angle.float() * mask).sum() / count

    def flops_per_token(self) -> int:
        """The probe <w, h> (the bias add and softplus are not multiply-adds): once in evaluation;
        twice in training, where `observe` runs it again for the loss, after calibrating b. The
        angle predictor adds nothing: its one dot product per token is the write's own gate, per
        token O(d) work that the accounting leaves out for every residual (`nag_lightning.model.flops`)."""
        if self.predictor == "angle":
            return 0
        return (2 if self.training else 1) * 2 * self.d_model

    def backward_flops_per_token(self) -> int:
        """The probe's weight gradient from the loss of `observe`'s run: it reads a detached input
        (no input gradient), and the routing run's prediction is used detached."""
        return 0 if self.predictor == "angle" else 2 * self.d_model

    def evaluation_note(self) -> str | None:
        """With target_rate, a warning while evaluation's tau is still settling."""
        if self.target_rate is None or self._steps() >= EVAL_SETTLING_STEPS:
            return None
        return (
            f"The threshold router has trained fewer than {EVAL_SETTLING_STEPS} steps, and evaluation's "
            "threshold lags predictions that still move fast: until then evaluation can skip far "
            f"more or fewer tokens than target_rate={self.target_rate} (see docs/routing.md); "
            "judge evaluation's MoD rate after that."
        )

    def stats(self) -> dict[str, float]:
        """tau, the probe's MSE and the mean predicted and measured angle of executed tokens."""
        return {k: v.item() for k, v in self._stats.items()}
