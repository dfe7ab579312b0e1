# SPDX-License-Identifier: Apache-2.0
"""Serving steps for stage 0001's bench: the six named steps it was tuned
on, and a seeded family it was not.

A step is what vLLM's scheduler hands the indexer in one forward with
chunked prefill and prefix caching on: prefill requests as (cached tokens,
new tokens), and decodes, which take one token of the step's budget each.
The family draws, per step, a token budget (vLLM's
``max_num_batched_tokens``: 8K or 16K) and one of three kinds:

- a fresh prompt of 1K-64K tokens (log-uniform), at one of its chunks: the
  first chunk has nothing cached, a later one its earlier chunks;
- one to eight turns of 64-4,096 new tokens over 1K-300K cached
  (log-uniform), as many as fit the budget;
- a mix: a fresh prompt's chunk beside one to three turns, and 1-64 decodes.

The draw depends only on the seed, so a run states its family by
``(count, seed)``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

K = 1024

# The steps the planner's costs were fitted and checked on.
NAMED: dict[str, list[tuple[int, int]]] = {
    "fresh 16K": [(0, 16 * K)],
    "fresh 64K, last 16K-row step": [(48 * K, 16 * K)],
    "turn 4096 over 200K": [(200 * K, 4096)],
    "turn 512 over 100K + fresh 8K": [(100 * K, 512), (0, 8 * K)],
    "8 turns of 256 over 4K-200K": [
        (p * K, 256) for p in (4, 8, 16, 32, 64, 100, 150, 200)
    ],
    "turn 64 over 15K + fresh 1K": [(15 * K, 64), (0, K)],
}
# The two named steps whose long turns leave a rank one long row's time.
LONG_TURNS = ("turn 512 over 100K + fresh 8K", "8 turns of 256 over 4K-200K")

BUDGETS = (8 * K, 16 * K)
FRESH = (1 * K, 64 * K)
TURN_NEW = (64, 4096)
TURN_CACHED = (1 * K, 300 * K)
MAX_TURNS = 8
MAX_DECODES = 64


@dataclass(frozen=True)
class Step:
    """One step: its prefill requests (cached, new) and its decode count."""

    name: str
    prefills: list[tuple[int, int]]
    decodes: int = 0

    @property
    def tokens(self) -> int:
        return sum(q for _, q in self.prefills) + self.decodes


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def _fresh_chunk(rng: random.Random, budget: int) -> tuple[int, int, str]:
    """A fresh prompt's chunk: (cached, new) and its description."""
    prompt = _log_uniform(rng, *FRESH)
    chunks = -(-prompt // budget)
    chunk = rng.randrange(chunks)
    cached = chunk * budget
    new = min(budget, prompt - cached)
    return cached, new, f"fresh {prompt / K:.1f}K, chunk {chunk + 1}/{chunks}"


def _turns(rng: random.Random, room: int, most: int) -> list[tuple[int, int]]:
    """Up to ``most`` turns (at least one) that fit ``room`` tokens."""
    turns: list[tuple[int, int]] = []
    for _ in range(rng.randint(1, most)):
        new = min(_log_uniform(rng, *TURN_NEW), room)
        if new < TURN_NEW[0] and turns:
            break
        turns.append((_log_uniform(rng, *TURN_CACHED), new))
        room -= new
    return turns


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("s" if number != 1 else "")


def family(count: int, seed: int) -> list[Step]:
    """``count`` steps drawn from the module's distribution with ``seed``."""
    rng = random.Random(seed)
    steps = []
    for index in range(count):
        budget = rng.choice(BUDGETS)
        kind = rng.choice(("fresh", "turns", "mix"))
        label = f"f{index:02d} {kind}, {budget // K}K budget"
        if kind == "fresh":
            cached, new, what = _fresh_chunk(rng, budget)
            steps.append(Step(f"{label}: {what}", [(cached, new)]))
        elif kind == "turns":
            turns = _turns(rng, budget, MAX_TURNS)
            steps.append(Step(f"{label}: {_count(len(turns), 'turn')}", turns))
        else:
            decodes = rng.randint(1, MAX_DECODES)
            cached, new, what = _fresh_chunk(rng, budget // 2)
            room = budget - decodes - new
            turns = _turns(rng, room, 3) if room >= TURN_NEW[0] else []
            steps.append(
                Step(
                    f"{label}: {what}, {_count(len(turns), 'turn')}, "
                    f"{_count(decodes, 'decode')}",
                    [*turns, (cached, new)],
                    decodes,
                )
            )
    return steps


def named() -> list[Step]:
    return [Step(name, prefills) for name, prefills in NAMED.items()]
