# SPDX-License-Identifier: Apache-2.0
"""Turn the base (sdist or git revision) into a work repo with one base commit.

The base commit is deterministic: fixed identity and date, every file added
(``-f``: the sdist's own .gitignore hides vllm/_version.py and vllm.egg-info,
without which vLLM cannot read its version and disables Triton). The same
sdist therefore gives the same commit id on every machine, which keeps blob ids
in the patch files meaningful for three-way merges.
"""

from __future__ import annotations

import io
import re
import shutil
import tarfile
import time
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Base, GitBase, SdistBase, Series
from scripts.series.git import (
    TOOL_IDENTITY,
    Identity,
    git,
    git_out,
    is_repo,
    ownership_refusal,
)
from scripts.series.layout import (
    BASE_REF,
    BASE_TAG,
    SERIES_BRANCH,
    staging_dir,
    workdir,
)
from scripts.series.stages.extract import extract
from scripts.series.stages.fetch import fetch_git_commit, fetch_sdist

BASE_DATE = "2000-01-01T00:00:00+00:00"


def base_id(base: Base) -> str:
    """The line recorded in the base commit that identifies what it holds."""
    if isinstance(base, SdistBase):
        return f"Base-sha256: {base.sha256}"
    commit = resolve_git_rev(base)
    return f"Base-git-commit: {commit}"


def resolve_git_rev(base: GitBase) -> str:
    if base.url is not None:
        fetch_git_commit(base)
        return _cached_commit(base)
    if not is_repo(base.path) and not (base.path / "HEAD").exists():
        raise SeriesError(
            f"base.git: {base.path} is not a git repository. A pin to a folder "
            "works only on the machine whose checkout it names (a rebase onto "
            "a checkout with no remote that has the commit writes one); pin a "
            "repository URL and a full commit, or a release"
        )
    result = git(
        base.path,
        "rev-parse",
        "--verify",
        "--quiet",
        f"{base.rev}^{{commit}}",
        check=False,
    )
    if result.returncode != 0:
        refused = ownership_refusal(result.stderr)
        if refused:
            raise SeriesError(refused)
        raise SeriesError(f"base.rev: {base.rev!r} is not a commit in {base.path}")
    return result.stdout.decode().strip()


def _cached_commit(base: GitBase) -> str:
    """A URL pin's commit from its cache repository, every object of it
    there; a cache a kill or a hand left part way is named, with the way
    on (the next command fetches the commit again). The cache is a bare
    repository, named as one: git must not look above an emptied folder
    for another repository."""
    walked = git(
        base.path, "--git-dir", str(base.path),
        "rev-list", "--objects", "-n", "1", f"{base.rev}^{{commit}}",
        check=False,
    )  # fmt: skip
    if walked.returncode != 0:
        refused = ownership_refusal(walked.stderr)
        if refused:
            raise SeriesError(refused)
        said = walked.stderr.decode(errors="replace").strip().splitlines()
        raise SeriesError(
            f"the cache of the pinned commit {base.rev[:12]}, {base.path}, is "
            f"damaged ({said[-1] if said else 'not a git repository'}): delete "
            "that folder and run the command again, which fetches the commit "
            f"from {base.url} anew"
        )
    return base.rev


def _extract_sdist(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as archive:
        members = archive.getmembers()
        top = {m.name.split("/", 1)[0] for m in members}
        if len(top) != 1:
            raise SeriesError(f"{sdist.name}: expected one top-level folder")
        prefix = top.pop() + "/"
        inside = [m for m in members if m.name.startswith(prefix)]
        for member in inside:
            member.name = member.name[len(prefix) :]
        extract(archive, dest, inside, sdist.name)


def extract_commit(repo: Path, commit: str, dest: Path) -> None:
    """The files of ``commit`` in ``repo`` into ``dest`` (no .git)."""
    archive = git(repo, "archive", "--format=tar", commit).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        extract(tar, dest, tar.getmembers(), f"git archive of {commit[:12]}")


def _extract_git(base: GitBase, commit: str, dest: Path) -> None:
    extract_commit(base.path, commit, dest)
    _write_version_metadata(base, git_version(base.path, commit), dest)


def git_version(repo: Path, commit: str) -> str:
    """The version setuptools-scm gives a checkout of ``commit`` (its
    guess-next-dev scheme): ``0.33.0`` on the tag v0.33.0, ``0.33.1.dev3+gabc1234``
    three commits past it; ``0.0.0.dev0+g...`` with no v* tag behind it."""
    described = git(
        repo, "describe", "--tags", "--long", "--match", "v[0-9]*", commit, check=False
    )
    short = git_out(repo, "rev-parse", "--short=9", commit)
    match = re.fullmatch(
        r"v(\d+(?:\.\d+)*)-(\d+)-g[0-9a-f]+", described.stdout.decode().strip()
    )
    if not match:
        return f"0.0.0.dev0+g{short}"
    release, distance = match.group(1), int(match.group(2))
    if distance == 0:
        return release
    parts = release.split(".")
    parts[-1] = str(int(parts[-1]) + 1)
    return f"{'.'.join(parts)}.dev{distance}+g{short}"


def _write_version_metadata(base: GitBase, version: str, dest: Path) -> None:
    """What an install of the checkout would generate and the sdist ships:
    ``<name>/_version.py`` and ``<name>.egg-info/PKG-INFO``. vLLM reads its
    own version through them at import (without it, it turns Triton off)."""
    version_file = dest / base.name / "_version.py"
    if not version_file.exists():
        numbers = tuple(
            int(p) if p.isdigit() else p for p in re.split(r"[.+]", version)
        )
        version_file.write_text(
            "# Written by the DSA series tool, as setuptools-scm would.\n"
            f"__version__ = version = {version!r}\n"
            f"__version_tuple__ = version_tuple = {numbers!r}\n"
            "__commit_id__ = commit_id = None\n"
        )
    info = dest / f"{base.name}.egg-info" / "PKG-INFO"
    if not info.exists():
        info.parent.mkdir(exist_ok=True)
        info.write_text(
            f"Metadata-Version: 2.1\nName: {base.name}\nVersion: {version}\n"
        )


def _base_message(base: Base) -> str:
    if isinstance(base, SdistBase):
        title = f"{base.name} {base.version} from {base.filename}"
    else:
        title = f"{base.name} from {base.url or base.path} at {base.rev}"
    return f"{title}\n\n{base_id(base)}\n"


def recorded_base_id(repo: Path) -> str | None:
    if not is_repo(repo):
        return None
    result = git(repo, "log", "-1", "--format=%B", BASE_REF, check=False)
    if result.returncode != 0:
        return None
    for line in result.stdout.decode().splitlines():
        if line.startswith("Base-"):
            return line
    return None


def prepare(
    series: Series,
    *,
    offline: bool = False,
    quiet: bool = False,
    repo: Path | None = None,
) -> Path:
    """Make sure the work repo (default: ``workdir(series)``) holds the
    series' base; return its path.

    An existing work repo for another base is an error, not overwritten. The
    work is done in a temporary folder and renamed into place at the end, so
    an interrupted prepare leaves nothing half-made behind.
    """
    repo = repo or workdir(series)
    expected = base_id(series.base)
    if repo.exists():
        found = recorded_base_id(repo)
        if found == expected:
            return repo
        raise SeriesError(
            f"{repo} exists but does not hold this base ({found or 'no base commit'}"
            f", expected {expected}); move it away or delete it, then run again"
        )
    staging = staging_dir(repo)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _make_base(series, staging, offline=offline, quiet=quiet)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.rename(repo)
    return repo


def _make_base(series: Series, staging: Path, *, offline: bool, quiet: bool) -> None:
    started = time.monotonic()
    if isinstance(series.base, SdistBase):
        _extract_sdist(fetch_sdist(series.base, offline=offline), staging)
    else:
        _extract_git(series.base, resolve_git_rev(series.base), staging)
    extracted = time.monotonic()
    identity = Identity(*TOOL_IDENTITY, date=BASE_DATE)
    git(staging, "init", "-q", "-b", SERIES_BRANCH)
    git(staging, "add", "-A", "-f")
    git(
        staging,
        "commit",
        "-q",
        "--no-verify",
        "-m",
        _base_message(series.base),
        identity=identity,
    )
    git(staging, "tag", BASE_TAG)
    if not quiet:
        commit = git_out(staging, "rev-parse", "--short=12", BASE_REF)
        print(
            f"prepared the base {commit} (extract {extracted - started:.1f} s, "
            f"base commit {time.monotonic() - extracted:.1f} s)"
        )
