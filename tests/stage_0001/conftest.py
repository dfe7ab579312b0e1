# SPDX-License-Identifier: Apache-2.0
"""Stage 0001's test helpers: the host bench where there is no GPU."""

import functools
import os
import time

import pytest
import torch


class _Event:
    """A CUDA event's timing calls, on the host clock."""

    def __init__(self, enable_timing: bool = True):
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: "_Event") -> float:
        return (end.at - self.at) * 1e3


@pytest.fixture
def bench_here(monkeypatch) -> None:
    """The bench on the CPU, through Triton's interpreter, where there is no
    GPU: CUDA's timing calls stood in, so that its plumbing runs whole."""
    from scripts.bench import cp_indexer_host_timing as timing
    from scripts.harness import indexer_batch

    if torch.cuda.is_available():
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the stand-in kernels run on the CPU only in the interpreter")
    monkeypatch.setattr(timing, "DEVICE", "cpu")
    monkeypatch.setattr(timing, "compute_units", lambda: 8)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(timing, "_SLEEP_CYCLES_PER_MS", [1.0])
    # vLLM's Triton K gather is slow in the interpreter: its torch twin.
    run = functools.partial(indexer_batch.run_indexer, torch_gather=True)
    monkeypatch.setattr(indexer_batch, "run_indexer", run)
