# SPDX-License-Identifier: Apache-2.0
"""Check exported PRs as a vLLM maintainer takes them (``export
--test-python``): ``git am`` on the base, title and sign-off, the target's
pre-commit, its Buildkite wiring and layering, and the PR's tests in each
view (``pr_views``); the items go to ``<patch>.review.md``."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series, cache_dir
from scripts.series.export.export import PullRequest
from scripts.series.export.pr_views import (
    VIEWS,
    View,
    missing_platform,
    run_view,
    verdict,
)
from scripts.series.export.vllm_precommit import (
    hook_python,
    hook_results,
    run_in_project,
)
from scripts.series.git import git, git_out
from scripts.series.layout import pr_check_dir, workdir
from scripts.series.stages.state import read_chain


def maintainer_checks(
    cache: Path, tree: Path, files: list[str], python: str
) -> list[dict]:
    """``maintainer_checks`` (Buildkite wiring, layering) in the hooks'
    virtualenv, which has PyYAML and the target's tools."""
    py = hook_python(cache, python)
    out = git_out(tree, "rev-parse", "HEAD~1")
    command = [
        str(py),
        "-m",
        "scripts.series.export.maintainer_checks",
        str(tree),
        out,
        *files,
    ]
    return json.loads(run_in_project(command, "run the maintainer's checks"))


# The checks' processes (a PR's pre-commit, a view's pytest) at once: one
# per CPU, whichever PR they are of.
_CPUS = threading.BoundedSemaphore(os.cpu_count() or 1)


def precommit_cache() -> Path:
    return cache_dir() / "pre-commit"


def _patches_in_order(pr: PullRequest, by_id: dict[str, PullRequest]) -> list[Path]:
    """The patches to apply for ``pr``: those it needs first, then its own."""
    needed = _patches_in_order(by_id[pr.needs], by_id) if pr.needs else []
    return [*needed, pr.patch]


@dataclass(frozen=True)
class Item:
    """One line of a maintainer's first pass: what, whether it holds, why."""

    check: str
    ok: bool
    detail: str
    ran: bool = True  # False: nothing to run it on, which fails nothing

    def result(self, passed: str = "passed") -> str:
        if not self.ran:
            return "not run"
        return passed if self.ok else "FAILED"


def check_pr(
    series: Series, pr: PullRequest, by_id: dict[str, PullRequest], python: str
) -> list[Item]:
    """A maintainer's first pass over ``pr``, item by item; it stops at the
    first item that leaves nothing to check after it (a patch that does not
    apply, a title `git am` changes)."""
    repo = workdir(series)
    base = read_chain(series, repo).base
    items: list[Item] = []
    tree = pr_check_dir(series) / pr.stage.id / "vllm"  # its logs beside it
    git(repo, "worktree", "add", "-q", "--detach", str(tree), base)
    try:
        _first_pass(series, pr, by_id, python, repo, tree, items)
    finally:
        git(repo, "worktree", "remove", "--force", str(tree))
        shutil.rmtree(tree.parent)
    return items


def _first_pass(
    series: Series,
    pr: PullRequest,
    by_id: dict[str, PullRequest],
    python: str,
    repo: Path,
    tree: Path,
    items: list[Item],
) -> None:
    for patch in _patches_in_order(pr, by_id):
        applied = git(tree, "am", "-q", str(patch), check=False)
        if applied.returncode != 0:
            why = applied.stderr.decode(errors="replace").strip()
            items.append(Item(f"`git am` of {patch.name}", False, why))
            return
    needs = f" after the PR of stage {pr.needs}" if pr.needs else ""
    items.append(Item("`git am`", True, f"applies on {series.base.label}{needs}"))
    subject, author, message = (
        git_out(tree, "log", "-1", f"--format={field}")
        for field in ("%s", "%an <%ae>", "%B")
    )
    wanted = git_out(repo, "log", "-1", "--format=%s", pr.commit)
    if subject != wanted:
        why = f"`git am` changed it to {subject!r} (exported: {wanted!r})"
        items.append(Item("title", False, why))
        return
    signed = f"Signed-off-by: {author}" in message
    items.append(
        Item(
            "title and sign-off",
            signed,
            f"{subject!r}, signed off by {author}"
            if signed
            else f"not signed off by its author, {author}",
        )
    )
    # What an editor keeps of it (`git commit --amend`: comment lines and
    # surplus blank lines go).
    git(tree, "commit", "-q", "--amend", "--no-edit", "--cleanup=strip")
    kept = git_out(tree, "log", "-1", "--format=%B") == message
    items.append(
        Item(
            "message",
            kept,
            "unchanged by an editor"
            if kept
            else "changes when edited (lines git strips)",
        )
    )
    files = git_out(tree, "diff", "--name-only", "--diff-filter=d", "HEAD~1", "HEAD")
    names = files.splitlines()
    cache = precommit_cache()
    if not (tree / ".pre-commit-config.yaml").is_file():
        why = "the target has no .pre-commit-config.yaml"
        items.append(Item("vLLM's pre-commit", True, why, ran=False))
    else:
        _precommit(cache, tree, names, python, items)
    if pr.stage.vllm_tests:
        items += _tests_in_every_view(pr, python, tree)


def _tests_in_every_view(pr: PullRequest, python: str, tree: Path) -> list[Item]:
    """The PR's tests as each machine of ``pr_views.VIEWS`` runs them, side
    by side (one per CPU, with the other PRs' checks): one item per view."""
    paths = pr.stage.vllm_tests
    tests = ", ".join(paths)

    def run(view: View) -> Item:
        if view.arch is None:
            check = f"its tests with plain pytest on a CPU ({tests})"
        else:
            check = f"its tests as {view.label} runs them, emulated on a CPU ({tests})"
        if why := missing_platform(view, tree):
            return Item(check, True, why, ran=False)
        junit, log = (tree.parent / f"pr-{view.key}.{ext}" for ext in ("xml", "log"))
        with _CPUS:
            tally = run_view(view, python, tree, paths, junit, log)
        ok, detail = verdict(view, tally)
        return Item(check, ok, detail)

    with ThreadPoolExecutor(max_workers=len(VIEWS)) as pool:
        return list(pool.map(run, VIEWS))


def _precommit(
    cache: Path, tree: Path, names: list[str], python: str, items: list[Item]
) -> None:
    with _CPUS:
        hooks = hook_results(cache, tree, names, python)
        checks = maintainer_checks(cache, tree, names, python)
    for hook in hooks:
        if hook.status == "skipped":
            continue
        detail = "on the PR's files" if hook.status == "passed" else hook.output
        items.append(Item(f"pre-commit `{hook.id}`", hook.status == "passed", detail))
    for check in checks:
        items.append(Item(check["check"], check["ok"], check["detail"]))


def format_review(pr: PullRequest, items: list[Item]) -> str:
    lines = [
        f"# A maintainer's first pass: {pr.branch}",
        "",
        "Written by `nox -s export`; each item as checked on this export.",
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]
    for item in items:
        detail = " ".join(item.detail.split())[:600].replace("|", "\\|")
        lines.append(f"| {item.check} | {item.result('ok')} | {detail} |")
    return "\n".join(lines) + "\n"


def with_checks(description: str, base: str, items: list[Item]) -> str:
    """The description with this export's own checks at the end of its
    Validation: what a reviewer re-runs in a vLLM checkout, as it went."""
    rows = "\n".join(f"| {item.check} | {item.result()} |" for item in items)
    block = (
        f"Checked on a checkout of {base} as a maintainer takes the PR (`git am`, "
        "then the tree's own pre-commit on the PR's files at the versions its "
        "`.pre-commit-config.yaml` pins, the Buildkite steps that run its "
        "tests, its imports, its tests with plain pytest on a CPU and as AMD "
        "CI's MI300 and MI355 steps run them, with AITER on and off: vLLM's "
        "ROCm platform emulated on a CPU, no AMD GPU):\n\n"
        f"| check | result |\n|---|---|\n{rows}\n"
    )
    description = re.sub(
        r"Not yet run on \S+ \(the DSA series' test command runs them on every "
        r"stage tree\)\.",
        "Run by this export's check, below.",
        description,
    )
    head, marker, tail = description.partition("\n## Details")
    return f"{head.rstrip()}\n\n{block}{marker}{tail}"


def check_prs(series: Series, prs: Sequence[PullRequest], python: str) -> None:
    """Write each PR's first pass beside its patch; raise SeriesError naming
    every item that fails."""
    found = shutil.which(python)
    if found is None:
        raise SeriesError(f"--test-python {python}: no such Python")
    python = os.path.abspath(found)  # the checks run in other folders
    by_id = {pr.stage.id: pr for pr in prs}
    # What a killed check left: its worktrees, then their registrations.
    shutil.rmtree(pr_check_dir(series), ignore_errors=True)
    pr_check_dir(series).mkdir(parents=True)
    git(workdir(series), "worktree", "prune")
    # The PRs side by side: one's pre-commit runs while another's tests do,
    # at most one process per CPU (_CPUS).
    with ThreadPoolExecutor(max_workers=len(prs) or 1) as pool:
        checked = list(pool.map(lambda pr: check_pr(series, pr, by_id, python), prs))
    problems = []
    for pr, items in zip(prs, checked, strict=True):
        pr.review.write_text(format_review(pr, items))
        pr.description.write_text(
            with_checks(pr.description.read_text(), series.base.label, items)
        )
        problems += [
            f"PR of stage {pr.stage.id}: {item.check}: {item.detail}"
            for item in items
            if not item.ok
        ]
    if problems:
        raise SeriesError(
            "exported PRs fail the maintainer's check:\n" + "\n".join(problems)
        )
