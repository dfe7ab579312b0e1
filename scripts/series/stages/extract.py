# SPDX-License-Identifier: Apache-2.0
"""Unpack a tar archive (a vLLM sdist, a ``git archive``) into a folder and
nowhere else.

Python 3.11.4 and newer do it with tarfile's ``data`` filter. Older 3.11s
(Debian 12 ships 3.11.2) have no filter, so each member is checked here by
the same rules before anything is written: a regular file, a folder or a
link, whose path and link target stay inside the folder; no owner, no
setuid/setgid/sticky bit, no write bit for others."""

from __future__ import annotations

import os
import tarfile
from collections.abc import Sequence
from pathlib import Path

from scripts.series import SeriesError


def _inside(dest: str, path: str) -> bool:
    return os.path.commonpath([dest, path]) == dest


def _checked(member: tarfile.TarInfo, dest: str, archive: str) -> tarfile.TarInfo:
    def refuse(why: str) -> SeriesError:
        return SeriesError(f"{archive}: refused to unpack {member.name!r}: {why}")

    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise refuse("it is no file, folder or link")
    if member.name.startswith("/") or os.path.isabs(member.name):
        raise refuse("its path is absolute")
    target = os.path.realpath(os.path.join(dest, member.name))
    if not _inside(dest, target):
        raise refuse("it would be written outside the folder")
    if member.issym() or member.islnk():
        if os.path.isabs(member.linkname):
            raise refuse("it links to an absolute path")
        start = os.path.dirname(target) if member.issym() else dest
        if not _inside(dest, os.path.realpath(os.path.join(start, member.linkname))):
            raise refuse("it links outside the folder")
    member.uid, member.gid = os.getuid(), os.getgid()
    member.uname = member.gname = ""
    if member.isreg() or member.isdir():
        member.mode = (member.mode & 0o755) | (0o700 if member.isdir() else 0o600)
    return member


def extract(
    archive: tarfile.TarFile, dest: Path, members: Sequence[tarfile.TarInfo], name: str
) -> None:
    """Write ``members`` of ``archive`` (named ``name`` in errors) into
    ``dest``, refusing any that would reach outside it."""
    if hasattr(tarfile, "data_filter"):
        try:
            archive.extractall(dest, members=members, filter="data")
        except tarfile.FilterError as refused:
            raise SeriesError(f"{name}: refused to unpack: {refused}") from None
        return
    root = os.path.realpath(dest)
    links = [member for member in members if member.issym() or member.islnk()]
    files = [_checked(m, root, name) for m in members if m not in links]
    archive.extractall(dest, members=files, numeric_owner=True)
    # Links last and one at a time, each checked against the folder as it
    # is by then (a link through a link made before it): no file is ever
    # written through one.
    for link in links:
        archive.extract(_checked(link, root, name), dest, numeric_owner=True)
