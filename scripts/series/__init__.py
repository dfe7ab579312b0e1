# SPDX-License-Identifier: Apache-2.0
"""Tooling that turns patches/ + vllm_overlay/ into tested vLLM trees.

One module per job: config (series.toml), fetch (the pinned sdist), prepare
(the base commit), apply (the stage commits), export (patch files from the
stage commits), status. ``python -m scripts.series --help`` is the CLI.
"""


class SeriesError(Exception):
    """An error the user can act on; the CLI prints it without a traceback."""
