# SPDX-License-Identifier: Apache-2.0
"""Write a series file (the fields config.load_series reads), edit the
project's own in place to say what a rebased one says (comments kept), and
say how far a branch pinned to a git commit goes."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Base, GitBase, SdistBase, Series, is_git_url
from scripts.series.git import git


def base_fields(base: Base, folder: Path) -> dict[str, str]:
    """The [base] table's pin. A git commit is named by the URL of a remote
    of the checkout that has it (``fetchable_url``), else by the checkout's
    own ``file://`` URL, which every clone on this machine fetches from, at
    any depth; a folder pinned by hand stays as written."""
    if isinstance(base, SdistBase):
        return {"version": base.version, "sha256": base.sha256}
    full_commit = re.fullmatch(r"[0-9a-f]{40}", base.rev)
    if base.url is None and not (full_commit and base.path.is_dir()):
        return {"git": os.path.relpath(base.path, folder), "rev": base.rev}
    url = base.url or fetchable_url(base.path, base.rev) or local_url(base.path)
    return {"git": url, "rev": base.rev}


def local_url(checkout: Path) -> str:
    return checkout.resolve().as_uri()


def fetchable_url(checkout: Path, commit: str) -> str | None:
    """The URL of a remote of ``checkout`` that has ``commit`` (one of its
    remote-tracking branches contains it), ``upstream`` and ``origin``
    first; None when no remote has it. A remote that is a folder (a clone
    of a local mirror) is named by its absolute ``file://`` URL, which every
    clone on this machine fetches from, at any depth."""
    found = git(
        checkout,
        "for-each-ref",
        "--contains",
        commit,
        "--format=%(refname)",
        "refs/remotes",
        check=False,
    )
    prefix = "refs/remotes/"
    remotes = {
        ref[len(prefix) :].split("/", 1)[0]
        for ref in found.stdout.decode().split()
        if ref.startswith(prefix)
    }
    for remote in sorted(remotes, key=lambda r: (r != "upstream", r != "origin", r)):
        url = git(checkout, "remote", "get-url", remote, check=False)
        where = url.stdout.decode().strip()
        if url.returncode != 0 or not where:
            continue
        if is_git_url(where):
            return where
        folder = (checkout / Path(where).expanduser()).resolve()
        if folder.is_dir():
            return folder.as_uri()
    return None


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


def updated_series_file(text: str, new_text: str) -> str:
    """The series file ``text`` made to say what the series file
    ``new_text`` (written by ``series_toml`` for the same folder) says. A
    table whose values are unchanged keeps its text, a changed one gets the
    new values, and every comment stays where it was (one inside a changed
    table's values moves below them)."""
    wanted = {}
    for table in _tables(new_text)[1:]:
        value = tomllib.loads("".join(table))
        wanted[_table_key(value)] = ([line for line in table if line.strip()], value)
    old = _tables(text)
    out = old[0]
    for table in old[1:]:
        statements, comments = _statements(table)
        value = tomllib.loads("".join(statements))
        new = wanted.pop(_table_key(value), None)
        if new is None:  # a dropped stage or regression suite: its comments stay
            out += comments
        elif new[1] == value:
            out += table
        else:
            # The header line as the user wrote it (its spacing, a comment).
            out += [table[0], *new[0][1:], *comments]
    for table, _ in wanted.values():
        out += ["\n", *table, "\n"]
    edited = re.sub(r"\n{3,}", "\n\n", "".join(out))
    # Tables in another order than the new file's: written anew.
    return edited if tomllib.loads(edited) == tomllib.loads(new_text) else new_text


# A table header as TOML allows it: [base], [ base ], ["base"],
# [[stage]] or [[ stage ]], a comment after it. A line of a multi-line
# array ([1, 2],) is none: its parts are not a key.
_KEY = r"""(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')"""
_HEADER = re.compile(rf"^\s*\[\[?\s*{_KEY}(?:\s*\.\s*{_KEY})*\s*\]\]?\s*(#.*)?$")


def _tables(text: str) -> list[list[str]]:
    """``text``'s lines cut before each table header: what comes before the
    first table, then each table with the lines up to the next one."""
    tables: list[list[str]] = [[]]
    for line in text.splitlines(keepends=True):
        if _HEADER.match(line):
            tables.append([])
        tables[-1].append(line if line.endswith("\n") else line + "\n")
    return tables


def _statements(table: list[str]) -> tuple[list[str], list[str]]:
    """A table's header and key/value lines (a value over as many lines as
    it takes), and its other lines (comments, blank lines)."""
    statements, others = [table[0]], []
    start = 1
    while start < len(table):
        line = table[start]
        if not line.strip() or line.lstrip().startswith("#"):
            others.append(line)
            start += 1
            continue
        end = start + 1
        while not _parses("".join(table[start:end])):
            if end == len(table):
                raise SeriesError(f"series.toml: cannot read {line.strip()!r}")
            end += 1
        statements += table[start:end]
        start = end
    return statements, others


def _parses(text: str) -> bool:
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    return True


def _table_key(value: dict) -> tuple[str, str | None]:
    """Which table: [base], or an entry of [[stage]] (by id) or of
    [[regression]] (by name)."""
    ((kind, table),) = value.items()
    if isinstance(table, list):
        return kind, table[0].get("id", table[0].get("name"))
    return kind, None


def git_pin_note(pinned: GitBase) -> str:
    """How far a branch pinned to a git commit goes: CI, when it names a URL
    any clone can fetch; this machine only, when it names a folder."""
    url = fetchable_url(pinned.path, pinned.rev)
    keep = (
        ". It is for testing against vLLM main: install and the Dockerfile "
        "take a release, so never merge it (check-patches refuses a git pin "
        "outside the tool's rebase/ and rehearsal/ branches)"
    )
    local = "every clone on this machine applies it, other machines and CI cannot"
    if url is None:
        return (
            f" here: no remote of {pinned.path} has {pinned.rev[:12]}, so it "
            f"pins the checkout itself, {local_url(pinned.path)}: {local} (push "
            "the commit to a remote of the checkout, fetch it there, and rebase "
            f"again to pin that remote's URL){keep}"
        )
    if url.startswith("file://"):
        return (
            f" here: it pins {url}, the checkout's remote, a repository on this "
            f"machine: {local}{keep}"
        )
    return f" (or push it for CI: it pins {url} at the commit){keep}"
