# SPDX-License-Identifier: Apache-2.0
"""What the benchmarks share: the applied tree they run, CUDA-event timing and
the versions a result is stated with.

The tree is the test contract's (scripts/series/contract.py): under
``scripts/gpu_run.sh`` or a nox session it is set already; ``--tree`` names
one by hand. Run a benchmark from the project root as a module,
``python3 -m scripts.bench.<name>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from scripts.series.contract import TREE_ENV

# scripts/gpu_run.sh names itself here, for the command a result states.
GPU_RUN_ENV = "DSA_GPU_RUN"

DOCS = Path(__file__).resolve().parents[2] / "docs"


def parse_args(doc: str, **int_options: int) -> argparse.Namespace:
    """A benchmark's command line: --tree, --out and ``int_options`` (name:
    default); vLLM is then imported from the tree."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument(
        "--tree",
        type=Path,
        default=os.environ.get(TREE_ENV),
        help=f"the applied vLLM tree (default: ${TREE_ENV}, the test contract's)",
    )
    parser.add_argument("--out", type=Path, default=DOCS)
    for name, default in int_options.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    use_tree(args.tree)
    return args


def use_tree(tree: Path | None) -> None:
    """Import vLLM from ``tree``, with the stand-in for its compiled ops."""
    if tree is None:
        raise SystemExit(
            f"no vLLM tree: pass --tree or run under scripts/gpu_run.sh ({TREE_ENV})"
        )
    os.environ[TREE_ENV] = str(tree)
    sys.path.insert(0, str(tree))
    from scripts.harness import compiled_stub

    compiled_stub.install()


def command_line(module: str) -> str:
    """The command that produced this run's results, as they state it."""
    kind = "DSA_KIND_STANDINS=1 " if os.environ.get("DSA_KIND_STANDINS") == "1" else ""
    wrapper = os.environ.get(GPU_RUN_ENV, "")
    args = " ".join(sys.argv[1:])
    return f"{kind}{wrapper} python3 -m {module} {args}".replace("  ", " ").strip()


# The project's commit, for a run on a machine whose copy has no git
# history (the lent GPUs): set by the command that starts the run.
COMMIT_ENV = "DSA_COMMIT"


def source_commit() -> str | None:
    """The project commit a result comes from: ``DSA_COMMIT``, else git's
    HEAD (with "+edits" where the checkout differs from it), else None."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    root = Path(__file__).resolve().parents[2]
    git = ["git", "-C", str(root)]
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    if head.returncode != 0:
        return None
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"], check=False)
    return head.stdout.strip() + ("+edits" if dirty.returncode else "")


def median_ms(
    fn: Callable[[], object],
    runs: int,
    warmup: int,
    before_each: Callable[[], object] | None = None,
) -> float:
    """Median CUDA-event time of ``fn`` in ms; ``before_each`` runs untimed
    before every timed call (a barrier, so ranks start together)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        if before_each is not None:
            before_each()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gpu_versions() -> dict:
    """GPUs (nvidia-smi name and driver; torch's device names where there is
    no nvidia-smi, as on ROCm), torch, triton, CUDA or HIP, NCCL or RCCL,
    Python."""
    import torch
    import triton

    try:
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.splitlines()
    except FileNotFoundError:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        gpus = [torch.cuda.get_device_name(i) for i in range(count)]
    versions = {
        "gpus": gpus,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
        "python": sys.version.split()[0],
    }
    if torch.version.hip:
        versions["hip"] = torch.version.hip
    return versions
