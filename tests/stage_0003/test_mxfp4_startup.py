# SPDX-License-Identifier: Apache-2.0
"""Stage 0003 through vLLM's real startup path, as ``vllm serve`` takes it:
``EngineArgs`` -> ``create_engine_config`` (the VllmConfig checks and
vLLM's ROCm platform hooks) -> model construction -> vLLM's block-size step
(``update_block_size_for_backend``) -> the KV-cache spec each layer reports.

The scenarios run in one fresh interpreter set up as a gfx950 box with AITER
(``scripts.harness.rocm_startup``: vLLM's own ``RocmPlatform`` from the first
import, AMD SMI and AITER stand-ins); tensors live on the CPU and no weights
are loaded (startup decides shapes, block size and cache layout first).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.harness.tree import applied_tree

TREE = applied_tree("0003")

MXFP4 = {"indexer_kv_dtype": "mxfp4"}
# A two-layer DeepSeek-V3.2 with the real indexer shape (64 heads of 128).
DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
}
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    **{k: v for k, v in DEEPSEEK_V32.items() if not k.startswith("index_")},
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
}


SCENARIOS = {
    # The documented command: --attention-config '{"indexer_kv_dtype": "mxfp4"}'.
    "documented command": dict(hf_config=DEEPSEEK_V32, attention_config=MXFP4),
    "block size 128": dict(
        hf_config=DEEPSEEK_V32, attention_config=MXFP4, engine_args={"block_size": 128}
    ),
    "fp8 default": dict(
        hf_config=DEEPSEEK_V32, attention_config={}, engine_args={"block_size": 64}
    ),
    "block size 32": dict(
        hf_config=DEEPSEEK_V32, attention_config=MXFP4, engine_args={"block_size": 32}
    ),
    "AITER not installed": dict(
        hf_config=DEEPSEEK_V32, attention_config=MXFP4, aiter_installed=False
    ),
    "AITER switched off": dict(
        hf_config=DEEPSEEK_V32, attention_config=MXFP4, use_aiter="0"
    ),
    "llama": dict(hf_config=LLAMA, attention_config=MXFP4),
    "deepseek v3": dict(hf_config=DEEPSEEK_V3, attention_config=MXFP4),
}


@pytest.fixture(scope="module")
def started() -> dict[str, dict]:
    scenarios = [{"name": f"s{i}", **s} for i, s in enumerate(SCENARIOS.values())]
    project = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "scripts.harness.rocm_startup"],
        input=json.dumps(scenarios),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{TREE.path}{os.pathsep}{project}"},
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return dict(zip(SCENARIOS, results, strict=True))


def _indexer_layers(result: dict) -> set[tuple]:
    assert "layers" in result, result.get("traceback")
    return {tuple(v) for name, v in result["layers"].items() if "indexer" in name}


def test_the_documented_command_starts_with_64_token_pages(started):
    """The option and nothing else: vLLM's block-size step picks 64, and
    every indexer layer reports the MXFP4 backend with 68-byte rows."""
    result = started["documented command"]
    assert _indexer_layers(result) == {("DEEPSEEK_V32_ROCM_MXFP4_INDEXER", 64 * 68)}
    assert result["block_size"] == 64
    assert len(result["layers"]) == 4  # two MLA layers, two indexer caches


def test_each_indexer_layer_checks_once_and_the_model_says_it_once(started):
    """Two indexer layers: the MXFP4 startup checks run once per layer (not
    once for the row size and again for the cache), and one INFO line says
    the MXFP4 cache is on."""
    result = started["documented command"]
    assert result["mxfp4_checks"] == 2
    assert result["mxfp4_log"] == [
        "DSA indexer: MXFP4 K cache on (indexer_kv_dtype='mxfp4'), 68 bytes per "
        "token, scored in place by aiter's paged MXFP4 MQA-logits kernel."
    ]
    fp8 = started["fp8 default"]
    assert fp8["mxfp4_checks"] == 0 and fp8["mxfp4_log"] == []


def test_a_given_block_size_of_128_is_kept(started):
    result = started["block size 128"]
    assert _indexer_layers(result) == {("DEEPSEEK_V32_ROCM_MXFP4_INDEXER", 128 * 68)}
    assert result["block_size"] == 128


def test_fp8_stays_the_default(started):
    assert _indexer_layers(started["fp8 default"]) == {
        ("DEEPSEEK_V32_INDEXER", 64 * 132)
    }


@pytest.mark.parametrize(
    "name, match",
    [
        ("block size 32", "needs --block-size 64 or 128 .*got 32"),
        ("AITER not installed", "the aiter package is not installed"),
        ("AITER switched off", "enable aiter with VLLM_ROCM_USE_AITER=1"),
    ],
)
def test_what_cannot_serve_stops_at_model_construction(started, name, match):
    result = started[name]
    assert result.get("stopped_at") == "model", result
    assert result["error"].startswith("ValueError")
    assert re.search(match, result["error"]), result["error"]


@pytest.mark.parametrize("name", ["llama", "deepseek v3"])
def test_a_model_without_the_mxfp4_indexer_is_refused_at_config(started, name):
    """The option would be ignored silently: refused when the config is made."""
    result = started[name]
    assert result.get("stopped_at") == "config", result
    assert "has no sparse-attention (DSA) indexer" in result["error"]
