# SPDX-License-Identifier: Apache-2.0
"""Tooling that turns patches/ + vllm_overlay/ into tested vLLM trees.

One module per job, named after its verb where it has one: fetch, prepare,
apply, refresh, check, status, export, overview, testrun (``test``), rebase;
and what they share: config (series.toml), layout (every build path, tag,
branch and state-file name), contract (the test environment of a tree),
state (which stage commits a tree holds), trees (per-stage test trees), git
and patchfile (helpers). ``cli`` is the command line (``python -m
scripts.series --help``).
"""


class SeriesError(Exception):
    """An error the user can act on; the CLI prints it without a traceback."""
