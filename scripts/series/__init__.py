# SPDX-License-Identifier: Apache-2.0
"""Tooling that turns patches/ + vllm_overlay/ into tested vLLM trees.

One module per job: config (series.toml), fetch (the pinned sdist), prepare
(the base commit), apply (the stage commits), state (which stage commits
the tree holds), trees (per-stage test trees), testrun (the pytest runs and
their summary), export (refresh/check: patch files from the stage commits),
pr_export (export: one upstream PR per stage), rebase (onto a newer vLLM),
status, git and patchfile (helpers), cli. ``python -m scripts.series
--help`` is the CLI.
"""


class SeriesError(Exception):
    """An error the user can act on; the CLI prints it without a traceback."""
