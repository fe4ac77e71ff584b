"""Wall time from typing a command to its end, for the commands a new user types first.

Each command runs as a new process. With several `--pythonpath` folders (each holding an
`nag_lightning` and a `nag_kernels` to compare, e.g. two checkouts), every command runs once per
folder in turn, `--repeats` times, so the versions share the machine's load; medians. `import torch`
and `import lightning.pytorch` are the floors: a command that needs torch cannot start faster.

    python3 benchmarks/bench_startup.py [--pythonpath OLD NEW] [--ckpt_path RUN/checkpoints/last.ckpt]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def commands(ckpt_path: str | None) -> dict[str, list[str]]:
    found = {
        "nag-lightning --help": ["nag-lightning", "--help"],
        "nag-lightning generate --help": ["nag-lightning", "generate", "--help"],
        "nag-lightning compare --help": ["nag-lightning", "compare", "--help"],
        "nag-lightning study depth --help": ["nag-lightning", "study", "depth", "--help"],
        "nag-lightning fit --help": ["nag-lightning", "fit", "--help"],
    }
    if ckpt_path:
        found["nag-lightning generate (8 bytes)"] = [
            "nag-lightning", "generate", "--ckpt_path", ckpt_path, "--max_new_tokens", "8"]
    found["python -c 'import torch'"] = [sys.executable, "-c", "import torch"]
    found["python -c 'import lightning.pytorch'"] = [sys.executable, "-c", "import lightning.pytorch"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pythonpath", nargs="*", default=[None],
                        help="PYTHONPATH of each version to time (default: as installed)")
    parser.add_argument("--ckpt_path", help="a checkpoint for `generate` (skipped without one)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    todo = commands(args.ckpt_path)
    times: dict[tuple[str, str | None], list[float]] = {}
    for _ in range(args.repeats):
        for name, command in todo.items():
            for path in args.pythonpath:
                env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
                if path:
                    env["PYTHONPATH"] = path
                start = time.perf_counter()
                subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                times.setdefault((name, path), []).append(time.perf_counter() - start)
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| command | " + " | ".join(f"{p or 'installed'} (s)" for p in args.pythonpath) + " |")
    print("|---|" + "---|" * len(args.pythonpath))
    for name in todo:
        medians = [statistics.median(times[(name, p)]) for p in args.pythonpath]
        print(f"| `{name}` | " + " | ".join(f"{m:.2f}" for m in medians) + " |")


if __name__ == "__main__":
    main()
