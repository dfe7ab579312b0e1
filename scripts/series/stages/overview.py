# SPDX-License-Identifier: Apache-2.0
"""The README's stage table, generated from series.toml and the patch files
(``python3 -m scripts.series overview``); ``check`` fails when the README's
copy differs."""

from __future__ import annotations

import re
from pathlib import Path

from scripts.series.config import Series, Stage

BEGIN = "<!-- stage table: python3 -m scripts.series overview -->"
END = "<!-- end of stage table -->"

# An upstream PR named as GitHub writes it: owner/repo#number.
_PR = re.compile(r"^([\w.-]+/[\w.-]+)#(\d+)$")


def _switches(stage: Stage) -> str:
    return "<br>".join(f"`{s}`" for s in stage.switches) or "none"


def _upstream(stage: Stage) -> str:
    status = stage.upstream_status.replace("-", " ")
    if stage.upstream_status == "not-submitted":
        return status
    pr = _PR.match(stage.upstream_pr)
    if pr:
        url = f"https://github.com/{pr[1]}/pull/{pr[2]}"
        return f"{status}: [{stage.upstream_pr}]({url})"
    return f"{status} ({stage.upstream_pr})"


def stage_table(series: Series) -> str:
    """The README's table: per stage, what it does, how to turn it on and
    where upstream stands; the stage links to docs/stage_<id>.md if any."""
    rows = [
        "| stage | what it does | turn it on | upstream |",
        "|---|---|---|---|",
    ]
    for stage in series.stages:
        name = f"**{stage.id}**"
        if (series.root / "docs" / f"stage_{stage.id}.md").is_file():
            name = f"[**{stage.id}**](docs/stage_{stage.id}.md)"
        rows.append(
            f"| {name} | {stage.title} | {_switches(stage)} | {_upstream(stage)} |"
        )
    return "\n".join(rows)


def with_stage_table(text: str, series: Series) -> str | None:
    """A README's ``text`` with the table between its markers made anew
    (None: it has no markers)."""
    if BEGIN not in text or END not in text:
        return None
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n{stage_table(series)}\n{END}{tail}"


def readme_table_is_current(series: Series, readme: Path) -> bool:
    text = readme.read_text(encoding="utf-8")
    return with_stage_table(text, series) == text
