# SPDX-License-Identifier: Apache-2.0
"""The README's stage table, generated from series.toml and the patch files
(``python -m scripts.series overview``); ``check`` fails when the README's
copy differs."""

from __future__ import annotations

from pathlib import Path

from scripts.series.config import Series
from scripts.series.patchfile import read_patch

BEGIN = "<!-- stage table: python -m scripts.series overview -->"
END = "<!-- end of stage table -->"


def stage_table(series: Series) -> str:
    rows = [
        "| stage | turn it on | hooks into vLLM | overlay modules | series tests "
        "| PR tests (vLLM's tests/) | validated on | upstream |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stage in series.stages:
        files = read_patch(series.patch_file(stage)).files
        hooks = "<br>".join(f"`{f.removeprefix('vllm/')}`" for f in files)
        overlays = "<br>".join(
            f"`{o.rsplit('/', 1)[-1]}`"
            for o in stage.overlays
            if o not in stage.vllm_tests
        )
        pr_tests = "<br>".join(f"`{t}`" for t in stage.vllm_tests) or "none"
        switches = "<br>".join(f"`{s}`" for s in stage.switches) or "none"
        upstream = stage.upstream_status.replace("-", " ")
        if stage.upstream_status != "not-submitted":
            upstream += f" ({stage.upstream_pr})"
        rows.append(
            f"| **{stage.id}** {stage.title} | {switches} | {hooks} | {overlays} "
            f"| `tests/{stage.tests}/` | {pr_tests} | {stage.validated_on} "
            f"| {upstream} |"
        )
    return "\n".join(rows)


def readme_table_is_current(series: Series, readme: Path) -> bool:
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        return False
    current = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    return current == stage_table(series)
