# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V3.2's fused attention kernels (``fused_norm_rope``, which
writes the indexer K cache, and ``fused_q``, which quantises the index
query), compiled for the AMD targets in every layer kind a DSA model serves.

Stage 0003 changes both kernels (the MXFP4 cache write and query). The
specialisations come from the model's own glue: the ROCm attention layer
(``deepseek_v32/amd/rocm.py``) is built with each published model's shapes
and dtypes and its ``forward`` runs with Triton's compile-only driver, so
every launch is recorded with the arguments (views, strides, dtypes) and
constexprs the layer computes, then compiled. Per test: one model x layer
kind x indexer cache x target, over 64- and 128-token pages, next_n 1, 2
and 4 (a decode step of two requests) and the TP sizes 1-8 (the layer's
local head count)."""

from __future__ import annotations

import pytest

from scripts.harness import dsa_attention, gfx_compile
from scripts.harness.rocm_platform import emulate_rocm, use_rocm_fp8_encoding
from scripts.harness.tree import applied_tree

TREE = applied_tree("0003")

from vllm.config import set_current_vllm_config  # noqa: E402

# The files that define or launch these kernels: a tree compiles them when
# its own stage patches one (scripts/series/testing/testrun.py).
KERNEL_CALLERS = (
    "vllm/models/deepseek_v32/common/kernels.py",
    "vllm/models/deepseek_v32/amd/rocm.py",
    "vllm/models/deepseek_v32/attention.py",
    "vllm/models/deepseek_v32/common/mxfp4_indexer_cache.py",
)
PAGES = (64, 128)
NEXT_N = (1, 2, 4)
TP_SIZES = (1, 2, 4, 8)
REQUESTS = 2
# The MXFP4 indexer cache needs CDNA4 (gfx950); the FP8 one runs on both,
# with fnuz FP8 on gfx942.
CACHES_BY_TARGET = [("fp8", "gfx950"), ("mxfp4", "gfx950"), ("fp8", "gfx942")]


def _layer_kinds():
    for model in dsa_attention.MODELS:
        for kind in dsa_attention.LAYER_KINDS:
            for cache, arch in CACHES_BY_TARGET:
                name = model.model_type + (
                    "-neox" if model is dsa_attention.GLM5_NEOX else ""
                )
                yield pytest.param(
                    model, kind, cache, arch, id=f"{name}-{kind}-{cache}-{arch}"
                )


@pytest.mark.parametrize(("model", "kind", "cache", "arch"), _layer_kinds())
def test_fused_attention_kernels_compile(compile_matrix, model, kind, cache, arch):
    recorder = gfx_compile.Recorder()
    for page in PAGES:
        config = dsa_attention.make_config(model, cache, page)
        for tp in TP_SIZES:
            with (
                pytest.MonkeyPatch.context() as monkeypatch,
                emulate_rocm(arch),
                set_current_vllm_config(config),
            ):
                use_rocm_fp8_encoding(monkeypatch, arch)
                config.compilation_config.static_forward_context.clear()
                layer = dsa_attention.build_layer(
                    monkeypatch, config, model, kind, tp=tp
                )
                for next_n in NEXT_N:
                    recorder.label = (
                        f"{model.name} {kind} layer, {cache} indexer cache, "
                        f"{page}-token pages, next_n {next_n}, TP {tp}"
                    )
                    with gfx_compile.recording(arch, into=recorder):
                        dsa_attention.run_attention(
                            monkeypatch, layer, REQUESTS * next_n
                        )
    kernels = {variant.name for variant in recorder.variants}
    assert {"_fused_norm_rope_kernel", "_fused_q_kernel"} <= kernels, kernels
    failures = compile_matrix.compile(arch, recorder)
    assert not failures, "\n\n".join(failures)
