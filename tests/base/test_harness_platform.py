# SPDX-License-Identifier: Apache-2.0
"""The ROCm platform shim flips exactly the checks the indexer reads, feeds
vLLM's real dispatch code, and restores everything afterwards."""

import pytest
import torch

from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("base")


@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_platform_checks_follow_the_arch(arch):
    from vllm._aiter_ops import is_aiter_found_and_supported, rocm_aiter_ops
    from vllm.platforms import current_platform

    with emulate_rocm(arch):
        assert current_platform.is_rocm()
        assert is_aiter_found_and_supported()
        assert rocm_aiter_ops.is_enabled()
        assert rocm_aiter_ops.is_indexer_top_k_enabled() is (arch == "gfx950")
    assert not current_platform.is_rocm()
    assert not is_aiter_found_and_supported()


def test_aiter_off_disables_aiter_but_keeps_rocm():
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.platforms import current_platform

    with emulate_rocm("gfx950", aiter=False):
        assert current_platform.is_rocm()
        assert not rocm_aiter_ops.is_enabled()
        assert not rocm_aiter_ops.is_indexer_top_k_supported(
            is_prefill=True, compress_ratio=4, num_rows=8
        )


def test_vllm_routes_prefill_logits_through_the_aiter_module():
    """rocm_fp8_mqa_logits takes AITER's module when it is found; the
    stand-in computes vLLM's torch reference, so both paths agree on every
    row's [ks, ke) (newer vLLM asks AITER not to clean the rest)."""
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ops

    torch.manual_seed(0)
    m, n, h, d = 6, 20, 4, 32
    q = torch.randn(m, h, d).to(ops.FP8_DTYPE)
    k = torch.randn(n, d).to(ops.FP8_DTYPE)
    scale = torch.rand(n, 1) + 0.5
    weights = torch.randn(m, h)
    ks = torch.zeros(m, dtype=torch.int32)
    ke = torch.arange(n - m + 1, n + 1, dtype=torch.int32)
    reference = ops.fp8_mqa_logits_torch(q, (k, scale), weights, ks, ke)
    with emulate_rocm("gfx950"):
        assert ops.mqa_logits_module() is not None
        via_aiter = ops.rocm_fp8_mqa_logits(q, (k, scale), weights, ks, ke)
    inside = torch.arange(n) < ke[:, None]
    assert torch.equal(via_aiter[inside], reference[inside])
    # vLLM caches the module lookup; the shim must not leave the stand-in there.
    assert ops.mqa_logits_module.cache_info().currsize == 0


def test_the_torch_k_cache_writer_matches_vllms_insert_kernel():
    """The harness writes long test contexts with torch; its bytes must be
    the ones vLLM's Triton insert kernel writes, and the reader must invert
    them."""
    from scripts.harness.indexer_k_cache import read_paged_k, write_paged_k
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (
        indexer_k_quant_and_cache_triton,
    )

    torch.manual_seed(3)
    keys = (torch.randn(70, 128) * torch.rand(70, 1) * 40).to(torch.bfloat16)
    keys[5] = 0  # all-zero key: the 1e-4 floor
    slots = torch.randperm(3 * 64)[:70].to(torch.int64)
    by_kernel = torch.zeros(3, 64, 132, dtype=torch.uint8)
    by_torch = torch.zeros_like(by_kernel)
    indexer_k_quant_and_cache_triton(keys, by_kernel, slots, 128, "ue8m0")
    write_paged_k(by_torch, slots, keys)
    assert torch.equal(by_torch, by_kernel)
    blocks = torch.arange(3, dtype=torch.int32)
    decoded = read_paged_k(by_torch, blocks, 3 * 64, 128)[slots]
    torch.testing.assert_close(decoded, keys.float(), rtol=0.07, atol=1e-3)


def test_the_torch_k_gather_matches_vllms_gather_kernel():
    """Long test contexts gather K with torch; the bytes must be the ones
    vLLM's Triton gather writes, for packed sequences over shuffled pages."""
    from scripts.harness.indexer_k_cache import gather_paged_k
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (
        FP8_DTYPE,
        cp_gather_indexer_k_quant_cache_triton,
    )

    gen = torch.Generator().manual_seed(4)
    cache = torch.randint(0, 256, (6, 64, 132), dtype=torch.uint8, generator=gen)
    lengths = torch.tensor([70, 5, 100], dtype=torch.int32)
    cu = torch.zeros(4, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    block_table = torch.randperm(6, generator=gen).to(torch.int32).reshape(3, 2)
    token_to_seq = torch.repeat_interleave(torch.arange(3), lengths).to(torch.int32)
    total = int(cu[-1])
    outputs = []
    for gather in (cp_gather_indexer_k_quant_cache_triton, gather_paged_k):
        k_fp8 = torch.zeros(total, 128, dtype=torch.uint8).view(FP8_DTYPE)
        k_scale = torch.zeros(total, 4, dtype=torch.uint8)
        gather(cache, k_fp8, k_scale, block_table, cu, token_to_seq=token_to_seq)
        outputs.append((k_fp8.view(torch.uint8), k_scale))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize(
    "query_slice, dcp_rank, dcp_world, interleave, ratio",
    [
        (None, 0, 1, 1, 1),
        (slice(700, 1900), 0, 1, 1, 1),
        (slice(0, 1100), 0, 1, 1, 4),
        (None, 1, 2, 1, 1),
        (slice(300, 2500), 2, 4, 8, 1),
    ],
)
def test_the_torch_chunk_metadata_matches_vllms_kernel(
    query_slice, dcp_rank, dcp_world, interleave, ratio
):
    """Long test contexts build prefill chunk metadata with torch; every
    output must equal what vLLM's Triton kernel writes, over a chunk of
    requests with and without context (a request longer than the kernel's
    1,024-token block), query slices and DCP shards."""
    from scripts.harness.chunk_metadata import torch_chunk_metadata
    from vllm.v1.attention.backends.mla.indexer import build_prefill_chunk_metadata

    query_lens = torch.tensor([5, 1500, 300, 700], dtype=torch.int32)
    contexts = torch.tensor([0, 2000, 0, 90], dtype=torch.int32)
    seq_lens = contexts + query_lens
    query_start_loc = torch.zeros(5, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    compressed = seq_lens // ratio

    def build():
        chunk = build_prefill_chunk_metadata(
            1,
            4,
            query_start_loc,
            query_start_loc,
            seq_lens,
            compressed,
            compressed,
            torch.zeros(4, 64, dtype=torch.int32),
            ratio,
            query_slice=query_slice,
            dcp_rank=dcp_rank,
            dcp_world_size=dcp_world,
            cp_kv_cache_interleave_size=interleave,
        )
        assert chunk is not None
        return chunk.cu_seqlen_ks, chunk.cu_seqlen_ke, chunk.token_to_seq

    by_kernel = build()
    with torch_chunk_metadata():
        by_torch = build()
    for kernel_out, torch_out in zip(by_kernel, by_torch, strict=True):
        assert torch.equal(kernel_out, torch_out)


def test_the_torch_chunk_metadata_follows_token_positions():
    """From vLLM 0.34.0 the kernel also takes each query token's position
    (ShardQ's tokens are not their request's contiguous last ones): the torch
    copy must write what the kernel writes for shuffled positions too."""
    import inspect

    from scripts.harness.chunk_metadata import torch_chunk_metadata
    from vllm.v1.attention.backends.mla.indexer import build_prefill_chunk_metadata

    if "positions" not in inspect.signature(build_prefill_chunk_metadata).parameters:
        pytest.skip("this vLLM's chunk metadata takes no token positions")
    query_lens = torch.tensor([40, 300, 7], dtype=torch.int32)
    seq_lens = query_lens + torch.tensor([500, 0, 64], dtype=torch.int32)
    query_start_loc = torch.zeros(4, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    gen = torch.Generator().manual_seed(0)
    positions = torch.cat(
        [
            (seq_len - query_len + torch.randperm(int(query_len), generator=gen))
            for seq_len, query_len in zip(seq_lens, query_lens, strict=True)
        ]
    ).to(torch.int64)

    def build():
        chunk = build_prefill_chunk_metadata(
            0,
            3,
            query_start_loc,
            query_start_loc,
            seq_lens,
            seq_lens,
            seq_lens,
            torch.zeros(3, 64, dtype=torch.int32),
            1,
            positions=positions,
        )
        assert chunk is not None
        return chunk.cu_seqlen_ks, chunk.cu_seqlen_ke, chunk.token_to_seq

    by_kernel = build()
    with torch_chunk_metadata():
        by_torch = build()
    for kernel_out, torch_out in zip(by_kernel, by_torch, strict=True):
        assert torch.equal(kernel_out, torch_out)


def _aiter_modules(logits_params: str) -> dict:
    """Stand-in AITER modules: the MXFP4 launcher's ``paged_mxfp4_mqa_logits``
    takes ``logits_params``; the rest of the API is there."""
    import types

    namespace: dict = {}
    exec(f"def paged_mxfp4_mqa_logits(q, {logits_params}): pass", namespace)
    launcher = types.ModuleType("pa_mqa_logits_mxfp4")
    launcher.paged_mxfp4_mqa_logits = namespace["paged_mxfp4_mqa_logits"]  # type: ignore[attr-defined]
    for name in ("cache_format", "select_config", "build_schedule"):
        setattr(launcher, name, lambda *args: None)
    cache_op = types.ModuleType("k_norm_rope_mxfp4_cache")
    cache_op.k_norm_rope_mxfp4_cache = lambda *args, shuffle=None: None  # type: ignore[attr-defined]
    return {
        "aiter.ops.triton.attention.pa_mqa_logits_mxfp4": launcher,
        "aiter.ops.triton.fusions.k_norm_rope_mxfp4_cache": cache_op,
    }


def test_an_aiter_older_than_stage_0003_needs_is_named(monkeypatch):
    """The gfx950 tests skip, naming what is missing, instead of failing on
    an ImportError or a TypeError deep in a kernel call."""
    import sys

    from scripts.harness.rocm_platform import missing_aiter_mxfp4_api

    full = "*, out_logits, clean_logits, row_ends, query_start_loc, schedule"
    for name, module in _aiter_modules(full).items():
        monkeypatch.setitem(sys.modules, name, module)
    assert missing_aiter_mxfp4_api() == []
    for name, module in _aiter_modules("*, out_logits, clean_logits").items():
        monkeypatch.setitem(sys.modules, name, module)
    assert missing_aiter_mxfp4_api() == [
        f"aiter.ops.triton.attention.pa_mqa_logits_mxfp4.paged_mxfp4_mqa_logits({p}=)"
        for p in ("row_ends", "query_start_loc", "schedule")
    ]
    monkeypatch.setitem(
        sys.modules, "aiter.ops.triton.fusions.k_norm_rope_mxfp4_cache", None
    )
    assert "aiter.ops.triton.fusions.k_norm_rope_mxfp4_cache" in (
        missing_aiter_mxfp4_api()
    )
