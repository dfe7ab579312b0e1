# SPDX-License-Identifier: Apache-2.0
"""Benchmark of stage 0003 on one GPU: the MXFP4 indexer-key quantise-and-write
kernel's achieved bandwidth against the GPU's measured copy bandwidth, and the
indexer cache's bytes per token and KV-capacity gain for DeepSeek-V3.2 and
GLM-5.2.

The kernel is the test harness's ``indexer_k_mxfp4_quant_and_cache``: the
applied tree's quantiser and store (what ``fused_norm_rope`` runs) as a
kernel of its own, which vLLM does not have. It reads bf16 keys
[T, 128] and int64 slots and writes 68-byte rows into 64-token pages, at
consecutive slots (a prefill's new tokens) or at a random permutation of
them. Achieved bandwidth counts those bytes once. Copy bandwidth is
``torch.Tensor.copy_`` of a 2 GiB buffer (read + write).

Usage (on the device, see README "Benchmarks"):
    python scripts/bench_mxfp4_indexer_cache.py --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENS = (16384, 262144, 1048576, 4194304)
HEAD_DIM, PAGE = 128, 64
GOAL = 0.70
RUNS, WARMUP = 20, 3

# Per-token KV bytes of each layer kind: kv_lora_rank 512 + qk_rope_head_dim
# 64 as FP8 (--kv-cache-dtype fp8) is 576 bytes of MLA cache; index_head_dim
# 128 is 132 bytes FP8 (values + one fp32 scale) or 68 bytes MXFP4. Layer
# counts, not checked here (no model files offline): DeepSeek-V3.2 61 layers,
# each with an indexer, and GLM-5 78 layers, from their published config.json
# as recalled; GLM-5.2's 21 indexer layers from the stage 0002 PR text.
MODELS = {
    "DeepSeek-V3.2": {"layers": 61, "indexer_layers": 61},
    "GLM-5.2": {"layers": 78, "indexer_layers": 21},
}
MLA_BYTES, FP8_ROW, MXFP4_ROW = 576, 132, 68


def _copy_gbps() -> float:
    import torch

    from harness.gpu_bench import median_ms

    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_ms(lambda: dst.copy_(src), RUNS, WARMUP) / 1e6


def _writer_rows() -> list[dict]:
    import torch

    from harness.gpu_bench import median_ms
    from harness.mxfp4_writer import indexer_k_mxfp4_quant_and_cache
    from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import (
        RocmPagedMxfp4CacheLayout,
    )

    layout = RocmPagedMxfp4CacheLayout(16, 16, 4)
    rows = []
    for tokens in TOKENS:
        keys = torch.randn(tokens, HEAD_DIM, device="cuda").bfloat16()
        cache = torch.empty(tokens // PAGE, PAGE, MXFP4_ROW, dtype=torch.uint8)
        cache = cache.cuda()
        moved = tokens * (HEAD_DIM * 2 + 8 + MXFP4_ROW)
        patterns = {
            "consecutive": torch.arange(tokens, device="cuda"),
            "random": torch.randperm(tokens, device="cuda"),
        }
        for name, slots in patterns.items():
            ms = median_ms(
                functools.partial(
                    indexer_k_mxfp4_quant_and_cache, keys, slots, cache, layout
                ),
                RUNS,
                WARMUP,
            )
            rows.append(
                {"tokens": tokens, "slots": name, "ms": ms, "gbps": moved / ms / 1e6}
            )
    return rows


def _capacity() -> list[dict]:
    rows = []
    for name, m in MODELS.items():
        fp8 = m["layers"] * MLA_BYTES + m["indexer_layers"] * FP8_ROW
        mxfp4 = m["layers"] * MLA_BYTES + m["indexer_layers"] * MXFP4_ROW
        rows.append(
            {
                "model": name,
                **m,
                "fp8_bytes": fp8,
                "mxfp4_bytes": mxfp4,
                "gain": fp8 / mxfp4 - 1,
            }
        )
    return rows


def _report(result: dict, command: str, out: Path) -> None:
    v = result["versions"]
    copy = result["copy_gbps"]
    lines = [
        "# MXFP4 indexer K cache writer (stage 0003)",
        "",
        f"Hardware: {', '.join(v['gpus'])}. torch {v['torch']}, triton {v['triton']}, "
        f"CUDA {v['cuda']}, Python {v['python']}.",
        "",
        f"Command: `{command}`",
        "",
        f"Copy bandwidth (`copy_` of 2 GiB, read + write): **{copy:.0f} GB/s**.",
        "",
        "Quantise-and-write kernel (bf16 keys [T, 128] + int64 slots in, 68-byte "
        "rows out to consecutive or random slots of 64-token pages); median of 20 "
        f"CUDA-event timings. Goal: at least {GOAL:.0%} of the copy bandwidth.",
        "",
        "| tokens | slots | ms | GB/s | of copy bandwidth |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in result["writer"]:
        lines.append(
            f"| {r['tokens']} | {r['slots']} | {r['ms']:.3f} | {r['gbps']:.0f} | "
            f"{r['gbps'] / copy:.0%} |"
        )
    lines += [
        "",
        "Bytes per token of KV cache (all layers; MLA cache FP8, 576 B a layer) "
        "and the tokens a fixed KV budget holds. Computed, not measured; the "
        "layer counts are the models' published configs as recalled (not "
        "checked here) and GLM-5.2's indexer layers are from the stage 0002 PR:",
        "",
        "| model | layers | indexer layers | FP8 indexer (B) | MXFP4 indexer (B) "
        "| KV capacity gain |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["capacity"]:
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['indexer_layers']} | "
            f"{r['fp8_bytes']} | {r['mxfp4_bytes']} | +{r['gain']:.1%} |"
        )
    lines += [
        "",
        "Taken from the PR text (MI355X, TP4, not measured here): KV cache "
        "+10.2% tokens for DeepSeek-V3.2, +3.0% for GLM-5.2-MXFP4.",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "mxfp4_indexer_cache_bench.md").write_text("\n".join(lines) + "\n")
    (out / "mxfp4_indexer_cache_bench.json").write_text(
        json.dumps(result, indent=1) + "\n"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{t // 1024}K" for t in TOKENS]
    for offset, name in ((-0.2, "consecutive"), (0.2, "random")):
        gbps = [r["gbps"] for r in result["writer"] if r["slots"] == name]
        left.bar(
            [i + offset for i in range(len(TOKENS))],
            gbps,
            0.4,
            label=f"writer, {name} slots",
        )
    left.set_xticks(range(len(TOKENS)), labels)
    left.axhline(copy, color="k", ls="--", label="copy_")
    left.axhline(GOAL * copy, color="r", ls=":", label=f"{GOAL:.0%} of copy")
    left.set_xlabel("tokens per call")
    left.set_ylabel("GB/s")
    left.set_title("Quantise-and-write bandwidth")
    left.legend()
    names = [r["model"] for r in result["capacity"]]
    x = range(len(names))
    right.bar(
        [i - 0.2 for i in x],
        [r["fp8_bytes"] for r in result["capacity"]],
        0.4,
        label="FP8 indexer (132 B)",
    )
    right.bar(
        [i + 0.2 for i in x],
        [r["mxfp4_bytes"] for r in result["capacity"]],
        0.4,
        label="MXFP4 indexer (68 B)",
    )
    for i, r in enumerate(result["capacity"]):
        right.annotate(
            f"+{r['gain']:.1%} tokens", (i, r["fp8_bytes"]), ha="center", va="bottom"
        )
    right.set_xticks(list(x), names)
    right.set_ylabel("KV bytes per token (all layers)")
    right.set_title("KV capacity")
    right.legend(loc="lower right")
    fig.suptitle(v["gpus"][0].split(",")[0])
    fig.tight_layout()
    fig.savefig(out / "mxfp4_indexer_cache_bench.png", dpi=110)
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    from harness import compiled_stub
    from harness.gpu_bench import gpu_versions

    compiled_stub.install()
    compiled_stub.use_generic_platform()
    result = {
        "versions": gpu_versions(),
        "copy_gbps": _copy_gbps(),
        "writer": _writer_rows(),
        "capacity": _capacity(),
    }
    command = (
        "scripts/gpu_run.sh 0003 .devcarry/vllm-0003.tgz .whl "
        "python3 scripts/bench_mxfp4_indexer_cache.py --out $OUT"
    )
    _report(result, command, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
