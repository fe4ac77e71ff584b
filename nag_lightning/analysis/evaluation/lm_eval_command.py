"""`nag-lightning eval`: lm-evaluation-harness tasks on a checkpoint or an exported folder.

Runs lm-eval's `simple_evaluate` with the model of `nag_lightning.analysis.evaluation.lm_eval_model` and
prints its table. lm-eval is an optional extra (`pip install 'nag-lightning[eval]'`); this module
imports it only when the command runs, so the base install never needs it.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path


def evaluate_tasks(
    ckpt_path: str,
    tasks: str | list[str],
    include_path: str | None = None,
    limit: float | None = None,
    batch_size: int = 8,
    num_fewshot: int | None = None,
    device: str = "cpu",
    output: str | None = None,
    trust_checkpoint: bool = False,
    prefix_token: int | None = None,
    seed: int = 0,
) -> dict:
    """Evaluate a checkpoint on lm-evaluation-harness tasks and print lm-eval's table.

    Args:
        ckpt_path: a .ckpt file written by `nag-lightning fit`, or a folder of `nag-lightning export`.
        tasks: lm-eval task names (or groups), as a list or separated by commas, e.g.
            hellaswag,lambada_openai; tasks of include_path too.
        include_path: a folder of task YAML files of your own, added to lm-eval's tasks.
        limit: at most this many documents per task (a fraction below 1: that share of them).
        batch_size: sequences per forward pass.
        num_fewshot: examples in each prompt; None: the task's own setting.
        device: where the model runs: cpu, cuda, cuda:N or mps.
        output: a JSON file to write lm-eval's results to (it must not exist yet).
        trust_checkpoint: let a checkpoint's residual or router named by a class path outside the
            registered plugins be built; only for checkpoints whose origin you trust.
        prefix_token: the token id a text's first token is predicted from; None: a newline's.
        seed: the seed of lm-eval's sampling of few-shot examples and of generation.
    """
    harness = _harness()
    tasks = [t.strip() for t in tasks.split(",") if t.strip()] if isinstance(tasks, str) else list(tasks)
    if not tasks:
        raise ValueError("--tasks names no task; give lm-eval task names, e.g. --tasks hellaswag.")
    if output is not None and Path(output).exists():
        raise ValueError(f"--output {output} already exists; give a new file, so that nothing is "
                         "overwritten.")
    if limit is not None and not limit > 0:
        raise ValueError(f"--limit={limit} is not a number of documents; give one above 0, or leave it out.")
    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"--include_path {include_path} is not a folder; give the folder of "
                                "your task YAML files.")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # indexing lm-eval's thousands of task files takes most of a small run: only when needed
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(not manager.match_tasks([t]) for t in tasks):
        manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise ValueError(f"lm-eval knows no task {', '.join(unknown)}; see `lm-eval ls tasks`, or give "
                         "--include_path for a folder of your own task YAML files.")
    model = harness.NagLM(ckpt_path, batch_size=batch_size, device=device,
                          trust_checkpoint=trust_checkpoint, prefix_token=prefix_token)
    results = simple_evaluate(model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                              task_manager=manager, random_seed=seed, numpy_random_seed=seed,
                              torch_random_seed=seed, fewshot_random_seed=seed)
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    return results


def _harness():
    """The lm-eval model module, or one sentence saying how to install lm-eval."""
    try:
        return importlib.import_module("nag_lightning.analysis.evaluation.lm_eval_model")
    except ImportError as error:
        if "lm_eval" not in str(error):
            raise
        raise ValueError("nag-lightning eval needs lm-evaluation-harness, an optional extra: "
                         "pip install 'nag-lightning[eval]' (or pip install lm-eval).") from None


def eval_command(args: list[str]) -> None:
    """`nag-lightning eval`: lm-evaluation-harness tasks on a checkpoint or exported folder."""
    from nag_lightning.arguments import function_parser

    options = function_parser(evaluate_tasks, "nag-lightning eval").parse_args(args)
    results = evaluate_tasks(**options.as_dict())
    from lm_eval.utils import make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if options.output:
        print(f"wrote {options.output}")
