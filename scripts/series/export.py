# SPDX-License-Identifier: Apache-2.0
"""Export each stage as its own upstream vLLM pull request.

A stage's PR is one commit: its glue and its overlay modules folded
together, on the pinned base (or, when it does not apply there, on the PR of
the stage it needs first), with a description in vLLM's PR template. It is
written as a branch ``pr/<id>`` in the work repo and as a patch plus a
description under ``build/export/<base>/``. Everything is made with git plumbing
and a temporary index, so the work tree is not touched, and with fixed
identities and dates, so two exports are byte-identical.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series, Stage
from scripts.series.git import Identity, commit_tree, git, git_out, rev_parse
from scripts.series.layout import export_dir, exported_ref, pr_branch, workdir
from scripts.series.refresh import FORMAT_PATCH_FLAGS
from scripts.series.state import read_chain

_TRAILER = re.compile(r"^[A-Za-z-]+: .+$")


@dataclass(frozen=True)
class PullRequest:
    stage: Stage
    branch: str
    commit: str
    needs: str | None  # the stage whose PR must land first, if any
    patch: Path
    description: Path


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:60]


def _split_message(message: str) -> tuple[str, str, list[str]]:
    """Subject, body and trailers (Signed-off-by, Co-authored-by, ...)."""
    subject, _, rest = message.strip().partition("\n")
    lines = rest.strip().splitlines()
    trailers: list[str] = []
    while lines and (_TRAILER.match(lines[-1]) or not lines[-1].strip()):
        if lines[-1].strip():
            trailers.insert(0, lines[-1])
        lines.pop()
    return subject, "\n".join(lines).strip(), trailers


def _results_section(series: Series, stage: Stage) -> str:
    doc = series.root / "docs" / f"stage_{stage.id}.md"
    if not doc.exists():
        return "See the test plan; no recorded results yet."
    text = doc.read_text(encoding="utf-8")
    found = re.search(r"^## Results\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return found.group(1).strip() if found else text.strip()


def pr_description(series: Series, stage: Stage, message: str) -> str:
    """vLLM's PR template: purpose, test plan, test results, sign-off."""
    subject, body, trailers = _split_message(message)
    test_dir = series.tests_dir / stage.tests
    tests = (
        sorted(p.name for p in test_dir.glob("test_*.py")) if test_dir.is_dir() else []
    )
    plan = [
        f"CPU, on vLLM {getattr(series.base, 'version', series.base.label)} "
        f'with this change: `nox -s "tests({stage.id})"`, which runs:',
        *[f"- `tests/{stage.tests}/{name}`" for name in tests],
    ]
    sections = [
        subject,
        "",
        "## Purpose",
        "",
        body,
        "",
        "## Test Plan",
        "",
        *plan,
        "",
        "## Test Result",
        "",
        _results_section(series, stage),
        "",
        *trailers,
    ]
    return "\n".join(sections).rstrip() + "\n"


def _try_apply(repo: Path, parent: str, diff: bytes, index: Path) -> bool:
    git(repo, "read-tree", parent, index_file=index)
    check = git(
        repo,
        "apply",
        "--cached",
        "--check",
        "-",
        input=diff,
        index_file=index,
        check=False,
    )
    return check.returncode == 0


def _explain_missing_dependency(
    repo: Path, stage: Stage, diff: bytes, index: Path, done: dict[str, PullRequest]
) -> None:
    for other in reversed(done.values()):
        if _try_apply(repo, other.commit, diff, index):
            raise SeriesError(
                f"stage {stage.id} applies only on stage {other.stage.id}'s changes; "
                f'add depends_on = ["{other.stage.id}"] to its [[stage]] entry'
            )
    raise SeriesError(
        f"stage {stage.id} applies neither on the base nor on the PR of a stage it "
        f"depends on ({', '.join(stage.depends_on) or 'none declared'})"
    )


def _refuse_to_move_a_users_branch(
    repo: Path, branch: str, pr_commit: str, stage: Stage
) -> None:
    """A PR branch is export's to move only while it holds what export last
    wrote there, and is not checked out anywhere."""
    ref = f"refs/heads/{branch}"
    tip = rev_parse(repo, ref)
    if tip is None or tip == pr_commit:
        return
    if tip != rev_parse(repo, exported_ref(stage.id)):
        raise SeriesError(
            f"{branch} in {repo} holds commits export did not make (tip "
            f"{tip[:12]}); keep them under another name (`git -C {repo} branch "
            f"-m {branch} my-{branch}`), then export again"
        )
    worktrees = git_out(repo, "worktree", "list", "--porcelain").splitlines()
    if f"branch {ref}" in worktrees:
        raise SeriesError(
            f"{branch} is checked out in a work tree of {repo}; check out "
            "another branch there, then export again"
        )


def export_stage(
    series: Series, stage: Stage, done: dict[str, PullRequest]
) -> PullRequest:
    repo = workdir(series)
    chain = read_chain(series, repo)
    commit = chain.current_commit(stage.id)
    diff = git(repo, "diff", "--full-index", "--binary", f"{commit}^", commit).stdout
    message = git_out(repo, "log", "-1", "--format=%B", commit)
    author = git_out(repo, "log", "-1", "--format=%an%n%ae%n%aI", commit).split("\n")
    identity = Identity(author[0], author[1], author[2])
    with tempfile.TemporaryDirectory() as tmp:
        index = Path(tmp) / "index"
        needs = None
        parent = chain.base
        if not _try_apply(repo, parent, diff, index):
            for dep in reversed(stage.depends_on):
                if dep in done and _try_apply(repo, done[dep].commit, diff, index):
                    needs, parent = dep, done[dep].commit
                    break
            else:
                _explain_missing_dependency(repo, stage, diff, index, done)
        git(repo, "apply", "--cached", "-", input=diff, index_file=index)
        tree = git(repo, "write-tree", index_file=index).stdout.decode().strip()
    description = pr_description(series, stage, message)
    pr_commit = commit_tree(repo, tree, parent, description, identity)
    branch = pr_branch(stage.id)
    _refuse_to_move_a_users_branch(repo, branch, pr_commit, stage)
    git(repo, "update-ref", f"refs/heads/{branch}", pr_commit)
    git(repo, "update-ref", exported_ref(stage.id), pr_commit)
    out = export_dir(series)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{stage.id}-{_slug(stage.title)}"
    patch = out / f"{name}.patch"
    patch.write_bytes(
        git(repo, "format-patch", *FORMAT_PATCH_FLAGS, f"{parent}..{pr_commit}").stdout
    )
    description_file = out / f"{name}.md"
    description_file.write_text(description, encoding="utf-8")
    return PullRequest(stage, branch, pr_commit, needs, patch, description_file)


def export_stages(series: Series, stage_id: str | None = None) -> list[PullRequest]:
    """Export the stages in order (a stage's dependencies first)."""
    if stage_id == "base":
        raise SeriesError("the base is not a stage: name a stage to export")
    wanted = series.stages_upto(stage_id)
    done: dict[str, PullRequest] = {}
    for stage in wanted:
        done[stage.id] = export_stage(series, stage, done)
    if stage_id is not None:
        return [done[stage_id]]
    return list(done.values())
