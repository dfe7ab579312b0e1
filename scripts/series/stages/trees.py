# SPDX-License-Identifier: Apache-2.0
"""Per-stage test trees: a git worktree of the work repo at each stage's commit.

Tests of stage N run against the base plus stages 1..N, importable from this
tree, while the work tree itself stays where the user left it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series
from scripts.series.git import changed_files, git, rev_parse
from scripts.series.layout import stage_tree_dir, workdir
from scripts.series.stages.prepare import extract_commit
from scripts.series.stages.state import read_chain


def stage_tree(series: Series, stage_id: str) -> Path:
    """Return a clean tree at ``stage_id`` ("base" or a stage id)."""
    if stage_id != "base":
        series.stage(stage_id)  # an unknown id is an error of its own
    repo = workdir(series)
    chain = read_chain(series, repo)
    commit = chain.current_commit(stage_id)
    tree = stage_tree_dir(series, stage_id)
    if not (tree / ".git").exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        git(repo, "worktree", "prune")
        git(repo, "worktree", "add", "-q", "--detach", "--force", str(tree), commit)
        return tree
    if changed_files(tree):
        # The tests would run on those edits, not on the stage.
        raise SeriesError(
            f"test tree {tree} has edits (make them in the work tree, "
            f"{repo}); delete it to rebuild it"
        )
    if rev_parse(tree, "HEAD") != commit:
        git(tree, "checkout", "-q", "--detach", commit)
    return tree


# Written into a copy: the commit it holds and each of its files' sha256,
# so that the next copy-tree into it updates only what changed.
COPY_RECORD = ".dsa-series-copy.json"


def copy_tree(series: Series, stage_id: str, dest: Path) -> Path:
    """A plain copy (no .git) of the tree at ``stage_id``, to build and
    install vLLM from: a build writes into its tree (version file, egg-info,
    compiled extensions), which must not be one of the series' trees.

    Into a copy it made before, it writes only the files that differ between
    the two commits (a build's outputs stay, and unchanged files keep their
    times, so the rebuild is incremental); a file of the copy edited since
    that the update would replace or delete stops it, with nothing written."""
    if stage_id != "base":
        series.stage(stage_id)
    repo = workdir(series)
    commit = read_chain(series, repo).current_commit(stage_id)
    record = dest / COPY_RECORD
    if record.is_file():
        _update_copy(repo, commit, dest, json.loads(record.read_text()))
    elif dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise SeriesError(
            f"{dest} exists and is not an empty folder or a copy made by "
            "copy-tree; name a new one"
        )
    else:
        dest.mkdir(parents=True, exist_ok=True)
        extract_commit(repo, commit, dest)
    # What copy-tree wrote: each file's git blob id at the commit (not the
    # folder's contents, which may hold the user's edits).
    listing = git(repo, "ls-tree", "-r", "-z", commit).stdout.decode()
    blobs = {
        entry.split("\t", 1)[1]: entry.split()[2]
        for entry in listing.split("\0")
        if entry
    }
    text = json.dumps({"commit": commit, "files": blobs}, indent=1) + "\n"
    record.with_suffix(".tmp").write_text(text)
    record.with_suffix(".tmp").replace(record)
    return dest


def _blob_id(path: Path) -> str:
    """The git blob id of a file's contents ("" when it is absent)."""
    if not path.is_file():
        return ""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _update_copy(repo: Path, commit: str, dest: Path, recorded: dict) -> None:
    """Bring a copy from ``recorded["commit"]`` to ``commit``: check first,
    then write (a refusal writes nothing; after a failed write, running
    again finishes the update, since a file that already has the new
    contents counts as unedited)."""
    old, blobs = recorded["commit"], recorded["files"]
    if old == commit:
        return
    if rev_parse(repo, old) is None:
        raise SeriesError(
            f"{dest} holds commit {old[:12]}, which the work repo no longer "
            "has; copy into a new folder"
        )
    raw = git(
        repo, "diff", "--raw", "-z", "--no-renames", "--no-abbrev", old, commit
    ).stdout
    fields = [f.decode() for f in raw.split(b"\0") if f]
    updates = []  # (path, new mode, new blob id, new contents or None)
    for meta, name in zip(fields[::2], fields[1::2], strict=True):
        _, mode, _, blob, status = meta.split()
        data = None if status == "D" else git(repo, "show", f"{commit}:{name}").stdout
        updates.append((name, mode, blob, data))
    # A file may be replaced when absent (nothing to lose), or holding what
    # copy-tree wrote or the new contents; anything else is the user's.
    edited = [
        name
        for name, _, blob, data in updates
        if _blob_id(dest / name)
        not in {"", blobs.get(name, ""), "" if data is None else blob}
    ]
    if edited:
        raise SeriesError(
            f"{dest}: {', '.join(edited[:5])} changed since copy-tree wrote it, "
            "and the new stage changes it too; move your edit away or copy "
            "into a new folder (nothing written)"
        )
    for name, mode, _, data in updates:
        target = dest / name
        if data is None:
            target.unlink(missing_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(target.name + ".dsa-series-tmp")
        temporary.unlink(missing_ok=True)
        if mode == "120000":
            temporary.symlink_to(data.decode())
        else:
            temporary.write_bytes(data)
            temporary.chmod(0o755 if mode == "100755" else 0o644)
        temporary.replace(target)
