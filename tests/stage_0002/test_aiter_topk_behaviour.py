# SPDX-License-Identifier: Apache-2.0
"""Stage 0002's behaviour, stated without its own modules: through vLLM's
real indexer op on gfx950 with AITER, the uncompressed k=2048 indexer takes
AITER's top-k for decode always, and for a prefill chunk once its
``max_seqlen_k`` reaches 32,768 keys.

This is the stage's upstream probe (patches/series.toml): a rebase runs it
on a newer vLLM without the stage, and a pass there means upstream has the
behaviour, so the stage is dropped as upstreamed."""

from __future__ import annotations

import pytest

from harness import indexer_batch
from harness.rocm_platform import emulate_rocm
from harness.tree import applied_tree

TREE = applied_tree("0002")

from vllm._aiter_ops import rocm_aiter_ops  # noqa: E402

K = 2048


def _run(monkeypatch, requests, max_seqlen_k=None) -> list[str]:
    """Which AITER top-k entry points one indexer call used."""
    used: list[str] = []
    for name in ("indexer_top_k_prefill", "indexer_top_k_decode"):
        real = getattr(rocm_aiter_ops, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            used.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(rocm_aiter_ops, name, spy)
    with emulate_rocm("gfx950"):
        config = indexer_batch.make_vllm_config()
        builder = indexer_batch.make_builder(config, monkeypatch)
        batch = indexer_batch.build_batch(builder, requests)
        if max_seqlen_k is not None:
            for chunk in batch.metadata.prefill.chunks:
                chunk.max_seqlen_k = max_seqlen_k
        indexer_batch.run_indexer(batch, K)
    return used


def test_decode_takes_aiter(monkeypatch):
    assert _run(monkeypatch, [(40, 1), (7, 1)]) == ["indexer_top_k_decode"]


@pytest.mark.parametrize(
    "max_seqlen_k, aiter", [(32767, False), (32768, True), (131072, True)]
)
def test_prefill_takes_aiter_from_32k(monkeypatch, max_seqlen_k, aiter):
    used = _run(monkeypatch, [(0, 30), (5, 20)], max_seqlen_k)
    assert used == (["indexer_top_k_prefill"] if aiter else [])
