# SPDX-License-Identifier: Apache-2.0
"""Read a stage's patch file: its commit message, author and hunks."""

from __future__ import annotations

import functools
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.git import Identity, git

_DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$")
_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@")


@dataclass(frozen=True)
class Hunk:
    path: str
    number: int  # 1-based, within its file
    old_start: int
    header: str
    added: int = 0
    removed: int = 0
    reindented: int = 0  # removed lines added back with other indentation
    text: str = ""  # a patch of this one hunk: its file's header, then the hunk

    @property
    def changed(self) -> int:
        """Lines the hunk really changes: added plus removed, a line that is
        only re-indented (under a new ``if``) not counted."""
        return self.added + self.removed - 2 * self.reindented


@dataclass(frozen=True)
class PatchInfo:
    author: Identity
    message: str  # subject, blank line, body (trailers included)
    hunks: tuple[Hunk, ...]
    files: tuple[str, ...]
    new_files: tuple[str, ...]


def read_patch(path: Path) -> PatchInfo:
    """Parse a ``git format-patch`` file; error if it has no author or subject.

    ``mailinfo -b`` drops only a "[PATCH ...]" prefix, so vLLM-style titles
    such as "[ROCm][Perf] ..." keep their tags."""
    if not path.exists():
        raise SeriesError(f"patch file {path} does not exist")
    return parse_patch(path.read_bytes(), path.name)


# A command reads the same patch several times; git mailinfo is a process.
@functools.lru_cache(maxsize=64)
def parse_patch(data: bytes, name: str = "the patch") -> PatchInfo:
    """``read_patch`` of a patch's bytes (``name``: for the errors)."""
    with tempfile.TemporaryDirectory() as tmp:
        msg_file = Path(tmp) / "msg"
        result = git(
            Path(tmp),
            "mailinfo",
            "-b",
            "-u",
            str(msg_file),
            str(Path(tmp) / "diff"),
            input=data,
            check=False,
        )
        if result.returncode != 0:
            raise SeriesError(f"{name}: not a git format-patch file")
        body = msg_file.read_text(encoding="utf-8").strip()
    headers: dict[str, str] = {}
    for line in result.stdout.decode("utf-8").splitlines():
        key, _, value = line.partition(": ")
        headers[key] = value
    missing = [k for k in ("Author", "Email", "Date", "Subject") if not headers.get(k)]
    if missing:
        raise SeriesError(
            f"{name}: no {', '.join(missing)} header; write it with "
            "`nox -s refresh` (git format-patch form)"
        )
    message = headers["Subject"] + ("\n\n" + body if body else "") + "\n"
    author = Identity(headers["Author"], headers["Email"], headers["Date"])
    hunks, files, new_files = _scan_diff(data.decode("utf-8", errors="replace"))
    if not files:
        raise SeriesError(f"{name}: the patch changes no file")
    return PatchInfo(author, message, hunks, files, new_files)


def _counted(hunk: Hunk, added: list[str], removed: list[str]) -> Hunk:
    unmatched = Counter(line.strip() for line in added)
    reindented = 0
    for line in removed:
        if unmatched[line.strip()] > 0:
            unmatched[line.strip()] -= 1
            reindented += 1
    return replace(hunk, added=len(added), removed=len(removed), reindented=reindented)


def _scan_diff(text: str) -> tuple[tuple[Hunk, ...], tuple[str, ...], tuple[str, ...]]:
    hunks: list[Hunk] = []
    files: list[str] = []
    new_files: list[str] = []
    path = ""
    number = 0
    file_header: list[str] = []  # from "diff --git" to the first hunk
    lines: list[str] = []  # the current hunk's, header included
    added: list[str] = []
    removed: list[str] = []
    old_left = new_left = 0  # lines of the current hunk still to come
    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\n")
        if old_left or new_left or (lines and bare.startswith("\\")):
            lines.append(line)
            if bare.startswith("+"):
                added.append(bare[1:])
                new_left -= 1
            elif bare.startswith("-"):
                removed.append(bare[1:])
                old_left -= 1
            elif not bare.startswith("\\"):  # "\ No newline at end of file"
                old_left -= 1
                new_left -= 1
            if not (old_left or new_left):  # complete (or its "\" line)
                hunks[-1] = replace(
                    _counted(hunks[-1], added, removed),
                    text="".join(file_header + lines),
                )
        elif match := _DIFF_HEADER.match(bare):
            path = match.group(2)
            files.append(path)
            number = 0
            file_header, lines = [line], []
        elif (match := _HUNK_HEADER.match(bare)) and path:
            number += 1
            lines, added, removed = [line], [], []
            hunks.append(Hunk(path, number, int(match.group(1)), bare))
            old_left = int(match.group(2) or 1)
            new_left = int(match.group(3) or 1)
        elif path and not lines:
            if bare.startswith("new file mode"):
                new_files.append(path)
            file_header.append(line)
        else:
            lines = []  # past the last hunk of a file: the signature, say
    return tuple(hunks), tuple(files), tuple(new_files)


def failing_hunk(info: PatchInfo, git_stderr: str) -> str:
    """Turn ``git apply``'s complaint into 'file X, hunk N (@@ ... @@)'."""
    failed = re.search(r"patch failed: (\S+):(\d+)", git_stderr)
    if failed:
        path, line = failed.group(1), int(failed.group(2))
        for hunk in info.hunks:
            if hunk.path == path and hunk.old_start == line:
                return f"file {path}, hunk {hunk.number} ({hunk.header})"
        return f"file {path}, hunk at line {line}"
    missing = re.search(
        r"error: (\S+): (does not exist in index|No such file)", git_stderr
    )
    if missing:
        return f"file {missing.group(1)}: not in the tree"
    exists = re.search(r"error: (\S+): already exists", git_stderr)
    if exists:
        return f"file {exists.group(1)}: already exists in the tree"
    return git_stderr.strip().splitlines()[-1] if git_stderr.strip() else "unknown"
