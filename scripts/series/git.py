# SPDX-License-Identifier: Apache-2.0
"""Run git with a fixed configuration, so results do not depend on the user's.

The user's global and system git config (aliases, format.*, diff.*, hooks,
autocrlf) would change commit ids and patch bytes; it is ignored here.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError

# Fixed identity for commits the tooling makes itself (the base commit).
TOOL_IDENTITY = ("dsa-indexer-series", "dsa-indexer-series@localhost")

_FIXED_CONFIG = (
    "core.autocrlf=false",
    "core.safecrlf=false",
    "core.fileMode=true",
    "core.hooksPath=/dev/null",
    "commit.gpgSign=false",
    "tag.gpgSign=false",
    "advice.detachedHead=false",
    "init.defaultBranch=series",
    "i18n.commitEncoding=UTF-8",
    "gc.auto=0",
    # Committer of the one commit made without an explicit identity: the
    # amend that folds tree edits into a stage (its author is kept).
    f"user.name={TOOL_IDENTITY[0]}",
    f"user.email={TOOL_IDENTITY[1]}",
)


@dataclass(frozen=True)
class Identity:
    name: str
    email: str
    date: str  # anything git accepts, e.g. "2026-10-18T00:00:00+00:00"


def git_env(identity: Identity | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GIT_") or k in ("GIT_SSH", "GIT_SSH_COMMAND")
    }
    env.update(
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        LC_ALL="C",
        LANG="C",
        TZ="UTC",
    )
    if identity is not None:
        env.update(
            GIT_AUTHOR_NAME=identity.name,
            GIT_AUTHOR_EMAIL=identity.email,
            GIT_AUTHOR_DATE=identity.date,
            GIT_COMMITTER_NAME=identity.name,
            GIT_COMMITTER_EMAIL=identity.email,
            GIT_COMMITTER_DATE=identity.date,
        )
    return env


def git(
    repo: Path,
    *args: str,
    identity: Identity | None = None,
    check: bool = True,
    input: bytes | None = None,
    index_file: Path | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``git -C repo args``; raise SeriesError with git's message on failure.

    ``index_file`` points git at a separate index (plumbing that must not
    touch the work tree)."""
    command = ["git", "-C", str(repo)]
    for item in _FIXED_CONFIG:
        command += ["-c", item]
    command += list(args)
    env = git_env(identity)
    if index_file is not None:
        env["GIT_INDEX_FILE"] = str(index_file)
    try:
        result = subprocess.run(command, env=env, capture_output=True, input=input)
    except FileNotFoundError:
        raise SeriesError("git is not installed (not found on PATH)") from None
    if check and result.returncode != 0:
        refused = ownership_refusal(result.stderr)
        if refused:
            raise SeriesError(refused)
        message = result.stderr.decode(errors="replace").strip()
        raise SeriesError(f"git {' '.join(args[:2])} failed in {repo}: {message}")
    return result


def status_as_the_user_sees_it(repo: Path) -> subprocess.CompletedProcess[bytes]:
    """``git status --porcelain`` with the user's own configuration, so that
    the files their global ignore file hides are not listed (the tool's
    other git calls ignore that configuration)."""
    env = {**os.environ, "LC_ALL": "C"}
    try:
        return subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain=v1", "-uall"],
            env=env,
            capture_output=True,
        )
    except FileNotFoundError:
        raise SeriesError("git is not installed (not found on PATH)") from None


def ownership_refusal(stderr: bytes) -> str | None:
    """The refusal to give for git's safe.directory check ("detected dubious
    ownership in repository at '...'"), or None for any other error. The
    user's safe.directory list is of no help: this tool ignores the user's
    git configuration (git_env)."""
    text = stderr.decode(errors="replace")
    if "dubious ownership" not in text:
        return None
    where = text.split("repository at", 1)[-1].split("\n", 1)[0].strip(" '")
    return (
        f"git refuses to read {where}: the checkout belongs to another user "
        "(git's safe.directory check), and this tool does not read your git "
        "configuration, so adding it to safe.directory does not help. Clone "
        f"it as yourself (`git clone {where} DEST`) and use DEST, or run as "
        "its owner"
    )


def git_out(repo: Path, *args: str) -> str:
    return git(repo, *args).stdout.decode().strip()


def is_repo(path: Path) -> bool:
    return (path / ".git").exists()


def changed_files(repo: Path) -> list[str]:
    """Uncommitted changes, untracked files included (ignored ones are not).
    A rename counts as its two paths: with renames, git would add the old
    path as an entry of its own, without the status this cuts off."""
    out = git(
        repo, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames"
    )
    entries = [e for e in out.stdout.decode().split("\0") if e]
    return [e[3:] for e in entries if len(e) > 3]


def files_with_conflict_markers(repo: Path) -> list[str]:
    """The files changed since HEAD that still hold a merge's conflict
    markers (lines starting <<<<<<< or >>>>>>>)."""
    changed = git_out(repo, "diff", "--name-only", "HEAD").split()
    if not changed:
        return []
    marked = git(
        repo, "grep", "-l", "-E", "^(<<<<<<<|>>>>>>>)( |$)", "--", *changed, check=False
    )
    return sorted(set(marked.stdout.decode().split()))


def untracked_files(repo: Path) -> list[str]:
    """Files git does not track and does not ignore."""
    out = git(repo, "ls-files", "-z", "--others", "--exclude-standard")
    return [e for e in out.stdout.decode().split("\0") if e]


def rev_parse(repo: Path, ref: str) -> str | None:
    """The commit ``ref`` names, or None if it names none."""
    return _peeled(repo, ref, "commit")


def tree_id(repo: Path, ref: str) -> str | None:
    """The tree of the commit ``ref`` names, or None if it names none."""
    return _peeled(repo, ref, "tree")


def _peeled(repo: Path, ref: str, kind: str) -> str | None:
    if "^{" in ref:
        raise ValueError(f"{ref!r}: name the ref, not an object type")
    result = git(
        repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{{kind}}}", check=False
    )
    return result.stdout.decode().strip() or None


def commit_verbatim(
    repo: Path, message: str, identity: Identity, *, allow_empty: bool = False
) -> str:
    """Commit the index with ``message`` kept byte for byte (a patch's
    author, date and text make the same commit id everywhere); return it."""
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".msg") as msg:
        msg.write(message)
        msg.flush()
        git(
            repo,
            "commit",
            "-q",
            "--no-verify",
            "--allow-empty-message",
            *(["--allow-empty"] if allow_empty else []),
            "--cleanup=verbatim",
            "-F",
            msg.name,
            identity=identity,
        )
    commit = rev_parse(repo, "HEAD")
    assert commit is not None
    return commit


def commit_tree(
    repo: Path, tree: str, parent: str, message: str, identity: Identity
) -> str:
    """The commit object of ``tree`` on ``parent`` (refs untouched); the same
    message and identity give the same id as ``commit_verbatim``."""
    out = git(
        repo,
        "commit-tree",
        tree,
        "-p",
        parent,
        "-F",
        "-",
        input=message.encode("utf-8"),
        identity=identity,
    )
    return out.stdout.decode().strip()


def add_blob_to_index(repo: Path, path: str, blob: str, index: Path) -> None:
    """Put ``blob`` at ``path`` (a plain file) in the scratch ``index``."""
    git(
        repo,
        "update-index",
        "--add",
        "--cacheinfo",
        f"100644,{blob},{path}",
        index_file=index,
    )
