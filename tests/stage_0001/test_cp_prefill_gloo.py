# SPDX-License-Identifier: Apache-2.0
"""Stage 0001 on gloo: the real patched ``rocm_aiter_sparse_attn_indexer``
split over 2, 4 and 8 ranks of a real vLLM TP group gives the single-rank
result, each prefill row scored by one rank, merged once by an all_gatherv
of each rank's own rows.

The top-k stand-ins choose their output order and tied columns differently
on every rank and call (``scripts.harness.adversary``), as the real kernels may: a
row scored by two ranks would merge into duplicates, and results are
compared as sets, by score where scores tie."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.harness import adversary, indexer_batch, topk_reference
from scripts.harness.multiproc import GlooPyNccl, run_ranks
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree
from scripts.series.contract import BASE_TREE_ENV, tree_env

TREE = applied_tree("0001")

from vllm.v1.attention.ops import (  # noqa: E402
    rocm_cp_indexer_plan,
)
from vllm.v1.attention.ops.rocm_cp_indexer import CPIndexerPrefill  # noqa: E402

TOPK = 16
SERVING_GATE = rocm_cp_indexer_plan.split_repays
# Chunk at 4,096 logits so that ~100 tokens make several chunks.
LOGITS = 4096

# name: (requests as (context, query), CUDA-graph padding rows)
SCENARIOS = {
    "one long sequence": ([(0, 60)], 0),
    "packed sequences": ([(0, 20), (9, 14), (0, 11), (30, 16)], 0),
    "multiple chunks": ([(60, 90)], 0),
    "an odd row count": ([(5, 47)], 0),
    # 65 keys: chunks of 63 rows, then 2 (< tp at 4 and 8): only the last
    # chunk is short.
    "a short tail chunk": ([(0, 65)], 0),
    # 4,002 keys: one row per chunk, twice, then a 60-row chunk.
    "short chunks before a long one": ([(4000, 2), (0, 60)], 0),
    "mixed decode and prefill": ([(30, 1), (41, 1), (0, 30), (25, 20)], 0),
    "cuda-graph padded rows": ([(30, 1), (0, 25), (12, 18)], 7),
    "rows shorter than k": ([(0, 12), (3, 9)], 0),
    # Several thousand keys a row (chunked at LONG_ROW_LOGITS).
    "long rows": ([(3000, 30), (4050, 40)], 0),
    # A turn over a cached prefix next to a fresh prompt: one turn row costs
    # ~15x a fresh one, so the ranks' row counts differ widely.
    "a turn over a cached prefix": ([(1500, 8), (0, 40)], 0),
    # Three prefill rows: split over 2 ranks; replicated, no merge, over 4
    # and 8 (fewer rows than ranks).
    "fewer rows than ranks": ([(4000, 3)], 0),
}


def _replicated(name: str, world_size: int) -> bool:
    """Whether a scenario stays replicated at ``world_size`` ranks."""
    return sum(new for _, new in SCENARIOS[name][0]) < world_size


LONG_ROW_LOGITS = 1 << 17


def _configure(monkeypatch: pytest.MonkeyPatch, cp: bool, logits: int = LOGITS) -> None:
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1" if cp else "0")
    indexer_batch.shrink_logits_budget(monkeypatch, logits)
    # These batches are far below the work that repays a split in serving,
    # and their rows hold tens of keys, not thousands: with serving's fixed
    # row cost every row would cost about the same (and with its call cost a
    # second chunk would outweigh a rank's rows), and the cuts would not
    # give the ranks the uneven row counts these scenarios are for.
    monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
    monkeypatch.setattr(rocm_cp_indexer_plan, "ROW_COST_KEYS", 0)
    monkeypatch.setattr(rocm_cp_indexer_plan, "CALL_COST_KEYS", 0)


def _build_all(tp_size: int, cp: bool) -> dict:
    """Every scenario's batch through vLLM's builder at ``tp_size``, its keys
    cached; built once, before the ranks fork."""
    batches = {}
    for name, (requests, padding) in SCENARIOS.items():
        with pytest.MonkeyPatch.context() as monkeypatch:
            logits = LONG_ROW_LOGITS if name == "long rows" else LOGITS
            _configure(monkeypatch, cp, logits)
            with emulate_rocm("gfx950"):
                config = indexer_batch.make_vllm_config(tp_size=tp_size)
                builder = indexer_batch.make_builder(config, monkeypatch)
                batches[name] = indexer_batch.build_batch(
                    builder,
                    requests,
                    padding=padding,
                    cache_new_keys=True,
                    torch_context=True,
                )
    return batches


def _run(batch) -> dict:
    """Run the op on one batch, recording the buffer before the merge and
    every collective: all_reduce, and PyNccl's all_gatherv (the rows this
    rank sends, the sizes, the group, and where its input and output lie in
    the top-k buffer, in rows)."""
    reduces: list[tuple[int, ...]] = []
    gathers: list[tuple[tuple[int, ...], list[int], torch.dtype]] = []
    groups: list[str] = []
    places: list[float] = []
    before_merge: list[torch.Tensor] = []
    real_all_reduce = torch.distributed.all_reduce
    real_all_gatherv = GlooPyNccl.all_gatherv
    real_merge = CPIndexerPrefill.merge

    def counting_all_reduce(tensor, *args, **kwargs):
        reduces.append(tuple(tensor.shape))
        return real_all_reduce(tensor, *args, **kwargs)

    def counting_all_gatherv(self, output, input_, sizes, stream=None):
        gathers.append((tuple(input_.shape), sizes, input_.dtype))
        groups.append(_group_name(self.coordinator))
        # Where the rank's rows lie in the output, in rows.
        row_bytes = input_.stride(0) * input_.element_size()
        places.append((input_.data_ptr() - output.data_ptr()) / row_bytes)
        return real_all_gatherv(self, output, input_, sizes, stream)

    def recording_merge(self, buffer):
        before_merge.append(buffer.clone())
        return real_merge(self, buffer)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(torch.distributed, "all_reduce", counting_all_reduce)
        monkeypatch.setattr(GlooPyNccl, "all_gatherv", counting_all_gatherv)
        monkeypatch.setattr(CPIndexerPrefill, "merge", recording_merge)
        with emulate_rocm("gfx950"):
            out = indexer_batch.run_indexer(
                batch, TOPK, skip_k_cache_insert=True, torch_gather=True
            )
    return {
        "out": out,
        "before_merge": before_merge[-1] if before_merge else None,
        "reduces": reduces,
        "gathers": gathers,
        "groups": groups,
        "places": places,
        "decode": batch.num_decode_tokens,
        "prefill": batch.num_prefill_tokens,
        "chunks": len(batch.metadata.prefill.chunks) if batch.metadata.prefill else 0,
        "row_ends": batch.row_ends,
    }


def _group_name(group) -> str:
    """Which of vLLM's groups ``group`` is (the merge must use the TP group)."""
    from vllm.distributed import get_tp_group

    return "tp" if group is get_tp_group() else group.unique_name


def _run_all(rank: int, world_size: int, batches: dict) -> dict:
    return {name: _run(batch) for name, batch in batches.items()}


@pytest.fixture(scope="module")
def single_rank() -> dict:
    batches = _build_all(1, cp=False)
    results = _run_all(0, 1, batches)
    for name, batch in batches.items():
        results[name]["logits"] = batch.reference_logits()
    return results


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda n: f"tp{n}")
def split_ranks(request) -> tuple[int, list[dict]]:
    batches = _build_all(request.param, cp=True)
    return request.param, run_ranks(request.param, _run_all, batches)


def test_scenarios_cover_what_they_claim(single_rank):
    assert single_rank["multiple chunks"]["chunks"] >= 3
    assert single_rank["short chunks before a long one"]["chunks"] == 3
    assert single_rank["fewer rows than ranks"]["prefill"] == 3
    assert single_rank["long rows"]["row_ends"].min() > 3000
    assert single_rank["long rows"]["chunks"] >= 2
    assert single_rank["one long sequence"]["chunks"] == 1
    assert single_rank["mixed decode and prefill"]["decode"] == 2
    assert min(single_rank["rows shorter than k"]["row_ends"].tolist()) < TOPK
    padded = single_rank["cuda-graph padded rows"]
    assert padded["out"].shape[0] == padded["decode"] + padded["prefill"] + 7
    assert all(s["reduces"] == s["gathers"] == [] for s in single_rank.values())


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_merged_result_equals_the_single_rank_result(single_rank, split_ranks, name):
    world_size, ranks = split_ranks
    expected = single_rank[name]
    real = expected["row_ends"].numel()
    for rank, result in enumerate(ranks):
        got = result[name]["out"]
        assert got.shape == expected["out"].shape
        # The same index set per row (by score where scores tie), each index
        # once: a row merged from two ranks' copies holds duplicates.
        topk_reference.assert_same_selection(
            expected["logits"],
            got[:real],
            expected["out"][:real],
            expected["row_ends"],
            TOPK,
        )
        assert got[real:].eq(-1).all(), f"tp{world_size} rank {rank}: padding"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_prefill_row_is_written_by_exactly_one_rank(split_ranks, name):
    world_size, ranks = split_ranks
    first = ranks[0][name]
    rows = slice(first["decode"], first["decode"] + first["prefill"])
    written = torch.stack(
        [(r[name]["before_merge"][rows] >= 0).any(dim=1) for r in ranks]
    ).sum(dim=0)
    # Replicated batches: every rank writes every row and nothing merges.
    writers = world_size if _replicated(name, world_size) else 1
    assert written.eq(writers).all(), f"rows written by {written.unique().tolist()}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_one_merge_per_prefill_over_the_prefill_rows_only(split_ranks, name):
    """One all_gatherv over the TP group per prefill, in place: each rank
    sends only its own rows, from its slice of the output, and the ranks'
    rows add up to the prefill rows. Every row here has fewer than 65,535
    keys: they travel as int16 (as bytes: NCCL has no int16), 2 k bytes."""
    world_size, ranks = split_ranks
    for rank, result in enumerate(ranks):
        scenario = result[name]
        assert scenario["reduces"] == []
        if _replicated(name, world_size):
            assert scenario["gathers"] == []
            continue
        [(sent, sizes, dtype)] = scenario["gathers"]
        assert len(sizes) == world_size
        assert sum(sizes) == scenario["prefill"] and min(sizes) >= 1
        assert sent == (sizes[rank], 2 * TOPK) and dtype == torch.int8
        assert scenario["groups"] == ["tp"]
        assert scenario["places"] == [sum(sizes[:rank])]


def _build_no_split(world_size: int) -> dict:
    """Batches where no row may be split (and one that is, for contrast)."""
    batches = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        _configure(monkeypatch, True)
        with emulate_rocm("gfx950"):
            config = indexer_batch.make_vllm_config(tp_size=world_size)
            builder = indexer_batch.make_builder(config, monkeypatch)
            # Fewer prefill rows than ranks: nothing to split.
            batches["tiny"] = indexer_batch.build_batch(
                builder, [(10, 1), (5, 3)], cache_new_keys=True
            )
            batches["candidates"] = indexer_batch.build_batch(
                builder, SCENARIOS["packed sequences"][0], cache_new_keys=True
            )
            batches["decode only"] = indexer_batch.build_batch(
                builder, [(30, 1), (12, 1)], cache_new_keys=True
            )
            # The stage's own gate: this batch is far below its minimum.
            monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", SERVING_GATE)
            batches["below the minimum"] = indexer_batch.build_batch(
                builder, SCENARIOS["packed sequences"][0], cache_new_keys=True
            )
    return batches


def _run_no_split(rank: int, world_size: int, batches: dict) -> dict:
    results = {name: _run(batch) for name, batch in batches.items()}
    # Candidate blocks keep the whole call replicated: their writes are per
    # row and unmerged. (vLLM's candidate kernels assert CUDA, so the op
    # itself cannot run them here; this checks the decision it takes.)
    cp_prefill = CPIndexerPrefill(batches["candidates"].metadata.prefill.cp_split, True)
    chunks = batches["candidates"].metadata.prefill.chunks
    results["candidate rows"] = [
        (w.batch_rows, w.gather_keys) for w in cp_prefill.windows(chunks)
    ]
    return results


def test_no_collective_runs_when_nothing_is_split():
    batches = _build_no_split(4)
    assert batches["tiny"].metadata.prefill.cp_split is None
    assert batches["below the minimum"].metadata.prefill.cp_split is None
    assert batches["candidates"].metadata.prefill.cp_split is not None
    chunks = batches["candidates"].metadata.prefill.chunks
    for result in run_ranks(4, _run_no_split, batches):
        for name in ("tiny", "decode only", "below the minimum"):
            assert result[name]["reduces"] == result[name]["gathers"] == [], name
        [(_, sizes, _)] = result["candidates"]["gathers"]
        assert sum(sizes) == batches["candidates"].num_prefill_tokens
        # With candidate blocks, every rank scores every row of every chunk.
        assert result["candidate rows"] == [
            (slice(c.token_start, c.token_end), True) for c in chunks
        ]


BYTE_IDENTITY_SCENARIOS = ["mixed decode and prefill", "multiple chunks"]

# Runs in a separate process on the base tree: each scenario's buffer, saved.
_BASE_RUN = """
import sys, torch, pytest
from scripts.harness import adversary, indexer_batch, triton_fp8_shim
from scripts.harness.rocm_platform import emulate_rocm
triton_fp8_shim.install()  # as tests/conftest.py does for this process
outputs = {}
for name, requests in eval(sys.argv[2]).items():
    with pytest.MonkeyPatch.context() as mp:
        indexer_batch.shrink_logits_budget(mp, 4096)
        with emulate_rocm("gfx950"):
            config = indexer_batch.make_vllm_config(2)
            builder = indexer_batch.make_builder(config, mp)
            batch = indexer_batch.build_batch(builder, requests, padding=3)
            adversary.restart()
            outputs[name] = indexer_batch.run_indexer(batch, 16)
torch.save(outputs, sys.argv[1])
"""


@pytest.fixture(scope="module")
def base_outputs(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The base tree's buffers for the byte-identity scenarios (one process)."""
    base_tree = os.environ.get(BASE_TREE_ENV)
    if not base_tree or not Path(base_tree).is_dir():
        pytest.skip(f"needs the base tree ({BASE_TREE_ENV}); run through nox")
    out_file = tmp_path_factory.mktemp("base") / "base.pt"
    project = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        **tree_env(Path(base_tree), ["base"], Path(base_tree), cpu=False),
        "PYTHONPATH": f"{base_tree}:{project}",
    }
    requests = {name: SCENARIOS[name][0] for name in BYTE_IDENTITY_SCENARIOS}
    subprocess.run(
        [sys.executable, "-c", _BASE_RUN, str(out_file), repr(requests)],
        env=env,
        check=True,
        cwd=out_file.parent,
    )
    return torch.load(out_file)


@pytest.mark.parametrize("name", BYTE_IDENTITY_SCENARIOS)
def test_flag_off_is_byte_identical_to_the_base(base_outputs, monkeypatch, name):
    indexer_batch.shrink_logits_budget(monkeypatch, LOGITS)
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "0")
    with emulate_rocm("gfx950"):
        builder = indexer_batch.make_builder(
            indexer_batch.make_vllm_config(2), monkeypatch
        )
        batch = indexer_batch.build_batch(builder, SCENARIOS[name][0], padding=3)
        # The same kernel calls in the same order as the base make the same
        # adversarial choices, so the bytes must match.
        adversary.restart()
        here = indexer_batch.run_indexer(batch, TOPK)
    base = base_outputs[name]
    assert here.dtype == base.dtype and here.shape == base.shape
    assert here.numpy().tobytes() == base.numpy().tobytes()


def _profiling_run(buffer: torch.Tensor) -> torch.Tensor:
    """The op as vLLM's profiling (dummy) run calls it: with no attention
    metadata, over 64 tokens, at tp 2."""
    from vllm.forward_context import create_forward_context, override_forward_context
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (
        rocm_aiter_sparse_attn_indexer,
    )

    with emulate_rocm("gfx950"):
        config = indexer_batch.make_vllm_config(tp_size=2)
        indexer_batch.ensure_workspace(torch.device("cpu"))
        with override_forward_context(create_forward_context(None, config)):
            return rocm_aiter_sparse_attn_indexer(
                torch.zeros(64, 8),
                indexer_batch.LAYER,
                torch.zeros(4, 64, 132, dtype=torch.uint8),
                torch.zeros(64, 4, 128).to(torch.float8_e4m3fn),
                torch.zeros(64, 128, dtype=torch.bfloat16),
                torch.zeros(64, 4),
                128,
                "ue8m0",
                TOPK,
                128,
                256,
                64,
                buffer,
            )


def _profiling_run_on_a_rank(rank: int, world_size: int, cp: bool) -> dict:
    """The profiling run on one rank of a real TP group: the collectives it
    makes, its output, and the sizes of the op's own uint8 torch.empty calls
    (the memory it reserves)."""
    import vllm.envs as envs
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse

    reduces: list = []
    sizes: list[int] = []
    real_empty = torch.empty

    def recording_empty(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__")
        if caller == rocm_aiter_mla_sparse.__name__ and kwargs.get("dtype") is (
            torch.uint8
        ):
            sizes.append(int(args[0]))
        return real_empty(*args, **kwargs)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1" if cp else "0")
        monkeypatch.setattr(envs, "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", 1, raising=False)
        monkeypatch.setattr(
            torch.distributed, "all_reduce", lambda *a, **k: reduces.append(a)
        )
        monkeypatch.setattr(torch, "empty", recording_empty)
        buffer = torch.full((64, TOPK), 7, dtype=torch.int32)
        out = _profiling_run(buffer)
    return {"reduces": reduces, "sizes": sizes, "untouched": out is buffer
            and bool(buffer.eq(7).all())}  # fmt: skip


@pytest.mark.parametrize("cp", [True, False])
def test_the_profiling_run_reserves_what_the_split_holds(cp):
    """vLLM's profiling (dummy) run calls the op without attention metadata,
    on every rank of the TP group: it makes no collective and leaves the
    top-k buffer as it was. It reserves the logits budget (1 MiB here) and,
    with the split on, the candidates a rank may send beside a call's
    logits (``key_split_max_rows`` of the budget: 4 rows of 16 KiB) and a
    key-split call's top-k (TOPK int32 a row); the merge's int16 rows of 64
    tokens take less."""
    for result in run_ranks(2, _profiling_run_on_a_rank, cp):
        assert result["reduces"] == [] and result["untouched"]
        row = rocm_cp_indexer_plan.CANDIDATE_ROW_BYTES + TOPK * 4
        sent = 4 * row if cp else 0
        assert result["sizes"] == [(1 << 20) + sent]


# vLLM's chunker at its default 512 MiB logits budget splits a 6,711-row
# slice over 40,000 keys into 3,355 / 3,355 / 1 rows: the layout that exposed
# the duplicate-row bug. The ranks run it over 10,000 keys (a 3,289-key
# cached prefix) at the budget that gives the same rows, a quarter of the
# work.
TAIL_ROWS = 6711
TAIL_LAYOUT = [3355, 3355, 1]
TAIL_CONTEXT = 3289


def test_the_default_budget_makes_the_tail_layout_at_40000_keys():
    import vllm.envs as envs
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerMetadataBuilder,
    )

    chunks = DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks(
        torch.tensor([40000]),
        torch.tensor([TAIL_ROWS]),
        # Any workspace that holds the keys: serving's is far larger.
        workspace_size=40000,
        max_logits_bytes=envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB * 1024 * 1024,
    )
    assert envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB == 512
    assert [q.stop - q.start for _, q in chunks] == TAIL_LAYOUT


def _tail_batch():
    """The tail layout at tp 8 through vLLM's builder; one indexer head
    keeps the CPU cost down."""
    keys = TAIL_CONTEXT + TAIL_ROWS
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
        # 3,355 rows of logits over ``keys``, as 512 MiB is over 40,000.
        indexer_batch.shrink_logits_budget(monkeypatch, TAIL_LAYOUT[0] * keys + 1)
        with emulate_rocm("gfx950"):
            config = indexer_batch.make_vllm_config(
                tp_size=8, max_len=10240, max_tokens=8192
            )
            builder = indexer_batch.make_builder(config, monkeypatch)
            return indexer_batch.build_batch(
                builder,
                [(TAIL_CONTEXT, TAIL_ROWS)],
                cache_new_keys=True,
                torch_context=True,
                heads=1,
            )


def test_the_3355_3355_1_layout_at_tp8():
    batch = _tail_batch()
    chunks = batch.metadata.prefill.chunks
    assert [c.token_end - c.token_start for c in chunks] == TAIL_LAYOUT
    ranks = run_ranks(8, _run_all, {"tail": batch})
    written = torch.stack(
        [(r["tail"]["before_merge"] >= 0).any(dim=1) for r in ranks]
    ).sum(dim=0)
    assert written.eq(1).all(), "each of the 6,711 rows needs exactly one writer"
    # Every 97th row and the last ones, against vLLM's torch logits.
    rows = torch.cat(
        [torch.arange(0, TAIL_ROWS, 97), torch.tensor([TAIL_ROWS - 2, TAIL_ROWS - 1])]
    )
    logits = batch.reference_logits(rows)
    expected = logits.topk(TOPK, dim=1).indices.to(torch.int32)
    for result in ranks:
        assert result["tail"]["reduces"] == []
        [(_, sizes, _)] = result["tail"]["gathers"]
        assert sum(sizes) == TAIL_ROWS
        topk_reference.assert_same_selection(
            logits, result["tail"]["out"][rows], expected, batch.row_ends[rows], TOPK
        )
