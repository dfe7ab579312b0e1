# SPDX-License-Identifier: Apache-2.0
"""vLLM's prefill chunk metadata kernel, in torch, for long test contexts.

``BuildPrefillChunkMetadataKernel`` (vllm/v1/attention/backends/mla/indexer.py)
runs one program per request that loops over the request's whole query for
every chunk it builds; through the Triton interpreter a 131,072-token prompt
takes ~14 s of metadata. This computes the same three outputs per request with
tensor ops. A base test checks it element for element against the kernel
(with query slices and DCP), so a change of the kernel upstream is caught;
a launch with an argument this copy does not know runs vLLM's kernel itself
(slower, never wrong).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def build_prefill_chunk_metadata(
    query_start_loc: torch.Tensor,
    uncompressed_seq_lens: torch.Tensor,
    cu_compressed_seq_lens: torch.Tensor,
    row_start_cu: torch.Tensor,
    token_to_seq: torch.Tensor,
    cu_seq_len_ks: torch.Tensor,
    cu_seq_len_ke: torch.Tensor,
    query_slice_start: int,
    query_slice_stop: int,
    dcp_rank: int,
    dcp_world: int,
    dcp_interleave: int,
    *,
    num_reqs: int,
    COMPRESS_RATIO: int,
    positions: torch.Tensor | None = None,
) -> None:
    """Same arguments as the kernel's launch; fills the three outputs.
    ``positions`` (vLLM 0.34.0 on): each query token's position, for tokens
    that are not their request's contiguous last ones."""
    starts = query_start_loc.tolist()
    cu = cu_compressed_seq_lens.tolist()
    row_starts = row_start_cu.tolist()
    seq_lens = uncompressed_seq_lens.tolist()
    device = cu_seq_len_ks.device
    for req in range(num_reqs):
        query_len = starts[req + 1] - starts[req]
        offset = torch.arange(query_len, device=device)
        rows = starts[req] + offset
        keep = (rows >= query_slice_start) & (rows < query_slice_stop)
        out = rows[keep] - query_slice_start
        if positions is None:
            context = (seq_lens[req] - query_len + 1 + offset[keep]) // COMPRESS_RATIO
        else:
            context = (positions[rows[keep]].to(torch.int64) + 1) // COMPRESS_RATIO
        if dcp_world > 1:
            # This rank's share of ``context`` keys, interleaved in runs.
            base = context // dcp_interleave // dcp_world * dcp_interleave
            rest = context - base * dcp_world - dcp_rank * dcp_interleave
            context = base + rest.clamp(0, dcp_interleave)
        cu_seq_len_ks[out] = row_starts[req]
        cu_seq_len_ke[out] = (row_starts[req] + context).to(cu_seq_len_ke.dtype)
        token_to_seq[cu[req] : cu[req + 1]] = req


@contextmanager
def torch_chunk_metadata() -> Iterator[None]:
    """vLLM's builder computes prefill chunk metadata with the function above."""
    from vllm.v1.attention.backends.mla import indexer

    name = "_BUILD_PREFILL_CHUNK_METADATA_KERNEL"
    kernel = getattr(indexer, name)
    known = inspect.signature(build_prefill_chunk_metadata).parameters

    def launch(*args, **kwargs) -> None:
        if len(args) <= len(known) and kwargs.keys() <= known.keys():
            build_prefill_chunk_metadata(*args, **kwargs)
        else:
            kernel(*args, **kwargs)

    setattr(indexer, name, launch)
    try:
        yield
    finally:
        setattr(indexer, name, kernel)
