# SPDX-License-Identifier: Apache-2.0
"""Per-row top-k stand-ins with the contracts of the kernels they stand for.

Contract points, with their sources (AITER at ROCm/aiter commit e4048607;
docs/aiter_contracts.md gives each point's lines):

- Logits are fp32 ``[rows, width]``; indices are int32 ``[rows, >= k]``.
- A row's valid columns are ``[start, end)``. It yields ``min(end - start,
  k)`` indices, then ``-1`` up to ``k``; a row no longer than ``k`` yields
  all its columns, whatever their values. (AITER
  csrc/kernels/topk_per_row_kernels.cu ~L2227, ~L2345.)
- **Order is unspecified**: output positions come from ``atomicAdd``
  (AITER .cu ~L1337; ``sorted`` is ignored, ~L2406 and ~L2548; vLLM's
  csrc/sampler.cu ~L281 is atomic too), and at a tie on the k-th value
  *which* tied column is kept is unspecified. The stand-ins permute each
  row's output and pick among tied columns at random, differently per rank
  and per call (``scripts.harness.adversary``).
- AITER prefill indices are chunk-global columns (``rowIt + rowStart``, .cu
  ~L2227); ``torch.ops._C.top_k_per_row_prefill`` writes them relative to the
  row's start (sequence-local). Assumption: not read in vLLM's
  csrc/sampler.cu here; vLLM's own op and its AITER adapter
  (``_localize_aiter_prefill_topk``, which subtracts the row start) rely on
  it.
- Decode rows start at 0. With 1-D ``seq_lens`` ``[B]`` row ``r`` ends at
  ``seq_lens[r // next_n] - next_n + r % next_n + 1`` (AITER .cu ~L2198);
  with 2-D ``[B, next_n]`` vLLM's kernel ends it at ``seq_lens.flatten()[r]``
  (assumption from vLLM's own tests; AITER reads a raw pointer, so a 2-D
  tensor is the 1-D rule over its flattened values). Negative ends count as 0.
- ``rowEnd`` is not clamped to the logits width (.cu L2186-2202):
  columns at or past the width read memory the stand-in fills with poison.
- AITER's kernel uses ``stride0`` as the row pitch and ignores ``stride1``
  (.cu ~L2826), and writes row ``r`` at ``indices + r * k`` whatever the
  output tensor's strides (.cu ~L380, ~L2217). Assumption: vLLM's ``_C`` op
  honours the output tensor's strides.
"""

from __future__ import annotations

import torch

from scripts.harness import adversary


def select_topk(
    logits: torch.Tensor,
    row_starts: torch.Tensor,
    row_ends: torch.Tensor,
    k: int,
    *,
    relative_to_start: bool,
    gen: torch.Generator | None = None,
) -> torch.Tensor:
    """int32 ``[rows, k]``: each row's top-k column set, then -1. With
    ``gen`` the set's order and the choice among tied k-th values are random;
    without it, sorted by score.

    fp32 throughout, in place where it can be (the rows of a long context
    are hundreds of MB): a valid column at NaN or -inf is keyed as fp32's
    lowest finite value, so that it ranks above every invalid column (-inf)
    and rows no longer than k return all their columns."""
    rows, width = logits.shape
    device = logits.device
    starts = row_starts.to(device, torch.int64).reshape(-1)[:rows]
    ends = torch.clamp(row_ends.to(device, torch.int64).reshape(-1)[:rows], min=0)
    lengths = torch.clamp(ends - starts, min=0)
    # Unclamped ends: columns past the width are read, and they are poison.
    span = max(width, int(ends.max()) if rows else 0)
    keyed = torch.full(
        (rows, span), adversary.POISON, dtype=torch.float32, device=device
    )
    keyed[:, :width] = logits.detach()
    lowest = torch.finfo(torch.float32).min
    keyed.nan_to_num_(nan=lowest, neginf=lowest)
    cols = torch.arange(span, device=device)
    outside = cols[None, :] < starts[:, None]
    outside |= cols[None, :] >= ends[:, None]
    keyed.masked_fill_(outside, float("-inf"))
    del outside
    take = min(k, span)
    # One more than k: a row whose (k+1)-th value equals its k-th has more
    # columns at the k-th value than places for them.
    top = torch.topk(keyed, min(take + 1, span), dim=1)
    picked = top.indices[:, :take]
    if gen is not None and take:
        # Keep every column above the k-th value; among those equal to it, a
        # random subset (only the rows that have to choose).
        kth = top.values[:, take - 1 : take]
        choosing = torch.zeros(0, dtype=torch.int64, device=device)
        if top.values.shape[1] > take:
            choosing = torch.nonzero(top.values[:, take] == kth[:, 0]).flatten()
        if choosing.numel():
            sub, sub_kth = keyed[choosing], kth[choosing]
            tied = sub == sub_kth
            score = torch.where(sub > sub_kth, 2.0, -1.0)
            score[tied] = torch.rand(
                int(tied.sum()), generator=gen, dtype=torch.float32, device=device
            )
            picked = picked.clone()
            picked[choosing] = torch.topk(score, take, dim=1).indices
        # Atomic order: permute each row's valid prefix.
        order_key = torch.rand((rows, take), generator=gen, device=device)
        n = torch.clamp(lengths, max=take)[:, None]
        order_key[torch.arange(take, device=device)[None, :] >= n] = 2.0
        picked = picked.gather(1, torch.argsort(order_key, dim=1))
    if relative_to_start:
        picked = picked - starts[:, None]
    out = torch.full((rows, k), -1, dtype=torch.int64, device=device)
    out[:, :take] = picked
    keep = (
        torch.arange(k, device=device)[None, :] < torch.clamp(lengths, max=k)[:, None]
    )
    out = torch.where(keep, out, torch.full_like(out, -1))
    return out.to(torch.int32)


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


def _elements_from(t: torch.Tensor) -> int:
    """How many elements of ``t``'s storage lie from its first element on:
    what a kernel handed the raw pointer can reach."""
    return t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()


def _rows_by_pitch(logits: torch.Tensor, num_rows: int, stride0: int) -> torch.Tensor:
    """AITER's reading of the logits: row r at ``stride0 * r``, unit column
    stride, ``stride1`` ignored; memory past the storage reads as poison."""
    flat = logits.new_full((num_rows * stride0,), adversary.POISON)
    count = min(flat.numel(), _elements_from(logits))
    flat[:count] = logits.as_strided((count,), (1,))
    return flat.view(num_rows, stride0)


def _aiter_write(indices: torch.Tensor, result: torch.Tensor, num_rows: int) -> None:
    """AITER writes row r at ``indices + r * k``, whatever the strides."""
    k = result.shape[1]
    if num_rows * k > _elements_from(indices):
        raise RuntimeError(
            f"AITER top-k would write {num_rows} x {k} indices past the end of "
            "the output tensor's memory"
        )
    flat = indices.as_strided((num_rows * k,), (1,))
    flat.copy_(result[:num_rows].reshape(-1).to(indices.dtype))


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
        logits[:num_rows],
        row_starts,
        row_ends,
        k,
        relative_to_start=True,
        gen=adversary.generator(logits.device),
    )
    _write(indices, result, num_rows)


def vllm_top_k_per_row_decode(
    logits, next_n, seq_lens, indices, num_rows, stride0, stride1, k
):
    _check(logits, indices, k)
    ends = decode_row_ends(seq_lens, next_n, num_rows)
    result = select_topk(
        logits[:num_rows],
        torch.zeros_like(ends),
        ends,
        k,
        relative_to_start=True,
        gen=adversary.generator(logits.device),
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
    """AITER's ``top_k_per_row_prefill`` (aiter/ops/topk.py ~L378)."""
    _check(logits, indices, k)
    for name, t in (("rowStarts", rowStarts), ("rowEnds", rowEnds)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    pitched = _rows_by_pitch(logits, numRows, stride0)
    gen = None if stable else adversary.generator(logits.device)
    result = select_topk(
        pitched, rowStarts, rowEnds, k, relative_to_start=False, gen=gen
    )
    _aiter_write(indices, result, numRows)
    if values is not None:
        gathered = pitched.gather(1, result.clamp(min=0).to(torch.int64))
        values[:numRows, :k] = torch.where(
            result >= 0, gathered, torch.full_like(gathered, float("-inf"))
        )


def aiter_one_block_workspace_bytes(num_rows: int, stride0: int) -> int:
    """Bytes of the workspace AITER's one-block top-k asks for:
    ``topk_ob_workspace_size(numRows, stride0, k, is_decode)`` (ROCm/aiter
    e4048607, csrc/kernels/topk_per_row_kernels.cu L2733-2742, through
    ``query_ob_workspace`` L2697-2711, which passes ``stride0`` as the row
    length): ``standalone_stable_radix_topk_one_block_`` (L2532; L2552-2556)
    sizes ``calc_buf_len(len) * 2 * (sizeof(float) + sizeof(int32)) * rows``,
    and ``calc_aligned_size`` (L2350-2359) rounds that up to 256 bytes and
    adds 255; the one-block ``calc_buf_len`` (L984-995) is ``len / 32``
    rounded down to a multiple of 64. Neither k nor the phase enters."""
    buf_len = (stride0 // 32) // 64 * 64
    size = buf_len * 2 * (4 + 4) * num_rows
    return (size + 255) // 256 * 256 + 255


# The workspace sizes AITER's top-k stand-ins allocated, in call order (for
# tests of what the memory profiling run reserves); tests clear it.
WORKSPACE_LOG: list[int] = []


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
):
    """AITER's ``top_k_per_row_decode`` (aiter/ops/topk.py ~L449): no
    ``values``; row bounds from a raw ``seqLens`` pointer (.cu ~L2198).
    Like the wrapper (topk.py L449-486; the .cu's decode entry L2928-2973
    runs the one-block kernel only), it allocates that kernel's workspace
    for the call (topk.py L472-473, ``torch.empty`` in L364-375), while the
    caller's logits exist."""
    _check(logits, indices, k)
    size = aiter_one_block_workspace_bytes(numRows, stride0)
    scratch = torch.empty(max(1, size), dtype=torch.uint8, device=logits.device)
    WORKSPACE_LOG.append(scratch.numel())
    if seqLens.dtype != torch.int32:
        raise TypeError(f"seqLens must be int32, got {seqLens.dtype}")
    ends = decode_row_ends(seqLens.reshape(-1), next_n, numRows)
    gen = None if stable else adversary.generator(logits.device)
    result = select_topk(
        _rows_by_pitch(logits, numRows, stride0),
        torch.zeros_like(ends),
        ends,
        k,
        relative_to_start=True,
        gen=gen,
    )
    _aiter_write(indices, result, numRows)


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
