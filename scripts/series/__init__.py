# SPDX-License-Identifier: Apache-2.0
"""Tooling that turns patches/ + vllm_overlay/ into tested vLLM trees.

One module per job, named after its verb where it has one: fetch, prepare,
apply, refresh, check, status, export (with pr_check, the maintainer's
check of the exported PRs), install (the stages written into an installed
vLLM), overview, testrun (``test`` and the
rebase's probe), rebase (with rebase_state, its state and report, and review,
the rebased series under review and ``--accept``); and what they share:
config (reading series.toml) and series_toml (writing it), layout (every
build path, tag, branch and state-file name), lock (one writer at a time),
contract (the test environment of a tree), state (which stage commits a tree
holds), trees (per-stage test trees), git and patchfile (helpers). ``cli`` is
the command line (``python -m scripts.series --help``).
"""


class SeriesError(Exception):
    """An error the user can act on; the CLI prints it without a traceback."""
