# SPDX-License-Identifier: Apache-2.0
"""The seeds' checks on every run: prefix caching off in the engine log,
``total_input_tokens == num_prompts * ISL`` and no failed request. A result
that fails one is reported, never averaged in."""

from __future__ import annotations

from scripts.validate.matrix import Point

# vLLM's engine logs its config at start-up (the seed's first check).
PREFIX_CACHING_OFF = "enable_prefix_caching=False"


def log_problems(engine_log: str) -> list[str]:
    if PREFIX_CACHING_OFF in engine_log:
        return []
    return [f"the engine log does not show {PREFIX_CACHING_OFF}"]


def result_problems(result: dict, point: Point) -> list[str]:
    """What is wrong with one `vllm bench serve --save-result` file."""
    problems = []
    expected = point.num_prompts * point.isl
    if result.get("total_input_tokens") != expected:
        problems.append(
            f"total_input_tokens {result.get('total_input_tokens')} != num_prompts "
            f"* ISL = {expected} (a cached prefix or a truncated prompt)"
        )
    completed = result.get("completed")
    failed = result.get("failed", 0)
    if failed or completed != point.num_prompts:
        problems.append(
            f"{completed} of {point.num_prompts} requests completed, {failed} failed"
        )
    return problems
