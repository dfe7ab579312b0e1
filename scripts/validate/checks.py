# SPDX-License-Identifier: Apache-2.0
"""The PR texts' checks on every run: prefix caching off in the engine log (on,
for an experiment that serves with it), ``total_input_tokens == num_prompts
* ISL`` (plus a point's suffix tokens) and no failed request. A result that
fails one is reported, never averaged in."""

from __future__ import annotations

from scripts.validate.matrix import Point

# vLLM's engine logs its config at start-up (the PR texts' first check).
PREFIX_CACHING_OFF = "enable_prefix_caching=False"
PREFIX_CACHING_ON = "enable_prefix_caching=True"


def log_problems(engine_log: str, prefix_caching: bool = False) -> list[str]:
    expected = PREFIX_CACHING_ON if prefix_caching else PREFIX_CACHING_OFF
    if expected in engine_log:
        return []
    return [f"the engine log does not show {expected}"]


def result_problems(result: dict, point: Point) -> list[str]:
    """What is wrong with one `vllm bench serve --save-result` file."""
    problems = []
    expected = point.num_prompts * (point.isl + point.suffix_len)
    if result.get("total_input_tokens") != expected:
        length = f"(ISL + {point.suffix_len})" if point.suffix_len else "ISL"
        problems.append(
            f"total_input_tokens {result.get('total_input_tokens')} != num_prompts "
            f"* {length} = {expected} (a cached prefix or a truncated prompt)"
        )
    completed = result.get("completed")
    failed = result.get("failed", 0)
    if failed or completed != point.num_prompts:
        problems.append(
            f"{completed} of {point.num_prompts} requests completed, {failed} failed"
        )
    return problems
