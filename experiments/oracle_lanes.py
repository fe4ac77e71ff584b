"""Where NAG's cost of skipping sits: the oracle that skips both lanes, against one that skips only
the direction (docs/results.md, section 0, "The price of turning").

The sweep's oracle (`nag_lightning.analysis.sweeps.oracle`) skips a sublayer for every token whose
measured angle is below tau: neither its rotation nor its radial (log-norm) update is written. This script
evaluates, for every sublayer and at the tau values that bracket a MoD rate, that oracle and a
variant that still writes the radial update of the skipped tokens, on the same validation batches:

    OMP_NUM_THREADS=1 python experiments/oracle_lanes.py \
        runs/study/depth/nag-L8-s1-lr0.006/version_0/checkpoints/last.ckpt --rate 0.25

The difference is what the radial lane costs when a token skips. A NAG checkpoint only.
"""

from __future__ import annotations

import argparse
import json

import torch

from nag_lightning.analysis.evaluation.checkpoint import checkpoint_data, evaluate, first_batches
from nag_lightning.analysis.sweeps.oracle import OracleSublayer, oracle
from nag_lightning.checkpoints.loading import load_model


class DirectionOnlyOracle(OracleSublayer):
    """The sweep's oracle, except that skipped tokens keep the write's radial (log-norm) lane."""

    def merge(self, state, written, keep):
        (u_new, rho_new), u_old = written, state[0]
        return torch.where(keep.unsqueeze(-1), u_new, u_old), rho_new


def tau_at_rate(model, batches, rate: float) -> float:
    """The angle below which `rate` of all (token, sublayer) writes fall, on `batches`."""
    model.record_diagnostics(True)
    angles = []
    for batch in batches:
        model(batch[:, :-1])
        angles += [s.contribution.flatten() for s in model.sublayers]
    model.record_diagnostics(False)
    return float(torch.quantile(torch.cat(angles), rate))


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--rate", type=float, default=0.25, help="the MoD rate to compare at")
    parser.add_argument("--val_batches", type=int, default=16)
    parser.add_argument("--trust_data", action="store_true",
                        help="read and write the files the checkpoint's data settings name")
    args = parser.parse_args()
    loaded = load_model(args.checkpoint)
    if type(loaded.model.strategy).__name__ != "NAGResidual":
        raise SystemExit("This compares NAG's two lanes; give the checkpoint of a `nag` run.")
    data = checkpoint_data(loaded, use_saved_files=args.trust_data)
    data.setup("fit")
    val = first_batches(data.val_dataloader(), args.val_batches)
    model = loaded.model
    tau = tau_at_rate(model, val, args.rate)
    dense = evaluate(model, val, token_bytes=loaded.token_bytes)["bpb"]
    result = {"checkpoint": args.checkpoint, "tau": tau, "dense_bpb": dense}
    for name, kind in (("both_lanes", OracleSublayer), ("direction_only", DirectionOnlyOracle)):
        with oracle(model, tau, every_sublayer=True, kind=kind):
            skipped = evaluate(model, val, token_bytes=loaded.token_bytes)
        result[f"{name}_mod_rate"] = skipped["mod_rate"]
        result[f"{name}_cost"] = skipped["bpb"] - dense
    print(json.dumps(result))


if __name__ == "__main__":
    main()
