# SPDX-License-Identifier: Apache-2.0
"""Stage 0001 with one GPU per rank:

- on 2 NVIDIA GPUs (the H200 x2 device): NCCL, vLLM's Triton kernels compiled
  for the GPU, the ROCm checks and AITER stood in as on the CPU;
- on 2 gfx950 GPUs with AITER (MI355X): the real AITER logits and top-k over
  RCCL, nothing stood in.

Both require the merged split result to equal the single-rank result."""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from scripts.harness import indexer_batch
from scripts.harness.multiproc import run_ranks
from scripts.harness.rocm_platform import emulate_rocm, real_gfx950_with_aiter
from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

WORLD = 2
TOPK = 2048
SCENARIOS = {
    "one long sequence": [(0, 3000)],
    "packed sequences": [(0, 700), (300, 900), (0, 64), (2000, 500)],
    "mixed decode and prefill": [(500, 1), (900, 1), (0, 1200), (800, 333)],
    # 8,000 keys at 16 MiB of logits: chunks of 524, 524 and 1 rows.
    "a short tail chunk": [(6951, 1049)],
}
# On gfx950 also past 32K keys, where the prefill chunks take AITER's top-k
# (with stage 0002; its rows come back unordered) and are merged.
GFX950_SCENARIOS = {**SCENARIOS, "32K keys, AITER's prefill top-k": [(32768, 600)]}
# A cold AITER JIT cache compiles its kernels in the first run of each rank.
GFX950_RANK_TIMEOUT_S = 1800


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


requires_two_nvidia_gpus = pytest.mark.skipif(
    torch.version.hip is not None or _gpus() < WORLD,
    reason=f"needs {WORLD} NVIDIA GPUs for NCCL (run on the H200 x2 device)",
)


def _gfx950_skip_reason() -> str | None:
    """Checked without starting HIP in this process (rocminfo, then amdsmi):
    ranks forked after the parent started HIP cannot start it themselves."""
    if not real_gfx950_with_aiter():
        return f"needs {WORLD} gfx950 GPUs (MI355X) with AITER installed"
    if importlib.util.find_spec("amdsmi") is None:
        return (
            "needs the amdsmi Python package (ROCm's): torch counts the GPUs "
            "through it without starting HIP before the ranks fork"
        )
    if _gpus() < WORLD:
        return f"needs {WORLD} gfx950 GPUs (MI355X), found {_gpus()}"
    return None


GFX950_SKIP = _gfx950_skip_reason()
requires_two_gfx950_gpus = pytest.mark.skipif(
    GFX950_SKIP is not None, reason=GFX950_SKIP or ""
)


def _run(tp_size: int, cp: bool, requests, device: str, real_rocm: bool):
    platform = contextlib.nullcontext() if real_rocm else emulate_rocm("gfx950")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
        monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1" if cp else "0")
        # 16 MiB of logits per chunk: these prefills take several chunks.
        monkeypatch.setenv("VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", "16")
        # These prefills are below the work that repays a split in serving.
        from vllm.v1.attention.ops import rocm_cp_indexer_plan

        monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
        with platform:
            from vllm._aiter_ops import rocm_aiter_ops

            rocm_aiter_ops.refresh_env_variables()
            longest = max(8192, max(c + q for c, q in requests))
            config = indexer_batch.make_vllm_config(
                tp_size=tp_size, device=device, max_len=longest, max_tokens=longest
            )
            builder = indexer_batch.make_builder(config, monkeypatch, device)
            batch = indexer_batch.build_batch(builder, requests, heads=32)
            assert cp is (batch.metadata.prefill.cp_split is not None)
            return indexer_batch.run_indexer(batch, TOPK).cpu()


def _on_rank(rank: int, world_size: int, real_rocm: bool) -> dict:
    device = f"cuda:{rank}"
    results = {}
    for name, requests in (GFX950_SCENARIOS if real_rocm else SCENARIOS).items():
        results[name] = {"split": _run(world_size, True, requests, device, real_rocm)}
        if rank == 0:
            results[name]["single"] = _run(1, False, requests, device, real_rocm)
    return results


def _check(ranks: list[dict], name: str) -> None:
    expected = ranks[0][name]["single"]
    for rank, result in enumerate(ranks):
        got = result[name]["split"]
        assert torch.equal(got.sort(dim=1).values, expected.sort(dim=1).values), (
            f"rank {rank}: {name}"
        )


@pytest.fixture(scope="module")
def nvidia_ranks() -> list[dict]:
    return run_ranks(WORLD, _on_rank, False, device="cuda")


@pytest.fixture(scope="module")
def gfx950_ranks() -> list[dict]:
    return run_ranks(
        WORLD, _on_rank, True, device="cuda", timeout_s=GFX950_RANK_TIMEOUT_S
    )


@requires_two_nvidia_gpus
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_nccl_merge_equals_the_single_rank_result(nvidia_ranks, name):
    _check(nvidia_ranks, name)


@requires_two_gfx950_gpus
@pytest.mark.parametrize("name", list(GFX950_SCENARIOS))
def test_real_aiter_split_equals_the_unsplit_result(gfx950_ranks, name):
    _check(gfx950_ranks, name)
