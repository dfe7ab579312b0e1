# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which top-k kernel the ROCm DSA indexer takes: AITER's for the
uncompressed k=2048 indexer (DeepSeek-V3.2, GLM-5.x) on gfx950, in decode
always and in prefill once a chunk's longest request reaches 32K keys; every
other indexer keeps the rules rocm_aiter_ops already had.

The gate is host-side policy, so the table runs on any machine with the ROCm
platform, the gfx950 check and AITER's presence patched the way vLLM's other
ROCm policy tests patch them. The last test asks the real platform and runs
only on ROCm.
"""

import itertools
import sys
import types

import pytest
import torch

import vllm._aiter_ops as aiter_ops
from vllm._aiter_ops import rocm_aiter_ops
from vllm.platforms import current_platform
from vllm.v1.attention.ops import rocm_indexer_topk_gate as gate

MAX_MODEL_LEN = 163840
PHASES = ["decode", "prefill 32767", "prefill 32768"]


def _rocm(monkeypatch: pytest.MonkeyPatch, gfx950: bool, aiter: bool) -> None:
    """ROCm with AITER found, on gfx950 or not, AITER switched on or off.
    vllm.platforms.rocm cannot be imported without a ROCm torch; the gate
    reaches it only through on_gfx950() (rocm_aiter_ops.is_indexer_top_k_enabled)."""
    rocm = types.ModuleType("vllm.platforms.rocm")
    rocm.on_gfx950 = lambda: gfx950  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.platforms.rocm", rocm)
    monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
    monkeypatch.setattr(aiter_ops, "is_aiter_found_and_supported", lambda: True)
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1" if aiter else "0")
    rocm_aiter_ops.refresh_env_variables()


@pytest.fixture(autouse=True)
def _restore_aiter_switches():
    yield
    rocm_aiter_ops.refresh_env_variables()


def _decide(phase: str, ratio: int, k: int, full_graph: bool) -> bool:
    if phase == "decode":
        # The op passes a replay-safe bound under FULL graphs (max_model_len),
        # the batch's longest context otherwise.
        bound = MAX_MODEL_LEN if full_graph else 4096 // ratio
        return gate.decode_uses_aiter_top_k(
            compress_ratio=ratio,
            topk_tokens=k,
            num_rows=8,
            num_columns=MAX_MODEL_LEN // ratio,
            max_valid_seq_len=bound,
        )
    longest = int(phase.split()[1])
    return gate.prefill_uses_aiter_top_k(
        compress_ratio=ratio, topk_tokens=k, num_rows=512, max_seqlen_k=longest
    )


def _rules_before(phase: str, ratio: int, k: int, full_graph: bool) -> bool:
    """What the indexer op decided before the gate, from rocm_aiter_ops' rules
    (which the gate leaves unchanged): only compressed indexers ever took
    AITER's top-k."""
    if phase == "decode":
        bound = MAX_MODEL_LEN if full_graph else 4096 // ratio
        return bool(
            rocm_aiter_ops.is_indexer_top_k_supported(
                is_prefill=False,
                compress_ratio=ratio,
                num_rows=8,
                max_valid_seq_len=bound,
            )
        ) and not rocm_aiter_ops.dsv4_indexer_prefers_native_top_k(
            num_rows=8, num_columns=MAX_MODEL_LEN // ratio, topk_tokens=k
        )
    return bool(
        rocm_aiter_ops.is_indexer_top_k_supported(
            is_prefill=True, compress_ratio=ratio, num_rows=512
        )
    )


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize(
    ("gfx950", "aiter", "ratio", "k", "phase", "full_graph"),
    itertools.product(
        [True, False], [True, False], [1, 4], [2048, 512, 1024], PHASES, [True, False]
    ),
)
def test_dispatch_table(monkeypatch, gfx950, aiter, ratio, k, phase, full_graph):
    _rocm(monkeypatch, gfx950, aiter)
    got = _decide(phase, ratio, k, full_graph)
    before = _rules_before(phase, ratio, k, full_graph)
    if ratio == 1 and k == 2048 and gfx950 and aiter:
        assert got is (phase != "prefill 32767"), "decode always, prefill from 32K"
    else:
        assert got is before, "must decide as before the gate"
    if ratio == 1:
        assert before is False  # nothing sent the uncompressed indexer to AITER


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
def test_off_rocm_nothing_takes_aiter():
    for ratio, k, phase, full_graph in itertools.product(
        [1, 4], [2048, 512], PHASES, [True, False]
    ):
        assert _decide(phase, ratio, k, full_graph) is False


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
def test_the_threshold_is_32k_keys_at_index_topk_2048():
    assert gate.AITER_PREFILL_MIN_KEYS == 32768
    assert gate.DSA_TOPK == 2048


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
def test_max_seqlen_k_is_the_longest_request_of_the_chunk():
    """The requests' full lengths, whatever slice of their query rows the
    chunk holds: every chunk of one long prompt takes the same kernel."""
    seq_lens = torch.tensor([9, 40000, 120, 7])
    assert gate.chunk_max_seqlen_k(seq_lens, 0, 2) == 40000
    assert gate.chunk_max_seqlen_k(seq_lens, 1, 2) == 40000
    assert gate.chunk_max_seqlen_k(seq_lens, 2, 4) == 120
    assert gate.chunk_max_seqlen_k(seq_lens, 3, 4) == 7


@pytest.mark.skipif(not current_platform.is_rocm(), reason="ROCm-only")
def test_gfx950_with_aiter_takes_aiter_top_k(monkeypatch):
    """On the real platform: with VLLM_ROCM_USE_AITER=1 an MI350X/MI355X
    takes AITER's top-k as the table says; other archs keep the in-tree one."""
    from vllm.platforms.rocm import on_gfx950

    if not aiter_ops.is_aiter_found_and_supported():
        pytest.skip("AITER is not installed")
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
    rocm_aiter_ops.refresh_env_variables()
    expected = {phase: on_gfx950() and phase != "prefill 32767" for phase in PHASES}
    assert {phase: _decide(phase, 1, 2048, True) for phase in PHASES} == expected
