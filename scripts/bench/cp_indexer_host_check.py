# SPDX-License-Identifier: Apache-2.0
"""The host bench's exactness check: every split step it runs gives every
rank the replicated op's top-k rows.

One GPU holds every simulated rank, so the key split's exchange and the
merge are emulated by copies between the ranks' buffers, in PyNccl's
layout (vllm-project/vllm v0.34.0, vllm/distributed/device_communicators/
pynccl.py: ``all_to_all_single`` L489-541 sends the next
``input_split_sizes[peer]`` rows to each peer and takes the next
``output_split_sizes[peer]`` from it; ``all_gatherv`` L329-362 puts each
rank's rows in its slice of the output, in rank order). The op runs three
times a rank: once to record the candidates each rank sends, once with
every rank's candidates delivered to record the rows each rank merges, and
once with both delivered, which leaves the rank's whole buffer. The
select then runs on real candidates, and the merge's int16 form is
packed and unpacked as it is served.

Each rank's prefill rows are then compared with the replicated op's, on
the replicated op's own logits (by score, where scores tie): valid
row-local indices first, each once, then -1, and the same scores."""

from __future__ import annotations

import dataclasses

import torch


class RowsDiffer(AssertionError):
    """A split step's rows differ from the replicated op's."""


def merged_buffers(
    run, this_rank: list[int], pynccl, tp: int, shape, device: str
) -> list:
    """Each simulated rank's top-k buffer after the op, its exchange and its
    merge: ``run(buffer)`` runs the op as rank ``this_rank[0]`` on the
    stand-in communicator ``pynccl``, whose collectives this replaces."""
    sent: dict[int, torch.Tensor] = {}
    merged: dict[int, torch.Tensor] = {}

    def record_sent(received, candidates, received_sizes, sent_sizes):
        sent[this_rank[0]] = candidates.clone()

    def deliver(received, candidates, received_sizes, sent_sizes):
        rank = this_rank[0]
        parts = [sent[peer].split(list(sent_sizes))[rank] for peer in range(tp)]
        received.copy_(torch.cat(parts))

    def record_merged(rows, own, sizes):
        merged[this_rank[0]] = own.clone()

    def gather(rows, own, sizes):
        for peer, part in enumerate(rows.split(list(sizes))):
            if peer != this_rank[0]:
                part.copy_(merged[peer])

    buffers: list[torch.Tensor] = []
    for exchange, merge in (
        (record_sent, lambda *_: None),
        (deliver, record_merged),
        (deliver, gather),
    ):
        pynccl.all_to_all_single, pynccl.all_gatherv = exchange, merge
        buffers = []
        for rank in range(tp):
            this_rank[0] = rank
            # Rows nobody writes hold a value no index takes.
            buffers.append(torch.full(shape, -7, dtype=torch.int32, device=device))
            run(buffers[-1])
    return buffers


def _scores(logits, ks, indices, valid) -> torch.Tensor:
    """Each row's scores at its row-local ``indices`` (-inf where not
    ``valid``), highest first."""
    columns = (ks[:, None].to(torch.int64) + indices.to(torch.int64)).clamp(
        0, logits.shape[1] - 1
    )
    scores = logits.gather(1, columns)
    return torch.where(valid, scores, float("-inf")).sort(dim=1, descending=True).values


def compare_window(window, logits, topk, buffers: list, k: int) -> int:
    """Rows ``window.start:end`` of every rank's buffer against the
    replicated op's ``topk`` of the same rows on its ``logits``; the rows
    compared, or RowsDiffer naming the first rank and row that differ."""
    rows = window.end - window.start
    lengths = (window.ke - window.ks).clamp(0, k).to(torch.int64)
    valid = torch.arange(k, device=topk.device)[None, :] < lengths[:, None]
    expected = _scores(logits, window.ks, topk[:, :k], valid)
    for rank, buffer in enumerate(buffers):
        got = buffer[window.start : window.end, :k]
        in_row = (got >= 0) & (got < (window.ke - window.ks)[:, None])
        shape_ok = torch.where(valid, in_row, got == -1).all(dim=1)
        ordered = torch.where(valid, got, torch.iinfo(torch.int32).max).sort(1).values
        repeats = ((ordered[:, 1:] == ordered[:, :-1]) & valid[:, 1:]).any(dim=1)
        same = (_scores(logits, window.ks, got, valid) == expected).all(dim=1)
        wrong = ~shape_ok | repeats | ~same
        if bool(wrong.any()):
            row = int(torch.nonzero(wrong)[0])
            why = "not min(L, k) distinct row-local indices then -1"
            if bool(shape_ok[row]) and not bool(repeats[row]):
                scores = _scores(logits, window.ks, got, valid)[row]
                at = int(torch.nonzero(scores != expected[row])[0])
                why = (
                    f"a different selection: its {at + 1}-th score "
                    f"{float(scores[at])!r} against {float(expected[row, at])!r}, "
                    f"the k-th {float(expected[row, int(lengths[row]) - 1])!r}"
                )
            raise RowsDiffer(f"rank {rank}, batch row {window.start + row}: {why}")
    return rows


def check_split(batch, buffers: list, run_replicated, k: int, monkeypatch) -> int:
    """Every rank's prefill rows in ``buffers`` against the replicated op
    on ``batch`` (``run_replicated(batch)``), compared window by window as
    the replicated op scores them; the rows compared."""
    from vllm.v1.attention.ops.rocm_cp_indexer import CPIndexerPrefill

    prefill = batch.metadata.prefill
    replicated = dataclasses.replace(
        batch,
        metadata=dataclasses.replace(
            batch.metadata, prefill=dataclasses.replace(prefill, cp_split=None)
        ),
    )
    compared = [0]
    keep = CPIndexerPrefill.keep_candidates

    def keep_and_compare(self, window, logits, topk):
        keep(self, window, logits, topk)
        compared[0] += compare_window(window, logits, topk, buffers, k)

    monkeypatch.setattr(CPIndexerPrefill, "keep_candidates", keep_and_compare)
    run_replicated(replicated)
    return compared[0]
