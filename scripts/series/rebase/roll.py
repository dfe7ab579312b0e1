# SPDX-License-Identifier: Apache-2.0
"""``roll``: rebase onto vLLM's newest release when it is newer than the
pin, and say what needs a person; a no-op when there is nothing new."""

from __future__ import annotations

import re
import urllib.error

from scripts.series import SeriesError
from scripts.series.config import SdistBase, Series
from scripts.series.layout import rebase_branch
from scripts.series.rebase import rebase
from scripts.series.rebase.branch import branch_commit
from scripts.series.rebase.state import rebase_command
from scripts.series.stages.fetch import INDEX_ENV, index_url, listed_files


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def releases(name: str) -> dict[str, str]:
    """{version: sdist sha256} of the final releases the index lists with an
    sdist and its hash (pre-releases and post-releases are not followed)."""
    pattern = re.compile(rf"{re.escape(name)}-(\d+(?:\.\d+)*)\.tar\.gz")
    url = f"{index_url()}/{name}/"
    try:
        files = listed_files(url)
    except (urllib.error.URLError, OSError, ValueError) as error:
        # URLError wraps the socket's error (refused, unknown host, timeout).
        reason = getattr(error, "reason", error)
        why = getattr(reason, "strerror", None) or str(reason)
        raise SeriesError(
            f"cannot read {name}'s releases from the package index at {url} "
            f"({why}); nothing was changed. Connect to the network, or set "
            f"{INDEX_ENV} to an index this machine can reach"
        ) from None
    found = {}
    for filename, (_, sha256, _) in files.items():
        if (match := pattern.fullmatch(filename)) and sha256:
            found[match.group(1)] = sha256.lower()
    return found


def sdist_sha256(name: str, version: str) -> str:
    """The index's sha256 of ``name``'s ``version`` sdist."""
    listed = releases(name)
    if version not in listed:
        raise SeriesError(
            f"{index_url()}/{name}/ lists no sdist (with its sha256) of "
            f"{name} {version}"
        )
    return listed[version]


def roll(series: Series, *, test_python: str | None = None) -> int:
    """Rebase onto the newest release if it is newer than the pin; 0 when
    nothing needs a person beyond reviewing what was written, 1 when the
    rebase stopped."""
    pin = series.base
    if not isinstance(pin, SdistBase):
        raise SeriesError(
            "roll follows vLLM's releases; this series is pinned to a git "
            f"checkout ({pin.label}): rebase it with "
            f"{rebase_command('--git PATH --rev REV')}"
        )
    listed = releases(pin.name)
    if not listed:
        raise SeriesError(f"{index_url()}/{pin.name}/ lists no release sdist")
    newest = max(listed, key=version_key)
    if version_key(newest) <= version_key(pin.version):
        print(f"{pin.name} {pin.version} is the newest release: nothing to do")
        return 0
    target = SdistBase(pin.name, newest, listed[newest])
    branch = rebase_branch(target)
    if branch_commit(series, branch) is not None:
        print(
            f"{pin.name} {newest} is out and the series is already rebased onto "
            f"it on the branch {branch}: test it, and merge it to adopt it (or "
            f"delete it, `git branch -D {branch}`, to rebase again)"
        )
        return 0
    print(f"{pin.name} {newest} is out (sdist sha256 {target.sha256}): rebasing")
    try:
        reports = rebase.start(series, target, test_python=test_python)
    except SeriesError as error:
        print(f"\nNeeds a person: the rebase onto {pin.name} {newest} stopped.")
        print(error)
        return 1
    needs = [
        f"stage {r.id} is already upstream ({r.evidence}): it leaves the series"
        for r in reports
        if r.outcome == "already upstream"
    ]
    needs += [
        f"stage {r.id}: {h.path} `{h.header}` was dropped by the merge"
        for r in reports
        for h in r.hunks
        if h.outcome == "dropped"
    ]
    print(
        f"\nNeeds a person: review docs/rebased_onto_{target.label}.md on the "
        f"branch {branch}"
    )
    for line in needs:
        print(f"- {line}")
    print("then test the branch (push it for CI) and merge it")
    return 0
