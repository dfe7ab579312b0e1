# SPDX-License-Identifier: Apache-2.0
"""Write patches/*.patch and vllm_overlay/ from the stage commits (``refresh``).

A patch file holds a stage's glue: its changes to vLLM's files, without the
overlay modules (those are copied to vllm_overlay/). ``git format-patch`` runs
with fixed flags and a fixed git configuration, so two exports of the same
commit are byte-identical.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series, Stage
from scripts.series.git import changed_files, git, git_out, rev_parse, tree_id
from scripts.series.layout import (
    REFRESH_BACKUP_REF,
    REFRESH_JOURNAL_FILE,
    SERIES_BRANCH,
    carry_path,
    git_file,
    stage_tag,
    stage_tag_ref,
    workdir,
)
from scripts.series.stages.patchfile import read_patch
from scripts.series.stages.state import (
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
    series: Series,
    repo: Path,
    stage: Stage,
    commit: str,
    overlays_from: str,
    journal: _Journal,
) -> bool:
    """Write a stage's patch (from its commit) and overlays (from the commit
    ``overlays_from``); return whether any file changed."""
    outputs = {
        series.patch_file(stage): format_stage_patch(series, repo, stage, commit)
    }
    for overlay in stage.overlays:
        data = overlay_bytes(repo, overlays_from, overlay)
        if data is None:
            raise SeriesError(f"stage {stage.id}: overlay {overlay} is not in the tree")
        outputs[series.overlay_file(overlay)] = data
    changed = False
    for path, data in outputs.items():
        if not path.exists() or path.read_bytes() != data:
            journal.writing(repo, path, data)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            changed = True
    _warn_new_files(stage, series.patch_file(stage))
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


_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? ")


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
    diff = git(repo, "diff", "-U0", "--no-renames", "HEAD").stdout.decode()
    found: dict[tuple[str, str], list[int]] = {}
    path = None
    for line in diff.splitlines():
        if line.startswith("--- "):
            path = line[6:] if line.startswith("--- a/") else None
        elif path and path not in overlays and (match := _HUNK_HEADER.match(line)):
            start, count = int(match.group(1)), int(match.group(2) or 1)
            if count == 0:
                continue  # lines only added: the top stage's
            blame = git(
                repo,
                "blame",
                "--porcelain",
                "-L",
                f"{start},+{count}",
                "HEAD",
                "--",
                path,
            ).stdout.decode()
            for entry in blame.splitlines():
                fields = entry.split()
                if len(fields) >= 3 and len(fields[0]) == 40 and fields[0] in owner_of:
                    stage = owner_of[fields[0]]
                    found.setdefault((path, stage.id), []).append(int(fields[2]))
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
        f"`apply --upto {first}`, `git -C {tree} stash pop`, `refresh`, then "
        f"`apply`. To have stage {top.id} change them on purpose, run "
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
    It refuses when patches/ or vllm_overlay/ changed since the tree was
    applied: the tree is then older than those files.
    Uncommitted edits go to the top stage, except edits to an overlay module,
    which go to the stage that owns it; an edit to lines a lower stage adds
    is refused, naming that stage, unless ``into_top``. Afterwards the
    stages are re-applied from the new files, and the result must equal the
    tree that was exported; that state stays at refs/dsa-series/before-refresh
    either way.
    """
    from scripts.series.stages.apply import refuse_foreign_branch

    repo = workdir(series)
    recover_interrupted_refresh(repo)
    if carry_path(repo).exists():
        raise SeriesError(
            "a carried stage waits for its conflicts to be resolved; finish it "
            "with `nox -s apply -- --continue` (or `--abort`) before refresh"
        )
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
    journal = _Journal.begin(series, repo, commits)
    try:
        changed = _refresh(series, repo, chain, commits, journal)
    except BaseException:
        journal.roll_back(repo, keep=False)  # nobody else touched anything
        raise
    journal.end(repo)
    return changed


def _refresh(
    series: Series,
    repo: Path,
    chain: Chain,
    commits: list[tuple[Stage, str]],
    journal: _Journal,
) -> list[Stage]:
    from scripts.series.stages.apply import apply

    if changed_files(repo):
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "--no-verify", "--amend", "--no-edit")
        folded = rev_parse(repo, "HEAD")
        assert folded is not None
        commits[-1] = (commits[-1][0], folded)
        journal.folded(repo, folded)
    git(repo, "update-ref", REFRESH_BACKUP_REF, "HEAD")
    exported_tree = tree_id(repo, "HEAD")
    assert exported_tree is not None  # HEAD is the commit just folded or kept

    final = commits[-1][1]
    changed = [
        s for s, c in commits if _write_stage(series, repo, s, c, final, journal)
    ]

    # Rebuild the stages from the files just written, as a fresh apply would.
    state = load_state(repo)
    for stage, commit in commits:
        state[stage.id] = {"commit": commit, "inputs": "refreshed"}
        git(repo, "tag", "-f", stage_tag(stage.id), commit)
    save_state(repo, state)
    git(repo, "checkout", "-q", "-B", SERIES_BRANCH, chain.base)
    apply(series, commits[-1][0].id, quiet=True)
    if tree_id(repo, "HEAD") != exported_tree:
        # What the series files cannot carry: an overlay's file mode, a
        # symlink (written as a file holding its target).
        diff = git(repo, "diff", "--raw", REFRESH_BACKUP_REF, "HEAD").stdout.decode()
        differences = [line.split(maxsplit=5)[-1] for line in diff.splitlines()]
        raise SeriesError(
            "the re-applied stages differ from the tree that was exported in "
            f"{', '.join(differences)} (the series keeps an overlay as a plain "
            "file: no mode change, no symlink); refresh was undone (your edits "
            f"are in the tree again, and at {REFRESH_BACKUP_REF})"
        )
    return changed


@dataclass
class _Journal:
    """What a refresh changes, recorded before it changes anything, so that a
    refresh that fails or is killed is undone: the series files it writes,
    the stage state and tags, and HEAD (the tree edits it folds into a commit
    go back to being uncommitted edits). Kept in .git/ until it is done."""

    head: str
    branch: str | None  # the branch HEAD was on; None when detached
    state: dict[str, dict[str, str]]
    tags: dict[str, str | None]
    files: dict[str, str | None]  # path -> original bytes (base64), None: absent
    had_edits: bool  # uncommitted edits, which refresh folds into a commit
    folded_into: str | None = None
    written: dict[str, str] = field(default_factory=dict)  # path -> sha256

    @classmethod
    def begin(
        cls, series: Series, repo: Path, commits: list[tuple[Stage, str]]
    ) -> _Journal:
        paths = [series.patch_file(s) for s in series.stages]
        paths += [series.overlay_file(o) for s, _ in commits for o in s.overlays]
        head = rev_parse(repo, "HEAD")
        assert head is not None
        branch = git(repo, "symbolic-ref", "-q", "--short", "HEAD", check=False)
        journal = cls(
            head=head,
            branch=branch.stdout.decode().strip() or None,
            state=load_state(repo),
            tags={s.id: rev_parse(repo, stage_tag_ref(s.id)) for s in series.stages},
            had_edits=bool(changed_files(repo)),
            files={
                str(p): base64.b64encode(p.read_bytes()).decode()
                if p.exists()
                else None
                for p in paths
            },
        )
        journal._save(repo)
        return journal

    def writing(self, repo: Path, path: Path, data: bytes) -> None:
        """Record what refresh is about to write to ``path``, so an undo
        after a kill can tell its writes from the user's later edits."""
        self.written[str(path)] = hashlib.sha256(data).hexdigest()
        self._save(repo)

    def folded(self, repo: Path, commit: str) -> None:
        self.folded_into = commit
        self._save(repo)

    def _save(self, repo: Path) -> None:
        path = git_file(repo, REFRESH_JOURNAL_FILE)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)

    def end(self, repo: Path) -> None:
        git_file(repo, REFRESH_JOURNAL_FILE).unlink()

    def roll_back(self, repo: Path, *, keep: bool = True) -> list[str]:
        """Undo the refresh. After a kill (``keep``), edits made since to the
        series files or the tree are kept first, and where is returned: an
        undo never destroys what it did not write itself."""
        kept = []
        for name, data in self.files.items():
            path = Path(name)
            original = None if data is None else base64.b64decode(data)
            if (
                keep
                and path.is_file()
                and path.read_bytes() != original
                and hashlib.sha256(path.read_bytes()).hexdigest()
                != self.written.get(name)
            ):
                copy = path.with_name(path.name + KEPT_SUFFIX)
                copy.write_bytes(path.read_bytes())
                kept.append(str(copy))
            if original is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(original)
        save_state(repo, self.state)
        for stage_id, commit in self.tags.items():
            if commit:
                git(repo, "tag", "-f", stage_tag(stage_id), commit)
            else:
                git(repo, "tag", "-d", stage_tag(stage_id), check=False)
        # The tree as refresh found it: HEAD (and its branch) where it was,
        # the folded edits back in the work tree, uncommitted.
        folded = self.folded_into
        if self.had_edits and folded is None:
            head = rev_parse(repo, "HEAD")
            if head == self.head:
                # Never folded: HEAD and the edits are where they were.
                self.end(repo)
                return kept
            # Killed between the amend and its journal entry: HEAD is the fold.
            folded = head
        if keep and changed_files(repo):
            # Edits made since the kill: kept, before the tree is reset.
            index = git_file(repo, "dsa-series-kept-index")
            git(repo, "add", "-A", index_file=index)
            tree = git(repo, "write-tree", index_file=index).stdout.decode().strip()
            index.unlink()
            commit = git_out(
                repo, "commit-tree", tree, "-p", "HEAD", "-m", "the tree an "
                "interrupted refresh was undone over",
            )  # fmt: skip
            git(repo, "update-ref", KEPT_TREE_REF, commit)
            kept.append(f"{repo} at {KEPT_TREE_REF}")
        git(repo, "checkout", "-q", "-f", "--detach", folded or self.head)
        git(repo, "reset", "-q", "--soft", self.head)
        if self.branch:
            git(repo, "checkout", "-q", "-B", self.branch)
        git(repo, "reset", "-q")
        self.end(repo)
        return kept


# Where an undo keeps what it found changed: series files beside themselves,
# the work tree as a commit.
KEPT_SUFFIX = ".kept-by-undo"
KEPT_TREE_REF = "refs/dsa-series/kept-by-undo"


def refresh_is_pending(repo: Path) -> bool:
    """Whether a killed refresh waits to be undone by a writing command."""
    return git_file(repo, REFRESH_JOURNAL_FILE).exists()


def recover_interrupted_refresh(repo: Path) -> None:
    """Undo a refresh that was killed (its journal is still in .git/)."""
    path = git_file(repo, REFRESH_JOURNAL_FILE)
    if not path.exists():
        return
    kept = _Journal(**json.loads(path.read_text())).roll_back(repo)
    print(
        "an earlier refresh was interrupted and has been undone: the series "
        "files, the tree and its edits are as they were before it"
    )
    if kept:
        print("edits made after the kill were kept before the undo: " + "; ".join(kept))
