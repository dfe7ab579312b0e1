# SPDX-License-Identifier: Apache-2.0
"""The series tool (``python3 -m scripts.series --help``): patches/ and
vllm_overlay/ turned into tested vLLM trees. Packages by job: stages/,
rebase/, export/, install/, testing/; docs/tooling.md describes the layout."""


class SeriesError(Exception):
    """An error the user can act on; the CLI prints it without a traceback."""
