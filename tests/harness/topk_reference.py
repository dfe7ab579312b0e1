# SPDX-License-Identifier: Apache-2.0
"""Reference per-row top-k with the exact contracts of the kernels it stands for.

Contracts (from vLLM's csrc/sampler.cu and AITER's aiter.ops.topk):

- Logits are fp32 ``[rows, width]``; indices are int32 ``[rows, >= k]``.
- A row's valid columns are ``[start, end)``. It yields ``min(end - start, k)``
  indices, an unordered set, then ``-1`` up to ``k``. A row no longer than
  ``k`` yields all its columns, whatever their values.
- ``torch.ops._C.top_k_per_row_prefill`` writes indices relative to the row's
  start (sequence-local); AITER's ``top_k_per_row_prefill`` writes them
  relative to the chunk (``start`` not subtracted).
- Decode rows start at 0. With 1-D ``seq_lens`` ``[B]`` row ``r`` ends at
  ``seq_lens[r // next_n] - next_n + r % next_n + 1``; with 2-D ``[B, next_n]``
  it ends at ``seq_lens.flatten()[r]``. Negative ends count as 0.
"""

from __future__ import annotations

import torch


def select_topk(
    logits: torch.Tensor,
    row_starts: torch.Tensor,
    row_ends: torch.Tensor,
    k: int,
    *,
    relative_to_start: bool,
) -> torch.Tensor:
    """int32 ``[rows, k]``: each row's top-k column set, then -1."""
    rows, width = logits.shape
    starts = row_starts.to(torch.int64).reshape(-1)[:rows]
    ends = torch.clamp(row_ends.to(torch.int64).reshape(-1)[:rows], min=0)
    ends = torch.minimum(ends, torch.full_like(ends, width))
    lengths = torch.clamp(ends - starts, min=0)
    device = logits.device
    cols = torch.arange(width, device=device)
    valid = (cols[None, :] >= starts[:, None]) & (cols[None, :] < ends[:, None])
    # float64 so that every valid column (even one at -inf) ranks above every
    # invalid one: rows no longer than k must return all their columns.
    keyed = logits.to(torch.float64).nan_to_num(nan=-1e300, neginf=-1e300)
    keyed = keyed.masked_fill(~valid, float("-inf"))
    take = min(k, width)
    picked = torch.topk(keyed, take, dim=1).indices
    if relative_to_start:
        picked = picked - starts[:, None]
    out = torch.full((rows, k), -1, dtype=torch.int64, device=device)
    out[:, :take] = picked
    keep = (
        torch.arange(k, device=device)[None, :] < torch.clamp(lengths, max=k)[:, None]
    )
    return torch.where(keep, out, torch.full_like(out, -1)).to(torch.int32)


def decode_row_ends(seq_lens: torch.Tensor, next_n: int, rows: int) -> torch.Tensor:
    r = torch.arange(rows, device=seq_lens.device)
    if seq_lens.dim() == 2:
        ends = seq_lens.reshape(-1).to(torch.int64)[:rows]
    else:
        per_seq = seq_lens.to(torch.int64)[r // next_n]
        ends = per_seq - next_n + r % next_n + 1
    return torch.clamp(ends, min=0)


def _write(indices: torch.Tensor, result: torch.Tensor, num_rows: int) -> None:
    indices[:num_rows, : result.shape[1]] = result[:num_rows].to(indices.dtype)


def _check(logits: torch.Tensor, indices: torch.Tensor, k: int) -> None:
    if logits.dtype != torch.float32:
        raise TypeError(f"logits must be float32, got {logits.dtype}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be int32, got {indices.dtype}")
    if indices.shape[-1] < k:
        raise ValueError(f"indices hold {indices.shape[-1]} columns, k={k}")


def vllm_top_k_per_row_prefill(
    logits, row_starts, row_ends, indices, num_rows, stride0, stride1, k
):
    _check(logits, indices, k)
    result = select_topk(
        logits[:num_rows], row_starts, row_ends, k, relative_to_start=True
    )
    _write(indices, result, num_rows)


def vllm_top_k_per_row_decode(
    logits, next_n, seq_lens, indices, num_rows, stride0, stride1, k
):
    _check(logits, indices, k)
    ends = decode_row_ends(seq_lens, next_n, num_rows)
    result = select_topk(
        logits[:num_rows], torch.zeros_like(ends), ends, k, relative_to_start=True
    )
    _write(indices, result, num_rows)


def aiter_top_k_per_row_prefill(
    logits,
    rowStarts,
    rowEnds,
    indices,
    values,
    numRows,
    stride0,
    stride1,
    k=2048,
    workspace=None,
    stable=False,
):
    _check(logits, indices, k)
    for name, t in (("rowStarts", rowStarts), ("rowEnds", rowEnds)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    result = select_topk(
        logits[:numRows], rowStarts, rowEnds, k, relative_to_start=False
    )
    _write(indices, result, numRows)
    if values is not None:
        gathered = logits[:numRows].gather(1, result.clamp(min=0).to(torch.int64))
        values[:numRows, :k] = torch.where(
            result >= 0, gathered, torch.full_like(gathered, float("-inf"))
        )


def aiter_top_k_per_row_decode(
    logits,
    next_n,
    seqLens,
    indices,
    numRows,
    stride0,
    stride1,
    k=2048,
    workspace=None,
    stable=False,
    values=None,
):
    _check(logits, indices, k)
    if seqLens.dtype != torch.int32:
        raise TypeError(f"seqLens must be int32, got {seqLens.dtype}")
    vllm_top_k_per_row_decode(
        logits, next_n, seqLens, indices, numRows, stride0, stride1, k
    )


_LIBRARY: torch.library.Library | None = None


def register_vllm_c_ops() -> None:
    """Register the references as ``torch.ops._C.top_k_per_row_{prefill,decode}``
    (the names vLLM's compiled ``_C`` library gives them), once per process."""
    global _LIBRARY
    if _LIBRARY is not None or hasattr(torch.ops._C, "top_k_per_row_prefill"):
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define(
        "top_k_per_row_prefill(Tensor logits, Tensor rowStarts, Tensor rowEnds, "
        "Tensor(a!) indices, int numRows, int stride0, int stride1, int topK) -> ()"
    )
    lib.define(
        "top_k_per_row_decode(Tensor logits, int next_n, Tensor seqLens, "
        "Tensor(a!) indices, int numRows, int stride0, int stride1, int topK) -> ()"
    )
    for device in ("CPU", "CUDA"):
        lib.impl("top_k_per_row_prefill", vllm_top_k_per_row_prefill, device)
        lib.impl("top_k_per_row_decode", vllm_top_k_per_row_decode, device)
    _LIBRARY = lib


def assert_same_selection(
    logits: torch.Tensor,
    actual: torch.Tensor,
    expected: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    offsets: torch.Tensor | None = None,
) -> None:
    """Rows select the same columns; where scores tie, the same values.

    ``offsets`` maps a row's indices to logits columns (the row start for
    sequence-local indices)."""
    for row in range(actual.shape[0]):
        n = min(int(lengths[row]), k)
        got, want = actual[row, :k].tolist(), expected[row, :k].tolist()
        assert got[n:] == [-1] * (k - n), f"row {row}: tail is not -1"
        assert min(got[:n], default=0) >= 0, f"row {row}: -1 inside the result"
        assert len(set(got[:n])) == n, f"row {row}: duplicate indices"
        if set(got[:n]) == set(want[:n]):
            continue
        shift = int(offsets[row]) if offsets is not None else 0
        values = logits[row].to(torch.float64)
        got_v = sorted(values[[i + shift for i in got[:n]]].tolist())
        want_v = sorted(values[[i + shift for i in want[:n]]].tolist())
        assert got_v == want_v, f"row {row}: different selection"


def assert_prefill_paths_agree(
    lengths: list[int], k: int, device: str, seed: int
) -> None:
    """vLLM's AITER prefill wrapper (AITER's top-k, then vLLM's Triton
    localisation) and the in-tree op select the same columns for packed rows
    of ``lengths`` keys, and each row holds min(L, k) sequence-local indices
    then -1. Uses whichever AITER and ``_C`` the process has (stand-ins or
    real)."""
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (
        _launch_aiter_top_k_per_row_prefill,
    )

    gen = torch.Generator().manual_seed(seed)
    sizes = torch.tensor(lengths, dtype=torch.int32)
    starts = (torch.cumsum(sizes, 0) - sizes).to(torch.int32).to(device)
    ends = starts + sizes.to(device)
    logits = torch.randn(len(lengths), int(ends.max()), generator=gen).to(device)
    via_aiter = torch.empty((len(lengths), k), dtype=torch.int32, device=device)
    in_tree = torch.empty_like(via_aiter)
    _launch_aiter_top_k_per_row_prefill(logits, starts, ends, via_aiter, k)
    torch.ops._C.top_k_per_row_prefill(
        logits,
        starts,
        ends,
        in_tree,
        len(lengths),
        logits.stride(0),
        logits.stride(1),
        k,
    )
    assert_same_selection(
        logits.cpu(), via_aiter.cpu(), in_tree.cpu(), sizes, k, offsets=starts.cpu()
    )
    for row, size in enumerate(lengths):
        n = min(size, k)
        got = via_aiter[row].cpu()
        assert got[n:].eq(-1).all() and got[:n].min() >= 0 and got[:n].max() < size
