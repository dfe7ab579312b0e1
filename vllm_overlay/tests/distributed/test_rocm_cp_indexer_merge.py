# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The context-parallel ROCm DSA indexer prefill, end to end: vLLM's indexer
metadata builder plans the step, ``rocm_aiter_sparse_attn_indexer`` scores
it on every TP rank, and with VLLM_ROCM_USE_AITER_CP_INDEXER=1 each rank
scores only its own prefill rows and the merge gives every rank every row:
the same top-k set per row as with the flag off.

Runs on gloo ranks on a CPU (the Triton kernels through TRITON_INTERPRET=1)
and over two GPUs on ROCm with AITER. On a CPU, what it lacks is stood in:
the ROCm platform check, PyNccl (by gloo collectives), AITER's prefill logits
kernel (by vLLM's own torch reference, ``fp8_mqa_logits_torch``) and
``_C.top_k_per_row_prefill`` (a
torch top-k with the kernel's contract: indices relative to the row's start,
as vLLM's AITER adapter ``_localize_aiter_prefill_topk`` assumes, -1 past a
short row; output order and the choice among tied k-th values unspecified,
since csrc/sampler.cu places outputs by atomicAdd: here random on each rank
and call, so that a row merged from two ranks' copies shows up). Run once as
the planner cuts whole rows, once with the long requests key-split (each
rank scores its part of their keys, and the rank whose range holds a row
selects its top-k from both ranks' candidates), and in the zigzag layout
(each rank's blocks of every request in one call, the merged rows put back
in batch order), without and with the long requests key-split (each owning
an equal block of their rows).
"""

import json
import os
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from vllm.platforms import current_platform

TOPK = 16
HEADS, HEAD_DIM, PAGE = 4, 128, 64
MAX_MODEL_LEN = 1024
LAYER = "model.layers.0.self_attn.indexer.k_cache"
# Prefill requests as (cached tokens, new tokens): fresh prompts, new turns
# over cached prefixes, a request shorter than TOPK; then CUDA-graph padding.
REQUESTS = [(0, 40), (25, 20), (9, 3), (60, 30)]
PADDING_ROWS = 5
STRIPE = 4
# Logits per prefill chunk, so that this batch makes several chunks.
CHUNK_LOGITS = 2048
# A DeepSeek-V3.2 checkpoint's config.json, cut to one small layer (the
# attention and indexer shape of the published one, HEADS indexer heads).
TINY_DSV32 = {
    "model_type": "deepseek_v32",
    "architectures": ["DeepseekV32ForCausalLM"],
    "torch_dtype": "bfloat16",
    "hidden_size": 256,
    "num_hidden_layers": 1,
    "vocab_size": 1024,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "index_n_heads": HEADS,
    "index_head_dim": HEAD_DIM,
    "index_topk": 2048,
    "max_position_embeddings": 163840,
}


# Keeps the stand-in op registered for the process.
_LIBRARIES: list = []


class _GlooPyNccl:
    """PyNccl's all_gatherv and all_to_all_single, which gloo ranks lack, on
    gloo (vllm/distributed/device_communicators/pynccl.py). all_gatherv:
    inside one NCCL group, one broadcast per root from its input into its
    slice of the output, in rank order. Fails where NCCL is undefined:
    non-contiguous buffers, and a root's input overlapping the output other
    than as exactly its own slice (NCCL broadcasts in place only when send
    and receive are one)."""

    disabled = False

    def __init__(self, group) -> None:
        self.group = group
        self.exchanges = 0

    def all_to_all_single(
        self, output, input_, output_split_sizes, input_split_sizes, stream=None
    ):
        """The next ``input_split_sizes[peer]`` rows of the input to each
        peer, the next ``output_split_sizes[peer]`` rows of the output from
        it, of contiguous tensors (vllm-project/vllm v0.34.0, pynccl.py
        ``all_to_all_single``, L489-541)."""
        world_size = self.group.world_size
        assert output.is_contiguous() and input_.is_contiguous()
        assert len(output_split_sizes) == len(input_split_sizes) == world_size
        assert output.shape[0] == sum(output_split_sizes)
        assert input_.shape[0] == sum(input_split_sizes)
        self.exchanges += 1
        torch.distributed.all_to_all_single(
            output,
            input_,
            list(output_split_sizes),
            list(input_split_sizes),
            group=self.group.device_group,
        )

    def all_gatherv(self, output, input_, sizes, stream=None):
        rank = self.group.rank_in_group
        assert output.is_contiguous() and input_.is_contiguous()
        assert output.shape[0] == sum(sizes) and len(sizes) == self.group.world_size
        assert input_.shape == (sizes[rank], *output.shape[1:])
        parts = output.split(sizes)
        if input_.data_ptr() != parts[rank].data_ptr():
            end = input_.data_ptr() + input_.nbytes
            out_end = output.data_ptr() + output.nbytes
            assert end <= output.data_ptr() or input_.data_ptr() >= out_end
            parts[rank].copy_(input_)
        for root, part in enumerate(parts):
            torch.distributed.broadcast(
                part, src=self.group.ranks[root], group=self.group.device_group
            )


def _stand_in_for_rocm(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """The ROCm platform with AITER, on a CPU."""
    import vllm._aiter_ops as aiter_ops
    import vllm.v1.attention.backends.mla.indexer as indexer
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op

    monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
    monkeypatch.setattr(aiter_ops, "is_aiter_found_and_supported", lambda: True)
    # AITER's own top-k is not here either (it asks the GPU's arch): vLLM's
    # _C kernel, stood in below, scores the rows.
    monkeypatch.setattr(
        aiter_ops.rocm_aiter_ops, "is_indexer_top_k_enabled", lambda: False
    )
    monkeypatch.setattr(indexer, "num_compute_units", lambda device_index: 256)
    monkeypatch.setattr(op, "rocm_fp8_mqa_logits", op.fp8_mqa_logits_torch)
    # The workspace frees the accelerator's cache when it grows; a CPU has none.
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    calls = iter(range(1 << 30))

    def top_k_per_row_prefill(logits, starts, ends, out, rows, s0, s1, k):
        # The kernel emits in atomic order and keeps any of the columns tied
        # at the k-th value: both are chosen at random, per rank and call.
        gen = torch.Generator().manual_seed(1000 * rank + next(calls))
        cols = torch.arange(logits.shape[1])
        valid = (cols >= starts[:rows, None]) & (cols < ends[:rows, None])
        keyed = logits[:rows].double().masked_fill(~valid, float("-inf"))
        take = min(k, keyed.shape[1])
        kth = keyed.topk(take, dim=1).values[:, -1:]
        rank_key = torch.rand(keyed.shape, generator=gen, dtype=torch.float64)
        rank_key = torch.where(keyed > kth, 2.0, rank_key)  # kept for sure
        rank_key = rank_key.masked_fill((keyed < kth) | ~valid, -1.0)
        picked = rank_key.topk(take, dim=1).indices
        order = torch.rand(picked.shape, generator=gen).argsort(dim=1)
        picked = picked.gather(1, order)
        # Valid indices first, relative to the row's start; then -1.
        count = valid.sum(dim=1, keepdim=True).clamp(max=take)
        picked = picked.gather(
            1, valid.gather(1, picked).logical_not().int().argsort(dim=1, stable=True)
        )
        relative = torch.where(
            torch.arange(take) < count, picked - starts[:rows, None], -1
        )
        out[:rows].fill_(-1)
        out[:rows, :take] = relative.int()

    if not hasattr(torch.ops._C, "top_k_per_row_prefill"):
        library = torch.library.Library("_C", "FRAGMENT")
        library.define(
            "top_k_per_row_prefill(Tensor logits, Tensor rowStarts, Tensor rowEnds, "
            "Tensor! indices, int numRows, int stride0, int stride1, int topK) -> ()"
        )
        library.impl("top_k_per_row_prefill", top_k_per_row_prefill, "CPU")
        _LIBRARIES.append(library)


def _model_config(checkpoint: str):
    from vllm.config import ModelConfig

    return ModelConfig(
        model=checkpoint, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
    )


def _vllm_config(world_size: int, device: torch.device, checkpoint: str):
    from vllm.config import DeviceConfig, ParallelConfig, SchedulerConfig, VllmConfig

    config = VllmConfig(
        model_config=_model_config(checkpoint),
        device_config=DeviceConfig(device=device.type),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=512,
            max_num_seqs=8,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=world_size),
    )
    return config


def _batch(device: torch.device):
    """The step's inputs, the same on every rank: a paged FP8 K cache holding
    each request's cached tokens, the new tokens' keys, queries and weights,
    and vLLM's CommonAttentionMetadata for it."""
    from vllm.v1.attention.backends.utils import CommonAttentionMetadata
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (
        FP8_DTYPE,
        indexer_k_quant_and_cache_triton,
    )

    gen = torch.Generator().manual_seed(0)
    pages = [-(-(c + q) // PAGE) for c, q in REQUESTS]
    kv_cache = torch.zeros(sum(pages), PAGE, HEAD_DIM + 4, dtype=torch.uint8)
    kv_cache = kv_cache.to(device)
    block_table = torch.zeros(len(REQUESTS), MAX_MODEL_LEN // PAGE, dtype=torch.int32)
    for req, first in enumerate(torch.tensor([0, *pages]).cumsum(0)[:-1].tolist()):
        block_table[req, : pages[req]] = torch.arange(first, first + pages[req])

    def slots(req: int, positions: torch.Tensor) -> torch.Tensor:
        return block_table[req, positions // PAGE].long() * PAGE + positions % PAGE

    new_slots = []
    for req, (cached, new) in enumerate(REQUESTS):
        if cached:
            keys = torch.randn(cached, HEAD_DIM, generator=gen).bfloat16()
            indexer_k_quant_and_cache_triton(
                keys.to(device),
                kv_cache,
                slots(req, torch.arange(cached)).to(device),
                128,
                "ue8m0",
            )
        new_slots.append(slots(req, torch.arange(cached, cached + new)))
    tokens = sum(new for _, new in REQUESTS)
    rows = tokens + PADDING_ROWS
    query_lens = torch.tensor([new for _, new in REQUESTS], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in REQUESTS], dtype=torch.int32)
    query_start = torch.nn.functional.pad(query_lens.cumsum(0), (1, 0)).int()
    common = CommonAttentionMetadata(
        query_start_loc=query_start.to(device),
        query_start_loc_cpu=query_start,
        seq_lens=seq_lens.to(device),
        num_reqs=len(REQUESTS),
        num_actual_tokens=tokens,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table.to(device),
        slot_mapping=torch.cat(new_slots).to(device),
        seq_lens_cpu_upper_bound=seq_lens,
    )
    inputs = SimpleNamespace(
        kv_cache=kv_cache,
        q_fp8=torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(FP8_DTYPE),
        k=torch.randn(rows, HEAD_DIM, generator=gen).bfloat16(),
        weights=torch.randn(rows, HEADS, generator=gen),
    )
    for name, value in vars(inputs).items():
        setattr(inputs, name, value.to(device))
    return common, inputs, tokens


def _run_step(config, device, common, inputs, cp: bool):
    """Build the step's metadata with the flag ``cp`` and run the real op;
    the top-k buffer, the logits of each row this rank scored (in the order
    scored), and the step's split."""
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import create_forward_context, override_forward_context
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerMetadataBuilder,
        get_max_prefill_buffer_size,
    )
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    os.environ["VLLM_ROCM_USE_AITER_CP_INDEXER"] = "1" if cp else "0"
    rocm_aiter_ops.refresh_env_variables()
    spec = MLAAttentionSpec(
        block_size=PAGE, num_kv_heads=1, head_size=HEAD_DIM + 4, dtype=torch.uint8
    )
    with set_current_vllm_config(config):
        builder = DeepseekV32IndexerMetadataBuilder(
            spec, [LAYER], config, device, block_table_width=MAX_MODEL_LEN // PAGE
        )
    metadata = builder.build(0, common)
    assert len(metadata.prefill.chunks) >= 3, "the batch should make several chunks"

    # Each scored row's logits over its own keys, in the order scored.
    row_scores: list[torch.Tensor] = []
    logits_kernel = op.rocm_fp8_mqa_logits

    def recording_logits(q, kv, weights, ks, ke):
        logits = logits_kernel(q, kv, weights, ks, ke)
        for row, (start, end) in enumerate(zip(ks.tolist(), ke.tolist(), strict=True)):
            row_scores.append(logits[row, start:end].cpu())
        return logits

    rows = inputs.q_fp8.shape[0]
    buffer = torch.full((rows, TOPK), 7777, dtype=torch.int32, device=device)
    context = create_forward_context({LAYER: metadata}, config)
    with override_forward_context(context), pytest.MonkeyPatch.context() as mp:
        mp.setattr(op, "rocm_fp8_mqa_logits", recording_logits)
        op.rocm_aiter_sparse_attn_indexer(
            torch.zeros(rows, 8, device=device),
            LAYER,
            inputs.kv_cache.clone(),
            inputs.q_fp8,
            inputs.k,
            inputs.weights,
            128,
            "ue8m0",
            TOPK,
            HEAD_DIM,
            MAX_MODEL_LEN,
            get_max_prefill_buffer_size(config),
            buffer,
        )
    return buffer.cpu(), row_scores, metadata.prefill.cp_split


def _key_split_the_long_requests(monkeypatch, plan, zigzag: bool) -> None:
    """The planner key-splits every request whose rows reach 16 keys a
    rank, longest first, within 64 rows: the 3rd and 2nd here (its
    minimums and caps, sized for serving's k = 2,048, scaled to TOPK; in
    the zigzag layout, as if each one's longest row bound)."""
    if zigzag:
        monkeypatch.setattr(
            plan,
            "binding_requests",
            lambda keys, query_lens, tp_size, _, max_rows, __: tuple(
                sorted(plan.key_split_candidates(keys, query_lens, tp_size, max_rows))
            ),
        )
    monkeypatch.setattr(plan, "KEY_SPLIT_BY_MODEL", False)
    monkeypatch.setattr(plan, "KEY_SPLIT_MIN_STEP_KEY_ROWS", 0)
    monkeypatch.setattr(plan, "KEY_SPLIT_MIN_KEYS_PER_RANK", TOPK)
    monkeypatch.setattr(plan, "key_split_max_rows", lambda *_: 64)
    monkeypatch.setattr(plan, "key_split_max_owned", lambda *_: 64)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    device_kind: str,
    checkpoint: str,
    mode: str,
) -> None:
    import vllm.envs as envs
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.v1.attention.ops import rocm_cp_indexer_plan
    from vllm.v1.worker import workspace

    device = torch.device(device_kind, rank if device_kind != "cpu" else None)
    monkeypatch = pytest.MonkeyPatch()
    if device.type == "cpu":
        # Forked: OpenMP's pool does not survive a fork (a parallel op would
        # hang), and the ranks share the CPUs anyway.
        torch.set_num_threads(1)
        _stand_in_for_rocm(monkeypatch, rank)
    else:
        torch.accelerator.set_device_index(device)
    os.environ["VLLM_ROCM_USE_AITER"] = "1"
    os.environ["VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE"] = str(STRIPE)
    # This batch is far below the work that repays a split in production.
    monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
    key_split = mode in ("key-split", "zigzag-key-split")
    zigzag = mode.startswith("zigzag")
    if key_split:
        _key_split_the_long_requests(monkeypatch, rocm_cp_indexer_plan, zigzag)
    if zigzag:
        monkeypatch.setattr(rocm_cp_indexer_plan, "ROW_LAYOUT", "zigzag")
    # Chunk prefills at CHUNK_LOGITS fp32 logits (vLLM counts MiB).
    monkeypatch.setattr(
        envs,
        "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB",
        Fraction(4 * CHUNK_LOGITS, 1 << 20),
        raising=False,
    )
    backend = "gloo" if device.type == "cpu" else current_platform.dist_backend
    config = _vllm_config(world_size, device, checkpoint)
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size, rank, f"tcp://localhost:{port}", rank, backend=backend
        )
        ensure_model_parallel_initialized(world_size, 1)
    from vllm.distributed import get_tp_group

    if device.type == "cpu":
        get_tp_group().device_communicator.pynccl_comm = _GlooPyNccl(get_tp_group())
    # What VllmConfig sets for a sparse MLA model.
    config.attention_config.sparse_mla_prefill_workspace_factor = 5
    workspace.init_workspace_manager(device)
    common, inputs, tokens = _batch(device)

    replicated, scores, _ = _run_step(config, device, common, inputs, cp=False)
    split, own_rows, plan = _run_step(config, device, common, inputs, cp=True)
    counts = [0] * world_size
    torch.distributed.all_gather_object(counts, len(own_rows))
    # Counted by the gloo stand-in only.
    pynccl = get_tp_group().device_communicator.pynccl_comm
    exchanges = getattr(pynccl, "exchanges", None)
    destroy_model_parallel()
    destroy_distributed_environment()
    monkeypatch.undo()

    # With the flag off, chunks score the prefill rows in order, each once.
    assert len(scores) == tokens, "with the flag off every rank scores every row"
    # Each row once, by one rank; a key-split row by every rank, over its part.
    shared = plan.key_split_rows
    assert [(start, end) for start, end in plan.key_split] == (
        [(40, 60), (63, 93)] if key_split else []
    )
    # Zigzag: each rank's rows of every request, in the ranks' order.
    assert (plan.order is not None) == zigzag
    assert sum(counts) == tokens + (world_size - 1) * shared, counts
    assert max(counts) < tokens, f"rows scored per rank: {counts}"
    if exchanges is not None:
        assert exchanges == int(key_split), "one exchange a key-split prefill"
    for row in range(tokens):
        want = replicated[row][replicated[row] >= 0].long()
        got = split[row][split[row] >= 0].long()
        top = min(TOPK, scores[row].numel())
        # The flag-off result is a top-k of the row's scores...
        rest = torch.ones(scores[row].numel(), dtype=torch.bool)
        rest[want] = False
        assert want.numel() == want.unique().numel() == top, f"row {row}"
        assert not rest.any() or scores[row][want].min() >= scores[row][rest].max()
        # ...and the split one holds the same scores, each index once (a row
        # merged from two ranks' copies holds duplicates or loses keys). By
        # score, since the kernels may keep any of the tied k-th columns.
        assert got.numel() == got.unique().numel() == top, f"rank {rank} row {row}"
        assert torch.equal(
            scores[row][got].sort().values, scores[row][want].sort().values
        ), f"rank {rank} row {row}: {got.tolist()} vs {want.tolist()}"
    assert torch.equal(split[tokens:], replicated[tokens:]), "padding rows"


def _run(world_size: int, device_kind: str, folder, mode: str) -> None:
    from vllm.utils.network_utils import get_open_port
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse

    if mode.endswith("key-split") and rocm_aiter_mla_sparse._ON_GFX942:
        pytest.skip(
            "gfx942's prefill logits kernel fills its whole chunk: the planner "
            "key-splits no row there"
        )

    (folder / "config.json").write_text(json.dumps(TINY_DSV32))
    if device_kind == "cpu":
        # Forked: the ranks share the vLLM this process has imported (and
        # the model class it inspected) instead of doing it again each. GPU
        # ranks must not inherit a CUDA context, so they are spawned.
        import vllm.v1.attention.backends.mla.indexer  # noqa: F401
        import vllm.v1.attention.ops.rocm_aiter_mla_sparse  # noqa: F401

        _model_config(str(folder))
    for attempt in range(3):
        try:
            torch.multiprocessing.start_processes(
                _worker,
                args=(world_size, get_open_port(), device_kind, str(folder), mode),
                nprocs=world_size,
                start_method="fork" if device_kind == "cpu" else "spawn",
            )
            return
        except torch.multiprocessing.ProcessRaisedException as error:
            # Another process may bind the port between get_open_port and
            # rank 0's store: try another one.
            if "EADDRINUSE" not in str(error) or attempt == 2:
                raise


# Whole rows cut by cost, the long requests key-split, the zigzag layout
# without and with them.
MODES = ["whole-rows", "key-split", "zigzag", "zigzag-key-split"]


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize("mode", MODES)
def test_split_prefill_equals_the_replicated_one_on_cpu(tmp_path, mode):
    """Two gloo ranks (the 93 prefill rows do not divide evenly)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs vLLM's Triton kernels on a CPU: needs TRITON_INTERPRET=1")
    _run(2, "cpu", tmp_path, mode)


@pytest.mark.skipif(
    not current_platform.is_rocm() or torch.accelerator.device_count() < 2,
    reason="ROCm-only, needs 2 GPUs",
)
@pytest.mark.parametrize("mode", MODES)
def test_split_prefill_equals_the_replicated_one_on_gpus(tmp_path, mode):
    """The same over the TP device group of two GPUs (RCCL), with AITER."""
    _run(2, "cuda", tmp_path, mode)
