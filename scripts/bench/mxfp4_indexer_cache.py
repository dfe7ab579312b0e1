# SPDX-License-Identifier: Apache-2.0
"""Benchmark of stage 0003 on one GPU: DeepSeek-V3.2's ``fused_norm_rope``
writing the FP8 indexer cache (132-byte rows, SHUFFLE pages) against writing
the MXFP4 one (68-byte rows, AITER's preshuffled pages for 64 heads), side by
side in one run, and the indexer cache's bytes per token and KV-capacity gain
for DeepSeek-V3.2 and GLM-5.2.

``fused_norm_rope`` is the kernel vLLM runs: the q/kv RMSNorms, k_pe's RoPE
and the indexer key's LayerNorm + RoPE + cache store, one launch. Shapes are
DeepSeek-V3.2's (q_lora_rank 1536, kv_lora_rank 512, rope 64, index head
dim 128, index_topk 2048), 64-token pages, random slots; the MLA cache write
is left out so the two runs differ only in the indexer store. Goal: MXFP4 no
slower than FP8 at every size.

Usage (on the device, see README "GPU runs"):
    python3 -m scripts.bench.mxfp4_indexer_cache --out DIR
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from scripts.bench.common import (
    command_line,
    gpu_versions,
    median_ms,
    parse_args,
)

TOKENS = (1, 16, 256, 4096, 65536)
Q_LORA, KV_LORA, ROPE, INDEX_DIM, TOPK = 1536, 512, 64, 128, 2048
PAGE, MAX_POS = 64, 163840
RUNS, WARMUP, GRAPH_CALLS = 20, 3, 20

# Per-token KV bytes of each layer kind: kv_lora_rank 512 + qk_rope_head_dim
# 64 as FP8 (--kv-cache-dtype fp8) is 576 bytes of MLA cache; index_head_dim
# 128 is 132 bytes FP8 (values + one fp32 scale) or 68 bytes MXFP4. Layer
# counts (num_hidden_layers) read from copies of the published config.json
# files kept in public GitHub repositories (Hugging Face was not reachable
# from the machine that wrote this): DeepSeek-V3.2 61 layers, each with an
# indexer; GLM-5.x 78 layers.
# GLM-5.2's 21 indexer layers are from the stage 0003 PR text, not checked.
MODELS = {
    "DeepSeek-V3.2": {"layers": 61, "indexer_layers": 61},
    "GLM-5.2": {"layers": 78, "indexer_layers": 21},
}
MLA_BYTES, FP8_ROW, MXFP4_ROW = 576, 132, 68


def _graph(fn):
    """``fn`` called GRAPH_CALLS times, captured in one CUDA graph."""
    import torch

    fn()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return graph


def _fused_norm_rope_rows() -> list[dict]:
    import torch

    from vllm.models.deepseek_v32.common.kernels import fused_norm_rope
    from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import (
        RocmPagedMxfp4CacheLayout,
    )

    # AITER's cache_format for 64 heads of 128: n_per_tile 32 (mfma_nonk_dim).
    layout = RocmPagedMxfp4CacheLayout(32, 16, 2)
    cuda, bf16 = "cuda", torch.bfloat16
    cos_sin = torch.randn(MAX_POS, ROPE, device=cuda)
    rows = []
    for tokens in TOKENS:
        pages = -(-tokens // PAGE)
        positions = torch.randint(0, MAX_POS, (tokens,), device=cuda)
        args = (
            positions,
            torch.randn(tokens, Q_LORA, device=cuda, dtype=bf16),
            torch.ones(Q_LORA, device=cuda, dtype=bf16),
            1e-6,
            torch.randn(tokens, KV_LORA, device=cuda, dtype=bf16),
            torch.ones(KV_LORA, device=cuda, dtype=bf16),
            1e-6,
            torch.randn(tokens, ROPE, device=cuda, dtype=bf16),
            cos_sin,
            torch.randn(tokens, INDEX_DIM, device=cuda, dtype=bf16),
            torch.ones(INDEX_DIM, device=cuda),
            torch.zeros(INDEX_DIM, device=cuda),
            1e-6,
            cos_sin,
            torch.empty(tokens, TOPK, dtype=torch.int32, device=cuda),
        )
        slots = torch.randperm(pages * PAGE, device=cuda)[:tokens]
        fp8 = torch.zeros(pages, PAGE, FP8_ROW, dtype=torch.uint8, device=cuda)
        mxfp4 = torch.zeros(pages, PAGE, MXFP4_ROW, dtype=torch.uint8, device=cuda)
        runs = {
            "fp8": functools.partial(
                fused_norm_rope,
                *args,
                slot_mapping=slots,
                indexer_k_cache=fp8,
                indexer_cache_shuffled=True,
            ),
            "mxfp4": functools.partial(
                fused_norm_rope,
                *args,
                slot_mapping=slots,
                indexer_k_cache=mxfp4,
                indexer_cache_mxfp4_layout=layout,
            ),
        }
        # GPU time only: each variant replays a CUDA graph of GRAPH_CALLS
        # launches (host launch cost, ~70 us a call, would otherwise decide
        # the small sizes); interleaved, so drift hits both alike.
        graphs = {name: _graph(fn) for name, fn in runs.items()}
        times: dict[str, list[float]] = {"fp8": [], "mxfp4": []}
        for _ in range(3):
            for name, graph in graphs.items():
                ms = median_ms(graph.replay, RUNS, WARMUP)
                times[name].append(ms / GRAPH_CALLS)
        fp8_ms, mxfp4_ms = min(times["fp8"]), min(times["mxfp4"])
        rows.append(
            {
                "tokens": tokens,
                "fp8_ms": fp8_ms,
                "mxfp4_ms": mxfp4_ms,
                "ratio": mxfp4_ms / fp8_ms,
            }
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
    lines = [
        "# MXFP4 indexer K cache: fused_norm_rope FP8 vs MXFP4 (stage 0003)",
        "",
        f"Hardware: {', '.join(v['gpus'])}. torch {v['torch']}, triton {v['triton']}, "
        f"CUDA {v['cuda']}, Python {v['python']}.",
        "",
        f"Command: `{command}`",
        "",
        "DeepSeek-V3.2's `fused_norm_rope` (RMSNorms, RoPE, indexer key "
        "LayerNorm + RoPE + cache store; MLA cache write left out) writing the FP8 "
        "indexer cache vs the MXFP4 one, random slots in 64-token pages. GPU time per "
        f"call: a CUDA graph of {GRAPH_CALLS} calls replayed, best of 3 interleaved "
        f"medians of {RUNS} CUDA-event timings. Goal: MXFP4 / FP8 <= 1.00 at every "
        "size.",
        "",
        "| tokens | FP8 cache (ms) | MXFP4 cache (ms) | MXFP4 / FP8 |",
        "|---:|---:|---:|---:|",
    ]
    for r in result["fused_norm_rope"]:
        lines.append(
            f"| {r['tokens']} | {r['fp8_ms']:.4f} | {r['mxfp4_ms']:.4f} | "
            f"{r['ratio']:.2f} |"
        )
    lines += [
        "",
        "Bytes per token of KV cache (all layers; MLA cache FP8, 576 B a layer) "
        "and the tokens a fixed KV budget holds. Computed, not measured; the "
        "layer counts are from copies of the models' published config.json "
        "(DeepSeek-V3.2 61, GLM-5.x 78) and GLM-5.2's indexer layers are "
        "from the stage 0003 PR text (not checked):",
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
        "Taken from the PR text (MI355X, TP4, not measured by this project): KV "
        "cache +10.2% tokens for DeepSeek-V3.2, +3.0% for GLM-5.2-MXFP4.",
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
    fused = result["fused_norm_rope"]
    x = range(len(fused))
    left.bar(
        [i - 0.2 for i in x],
        [r["fp8_ms"] * 1e3 for r in fused],
        0.4,
        label="FP8 indexer cache",
    )
    left.bar(
        [i + 0.2 for i in x],
        [r["mxfp4_ms"] * 1e3 for r in fused],
        0.4,
        label="MXFP4 indexer cache",
    )
    for i, r in enumerate(fused):
        left.annotate(
            f"{r['ratio']:.2f}x",
            (i, max(r["fp8_ms"], r["mxfp4_ms"]) * 1e3),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    left.set_xticks(list(x), [str(r["tokens"]) for r in fused])
    left.set_yscale("log")
    left.set_xlabel("tokens per call")
    left.set_ylabel("us per call")
    left.set_title("fused_norm_rope")
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
    args = parse_args(__doc__)
    from scripts.harness import compiled_stub

    compiled_stub.use_generic_platform()
    result = {
        "versions": gpu_versions(),
        "fused_norm_rope": _fused_norm_rope_rows(),
        "capacity": _capacity(),
    }
    _report(result, command_line(__spec__.name), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
