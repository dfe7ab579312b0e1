# SPDX-License-Identifier: Apache-2.0
"""Write a series file (the fields config.load_series reads)."""

from __future__ import annotations

import json

from scripts.series.config import SdistBase, Series


def series_toml(
    series: Series, *, review: tuple[str, list[str], str] | None = None
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
    if isinstance(series.base, SdistBase):
        lines += [
            f"version = {s(series.base.version)}",
            f"sha256 = {s(series.base.sha256)}",
        ]
    else:
        lines += [f"git = {s(str(series.base.path))}", f"rev = {s(series.base.rev)}"]
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
