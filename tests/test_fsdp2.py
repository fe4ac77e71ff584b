"""FSDP2 on CPU: Lightning's ModelParallelStrategy, built from recipes/scale/fsdp2.yaml, over two
processes (gloo). The model trains, and a run resumed from its sharded checkpoint (and from a
consolidated one, the recipe's format) continues exactly as the uninterrupted run.

Run as a module (`python -m tests.test_fsdp2 OUT_DIR`) this file is the worker: Lightning starts
the second rank by running the same command again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from nag_lightning.callbacks import FlopAccounting, RunCheckpoint
from nag_lightning.model import Block
from tests.test_scale import BATCH, SEQ, Record, loader, quiet, two_rank_reports

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "scale" / "fsdp2.yaml"


def recipe_strategy(**overrides) -> L.pytorch.strategies.Strategy:
    """The recipe's strategy, built as LightningCLI builds it, with `overrides` of its init_args."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy

    spec = yaml.safe_load(RECIPE.read_text())["trainer"]["strategy"]
    spec = {**spec, "init_args": {**spec["init_args"], **overrides}}
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=str | Strategy)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    return instantiate(parser.parse_object({"strategy": spec})).strategy


def fit(out: Path, sharded: bool, max_steps: int, ckpt_path: str | None = None) -> tuple[list, dict]:
    """Train the tiny routed, activation-checkpointed model under the recipe's strategy on two
    ranks; a checkpoint at every epoch end (2 steps). Returns this rank's losses and, on rank 0,
    the full (gathered) weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from nag_lightning.model import TransformerConfig
    from nag_lightning.training.module import LanguageModel

    torch.manual_seed(0)
    arch = TransformerConfig(d_model=32, n_layers=2, n_heads=2, seq_len=SEQ, router="topk",
                             activation_checkpointing=True)
    module = LanguageModel(arch, warmup_steps=1, lr=1e-2)
    record = Record()
    folder = out / ("sharded" if sharded else "full")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=max_steps, gradient_clip_val=1.0,
        strategy=recipe_strategy(data_parallel_size=2, save_distributed_checkpoint=sharded),
        callbacks=[record, FlopAccounting(), RunCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=out,
    )
    trainer.fit(module, loader(samples=2 * BATCH), ckpt_path=ckpt_path)  # one step per epoch
    assert all(isinstance(b, torch.distributed.fsdp.FSDPModule) for b in module.model.blocks)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(module.model, options=options)  # every rank takes part
    return record.losses, weights


def worker(out: Path) -> None:
    """Both ranks run this; Lightning's launcher starts rank 1 with the same command line."""
    quiet()
    report = {}
    for sharded in (True, False):
        name = "sharded" if sharded else "full"
        losses, weights = fit(out, sharded=sharded, max_steps=4)
        step2 = out / name / "epoch=1-step=2.ckpt"
        resumed, resumed_weights = fit(out, sharded=sharded, max_steps=4, ckpt_path=str(step2))
        report[name] = {"uninterrupted": losses, "resumed": resumed, "is_dir": step2.is_dir(),
                        "files": sorted(p.name for p in step2.iterdir()) if step2.is_dir() else []}
        if weights:  # rank 0
            report[name]["weights_equal"] = resumed_weights.keys() == weights.keys() and all(
                torch.allclose(resumed_weights[k], v, rtol=1e-6, atol=1e-7) if torch.is_tensor(v)
                else resumed_weights[k] == v  # the NAG settings
                for k, v in weights.items()
            )
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(report))


def test_fsdp2_two_processes_train_and_resume_from_sharded_and_full_checkpoints(tmp_path):
    ranks = two_rank_reports("tests.test_fsdp2", tmp_path, timeout=300)
    for rank in ranks:
        first = rank["sharded"]["uninterrupted"]
        assert len(first) == 4 and first[-1] < first[0] - 0.5  # it trained
        assert rank["full"]["uninterrupted"] == pytest.approx(first, rel=1e-6)  # format aside, the same run
        for name in ("sharded", "full"):
            # the resumed run starts at step 2 and repeats the uninterrupted run's steps 3 and 4
            assert rank[name]["resumed"] == pytest.approx(first[2:], rel=1e-6), name
    assert ranks[0]["sharded"]["uninterrupted"] != ranks[1]["sharded"]["uninterrupted"]  # own data
    sharded, full = ranks[0]["sharded"], ranks[0]["full"]
    assert sharded["is_dir"] and not full["is_dir"]
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(sharded["files"])  # one shard file per rank
    assert sharded["weights_equal"] and full["weights_equal"]


def test_fsdp2_recipe_builds_model_parallel_over_every_device(capsys):
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = yaml.safe_load(RECIPE.read_text())["trainer"]
    strategy = recipe_strategy()
    assert isinstance(strategy, ModelParallelStrategy)
    assert strategy._data_parallel_size == trainer["devices"] * trainer.get("num_nodes", 1)
    assert strategy._tensor_parallel_size == 1
    assert strategy._save_distributed_checkpoint is False  # resumable with --ckpt_path


def test_a_sharded_checkpoint_folder_is_refused_in_one_sentence(tmp_path):
    from nag_lightning.checkpoints.trust import read_checkpoint

    (tmp_path / "last.ckpt").mkdir()
    with pytest.raises(ValueError, match="is a folder, a sharded.*save_distributed_checkpoint: false"):
        read_checkpoint(tmp_path / "last.ckpt")


def test_fully_shard_makes_every_block_a_unit():
    """On a one-process gloo group: every Block and the root are FSDP2 units, the parameters are
    DTensors, and a training step runs through them (the two-process run is the slow test)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from nag_lightning.model import Transformer, TransformerConfig
    from nag_lightning.training.sharding import fully_shard_transformer

    # An in-memory store: no port, and nothing left in the environment for later child processes.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        torch.manual_seed(0)
        cfg = TransformerConfig(d_model=32, n_layers=2, n_heads=2, seq_len=SEQ, router="threshold",
                                router_options={"target_rate": 0.25, "warmup_steps": 0})
        model = Transformer(cfg)
        fully_shard_transformer(model, mesh)
        fully_shard_transformer(model, mesh)  # a second configure_model call changes nothing
        assert isinstance(model, FSDPModule)
        assert all(isinstance(b, Block) and isinstance(b, FSDPModule) for b in model.blocks)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        idx = torch.randint(0, 256, (2, SEQ + 1))
        out = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), idx[:, 1:].flatten())
        (loss + out.aux_loss).backward()
        assert all(p.grad is not None for p in model.blocks[0].parameters())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
