# SPDX-License-Identifier: Apache-2.0
"""The Triton kernels of the ROCm indexer op (``rocm_aiter_sparse_attn_
indexer`` with the FP8 K cache) compiled for the AMD targets, with the
shapes the stages route into them: stage 0001's split scores each rank's own
rows of every chunk, vLLM's k=2048 gate (0.33.0 on) sends decode and long
prefill chunks to AITER's top-k (and its prefill indices through vLLM's
Triton localisation).

The specialisations come from vLLM's own code: the metadata builder and the
op run on a step of decodes (next_n rows each) and prefills, with Triton's
compile-only driver recording every launch (the builder's decode kernel, the
K gather, the localisation) and the interpreter computing its results, so
the host code after each kernel sees real values; the K gather's results
come from its torch equivalent, which tests/base checks against it (the
interpreter took most of the matrix's time there). The cache is filled by
the torch equivalent of vLLM's K-cache writer, which the stages do not call.
The split runs on two forked gloo ranks of a real TP group. AITER's own
kernels (logits, top-k) are stand-ins here and are not compiled."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from scripts.harness import gfx_compile, indexer_batch, indexer_k_cache
from scripts.harness.multiproc import run_ranks
from scripts.harness.rocm_platform import emulate_rocm, use_rocm_fp8_encoding
from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

from vllm.config import set_current_vllm_config  # noqa: E402

# The files that define or launch these kernels: a tree compiles them when
# its own stage patches one (scripts/series/testing/testrun.py).
KERNEL_CALLERS = (
    "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py",
    "vllm/v1/attention/backends/mla/indexer.py",
    "vllm/v1/attention/ops/rocm_cp_indexer.py",
    "vllm/v1/attention/ops/rocm_cp_indexer_merge.py",
)
TOPK = 2048
PAGES = (64, 128)
NEXT_N = (1, 2, 4)
# DeepSeek-V3.2's 64 and GLM-5.x's 32 index heads (published configs; see
# scripts/harness/dsa_attention.py).
HEADS = (64, 32)
LONG_PREFILL = [(32760, 8)]  # 32,768 keys: AITER's prefill top-k (vLLM's k=2048 gate)


def _step(next_n: int) -> list[tuple[int, int]]:
    """Two decodes of next_n rows, a fresh prompt, and a turn over a short
    cached prefix (small: every kernel is interpreted too)."""
    return [(20, next_n), (9, next_n), (0, 24), (40, 7)]


def _padded_step(next_n: int) -> list[tuple[int, int]]:
    """Decodes of next_n rows with a zero-length request among them, then a
    prompt: the builder pads the decode rows (requires_padding), and the op
    packs the queries and weights and unpacks the top-k (stage 0004)."""
    return [(20, next_n), (30, 0), (9, next_n), (40, 7)]


def _key_split_every_turn(planned, keys, query_lens_cpu, *_):
    """Stage 0001's key split, forced onto every request with a cached
    prefix (the planner's model keeps it for serving-sized turns)."""
    ends = torch.cumsum(query_lens_cpu.to(torch.int64), 0).tolist()
    chosen = [
        (end - q, end)
        for end, q in zip(ends, query_lens_cpu.tolist(), strict=True)
        if q and int(keys[end - q]) > 1
    ]
    costs = planned.costs.clone()
    for start, end in chosen:
        costs[start:end] = 0
    return planned.bounds(costs), tuple(chosen)


def _run_op(
    recorder, arch, heads, page, next_n, tp=1, requests=None, label="", long=False,
    key_split=False, layout="cost",
) -> None:  # fmt: skip
    """Build the step with vLLM's builder and run the op, recording. A
    ``long`` step's kernels are recorded, not interpreted. At tp > 1 the
    step is split (far below the gate's minimum otherwise), its turns
    key-split with ``key_split``, its rows in the planner's ``layout``."""
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.ExitStack() as stack:
        # Before the platform: entering it reads AITER's switches.
        monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1" if tp > 1 else "0")
        from vllm.v1.attention.ops import rocm_cp_indexer_plan as plan

        monkeypatch.setattr(plan, "split_repays", lambda *_: True)
        monkeypatch.setattr(plan, "ROW_LAYOUT", layout)
        if key_split:
            monkeypatch.setattr(plan, "_key_split_plan", _key_split_every_turn)
            monkeypatch.setattr(plan, "KEY_SPLIT_MIN_STEP_KEY_ROWS", 0)
            monkeypatch.setattr(plan, "key_split_max_rows", lambda *_: 64)
        stack.enter_context(emulate_rocm(arch))
        use_rocm_fp8_encoding(monkeypatch, arch)
        config = indexer_batch.make_vllm_config(
            tp_size=tp,
            max_len=33024 if long else indexer_batch.MAX_MODEL_LEN,
            num_speculative_tokens=next_n - 1,
        )
        with set_current_vllm_config(config):
            builder = indexer_batch.make_builder(config, monkeypatch, block_size=page)
        recorder.label = label
        with (
            gfx_compile.recording(arch, interpret=not long, into=recorder),
            _gather_recorded_computed_in_torch(),
        ):
            # The cache is filled by the torch writer (the stages do not call
            # vLLM's); the builder's own kernels are recorded.
            batch = indexer_batch.build_batch(
                builder,
                requests or _step(next_n),
                heads=heads,
                cache_new_keys=True,
                torch_context=True,
            )
            indexer_batch.run_indexer(
                batch, TOPK, skip_k_cache_insert=True, torch_gather=long
            )
            if tp > 1:
                assert batch.metadata.prefill.cp_split is not None, "not split"


@contextmanager
def _gather_recorded_computed_in_torch() -> Iterator[None]:
    """The op's K gather: vLLM's Triton kernel is launched (recorded, not
    interpreted), and its torch equivalent writes the results."""
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as op_module

    name = "cp_gather_indexer_k_quant_cache_triton"
    triton_gather = getattr(op_module, name)

    def gather(*args, **kwargs):
        with gfx_compile.recorded_only():
            triton_gather(*args, **kwargs)
        kwargs.pop("block_tile_size", None)
        kwargs.pop("head_tile_size", None)
        indexer_k_cache.gather_paged_k(*args, **kwargs)

    setattr(op_module, name, gather)
    try:
        yield
    finally:
        setattr(op_module, name, triton_gather)


def _kinds():
    for arch in gfx_compile.ARCHS:
        for heads in HEADS:
            yield pytest.param(arch, heads, id=f"{arch}-{heads}-heads")


@pytest.mark.parametrize(("arch", "heads"), _kinds())
def test_indexer_op_kernels_compile(compile_matrix, arch, heads):
    recorder = gfx_compile.Recorder()
    for page in PAGES:
        for next_n in NEXT_N:
            _run_op(
                recorder, arch, heads, page, next_n,
                label=f"{heads} index heads, {page}-token pages, next_n {next_n}",
            )  # fmt: skip
    for next_n in (1, 2):  # the native decode path, which pads
        _run_op(
            recorder, arch, heads, PAGES[0], next_n, requests=_padded_step(next_n),
            label=f"{heads} index heads, padded next_n {next_n} decodes",
        )  # fmt: skip
    kernels = {variant.name for variant in recorder.variants}
    assert "_cp_gather_indexer_quant_cache" in " ".join(kernels), kernels
    assert {"PackSeqTritonKernel", "UnpackSeqTritonKernel"} <= {
        name.split(".")[0] for name in kernels
    }, kernels
    failures = compile_matrix.compile(arch, recorder)
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("arch", gfx_compile.ARCHS)
def test_split_prefill_kernels_compile(compile_matrix, arch):
    """Stage 0001's split at TP 2: each rank gathers the chunk's keys and
    scores its own rows, the merge packs them as int16 and unpacks them;
    with the turns key-split, each rank scores its part of their keys and
    selects their top-k from every rank's candidates (gfx950 only); in the
    zigzag layout the merge unpacks every row to its batch row."""
    kinds = {
        "whole rows": (False, "cost"),
        "key-split turns": (True, "cost"),
        "zigzag": (False, "zigzag"),
    }

    def on_rank(rank, world_size):
        recorder = gfx_compile.Recorder()
        for heads in HEADS:
            for kind, (key_split, layout) in kinds.items():
                _run_op(
                    recorder, arch, heads, 64, 2, tp=world_size,
                    key_split=key_split, layout=layout,
                    label=f"CP split ({kind}, {heads} index heads), "
                    f"rank {rank} of {world_size}",
                )  # fmt: skip
        return recorder.variants

    recorder = gfx_compile.Recorder()
    for variants in run_ranks(2, on_rank):
        for variant, labels in variants.items():
            for label in labels:
                recorder.label = label
                recorder.add(variant)
    kernels = {variant.name for variant in recorder.variants}
    # gfx942's logits fill their chunk: the planner key-splits nothing there.
    key_split = {"_keep_candidates_kernel", "_select_top_k_kernel"}
    expected = {"_narrow_kernel"} | (key_split if arch == "gfx950" else set())
    assert expected <= kernels and (arch == "gfx950" or not key_split & kernels), (
        kernels
    )
    narrow = [v.describe() for v in recorder.variants if v.name == "_narrow_kernel"]
    assert any("TO_ROWS=True" in d for d in narrow), narrow
    failures = compile_matrix.compile(arch, recorder)
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("heads", HEADS)
def test_long_prefill_localisation_compiles(compile_matrix, heads):
    """A chunk whose requests reach 32K keys takes AITER's prefill top-k on
    gfx950 (upstream's gate since vLLM 0.33.0, once our stage 0002), whose
    chunk-global indices vLLM's Triton kernel makes sequence-local."""
    recorder = gfx_compile.Recorder()
    _run_op(
        recorder, "gfx950", heads, 64, 1, requests=LONG_PREFILL, long=True,
        label=f"{heads} index heads, a 32K-key prefill chunk",
    )  # fmt: skip
    kernels = {variant.name for variant in recorder.variants}
    assert "_localize_aiter_prefill_topk_kernel" in kernels, kernels
    failures = compile_matrix.compile("gfx950", recorder)
    assert not failures, "\n\n".join(failures)
