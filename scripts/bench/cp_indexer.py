# SPDX-License-Identifier: Apache-2.0
"""Benchmark of stage 0001 on 2 GPUs: the patched indexer prefill, replicated
vs split across the TP ranks, at 8K, 32K and 64K rows of one sequence.

Each rank runs the real ``rocm_aiter_sparse_attn_indexer`` from the applied
tree (stage 0001) with the harness's stand-ins for what an NVIDIA GPU lacks:
AITER's logits entry point computes vLLM's torch reference
(``fp8_mqa_logits_torch``) and top-k is the harness's torch reference
(``torch.topk`` per row). vLLM's own Triton kernels (K gather) run compiled.
The indexer shape is GLM-5.x / DeepSeek-V3.2's: 32 heads, head dim 128,
k = 2048, default 512 MiB logits budget per chunk.

Replicated: every rank scores every row (the flag off). Split: the flag on,
each rank scores its cost-balanced range of rows, then one all_gatherv
merges. (docs/cp_indexer_bench_2gpu.md was last made on the previous design,
stripes merged by all_reduce(MAX); re-running it needs 2 GPUs.) Times are CUDA
event medians over the runs, per rank; the table takes the slower rank.

Usage (on the device, under scripts/gpu_run.sh; see README "GPU runs"):
    python3 -m scripts.bench.cp_indexer --out DIR
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

from scripts.bench.common import (
    command_line,
    gpu_versions,
    median_ms,
    parse_args,
)

ROWS = (8192, 32768, 65536)
TOPK = 2048
HEADS = 32
WORLD = 2


def _bench_rank(rank: int, world_size: int, runs: int, warmup: int) -> dict:
    import pytest
    import torch

    from scripts.harness import indexer_batch
    from scripts.harness.rocm_platform import emulate_rocm
    from vllm.distributed import get_tp_group

    device = f"cuda:{rank}"
    group = get_tp_group().device_group
    results: dict = {}
    for rows in ROWS:
        entry: dict = {}
        for mode in ("replicated", "split"):
            with pytest.MonkeyPatch.context() as monkeypatch:
                monkeypatch.setenv(
                    "VLLM_ROCM_USE_AITER_CP_INDEXER", "1" if mode == "split" else "0"
                )
                with emulate_rocm("gfx950"):
                    config = indexer_batch.make_vllm_config(
                        tp_size=world_size,
                        device=device,
                        max_len=rows,
                        max_tokens=rows,
                    )
                    builder = indexer_batch.make_builder(config, monkeypatch, device)
                    batch = indexer_batch.build_batch(
                        builder, [(0, rows)], heads=HEADS, cache_new_keys=True
                    )
                    entry[mode] = median_ms(
                        functools.partial(
                            indexer_batch.run_indexer,
                            batch,
                            TOPK,
                            skip_k_cache_insert=True,
                        ),
                        runs,
                        warmup,
                        torch.distributed.barrier,
                    )
                    del batch
                    torch.cuda.empty_cache()
        merged = torch.zeros(rows, TOPK, dtype=torch.int32, device=device)
        half = torch.zeros(rows // world_size, TOPK, dtype=torch.int32, device=device)
        gathered = torch.zeros(rows, TOPK, dtype=torch.int32, device=device)
        entry["all_reduce_max"] = median_ms(
            functools.partial(
                torch.distributed.all_reduce,
                merged,
                op=torch.distributed.ReduceOp.MAX,
                group=group,
            ),
            runs * 4,
            warmup,
            torch.distributed.barrier,
        )
        entry["all_gather_halves"] = median_ms(
            functools.partial(
                torch.distributed.all_gather_into_tensor, gathered, half, group=group
            ),
            runs * 4,
            warmup,
            torch.distributed.barrier,
        )
        results[rows] = entry
    return results


def _report(per_rank: list[dict], versions: dict, command: str, out: Path) -> None:
    rows = []
    for size in ROWS:
        rep = max(r[size]["replicated"] for r in per_rank)
        split = max(r[size]["split"] for r in per_rank)
        ar = max(r[size]["all_reduce_max"] for r in per_rank)
        ag = max(r[size]["all_gather_halves"] for r in per_rank)
        rows.append((size, rep, split, rep / split, ar, ag))
    lines = [
        "# CP indexer prefill on 2 GPUs: replicated vs split (stage 0001)",
        "",
        f"Hardware: {', '.join(versions['gpus'])}. torch {versions['torch']}, "
        f"triton {versions['triton']}, CUDA {versions['cuda']}, NCCL "
        f"{versions['nccl']}, Python {versions['python']}.",
        "",
        f"Command: `{command}`",
        "",
        "One sequence of M rows (causal, M keys), 32 heads, D 128, k 2048; the "
        "real patched rocm_aiter_sparse_attn_indexer with torch reference "
        "logits and top-k (AITER is ROCm-only). Median of CUDA-event times per "
        "call, the slower rank. Split includes the all_reduce(MAX) merge. "
        "Run with the stand-ins' plain choices (`DSA_KIND_STANDINS=1`): this "
        "measures speed, not the adversarial choices the tests make.",
        "",
        "| rows M | replicated (ms) | split (ms) | speedup | all_reduce MAX "
        "[M, 2048] int32 (ms) | all_gather of halves (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for size, rep, split, speedup, ar, ag in rows:
        lines.append(
            f"| {size} | {rep:.1f} | {split:.1f} | {speedup:.2f}x | {ar:.2f} | "
            f"{ag:.2f} |"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "cp_indexer_bench_2gpu.md").write_text("\n".join(lines) + "\n")
    (out / "cp_indexer_bench_2gpu.json").write_text(
        json.dumps({"versions": versions, "per_rank": per_rank}, indent=1) + "\n"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{size // 1024}K" for size in ROWS]
    x = range(len(ROWS))
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label="replicated")
    ax.bar([i + 0.2 for i in x], [r[2] for r in rows], 0.4, label="split (tp 2)")
    for i, r in enumerate(rows):
        ax.annotate(f"{r[3]:.2f}x", (i + 0.2, r[2]), ha="center", va="bottom")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("prefill rows (one sequence)")
    ax.set_ylabel("ms per indexer call (median)")
    ax.set_title("CP indexer prefill, 2x " + versions["gpus"][0].split(",")[0])
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cp_indexer_bench_2gpu.png", dpi=110)
    print("\n".join(lines))


def main() -> int:
    args = parse_args(__doc__, runs=7, warmup=2)
    from scripts.harness.multiproc import run_ranks

    per_rank = run_ranks(
        WORLD, _bench_rank, args.runs, args.warmup, device="cuda", timeout_s=1800
    )
    _report(per_rank, gpu_versions(), command_line(__spec__.name), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
