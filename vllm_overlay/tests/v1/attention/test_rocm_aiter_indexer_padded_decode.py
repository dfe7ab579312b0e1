# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""rocm_aiter_sparse_attn_indexer with padded MTP decodes: the prefill rows
that follow the decode rows in topk_indices_buffer keep their own top-k, and
each packed decode row is scored with its own token's head weights.

A zero-length request among next_n 2 decodes makes the builder pack the
decode rows to batch_size * next_n, more than the decode tokens; the packed
top-k must not be written over the prefill rows, which the op scores first,
and the weights must be packed as the queries are (AITER's paged logits read
the weights of packed row (b, j) at row b * next_n + j). A zero-length
request first leaves the decode group without a token: the op must not call
the paged logits with no rows.

vLLM's own metadata builder makes each step, and the logits kernels are
replaced by scores over each row's causal keys (-inf elsewhere). In the
first test every row has fewer keys than top-k and the scores are 0, so a
row's top-k is all of its causal keys, whatever the kernels' order or tie
choice. In the second every row has more keys than top-k and a key's score
depends on the row's weights, so a row scored with another token's weights
selects other keys. On a ROCm GPU the top-k kernels are the real ones;
without a GPU the ROCm checks and the top-k kernels are stood in (and the
Triton kernels need TRITON_INTERPRET=1).
"""

import json
import os

import pytest
import torch

from vllm.platforms import current_platform

TOPK = 2048
HEADS, HEAD_DIM, PAGE = 4, 128, 64
MAX_MODEL_LEN = 1024
LAYER = "model.layers.0.self_attn.indexer.k_cache"
# A DeepSeek-V3.2 checkpoint's config.json cut to one small layer, with its
# MTP layer (the indexer and attention shape of the published one).
TINY_DSV32 = {
    "model_type": "deepseek_v32",
    "architectures": ["DeepseekV32ForCausalLM"],
    "torch_dtype": "bfloat16",
    "hidden_size": 256,
    "num_hidden_layers": 1,
    "num_nextn_predict_layers": 1,
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
    "index_topk": TOPK,
    "max_position_embeddings": 163840,
}
# (cached tokens, new tokens) per request, decodes first: next_n 2 decodes
# with a zero-length one among them, then prefills.
STEPS = [
    [(248, 2), (40, 0), (120, 2), (0, 101)],
    [(50, 2), (120, 2), (40, 0), (0, 60), (10, 30)],
]

# Steps whose rows all have more keys than WEIGHTED_TOPK, so the weights decide
# what a row selects: a gap in the middle with a prefill after it, decodes
# only with a gap in the middle, and a gap first (the batch split then puts
# the zero-length request alone in the decode group).
WEIGHTED_TOPK = 16
WEIGHTED_STEPS = [
    [(248, 2), (40, 0), (120, 2), (90, 2), (40, 61)],
    [(250, 2), (100, 0), (130, 2), (77, 2)],
    [(140, 0), (200, 2), (96, 2), (30, 90)],
]

pytestmark = pytest.mark.skipif(
    not current_platform.is_rocm() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="ROCm, or a CPU running vLLM's Triton kernels with TRITON_INTERPRET=1",
)


def _stand_in_for_rocm_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm._aiter_ops as aiter_ops
    import vllm.v1.attention.backends.mla.indexer as indexer

    monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
    monkeypatch.setattr(aiter_ops, "is_aiter_found_and_supported", lambda: True)
    monkeypatch.setattr(
        aiter_ops.rocm_aiter_ops, "is_indexer_top_k_supported", lambda **_: False
    )
    monkeypatch.setattr(indexer, "num_compute_units", lambda device_index: 256)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)

    def finite_columns(logits, rows, starts, k, out):
        # The k best valid columns' indices from each row's start, in a
        # random order (the kernels' output order is unspecified), then -1.
        gen = torch.Generator().manual_seed(rows)
        out[:rows].fill_(-1)
        for row in range(rows):
            cols = torch.nonzero(torch.isfinite(logits[row])).flatten()
            if cols.numel() > k:
                cols = cols[logits[row, cols].topk(k).indices]
            cols = cols[torch.randperm(cols.numel(), generator=gen)]
            out[row, : cols.numel()] = (cols - int(starts[row])).int()

    def top_k_per_row_prefill(logits, starts, ends, out, rows, s0, s1, k):
        finite_columns(logits, rows, starts, k, out)

    def top_k_per_row_decode(logits, next_n, seq_lens, out, rows, s0, s1, k):
        finite_columns(logits, rows, torch.zeros(rows, dtype=torch.int64), k, out)

    for name, fn in [
        ("top_k_per_row_prefill", top_k_per_row_prefill),
        ("top_k_per_row_decode", top_k_per_row_decode),
    ]:
        monkeypatch.setattr(torch.ops._C, name, fn, raising=False)


def weighted_score(positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A key's score for a row: a function of the key's position in its
    sequence and of the row's head weights, so a row scored with another
    token's weights selects other keys."""
    return torch.cos(positions * weights[..., :1] + weights[..., 1:2])


def _key_scores(monkeypatch: pytest.MonkeyPatch, weighted: bool = False) -> None:
    """Logits over each row's causal keys, -inf elsewhere: 0, or with
    ``weighted`` the row's ``weighted_score``. As AITER's paged logits, the
    decode reads packed row (b, j)'s weights at row b * next_n + j and
    divides by the row count."""
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op

    def scores(cols, starts, ends, weights):
        valid = (cols >= starts[:, None]) & (cols < ends[:, None])
        out = torch.zeros(valid.shape, device=cols.device)
        if weighted:
            out = weighted_score(cols - starts[:, None], weights)
        return out.masked_fill(~valid, -torch.inf)

    def prefill_logits(q, kv, weights, ks, ke):
        cols = torch.arange(kv[0].shape[0], device=q.device)
        return scores(cols, ks, ke, weights)

    def decode_logits(q, kv, weights, context_lens, *args, max_model_len, **kwargs):
        batch, next_n = q.shape[:2]
        if batch * next_n == 0:
            raise ZeroDivisionError("AITER's paged logits split by the row count")
        if context_lens.dim() == 2:  # each token's own key count
            ends = context_lens.reshape(-1)
        else:
            token = torch.arange(next_n, device=q.device)
            ends = (context_lens[:, None] - next_n + 1 + token).reshape(-1)
        rows = ends.numel()
        assert weights.shape[0] >= rows, "the kernel reads a weight row per row"
        cols = torch.arange(max_model_len, device=q.device)
        return scores(cols, torch.zeros_like(ends), ends, weights[:rows])

    monkeypatch.setattr(op, "rocm_fp8_mqa_logits", prefill_logits)
    monkeypatch.setattr(op, "rocm_fp8_paged_mqa_logits", decode_logits)
    # The keys' values do not matter to these scores.
    monkeypatch.setattr(op, "cp_gather_indexer_k_quant_cache_triton", lambda *a, **k: 0)


def _vllm_config(folder, device):
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    (folder / "config.json").write_text(json.dumps(TINY_DSV32))
    model = ModelConfig(
        model=str(folder), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
    )
    parallel = ParallelConfig()
    return VllmConfig(
        model_config=model,
        speculative_config=SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=1,
            target_model_config=model,
            target_parallel_config=parallel,
        ),
        device_config=DeviceConfig(device=device.type),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=512,
            max_num_seqs=8,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        parallel_config=parallel,
    )


@pytest.fixture
def workspace_manager():
    """The workspace manager, which vLLM's model runner sets up, for this
    test only."""
    from vllm.v1.worker import workspace

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if workspace.is_workspace_manager_initialized():
        yield
        return
    workspace.init_workspace_manager(device)
    yield
    workspace.reset_workspace_manager()


def _run_step(requests, config, device, topk, weights):
    """Build the step with vLLM's metadata builder and run the op on it;
    return the top-k buffer and the step's metadata."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import create_forward_context, override_forward_context
    from vllm.utils.math_utils import cdiv
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerMetadataBuilder,
        get_max_prefill_buffer_size,
    )
    from vllm.v1.attention.backends.utils import CommonAttentionMetadata
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (
        FP8_DTYPE,
        rocm_aiter_sparse_attn_indexer,
    )
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    pages = [cdiv(c + q, PAGE) for c, q in requests]
    block_table = torch.zeros(len(requests), MAX_MODEL_LEN // PAGE, dtype=torch.int32)
    for req, first in enumerate(torch.tensor([0, *pages]).cumsum(0)[:-1].tolist()):
        block_table[req, : pages[req]] = torch.arange(first, first + pages[req])
    query_lens = torch.tensor([q for _, q in requests], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in requests], dtype=torch.int32)
    query_start = torch.nn.functional.pad(query_lens.cumsum(0), (1, 0)).int()
    tokens = int(query_lens.sum())
    common = CommonAttentionMetadata(
        query_start_loc=query_start.to(device),
        query_start_loc_cpu=query_start,
        seq_lens=seq_lens.to(device),
        num_reqs=len(requests),
        num_actual_tokens=tokens,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table.to(device),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=seq_lens,
    )
    spec = MLAAttentionSpec(
        block_size=PAGE, num_kv_heads=1, head_size=HEAD_DIM + 4, dtype=torch.uint8
    )
    with set_current_vllm_config(config):
        builder = DeepseekV32IndexerMetadataBuilder(
            spec, [LAYER], config, device, block_table_width=MAX_MODEL_LEN // PAGE
        )
        metadata = builder.build(0, common)

    buffer = torch.full((tokens, topk), 7777, dtype=torch.int32, device=device)
    context = create_forward_context({LAYER: metadata}, config)
    with override_forward_context(context):
        rocm_aiter_sparse_attn_indexer(
            torch.zeros(tokens, 8, device=device),
            LAYER,
            torch.zeros(
                sum(pages), PAGE, HEAD_DIM + 4, dtype=torch.uint8, device=device
            ),
            torch.zeros(tokens, HEADS, HEAD_DIM, device=device).to(FP8_DTYPE),
            None,
            weights,
            128,
            "ue8m0",
            topk,
            HEAD_DIM,
            MAX_MODEL_LEN,
            get_max_prefill_buffer_size(config),
            buffer,
            skip_k_cache_insert=True,
        )
    return buffer.cpu(), metadata


def _causal_keys(requests):
    """Each token's key count, in the step's token order."""
    return [cached + token + 1 for cached, new in requests for token in range(new)]


def _config_and_stand_ins(tmp_path, monkeypatch, weighted: bool):
    """The config and the device (the GPU where there is one; else the CPU,
    with the ROCm stand-ins), and the logits stand-ins."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Before the stand-ins: the model's inspection asks the real platform.
    config = _vllm_config(tmp_path, device)
    if device.type == "cpu":
        _stand_in_for_rocm_on_cpu(monkeypatch)
    _key_scores(monkeypatch, weighted)
    return config, device


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize("requests", STEPS)
def test_padded_decodes_leave_the_prefill_rows_alone(
    requests, tmp_path, monkeypatch, workspace_manager
):
    config, device = _config_and_stand_ins(tmp_path, monkeypatch, weighted=False)
    tokens = sum(q for _, q in requests)
    weights = torch.ones(tokens, HEADS, device=device)
    buffer, metadata = _run_step(requests, config, device, TOPK, weights)
    assert metadata.decode is not None and metadata.decode.requires_padding
    assert metadata.num_prefill_tokens > 0

    for row, keys in enumerate(_causal_keys(requests)):
        got = buffer[row]
        assert sorted(got[got >= 0].tolist()) == list(range(keys)), (
            f"row {row}: a row with {keys} keys holds {got[got >= 0].numel()}"
        )
        assert (got[keys:] == -1).all(), f"row {row}"


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize("requests", WEIGHTED_STEPS)
def test_each_decode_row_is_scored_with_its_own_weights(
    requests, tmp_path, monkeypatch, workspace_manager
):
    config, device = _config_and_stand_ins(tmp_path, monkeypatch, weighted=True)
    tokens = sum(q for _, q in requests)
    weights = torch.rand(tokens, HEADS, generator=torch.Generator().manual_seed(0))
    buffer, metadata = _run_step(
        requests, config, device, WEIGHTED_TOPK, weights.to(device)
    )
    # The layouts this test is for: padded decodes, or a decode group of one
    # zero-length request (the batch split's answer to a gap first).
    assert metadata.decode is not None
    assert metadata.decode.requires_padding or metadata.num_decode_tokens == 0

    for row, keys in enumerate(_causal_keys(requests)):
        assert keys > WEIGHTED_TOPK
        scores = weighted_score(torch.arange(keys), weights[row])
        kth = scores.topk(WEIGHTED_TOPK).values[-1]
        got = buffer[row].tolist()
        assert len(set(got)) == WEIGHTED_TOPK and min(got) >= 0, f"row {row}"
        # Near ties at the k-th place may go either way (GPU and CPU scores
        # differ in the last bits); anything else is another token's choice.
        assert scores[got].min() >= kth - 1e-5, (
            f"row {row} does not hold the top-k of its own token's scores"
        )
