# SPDX-License-Identifier: Apache-2.0
"""Unpacking an archive writes inside its folder only, on every Python the
tool runs on: with tarfile's ``data`` filter (3.11.4 and newer) and with
the tool's own checks where the filter is missing (Debian 12's 3.11.2).
The archives are the ones the filter guards against."""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from scripts.series import SeriesError
from scripts.series.config import REPO_ROOT
from scripts.series.stages.extract import extract


def _archive(*members: tuple[str, str, str | int]) -> bytes:
    """(name, kind, content): kind "file" (text), "dir", "sym"/"hard" (the
    link's target), "fifo", or "mode" (a file with that mode)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, kind, content in members:
            info = tarfile.TarInfo(name)
            data = b""
            if kind in ("file", "mode"):
                data = b"x" if kind == "mode" else str(content).encode()
                info.mode = int(content) if kind == "mode" else 0o644
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif kind in ("sym", "hard"):
                info.type = tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE
                info.linkname = str(content)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


HOSTILE = {
    "an absolute path": [("/tmp/evil", "file", "x")],
    "a path up and out": [("pkg/../../evil", "file", "x")],
    "a link to an absolute path": [("pkg", "dir", ""), ("pkg/l", "sym", "/etc")],
    "a link up and out": [("pkg", "dir", ""), ("pkg/l", "sym", "../../x")],
    "a link out through a link made before it": [
        ("b", "sym", "."),
        ("a", "sym", "b/.."),
    ],
    "a hard link to a file outside": [("h", "hard", "../outside.txt")],
    "a fifo": [("f", "fifo", "")],
}


@pytest.fixture(params=["data filter", "own checks"])
def unpack(request, monkeypatch, tmp_path):
    """Extract an archive's members into tmp_path/dest, by either way."""
    if request.param == "data filter" and not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tarfile data filter (older than 3.11.4)")
    if request.param == "own checks":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    (tmp_path / "outside.txt").write_text("not yours")
    dest = tmp_path / "sub" / "dest"
    dest.mkdir(parents=True)

    def run(data: bytes) -> Path:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            extract(tar, dest, tar.getmembers(), "test.tar")
        return dest

    return run


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_archive_is_refused_and_writes_nothing_outside(
    unpack, tmp_path, case
):
    try:
        unpack(_archive(*HOSTILE[case]))
    except SeriesError as refused:
        assert "test.tar: refused to unpack" in str(refused)
    else:
        # tarfile's filter unpacks an absolute path inside, its slash dropped.
        assert case == "an absolute path" and hasattr(tarfile, "data_filter")
        assert (tmp_path / "sub/dest/tmp/evil").exists()
    outside = sorted(
        p.relative_to(tmp_path).as_posix()
        for p in tmp_path.rglob("*")
        if not p.is_relative_to(tmp_path / "sub")
    )
    assert outside == ["outside.txt"]
    assert (tmp_path / "outside.txt").read_text() == "not yours"


def test_an_archive_with_links_inside_unpacks_whole(unpack):
    dest = unpack(
        _archive(
            ("pkg", "dir", ""),
            ("pkg/a.py", "file", "A = 1\n"),
            ("pkg/alias.py", "sym", "a.py"),
            ("pkg/copy.py", "hard", "pkg/a.py"),
            ("run", "mode", 0o4777),
        )
    )
    assert (dest / "pkg/alias.py").read_text() == "A = 1\n"
    assert (dest / "pkg/copy.py").read_text() == "A = 1\n"
    mode = stat.S_IMODE((dest / "run").stat().st_mode)
    assert not mode & (stat.S_ISUID | stat.S_IWOTH | stat.S_IWGRP), oct(mode)


def _older_python() -> str | None:
    """A Python 3.11 older than 3.11.4 on this host (Debian 12's), if any."""
    for candidate in ("/usr/bin/python3.11", "/usr/bin/python3"):
        if shutil.which(candidate):
            version = subprocess.run(
                [candidate, "-c", "import sys; print(sys.version_info[:3])"],
                capture_output=True, text=True, check=False,
            ).stdout  # fmt: skip
            if version.startswith("(3, 11, ") and int(version[8:-2]) < 4:
                return candidate
    return None


@pytest.mark.skipif(
    _older_python() is None, reason="no Python 3.11 older than 3.11.4 on this host"
)
def test_on_a_python_without_the_filter_hostile_archives_are_refused(tmp_path):
    """The tool as Debian 12's own Python runs it: refused, and unpacked."""
    script = (
        "import io, sys, tarfile\n"
        "from scripts.series import SeriesError\n"
        "from scripts.series.stages.extract import extract\n"
        "assert not hasattr(tarfile, 'data_filter')\n"
        "for i, data in enumerate(sys.stdin.buffer.read().split(b'--CUT--')):\n"
        "    dest = f'{sys.argv[1]}/{i}'\n"
        "    with tarfile.open(fileobj=io.BytesIO(data)) as tar:\n"
        "        try:\n"
        "            extract(tar, dest, tar.getmembers(), 'test.tar')\n"
        "            print('unpacked')\n"
        "        except SeriesError:\n"
        "            print('refused')\n"
    )
    archives = [_archive(*members) for members in HOSTILE.values()]
    archives.append(_archive(("a.py", "file", "A = 1\n"), ("b.py", "sym", "a.py")))
    (tmp_path / "outside.txt").write_text("not yours")
    dest = tmp_path / "sub"
    for i in range(len(archives)):
        (dest / str(i)).mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONSAFEPATH": "1"}
    ran = subprocess.run(
        [str(_older_python()), "-c", script, str(dest)],
        input=b"--CUT--".join(archives), capture_output=True, env=env, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr.decode()
    assert ran.stdout.decode().split() == ["refused"] * len(HOSTILE) + ["unpacked"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt", "sub"]
    assert (dest / str(len(HOSTILE)) / "b.py").read_text() == "A = 1\n"


@pytest.mark.skipif(
    _older_python() is None, reason="no Python 3.11 older than 3.11.4 on this host"
)
def test_debians_python_applies_a_series(two_stages):
    """Debian 12's own Python runs the tool: the stages applied, each tree
    unpacked from a ``git archive`` without tarfile's filter."""
    ran = subprocess.run(
        [str(_older_python()), "-m", "scripts.series", "--series",
         str(two_stages.series_file), "apply"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    status = subprocess.run(
        [str(_older_python()), "-m", "scripts.series", "--series",
         str(two_stages.series_file), "status"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "0002  applied" in status, status
