# SPDX-License-Identifier: Apache-2.0
"""Write patches/*.patch and vllm_overlay/ from the stage commits (``refresh``).

A patch file holds a stage's glue: its changes to vLLM's files, without the
overlay modules (those are copied to vllm_overlay/). ``git format-patch`` runs
with fixed flags and a fixed git configuration, so two exports of the same
commit are byte-identical.
"""

from __future__ import annotations

import sys
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series, Stage
from scripts.series.git import changed_files, git, rev_parse
from scripts.series.layout import (
    REFRESH_BACKUP_REF,
    SERIES_BRANCH,
    stage_tag,
    workdir,
)
from scripts.series.patchfile import read_patch
from scripts.series.state import (
    Chain,
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


def _write_stage(
    series: Series, repo: Path, stage: Stage, commit: str, overlays_from: str
) -> bool:
    """Write a stage's patch (from its commit) and overlays (from the commit
    ``overlays_from``); return whether any file changed."""
    outputs = {
        series.patches_dir / stage.patch: format_stage_patch(
            series, repo, stage, commit
        )
    }
    for overlay in stage.overlays:
        data = overlay_bytes(repo, overlays_from, overlay)
        if data is None:
            raise SeriesError(f"stage {stage.id}: overlay {overlay} is not in the tree")
        outputs[series.overlay_file(overlay)] = data
    changed = False
    for path, data in outputs.items():
        if not path.exists() or path.read_bytes() != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            changed = True
    _warn_new_files(stage, series.patches_dir / stage.patch)
    return changed


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


def refresh(series: Series) -> list[Stage]:
    """Turn the work tree's state into patch files; return the stages changed.

    It works on the stages HEAD builds on, so the tree may be at an earlier
    stage (``apply --upto``). Commits on top of them become the next stages
    in series.toml (one commit per stage, their patch files not written yet).
    It refuses when patches/ or vllm_overlay/ changed since the tree was
    applied: the tree is then older than those files.
    Uncommitted edits go to the top stage, except edits to an overlay module,
    which go to the stage that owns it. Afterwards the stages are re-applied
    from the new files, and the result must equal the tree that was exported;
    that state stays at refs/dsa-series/before-refresh either way.
    """
    from scripts.series.apply import apply

    repo = workdir(series)
    chain = read_chain(series, repo)
    below = _stages_below_head(repo, chain)
    stale = below[chain.current :]
    if stale:
        files = [f"patches/{s.patch}" for s, _ in stale]
        files += [f"vllm_overlay/{o}" for s, _ in stale for o in s.overlays]
        raise SeriesError(
            f"{', '.join(files)} changed since the tree was applied, so the tree "
            "is older than them and refresh would overwrite them; run apply to "
            "rebuild the tree from them (commit or stash tree edits first)"
        )
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
    for stage in new_stages[: len(extra)]:
        if (series.patches_dir / stage.patch).exists():
            raise SeriesError(
                f"a commit on top of the tree would become stage {stage.id}, which "
                f"already has {stage.patch}; apply up to the last stage and commit "
                "on top of it"
            )
    commits = list(below)
    commits += [(s, c.decode()) for s, c in zip(new_stages, extra, strict=False)]
    if not commits:
        raise SeriesError("nothing to refresh: no stage is applied")
    _refuse_cross_stage_overlay_edits(series, repo, commits)
    if changed_files(repo):
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "--no-verify", "--amend", "--no-edit")
        folded = rev_parse(repo, "HEAD")
        assert folded is not None
        commits[-1] = (commits[-1][0], folded)
    git(repo, "update-ref", REFRESH_BACKUP_REF, "HEAD")
    exported_tree = rev_parse(repo, "HEAD^{tree}")

    final = commits[-1][1]
    changed = [s for s, c in commits if _write_stage(series, repo, s, c, final)]

    # Rebuild the stages from the files just written, as a fresh apply would.
    state = load_state(repo)
    for stage, commit in commits:
        state[stage.id] = {"commit": commit, "inputs": "refreshed"}
        git(repo, "tag", "-f", stage_tag(stage.id), commit)
    save_state(repo, state)
    git(repo, "checkout", "-q", "-B", SERIES_BRANCH, chain.base)
    apply(series, commits[-1][0].id, quiet=True)
    if rev_parse(repo, "HEAD^{tree}") != exported_tree:
        diff = git(
            repo, "diff", "--name-only", REFRESH_BACKUP_REF, "HEAD"
        ).stdout.decode()
        raise SeriesError(
            "the re-applied stages differ from the tree that was exported in: "
            f"{diff.split()}; your work is kept at {REFRESH_BACKUP_REF}"
        )
    return changed
