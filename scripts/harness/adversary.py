# SPDX-License-Identifier: Apache-2.0
"""Seeded choices for the stand-ins, where the real kernel's contract leaves one.

AITER's kernels (and vLLM's compiled ones) may choose an output order, which
of several tied values to keep, what lies in padding or outside a row's
range. A stand-in that always makes the kind choice (sorted order, the lowest
tied column, clean padding) hides bugs that corrupt results on real hardware,
so every stand-in takes its choices from here: reproducible for a given seed,
different on every rank and on every call.

``DSA_KIND_STANDINS=1`` turns the choices off (sorted order, lowest tied
column, zero padding), only to debug a failure; CI never sets it.
``DSA_STANDIN_SEED`` changes the seed (default 0).
"""

from __future__ import annotations

import itertools
import os

import torch

KIND_ENV = "DSA_KIND_STANDINS"
SEED_ENV = "DSA_STANDIN_SEED"
# A finite score far above any real logit: garbage that a top-k reading
# where it must not ranks first, so the mistake shows.
POISON = 1e30

_calls = itertools.count()


def restart() -> None:
    """Start this process's call count again: two processes that restart and
    then make the same calls on the same inputs get the same choices (a
    byte-identity test of two trees' call sequences)."""
    global _calls
    _calls = itertools.count()


def kind() -> bool:
    """Whether the adversarial choices are turned off (debugging only)."""
    value = os.environ.get(KIND_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{KIND_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def generator(device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator on ``device`` for one call's choices, or None when they
    are off. Its seed mixes the base seed, this process's rank and a
    per-process call count, so two ranks (or two calls) on the same input
    choose differently."""
    if kind():
        return None
    seed = int(os.environ.get(SEED_ENV, "0"))
    mixed = hash((seed, _rank(), next(_calls))) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator(device=device).manual_seed(mixed)


def garbage(
    shape: tuple[int, ...], gen: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """fp32 filler on ``device`` for memory a kernel leaves undefined:
    poison, huge negatives and NaN mixed (zeros when the choices are off)."""
    if gen is None:
        return torch.zeros(shape, device=device)
    pick = torch.randint(0, 3, shape, generator=gen, device=device)
    values = torch.tensor([POISON, -POISON, float("nan")], device=device)
    return values[pick]
