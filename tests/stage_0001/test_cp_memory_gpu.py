# SPDX-License-Identifier: Apache-2.0
"""Stage 0001 on a GPU: the split prefill holds no more memory at once than
vLLM's profiling run reserves for it.

vLLM sizes the KV cache from the peak of a profiling run, in which the
indexer op reserves one call's logits (the logits budget,
``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB``) and, with this stage, what the split
holds beside them (``rocm_cp_indexer.profile_bytes``). The step here is
the key split at its heaviest for a 64 MiB budget at tp 8: a 256-row turn
over 64K cached keys, whose call's logits nearly fill the budget, every
row of it owned by rank 0, which receives 8 x 256 rows of candidates
(32 MiB) in the exchange right after that call. Rank 0's share of the
real op (one GPU: the exchange's stand-in writes its output, the merge's
does nothing) must peak no higher than the op's own profiling branch.
Two planted mistakes must each pass that reservation: the profiling run
reserving the logits alone, and the last call's logits kept alive
through the exchange."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from scripts.harness import indexer_batch
from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op  # noqa: E402
from scripts.bench import cp_indexer_host_timing as timing  # noqa: E402
from vllm.v1.attention.ops import (  # noqa: E402
    rocm_cp_indexer,
    rocm_cp_indexer_plan,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (run on the lent device)"
)
WORLD = 8
TOPK = 2048
LOGITS_MB = 64
# The turn's 256 rows over 64,256 keys fill 98% of a 64 MiB chunk, and a
# fresh prompt gives the other ranks rows.
REQUESTS = [(64_000, 256), (0, 2048)]


def _key_split_the_turn(planned, keys, query_lens_cpu, *_):
    """The planner's choice, forced: the turn, as rank 0's whole range (so
    it owns every key-split row, and its last call is the turn's), the
    prompt's rows cut evenly among the other ranks."""
    turn, rows = int(query_lens_cpu[0]), int(query_lens_cpu.sum())
    others = [turn + (rows - turn) * r // (WORLD - 1) for r in range(WORLD)]
    return [0, *others], ((0, turn),)


def _peak(fn) -> int:
    """Bytes ``fn`` allocates at its peak beyond what was allocated before."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _profile_run(batch) -> None:
    """The op as vLLM's profiling run calls it: no attention metadata, on
    the step's largest batch of tokens."""
    from vllm.forward_context import create_forward_context, override_forward_context
    from vllm.v1.attention.backends.mla.indexer import get_max_prefill_buffer_size

    config = batch.vllm_config
    tokens = config.scheduler_config.max_num_batched_tokens
    hidden = torch.zeros(tokens, 8, device="cuda")
    with override_forward_context(create_forward_context(None, config)):
        op.rocm_aiter_sparse_attn_indexer(
            hidden,
            indexer_batch.LAYER,
            batch.kv_cache,
            batch.q_fp8,
            None,
            batch.weights,
            indexer_batch.QUANT_BLOCK,
            indexer_batch.SCALE_FMT,
            TOPK,
            indexer_batch.HEAD_DIM,
            indexer_batch.max_model_len(config),
            get_max_prefill_buffer_size(config),
            None,
            skip_k_cache_insert=True,
        )


def _logits_kept(monkeypatch):
    """The last call's logits referenced until the merge."""
    keep = rocm_cp_indexer.CPIndexerPrefill.keep_candidates

    def keeping(self, window, logits, topk):
        self.kept = logits
        keep(self, window, logits, topk)

    monkeypatch.setattr(rocm_cp_indexer.CPIndexerPrefill, "keep_candidates", keeping)


def _logits_reserved_alone(monkeypatch):
    monkeypatch.setattr(op, "profile_bytes", lambda logits, *_: logits)


def _peaks(monkeypatch) -> tuple[int, int, dict]:
    """Rank 0's share of the op's peak, the profiling run's, and the step."""
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    monkeypatch.setenv("VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", str(LOGITS_MB))
    plan = rocm_cp_indexer_plan
    monkeypatch.setattr(plan, "split_repays", lambda *_: True)
    monkeypatch.setattr(plan, "_key_split_plan", _key_split_the_turn)
    monkeypatch.setattr(plan, "KEY_SPLIT_MIN_STEP_KEY_ROWS", 0)

    def exchange(received, sent, received_sizes, sent_sizes):
        received.zero_()

    pynccl = SimpleNamespace(
        disabled=False,
        all_gatherv=lambda output, own, sizes: None,
        all_to_all_single=exchange,
    )
    group = SimpleNamespace(
        world_size=WORLD, device_communicator=SimpleNamespace(pynccl_comm=pynccl)
    )
    monkeypatch.setattr(rocm_cp_indexer, "get_tp_group", lambda: group)
    monkeypatch.setattr(rocm_cp_indexer, "_tp_size", lambda: WORLD)
    monkeypatch.setattr(rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda: 0)
    with contextlib.ExitStack() as stack:
        # The host bench's kernels: the fast stand-ins of AITER's logits and
        # top-k, whose memory is AITER's (one logits tensor a call).
        timing.use_kernels(stack, monkeypatch)
        config = indexer_batch.make_vllm_config(
            tp_size=WORLD, device="cuda", max_len=64 * 1024, max_tokens=4096
        )
        builder = indexer_batch.make_builder(config, monkeypatch, "cuda")
        batch = indexer_batch.build_batch(
            builder, REQUESTS, heads=32, cache_new_keys=True, torch_context=True
        )
        split = batch.metadata.prefill.cp_split
        assert split is not None and split.key_split == ((0, 256),)
        assert split.key_split_owners[0] == 256 and split.bounds[1] == 256
        buffer = torch.empty(
            (batch.hidden_states.shape[0], TOPK), dtype=torch.int32, device="cuda"
        )

        def run():
            indexer_batch.run_indexer(
                batch,
                TOPK,
                skip_k_cache_insert=True,
                kv_cache=batch.kv_cache,
                buffer=buffer,
            )

        # Compiled, and vLLM's workspace grown, before either is measured.
        run()
        _profile_run(batch)
        step = {
            "logits": max(
                c.total_seq_lens * (c.token_end - c.token_start) * 4
                for c in batch.metadata.prefill.chunks
            ),
            "received": WORLD * 256 * plan.CANDIDATE_ROW_BYTES,
        }
        return _peak(run), _peak(lambda: _profile_run(batch)), step


def test_the_split_holds_no_more_than_the_profiling_run_reserves(monkeypatch):
    split, profile, step = _peaks(monkeypatch)
    # The step is as heavy as claimed: logits near the budget, and what
    # rank 0 receives more than the candidates it sends.
    assert step["logits"] > 0.9 * (LOGITS_MB << 20)
    print(f"split peak {split / 2**20:.1f} MiB, profile {profile / 2**20:.1f} MiB")
    assert split <= profile


@pytest.mark.parametrize("plant", [_logits_kept, _logits_reserved_alone])
def test_each_planted_mistake_passes_the_reservation(monkeypatch, plant):
    plant(monkeypatch)
    split, profile, _ = _peaks(monkeypatch)
    print(f"{plant.__name__}: split {split / 2**20:.1f}, profile {profile / 2**20:.1f}")
    assert split > profile
