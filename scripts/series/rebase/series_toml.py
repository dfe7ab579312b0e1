# SPDX-License-Identifier: Apache-2.0
"""Write a series file (the fields config.load_series reads), and edit the
project's own in place to say what a rebased one says (comments kept)."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Base, SdistBase, Series


def base_fields(base: Base, folder: Path) -> dict[str, str]:
    """The [base] table's pin; a git checkout's path relative to ``folder``
    (the series file's), so the file works in any clone of the project."""
    if isinstance(base, SdistBase):
        return {"version": base.version, "sha256": base.sha256}
    return {"git": os.path.relpath(base.path, folder), "rev": base.rev}


def series_toml(series: Series, folder: Path) -> str:
    """``series`` as a series file (the fields load_series reads) in
    ``folder``."""

    def s(value: str) -> str:
        return json.dumps(value, ensure_ascii=False)

    def strings(values: tuple[str, ...]) -> str:
        return "[" + ", ".join(s(v) for v in values) + "]"

    lines = ["# The patch series: one pinned vLLM base and the ordered stages."]
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


def updated_series_file(text: str, new_text: str, base: dict[str, str]) -> str:
    """The series file ``text`` made to say what the series file
    ``new_text`` says (its regression tests and stages) on the pin ``base``
    (``[base]``'s fields, a git path relative to ``text``'s folder), with
    every comment and unchanged value of ``text`` kept where it was."""
    try:
        import tomlkit
    except ImportError:
        raise SeriesError(
            "`rebase` edits series.toml with tomlkit, which this Python "
            "lacks: `pip install tomlkit` (the nox sessions install it)"
        ) from None
    doc = tomlkit.parse(text)
    new = tomllib.loads(new_text)
    _sync_table(doc["base"], {"name": new["base"]["name"], **base})
    if "regression" in new:
        _sync_array(doc, "regression", new["regression"], key=None)
    elif "regression" in doc:
        del doc["regression"]
    _sync_array(doc, "stage", new.get("stage", []), key="id")
    return tomlkit.dumps(doc)


def _sync_table(table, want: dict) -> None:
    for name in [k for k in table if k not in want]:
        del table[name]
    for name, value in want.items():
        if name not in table or table[name].unwrap() != value:
            table[name] = value


def _sync_array(doc, name: str, want: list[dict], key: str | None) -> None:
    """An array of tables made equal to ``want``; tables are matched by
    ``key`` (or by position), so a kept one keeps its comments."""
    import tomlkit

    have = doc.get(name)
    if have is None:
        have = doc[name] = tomlkit.aot()
    wanted = [w[key] if key else i for i, w in enumerate(want)]
    for index in reversed(range(len(have))):
        if (have[index][key] if key else index) not in wanted:
            del have[index]
    current = [t[key] if key else i for i, t in enumerate(have)]
    if current != wanted[: len(current)] or len(have) > len(want):
        # Reordered: rebuild in the new order (comments of moved
        # tables go with their values only where tomlkit keeps them).
        rebuilt = tomlkit.aot()
        for w in want:
            table = tomlkit.table()
            table.update(w)
            rebuilt.append(table)
        doc[name] = rebuilt
        return
    for index, w in enumerate(want):
        if index < len(have):
            _sync_table(have[index], w)
        else:
            table = tomlkit.table()
            table.update(w)
            have.append(table)
