# SPDX-License-Identifier: Apache-2.0
"""Stage 0001 on one GPU, host included: the whole indexer prefill op per
step, replicated vs each TP rank's share of the split, on serving steps.

For each step (requests as (cached tokens, new tokens), from the cost
model's workload set) and tp 2 and 8, vLLM's metadata builder plans the
step and the real ``rocm_aiter_sparse_attn_indexer`` of the applied tree
runs it: once replicated (the flag off), then once as each rank of a split
(the flag on, the rank's id patched in; one GPU has no TP group, so the
merge's collective is replaced by its local part and not timed). Per run:

- GPU ms: CUDA events around the call;
- host ms: wall time until the call returns, without waiting for the GPU
  (with no sync inside, the host runs ahead; a sync makes it wait);
- syncs: synchronizing CUDA calls counted by
  ``torch.cuda.set_sync_debug_mode("warn")``.

The logits and top-k are the fast stand-ins of
``scripts.harness.fast_indexer_kernels`` (a Triton fp8 MQA-logits kernel
and one torch.topk per chunk), so that GPU time is not dominated by a
reference kernel 10-100x slower than AITER. Their times are H200 times, not
MI355X times. Run on the previous design's tree too (stage 0001 at commit
5a047b0) for its figures; each run writes cp_indexer_host_bench_<after or
before>.json.

Usage (on the device, under scripts/gpu_run.sh; see README "GPU runs"):
    python3 -m scripts.bench.cp_indexer_host --out DIR
then, with both JSON files in docs/:
    python -m scripts.bench.cp_indexer_host --report docs
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

from scripts.bench.common import command_line, gpu_versions, parse_args

TOPK = 2048
HEADS = 32
K = 1024
STEPS: dict[str, list[tuple[int, int]]] = {
    "fresh 16K": [(0, 16 * K)],
    "fresh 64K, last 16K-row step": [(48 * K, 16 * K)],
    "turn 4096 over 200K": [(200 * K, 4096)],
    "turn 512 over 100K + fresh 8K": [(100 * K, 512), (0, 8 * K)],
    "8 turns of 256 over 4K-200K": [
        (p * K, 256) for p in (4, 8, 16, 32, 64, 100, 150, 200)
    ],
    "turn 64 over 15K + fresh 1K": [(15 * K, 64), (0, K)],
}
TPS = (2, 8)


def _timed(fn, runs: int) -> dict:
    """Median GPU ms, host ms and the syncs of one call."""
    import torch

    fn()  # warm-up: Triton compiles, workspace grows
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(runs):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    return {
        "gpu_ms": statistics.median(gpu),
        "host_ms": statistics.median(host),
        "syncs": syncs,
    }


def _bench(step: list[tuple[int, int]], tp: int, runs: int) -> dict:
    import pytest
    import torch

    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op
    from scripts.harness import fast_indexer_kernels as fast
    from scripts.harness import indexer_batch
    from scripts.harness.rocm_platform import emulate_rocm
    from vllm.v1.attention.ops import rocm_cp_indexer

    longest = max(c + q for c, q in step)
    rows = sum(q for _, q in step)
    result: dict = {}
    for mode in ("replicated", "split"):
        with contextlib.ExitStack() as stack:
            mp = stack.enter_context(pytest.MonkeyPatch.context())
            # Before the platform: entering it reads AITER's switches.
            mp.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1" if mode == "split" else "0")
            stack.enter_context(emulate_rocm("gfx950"))
            mp.setattr(op, "rocm_fp8_mqa_logits", fast.mqa_logits)
            mp.setattr(
                torch.ops._C,
                "top_k_per_row_prefill",
                fast.top_k_per_row_prefill,
                raising=False,
            )
            config = indexer_batch.make_vllm_config(
                tp_size=tp, device="cuda", max_len=longest + 64, max_tokens=rows
            )
            builder = indexer_batch.make_builder(config, mp, "cuda")
            batch = indexer_batch.build_batch(
                builder, step, heads=HEADS, cache_new_keys=True, torch_context=True
            )
            prefill = batch.metadata.prefill  # type: ignore[attr-defined]
            split = prefill.cp_split
            if mode == "split" and split is None:
                result["split"] = None  # below the minimum: stays replicated
                continue
            # One GPU: no TP group. The merge keeps its local work (its own
            # rows made contiguous, the gathered rows written back).
            group = SimpleNamespace(
                world_size=tp,
                device_group=None,
                all_gatherv=lambda own, dim=0, sizes=None: own.new_empty(
                    (sum(sizes), *own.shape[1:])
                ),
            )
            mp.setattr(
                rocm_cp_indexer, "get_tp_group", lambda g=group: g, raising=False
            )
            mp.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
            ranks = range(tp) if mode == "split" else [0]
            per_rank = []
            for rank in ranks:
                mp.setattr(
                    rocm_cp_indexer,
                    "get_tensor_model_parallel_rank",
                    lambda r=rank: r,
                    raising=False,
                )
                per_rank.append(
                    _timed(
                        functools.partial(
                            indexer_batch.run_indexer,
                            batch,
                            TOPK,
                            skip_k_cache_insert=True,
                        ),
                        runs,
                    )
                )
            result[mode] = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
            result[mode]["per_rank_gpu_ms"] = [r["gpu_ms"] for r in per_rank]
            result["chunks"] = len(prefill.chunks)
    return result


def report(docs: Path) -> str:
    """docs/cp_indexer_host_bench.md from the two runs' JSON files."""
    runs = {
        label: json.loads((docs / f"cp_indexer_host_bench_{label}.json").read_text())
        for label in ("before", "after")
    }
    after = runs["after"]
    lines = [
        "# CP indexer on one GPU, host included: split vs replicated",
        "",
        "Per serving step and tp, the whole `rocm_aiter_sparse_attn_indexer` "
        "call (vLLM's builder plans the step): replicated (flag off), and the "
        "slowest TP rank's share of the split (flag on; one GPU runs each "
        "rank's share in turn, and the merge's collective is not timed). "
        "*before*: the previous design (mirrored stripes by row index, "
        "commit 5a047b0); *after*: cost-balanced contiguous ranges. Host ms: "
        "wall time until the call returns, without waiting for the GPU; "
        "syncs: synchronizing CUDA calls per call "
        "(`torch.cuda.set_sync_debug_mode`). Speedup: replicated GPU ms / "
        "the slowest rank's GPU ms; ideal: tp.",
        "",
        "Logits and top-k are the fast stand-ins of "
        "`scripts/harness/fast_indexer_kernels.py` (a Triton fp8 MQA-logits "
        "kernel, one torch.topk per chunk); their times are H200 times, not "
        "MI355X times. Their top-k scans each chunk's whole key width for "
        "every row, so a row's cost here has a part proportional to the "
        "chunk's width, not only to its own key count; AITER's per-row "
        "kernels read each row's own key range (an assumption for the "
        "logits kernel, see ../shared/AITER_CONTRACTS.md).",
        "",
        f"Hardware and versions: {after['versions']}. Command: "
        f"`{after['command']}`, once on each tree.",
        "",
        "| step | tp | replicated GPU ms | split GPU ms (slowest rank) "
        "before / after | speedup before / after | host ms before / after | "
        "syncs before / after |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, result in after["results"].items():
        name, tp = key.split(" | tp ")
        old = runs["before"]["results"][key]
        rep = result["replicated"]

        def cells(entry):
            split = entry["split"]
            if split is None:
                return (
                    "replicated",
                    "1.00",
                    f"{entry['replicated']['host_ms']:.1f}",
                    str(entry["replicated"]["syncs"]),
                )
            return (
                f"{split['gpu_ms']:.2f}",
                f"{entry['replicated']['gpu_ms'] / split['gpu_ms']:.2f}",
                f"{split['host_ms']:.1f}",
                str(split["syncs"]),
            )

        b, a = cells(old), cells(result)
        lines.append(
            f"| {name} | {tp} | {rep['gpu_ms']:.2f} | {b[0]} / {a[0]} | "
            f"{b[1]} / {a[1]} | {b[2]} / {a[2]} | {b[3]} / {a[3]} |"
        )
    lines += [
        "",
        '"replicated": the step stays replicated (after: below the minimum '
        "split size). Replicated calls make 0 syncs (1 in the first measured "
        "call of a process).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    if sys.argv[1:2] == ["--report"]:
        docs = Path(sys.argv[2])
        (docs / "cp_indexer_host_bench.md").write_text(report(docs))
        return 0
    args = parse_args(__doc__, runs=5)
    from vllm.v1.attention.ops import rocm_cp_indexer

    # The previous design's tree has no minimum split size.
    label = "after" if hasattr(rocm_cp_indexer, "MIN_SPLIT_KEY_ROWS") else "before"
    results = {}
    for name, step in STEPS.items():
        for tp in TPS:
            results[f"{name} | tp {tp}"] = _bench(step, tp, args.runs)
            print(name, tp, results[f"{name} | tp {tp}"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "label": label,
        "command": command_line("scripts.bench.cp_indexer_host"),
        "versions": gpu_versions(),
        "results": results,
    }
    (args.out / f"cp_indexer_host_bench_{label}.json").write_text(
        json.dumps(payload, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
