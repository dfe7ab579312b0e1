# SPDX-License-Identifier: Apache-2.0
"""What the GPU benchmarks under scripts/ share: CUDA-event timing and the
versions a result is stated with."""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections.abc import Callable


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
    """GPUs (nvidia-smi name and driver), torch, triton, CUDA, NCCL, Python."""
    import torch
    import triton

    gpus = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "gpus": gpus.splitlines(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "python": sys.version.split()[0],
    }
