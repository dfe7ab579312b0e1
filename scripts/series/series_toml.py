# SPDX-License-Identifier: Apache-2.0
"""Write a series file (the fields config.load_series reads): a whole new
one for a rebased series under review, or the project's own edited in place
(comments kept) when a review is accepted."""

from __future__ import annotations

import json
import os
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Base, SdistBase, Series


def base_fields(base: Base, folder: Path) -> dict[str, str]:
    """The [base] table's pin; a git checkout's path relative to ``folder``
    (the series file's), so the file works in any clone of the project."""
    if isinstance(base, SdistBase):
        return {"version": base.version, "sha256": base.sha256}
    return {"git": os.path.relpath(base.path, folder), "rev": base.rev}


def series_toml(
    series: Series, folder: Path, *, review: tuple[str, list[str], str] | None = None
) -> str:
    """``series`` as a series file (the fields load_series reads). A series
    for review names its project folder, its overlay folders (its own, then
    the project's) and the digest of the series it was rebased from."""

    def s(value: str) -> str:
        return json.dumps(value, ensure_ascii=False)

    def strings(values: tuple[str, ...]) -> str:
        return "[" + ", ".join(s(v) for v in values) + "]"

    lines = ["# The patch series: one pinned vLLM base and the ordered stages."]
    if review is not None:
        project, overlays, digest = review
        lines += [
            "# Written by `python -m scripts.series rebase` for review.",
            f"project = {s(project)}",
            f"overlays = {strings(tuple(overlays))}",
            f"rebased_from = {s(digest)}",
        ]
    lines += ["", "[base]", f"name = {s(series.base.name)}"]
    lines += [f"{k} = {s(v)}" for k, v in base_fields(series.base, folder).items()]
    for suite in series.regression:
        lines += ["", "[[regression]]", f"name = {s(suite.name)}"]
        if suite.plugin:
            lines.append(f"plugin = {s(suite.plugin)}")
        lines.append(f"paths = {strings(suite.paths)}")
    for stage in series.stages:
        lines += [
            "",
            "[[stage]]",
            f"id = {s(stage.id)}",
            f"title = {s(stage.title)}",
            f"patch = {s(stage.patch)}",
            f"overlays = {strings(stage.overlays)}",
            f"depends_on = {strings(stage.depends_on)}",
            f"tests = {s(stage.tests)}",
        ]
        if stage.upstream_probe:
            lines.append(f"upstream_probe = {strings(stage.upstream_probe)}")
        if stage.switches:
            lines.append(f"switches = {strings(stage.switches)}")
        lines.append(f"validated_on = {s(stage.validated_on)}")
        if stage.large_hunks:
            lines.append("large_hunks = [")
            lines += [
                f"    {{ file = {s(h.path)}, hunk = {h.number}, "
                f"reason = {s(h.reason)} }},"
                for h in stage.large_hunks
            ]
            lines.append("]")
        lines.append(
            f"upstream = {{ pr = {s(stage.upstream_pr)}, "
            f"status = {s(stage.upstream_status)} }}"
        )
    return "\n".join(lines) + "\n"


def updated_series_file(text: str, new: Series, folder: Path) -> str:
    """The series file ``text`` edited to ``new``'s pin and stages: stages it
    left out removed, dependencies updated, everything else (comments
    included) as it was."""
    try:
        import tomlkit
    except ImportError:
        raise SeriesError(
            "`rebase --accept` edits series.toml with tomlkit, which this Python "
            "lacks: `pip install tomlkit` (the nox sessions install it)"
        ) from None
    doc = tomlkit.parse(text)
    base = doc["base"]
    pin = base_fields(new.base, folder)
    for key in ("version", "sha256", "git", "rev"):
        if key in base and key not in pin:
            del base[key]
    for key, value in pin.items():
        base[key] = value
    kept = {stage.id: stage for stage in new.stages}
    stages = doc["stage"]
    for index in reversed(range(len(stages))):
        stage_id = stages[index]["id"]
        if stage_id not in kept:
            del stages[index]
        elif tuple(stages[index].get("depends_on", [])) != kept[stage_id].depends_on:
            stages[index]["depends_on"] = list(kept[stage_id].depends_on)
    return tomlkit.dumps(doc)
