# SPDX-License-Identifier: Apache-2.0
"""``refresh``: patches/*.patch (the glue, by ``git format-patch`` with fixed
flags) and vllm_overlay/ written from the stage commits."""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Collection, Sequence
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series, Stage
from scripts.series.files import write_whole
from scripts.series.git import (
    Identity,
    add_blob_to_index,
    changed_files,
    commit_tree,
    git,
    git_out,
    tree_id,
)
from scripts.series.layout import (
    REFRESH_BACKUP_REF,
    SERIES_BRANCH,
    carry_path,
    git_file,
    stage_tag,
    workdir,
)
from scripts.series.stages.patchfile import parse_patch, read_patch
from scripts.series.stages.state import (
    Chain,
    fingerprint,
    load_state,
    read_chain,
    save_state,
)

FORMAT_PATCH_FLAGS = (
    "--stdout",
    "--no-stat",
    "--no-signature",
    "--zero-commit",
    "--full-index",
    "--keep-subject",
    "--no-numbered",
    "--no-thread",
    "--no-renames",
    "--no-color",
    "--unified=3",
    "--diff-algorithm=myers",
    "--encoding=UTF-8",
)


def format_stage_patch(series: Series, repo: Path, stage: Stage, commit: str) -> bytes:
    """The canonical patch bytes for a stage commit, overlay modules left out."""
    excludes = [f":(exclude){path}" for s in series.stages for path in s.overlays]
    out = git(
        repo,
        "format-patch",
        *FORMAT_PATCH_FLAGS,
        f"{commit}^..{commit}",
        "--",
        ".",
        *excludes,
    ).stdout
    if not out:
        raise SeriesError(
            f"stage {stage.id}: its commit changes no vLLM file outside its "
            "overlays; a stage needs glue in vLLM (at least one hunk)"
        )
    return out


def overlay_bytes(repo: Path, commit: str, path: str) -> bytes | None:
    result = git(repo, "show", f"{commit}:{path}", check=False)
    return result.stdout if result.returncode == 0 else None


def _warn_new_files(stage: Stage, patch: Path) -> None:
    for path in read_patch(patch).new_files:
        print(
            f"warning: stage {stage.id}'s patch adds {path}; new modules belong "
            "in vllm_overlay/ (list it under the stage's overlays)",
            file=sys.stderr,
        )


def _stage_outputs(
    series: Series, repo: Path, stage: Stage, commit: str, overlays_from: str
) -> dict[Path, bytes]:
    """A stage's series files: its patch (from its commit) and overlays
    (from the commit ``overlays_from``), path -> bytes."""
    outputs = {
        series.patch_file(stage): format_stage_patch(series, repo, stage, commit)
    }
    for overlay in stage.overlays:
        data = overlay_bytes(repo, overlays_from, overlay)
        if data is None:
            raise SeriesError(f"stage {stage.id}: overlay {overlay} is not in the tree")
        outputs[series.overlay_file(overlay)] = data
    return outputs


def _refuse_cross_stage_overlay_edits(
    series: Series, repo: Path, commits: list[tuple[Stage, str]]
) -> None:
    owner = {path: s for s in series.stages for path in s.overlays}
    for stage, commit in commits:
        touched = git(repo, "diff", "--name-only", f"{commit}^", commit).stdout
        for path in touched.decode().split():
            if path in owner and owner[path] is not stage:
                raise SeriesError(
                    f"stage {stage.id}'s commit changes {path}, an overlay of stage "
                    f"{owner[path].id}; put that change in stage "
                    f"{owner[path].id} (apply --upto {owner[path].id}, edit, "
                    "refresh) or in a module of stage "
                    f"{stage.id}'s own"
                )


_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? ")


def lines_added_by(
    repo: Path,
    diff: Sequence[str],
    rev: str,
    owner_of: dict[str, Stage],
    skip: Collection[str] = (),
) -> dict[tuple[str, str], list[int]]:
    """The lines that ``git diff -U0 DIFF`` changes or removes and a stage
    commit in ``owner_of`` added (``git blame`` at ``rev``, the diff's old
    side): (path, stage id) -> their line numbers at ``rev``. Files in
    ``skip`` are left out."""
    text = git(repo, "diff", "-U0", "--no-renames", *diff).stdout.decode()
    found: dict[tuple[str, str], list[int]] = {}
    path = None
    for line in text.splitlines():
        if line.startswith("--- "):
            path = line[6:] if line.startswith("--- a/") else None
        elif path and path not in skip and (match := _HUNK_HEADER.match(line)):
            start, count = int(match.group(1)), int(match.group(2) or 1)
            if count == 0:
                continue  # lines only added
            blame = git(
                repo, "blame", "--porcelain", "-L", f"{start},+{count}", rev, "--", path
            ).stdout.decode()
            for entry in blame.splitlines():
                fields = entry.split()
                if len(fields) >= 3 and len(fields[0]) == 40 and fields[0] in owner_of:
                    stage = owner_of[fields[0]]
                    found.setdefault((path, stage.id), []).append(int(fields[2]))
    return found


def _refuse_edits_to_lower_stages(
    series: Series, repo: Path, commits: list[tuple[Stage, str]]
) -> None:
    """Uncommitted edits go to the top stage. An edit that changes or removes
    lines a lower stage added would silently become a hunk of the top stage,
    so it stops here, naming the stage that owns the lines (``git blame``);
    ``--into-top`` takes it into the top stage on purpose."""
    top = commits[-1][0]
    owner_of = {commit: stage for stage, commit in commits[:-1]}
    overlays = {path for stage in series.stages for path in stage.overlays}
    found = lines_added_by(repo, ("HEAD",), "HEAD", owner_of, skip=overlays)
    if not found:
        return
    where = "; ".join(
        f"{path} line{'s' if len(lines) > 1 else ''} "
        f"{min(lines)}{f'-{max(lines)}' if len(lines) > 1 else ''}: stage {stage_id}"
        for (path, stage_id), lines in sorted(found.items())
    )
    first = sorted(found)[0][1]
    tree = shlex.quote(str(repo))
    raise SeriesError(
        f"the uncommitted edits change lines that a lower stage adds ({where}), "
        f"and would go into stage {top.id} as new hunks. To change the stage "
        f"that owns them, make the edit there: `git -C {tree} stash`, "
        f"`apply --upto {first}`, `git -C {tree} stash pop`, `refresh` (the "
        f"later stages follow). To have stage {top.id} change them on purpose, run "
        "`refresh --into-top`. Nothing was written."
    )


def _stages_below_head(repo: Path, chain: Chain) -> list[tuple[Stage, str]]:
    """The recorded stage commits that HEAD builds on (a prefix of the chain)."""

    def is_ancestor(commit: str) -> bool:
        result = git(repo, "merge-base", "--is-ancestor", commit, "HEAD", check=False)
        return result.returncode == 0

    if not is_ancestor(chain.base):
        raise SeriesError(
            f"HEAD does not build on the base ({chain.base[:12]}); check out the "
            "series branch first"
        )
    below = []
    for stage, commit in chain.applied:
        if not is_ancestor(commit):
            break
        below.append((stage, commit))
    return below


def refresh(series: Series, *, into_top: bool = False) -> list[Stage]:
    """Turn the work tree's state into patch files; return the stages changed.

    It works on the stages HEAD builds on, so the tree may be at an earlier
    stage (``apply --upto``). Commits on top of them become the next stages
    in series.toml (one commit per stage, their patch files not written yet).
    Uncommitted edits go to the top stage, except edits to an overlay module,
    which go to the stage that owns it; an edit to lines a lower stage adds
    is refused, naming that stage, unless ``into_top``.

    Everything is worked out in git's object store before anything changes:
    the edits folded into a commit (HEAD and the tree untouched), every
    series file's bytes, and the stages rebuilt from those bytes as a fresh
    apply would, which must give the tree that was exported. Only then are
    the series files written (each whole) and the tree's refs moved to the
    rebuilt stages; the tree's files stay as they are. A refresh that fails
    changes nothing; one killed while writing is finished by running it
    again. It refuses to overwrite a series file that changed since the
    tree was applied (an edit the tree does not hold), unless the file
    already holds what it would write.
    """
    from scripts.series.stages.apply import refuse_foreign_branch

    repo = workdir(series)
    if carry_path(repo).exists():
        raise SeriesError(
            "a carried stage waits for its conflicts to be resolved; finish it "
            "with `nox -s apply -- --continue` (or `--abort`) before refresh"
        )
    chain = read_chain(series, repo)
    below = _stages_below_head(repo, chain)
    tip = below[-1][1] if below else chain.base
    extra = git(repo, "rev-list", "--reverse", f"{tip}..HEAD").stdout.split()
    new_stages = series.stages[len(below) :]
    if len(extra) > len(new_stages):
        raise SeriesError(
            f"{len(extra)} commits sit on top of stage "
            f"{below[-1][0].id if below else 'base'} but series.toml lists "
            f"{len(new_stages)} stage(s) after it; add a [[stage]] entry for each "
            "commit, in order"
        )
    for stage, commit in zip(new_stages, extra, strict=False):
        if not series.patch_file(stage).exists():
            continue  # a new stage
        # The stage itself, amended (`git commit --amend`) or carried: the
        # commit has the stage's subject. Anything else would overwrite it.
        message = read_patch(series.patch_file(stage)).message
        # git's %s: the first paragraph, its lines joined by spaces
        subject = " ".join(message.split("\n\n", 1)[0].splitlines())
        if git_out(repo, "log", "-1", "--format=%s", commit.decode()) != subject:
            raise SeriesError(
                f"a commit on top of the tree would become stage {stage.id}, which "
                f"already has {stage.patch}, but its subject is not the stage's "
                f"({subject!r}); apply up to the last stage and commit on top of "
                "it, or keep the stage's subject when amending it"
            )
    commits = list(below)
    commits += [(s, c.decode()) for s, c in zip(new_stages, extra, strict=False)]
    if not commits:
        raise SeriesError("nothing to refresh: no stage is applied")
    _refuse_cross_stage_overlay_edits(series, repo, commits)
    if not into_top:
        _refuse_edits_to_lower_stages(series, repo, commits)
    refuse_foreign_branch(repo, chain)

    if changed_files(repo):
        commits[-1] = (commits[-1][0], _fold_edits(repo))
    final = commits[-1][1]
    outputs = {
        stage: _stage_outputs(series, repo, stage, commit, final)
        for stage, commit in commits
    }
    _refuse_overwriting_newer_files(series, below, chain.base, outputs)
    rebuilt = _rebuild(series, repo, chain.base, commits, outputs)
    git(repo, "update-ref", REFRESH_BACKUP_REF, final)

    changed = []
    for stage, files in outputs.items():
        stale = [p for p, d in files.items() if not p.exists() or p.read_bytes() != d]
        for path in stale:
            # Whole or not at all: a refresh killed here is finished by the next.
            write_whole(path, files[path])
        if stale:
            changed.append(stage)
        _warn_new_files(stage, series.patch_file(stage))
    _adopt(series, repo, chain.base, rebuilt)
    return changed


def _fold_edits(repo: Path) -> str:
    """HEAD with the tree's uncommitted edits (untracked files too), as a
    commit that keeps HEAD's author and message; HEAD, the index and the
    tree are left as they are."""
    index = git_file(repo, "dsa-series-refresh-index")
    try:
        git(repo, "read-tree", "HEAD", index_file=index)
        git(repo, "add", "-A", index_file=index)
        tree = git(repo, "write-tree", index_file=index).stdout.decode().strip()
    finally:
        index.unlink(missing_ok=True)
    fields = git_out(repo, "log", "-1", "--format=%an%x00%ae%x00%aI%x00%P", "HEAD")
    name, email, date, parent = fields.split("\0")
    message = git(repo, "log", "-1", "--format=%B", "HEAD").stdout.decode()
    # %B ends with one newline more than the message holds.
    return commit_tree(
        repo, tree, parent.split()[0], message[:-1], Identity(name, email, date)
    )


def _refuse_overwriting_newer_files(
    series: Series,
    below: list[tuple[Stage, str]],
    base: str,
    outputs: dict[Stage, dict[Path, bytes]],
) -> None:
    """A series file edited after the tree was applied is newer than the tree:
    refuse rather than overwrite it. A file that already holds what refresh
    writes (from a refresh killed while writing) is no edit."""
    state = load_state(workdir(series))
    parent = base
    newer = []
    for stage, commit in below:
        record = state.get(stage.id, {})
        if record.get("inputs") != fingerprint(series, stage, parent):
            files = outputs.get(stage, {series.patch_file(stage): b""})
            newer += [
                path
                for path, data in files.items()
                if not path.exists() or path.read_bytes() != data
            ]
        parent = commit
    if newer:
        shown = ", ".join(str(p.relative_to(series.root)) for p in newer)
        raise SeriesError(
            f"{shown} changed since the tree was applied, so the tree is older "
            "than them and refresh would overwrite them; run `nox -s apply` to rebuild "
            "the tree from them (commit or stash tree edits first)"
        )


def _rebuild(
    series: Series,
    repo: Path,
    base: str,
    commits: list[tuple[Stage, str]],
    outputs: dict[Stage, dict[Path, bytes]],
) -> list[tuple[Stage, str]]:
    """The stage commits a fresh apply makes from ``outputs``, built in git's
    object store; refuse if the top one's tree is not the exported tree
    (what the series files cannot carry: a mode change, a symlink)."""
    index = git_file(repo, "dsa-series-rebuild-index")
    rebuilt = []
    parent = base
    try:
        git(repo, "read-tree", base, index_file=index)
        for stage, _ in commits:
            patch = series.patch_file(stage)
            data = outputs[stage][patch]
            git(
                repo,
                "apply",
                "--cached",
                "--whitespace=nowarn",
                "-",
                input=data,
                index_file=index,
            )
            for overlay in stage.overlays:
                module = outputs[stage][series.overlay_file(overlay)]
                blob = _blob_of(repo, overlay, module)
                add_blob_to_index(repo, overlay, blob, index)
            tree = git(repo, "write-tree", index_file=index).stdout.decode().strip()
            info = parse_patch(data)
            parent = commit_tree(repo, tree, parent, info.message, info.author)
            rebuilt.append((stage, parent))
    finally:
        index.unlink(missing_ok=True)
    exported = commits[-1][1]
    if tree_id(repo, parent) != tree_id(repo, exported):
        diff = git(repo, "diff", "--raw", exported, parent).stdout.decode()
        differences = [line.split(maxsplit=5)[-1] for line in diff.splitlines()]
        raise SeriesError(
            "the stages re-applied from the series files would differ from your "
            f"tree in {', '.join(differences)} (the series keeps an overlay as a "
            "plain file: no mode change, no symlink); nothing was written"
        )
    return rebuilt


def _blob_of(repo: Path, path: str, data: bytes) -> str:
    """The blob id of ``data`` at ``path``, written to the object store (the
    path's attributes apply, as they do when apply adds the overlay)."""
    blob = git(repo, "hash-object", "-w", f"--path={path}", "--stdin", input=data)
    return blob.stdout.decode().strip()


def _adopt(
    series: Series, repo: Path, base: str, rebuilt: list[tuple[Stage, str]]
) -> None:
    """Record the rebuilt stages and put the series branch and HEAD on the
    top one. Its tree is the work tree's, so no file changes; the index is
    reset to it."""
    state = load_state(repo)
    parent = base
    for stage, commit in rebuilt:
        state[stage.id] = {
            "commit": commit,
            "inputs": fingerprint(series, stage, parent),
        }
        parent = commit
    save_state(repo, state)
    for stage, commit in rebuilt:
        git(repo, "tag", "-f", stage_tag(stage.id), commit)
    git(repo, "update-ref", f"refs/heads/{SERIES_BRANCH}", parent)
    git(repo, "symbolic-ref", "HEAD", f"refs/heads/{SERIES_BRANCH}")
    git(repo, "reset", "-q")
