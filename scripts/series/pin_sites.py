# SPDX-License-Identifier: Apache-2.0
"""The project's files that name the pinned vLLM, kept equal to
patches/series.toml: a rebase's branch moves them with the pin, and
``check`` (CI's check-patches) names any mention that differs.

In these files the pin is named only in the forms below, and those forms
name nothing but the pin. A remark about one release in particular (what
its source does, what a past run measured) belongs in another file, written
"vLLM X.Y.Z", where a move of the pin leaves it as it was.
"""

from __future__ import annotations

import re
from pathlib import Path

from scripts.series.config import Base, SdistBase

PIN_FILES = (
    "README.md",
    "Dockerfile",
    "docs/serving.md",
    "docs/maintaining.md",
    "docs/tooling.md",
)

_VERSION = r"\d+\.\d+(?:\.\d+)*"
# The work repo and the folders named after it: the pin's label
# (vllm-<version>, or vllm-git-<rev> for a git checkout).
_LABEL_FORMS = (re.compile(r"build/(?:results/|export/)?(vllm-[\w+-]+(?:\.[\w+-]+)*)"),)
# vLLM's image of the release, the image the README builds from it, and
# "vLLM X.Y.Z" in prose: the pin's version (a release pin only).
_VERSION_FORMS = (
    re.compile(rf"vllm-openai-rocm:v({_VERSION})"),
    re.compile(rf"dsa-vllm:({_VERSION})"),
    re.compile(rf"vLLM ({_VERSION})"),
)


def _forms(base: Base) -> list[tuple[re.Pattern[str], str]]:
    """Each form with the value it must hold for ``base``."""
    forms = [(form, base.label) for form in _LABEL_FORMS]
    if isinstance(base, SdistBase):
        forms += [(form, base.version) for form in _VERSION_FORMS]
    return forms


def _holding(value: str):
    """A ``re.sub`` replacement: the match with its group set to ``value``."""

    def replace(match: re.Match[str]) -> str:
        start, end = match.start(1) - match.start(), match.end(1) - match.start()
        return match[0][:start] + value + match[0][end:]

    return replace


def pin_mismatches(root: Path, base: Base) -> list[str]:
    """Each mention of the pin in the pin files that is not ``base``, as
    "FILE:LINE names X, the pin is Y"."""
    problems = []
    for name in PIN_FILES:
        path = root / name
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            for form, value in _forms(base):
                for match in form.finditer(line):
                    if match[1] != value:
                        problems.append(
                            f"{name}:{number} names {match[0]!r}, but the pin "
                            f"is {value}"
                        )
    return problems


def with_pin(text: str, base: Base) -> str:
    """``text`` with every form naming ``base`` (a git pin has no release
    version: its version forms stay as they are)."""
    for form, value in _forms(base):
        text = form.sub(_holding(value), text)
    return text


def moved_pin_files(
    root: Path, base: Base, pending: dict[Path, bytes] | None = None
) -> dict[Path, bytes]:
    """The pin files rewritten to name ``base``, those that change; a file
    in ``pending`` (what a caller is about to write) is read from there."""
    pending = pending or {}
    moved = {}
    for name in PIN_FILES:
        path = root / name
        if path in pending:
            text = pending[path].decode("utf-8")
        elif path.is_file():
            text = path.read_text(encoding="utf-8")
        else:
            continue
        new = with_pin(text, base)
        if new.encode("utf-8") != pending.get(path, text.encode("utf-8")):
            moved[path] = new.encode("utf-8")
    return moved
