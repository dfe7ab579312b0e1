# SPDX-License-Identifier: Apache-2.0
"""Export each stage as one upstream vLLM PR commit (branch ``pr/<id>``,
a patch and a description under ``build/export/<base>/``), made with git
plumbing and a scratch index, so the tree is untouched and two exports are
byte-identical."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series, Stage, load_series
from scripts.series.git import Identity, commit_tree, git, git_out, rev_parse
from scripts.series.layout import (
    export_dir,
    exported_ref,
    pr_branch,
    results_dir,
    workdir,
)
from scripts.series.stages.refresh import FORMAT_PATCH_FLAGS
from scripts.series.stages.state import read_chain
from scripts.series.testing.results import junit_suite, read_junit

_TRAILER = re.compile(r"^[A-Za-z-]+: .+$")


@dataclass(frozen=True)
class PullRequest:
    stage: Stage
    branch: str
    commit: str
    needs: str | None  # the stage whose PR must land first, if any
    patch: Path
    description: Path

    @property
    def review(self) -> Path:
        """The maintainer's first pass over ``patch`` (``export --test-python``)."""
        return self.patch.with_name(f"{self.patch.stem}.review.md")


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


_SERIES_ONLY = re.compile(
    r"`((?:nox |python3? -m scripts|scripts/|tests/(?:stage_|base/|tooling/)"
    r"|vllm_overlay/|docs/)[^`]*)`"
)


def _doc_section(series: Series, stage: Stage, heading: str) -> str | None:
    """A ``## <heading>...`` section of docs/stage_<id>.md, as a reader of
    the PR sees it: links between the series' docs (which do not resolve in
    a PR) become their text, and the series' own paths and commands plain
    text (they do not work in a vLLM checkout)."""
    doc = series.root / "docs" / f"stage_{stage.id}.md"
    if not doc.exists():
        return None
    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+\.md)\)", r"\1", doc.read_text("utf-8"))
    found = re.search(rf"^## {heading}[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if not found:
        return None
    return _SERIES_ONLY.sub(r"\1", _without_where(found.group(1), stage)).strip()


def _without_where(section: str, stage: Stage) -> str:
    """``section`` with its tables' ``where`` column dropped (it names the
    series' test files and scripts); a row whose ``where`` names one of the
    PR's own test files says so in its first cell."""
    lines: list[str] = []
    where = -1  # the column of the table being read, or -1
    in_table = False
    for line in section.splitlines():
        if not line.startswith("|"):
            in_table = False
            lines.append(line)
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not in_table:  # the header
            in_table = True
            where = cells.index("where") if "where" in cells else -1
        if not 0 <= where < len(cells):
            lines.append(line)
            continue
        place = cells.pop(where)
        own = [path for path in stage.vllm_tests if path in place]
        if own:
            cells[0] += " (this PR's " + ", ".join(f"`{p}`" for p in own) + ")"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The sections vLLM's template has asked for since 0.32.0; used as they are
# when the target tree has no template of its own.
_FALLBACK_TEMPLATE = "## Overview\n\n## Claims\n\n## Validation\n\n## Details\n"


def pr_description(
    series: Series,
    stage: Stage,
    message: str,
    template: str | None,
    needs: Stage | None,
) -> str:
    """The target's PR template (``.github/PULL_REQUEST_TEMPLATE.md``) with its
    Overview, Claims, Validation and Details filled from the stage's commit
    message and docs/stage_<id>.md; every figure says where it comes from."""
    subject, body, _ = _split_message(message)
    paragraphs = [p for p in body.split("\n\n") if p.strip()]
    overview = [paragraphs[0] if paragraphs else subject]
    upstream = _upstream_line(stage)
    if upstream:
        overview.append(upstream)
    if needs is not None:
        where = (
            f"upstream as {needs.upstream_pr}"
            if needs.upstream_status in ("open", "merged")
            else "its PR is not opened yet"
        )
        overview.append(
            f'Depends on "{needs.title}" ({where}), which must land first: '
            "this change applies on it."
        )
    pinned = load_series(series.root / "patches" / "series.toml").base
    validation = [
        _pr_tests_validation(series, stage),
        "Beyond this PR's tests: measured outside vLLM's tree on "
        f"{pinned.label}, with the test harnesses and benchmarks of the patch "
        f"series this change comes from (validated on: {stage.validated_on}).",
        _doc_section(series, stage, "Results") or "No recorded results yet.",
    ]
    claims = _doc_section(series, stage, "Figures from")
    sections = {
        "Overview": "\n\n".join(overview),
        "Claims": (
            claims
            if claims and claims.startswith("Quoted from")
            else "Quoted from the PR texts this change implements (MI355X, not "
            "measured here):\n\n" + claims
            if claims
            else "See Validation."
        ),
        "Validation": "\n\n".join(validation),
        "Details": "\n\n".join(paragraphs[1:]) or "-",
    }
    return f"{subject}\n\n" + _fill_template(template or _FALLBACK_TEMPLATE, sections)


def _upstream_line(stage: Stage) -> str | None:
    """What upstream already has of this change, as series.toml records it."""
    if stage.upstream_status == "merged":
        return (
            f"This is a backport: upstream merged this change as "
            f"{stage.upstream_pr}. It is exported for a fork that stays on this "
            "vLLM release, not to be opened upstream."
        )
    if stage.upstream_status == "open":
        return (
            f"Upstream PR {stage.upstream_pr} is open for the same feature; this "
            "is the series' implementation of it on this release."
        )
    return None


def _pr_tests_validation(series: Series, stage: Stage) -> str:
    """The PR's own tests: the command that runs them in a vLLM checkout and
    their outcome in the last `test` run of the stage's tree on this base."""
    if not stage.vllm_tests:
        return "This PR adds no tests to vLLM's tests/."
    command = "pytest -q " + " ".join(stage.vllm_tests)
    junit = results_dir(series) / stage.id / "pr-tests.xml"
    modules = tuple(
        path.removesuffix(".py").replace("/", ".") for path in stage.vllm_tests
    )
    tally = read_junit(junit, modules) if junit.exists() else None
    if tally is None or not (tally.passed or tally.failed or tally.skipped):
        outcome = (
            f"Not yet run on {series.base.label} (the DSA series' test command "
            "runs them on every stage tree)."
        )
    else:
        started = junit_suite(junit).get("timestamp", "?").partition(".")[0]
        skips = "; ".join(f"{n} skipped: {r}" for r, n in tally.skip_reasons.items())
        outcome = (
            f"CPU, {series.base.label} (run of {started}): "
            f"{tally.passed} passed, {tally.failed} failed"
            + (f"; {skips}" if skips else "")
        )
    return (
        f"Tests added to vLLM's tests/ (`cpu_test`; the ROCm ones skip elsewhere), "
        f"run from the root of a vLLM checkout:\n\n```\n{command}\n```\n\n{outcome}"
    )


def _fill_template(template: str, sections: dict[str, str]) -> str:
    """``template`` with each ``## <name>`` of ``sections`` followed by its
    text instead of the template's hint comment; sections the template lacks
    are added before its closing part (the checklist after ``---``)."""
    out: list[str] = []
    filling = False
    missing = dict(sections)
    for line in template.splitlines():
        heading = re.match(r"^## (.+?)\s*$", line)
        if heading or line.startswith("---"):
            if filling:
                out.append("")
            if line.startswith("---") and missing:
                out += [
                    text
                    for name, body in missing.items()
                    for text in (f"## {name}", "", body, "")
                ]
                missing.clear()
            name = heading.group(1) if heading else ""
            filling = name in sections
            out.append(line)
            if filling:
                out += ["", sections[name]]
                missing.pop(name, None)
            continue
        if filling and (not line.strip() or line.strip().startswith("<!--")):
            continue  # the hint, and blank lines around it
        if filling:
            out.append("")
            filling = False
        out.append(line)
    for name, body in missing.items():
        out += ["", f"## {name}", "", body]
    return "\n".join(out).rstrip() + "\n"


def commit_subject(title: str) -> str:
    """The PR title without its leading ``[ROCm][Perf]``-style tags: git
    mailinfo strips every leading ``[...]`` from a subject, so a plain `git
    am` would drop them. The tags stay in the PR title (the description's
    first line), which GitHub uses for the squash-merged commit."""
    return re.sub(r"^(\s*\[[^\]]*\])+\s*", "", title) or title


def commit_message(message: str, exporter: Identity) -> str:
    """A short vLLM-style message: the stage's subject (``commit_subject``)
    and its first paragraph, plain text (it survives an editor), signed off
    by whoever exports it, not by the series' identity. The rest of the
    stage's message goes to the description's Details."""
    subject, body, trailers = _split_message(message)
    summary = body.split("\n\n", 1)[0].strip()
    kept = [t for t in trailers if not t.startswith("Signed-off-by:")]
    trailers = [*kept, f"Signed-off-by: {exporter.name} <{exporter.email}>"]
    head = commit_subject(subject) + (f"\n\n{summary}" if summary else "")
    return f"{head}\n\n" + "\n".join(trailers) + "\n"


def exporter_identity(root: Path, signoff: str | None) -> Identity:
    """Who signs the PRs off (DCO): ``signoff`` ("Name <email>"), else the
    user's git identity; never an invented one."""
    if signoff is not None:
        found = re.fullmatch(r"\s*(.+?)\s*<([^<>\s]+@[^<>\s]+)>\s*", signoff)
        if not found:
            raise SeriesError(f"--signoff {signoff!r}: expected 'Name <email>'")
        return Identity(found.group(1), found.group(2), "")
    name, email = (
        subprocess.run(
            ["git", "-C", str(root), "config", "--get", key],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        for key in ("user.name", "user.email")
    )
    if not (name and email):
        raise SeriesError(
            "export signs each PR off as you (the DCO): set `git config "
            "user.name` and `user.email`, or pass --signoff 'Name <email>'"
        )
    return Identity(name, email, "")


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
    series: Series, stage: Stage, done: dict[str, PullRequest], exporter: Identity
) -> PullRequest:
    repo = workdir(series)
    chain = read_chain(series, repo)
    commit = chain.current_commit(stage.id)
    diff = git(repo, "diff", "--full-index", "--binary", f"{commit}^", commit).stdout
    message = git_out(repo, "log", "-1", "--format=%B", commit)
    # The exporter submits it; the stage's date keeps two exports identical.
    date = git_out(repo, "log", "-1", "--format=%aI", commit)
    identity = Identity(exporter.name, exporter.email, date)
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
    template = git(
        repo, "show", f"{chain.base}:.github/PULL_REQUEST_TEMPLATE.md", check=False
    ).stdout.decode("utf-8")
    description = pr_description(
        series, stage, message, template or None, series.stage(needs) if needs else None
    )
    pr_commit = commit_tree(
        repo, tree, parent, commit_message(message, exporter), identity
    )
    branch = pr_branch(stage.id)
    _refuse_to_move_a_users_branch(repo, branch, pr_commit, stage)
    git(repo, "update-ref", f"refs/heads/{branch}", pr_commit)
    git(repo, "update-ref", exported_ref(stage.id), pr_commit)
    out = export_dir(series)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{stage.id}-{_slug(stage.title)}"
    pr = PullRequest(stage, branch, pr_commit, needs, out / f"{name}.patch",
                     out / f"{name}.md")  # fmt: skip
    # The last export's review checked the last patch: gone before the new
    # patch is written, so a killed check never leaves it beside the new one.
    pr.review.unlink(missing_ok=True)
    pr.patch.write_bytes(
        git(repo, "format-patch", *FORMAT_PATCH_FLAGS, f"{parent}..{pr_commit}").stdout
    )
    pr.description.write_text(description, encoding="utf-8")
    return pr


def export_stages(
    series: Series, exporter: Identity, stage_id: str | None = None
) -> list[PullRequest]:
    """Export the stages in order, up to ``stage_id`` (all: None), signed off
    by ``exporter``; a stage's PR is made on the PRs it needs, so those are
    exported (and returned) too."""
    if stage_id == "base":
        raise SeriesError("the base is not a stage: name a stage to export")
    done: dict[str, PullRequest] = {}
    for stage in series.stages_upto(stage_id):
        done[stage.id] = export_stage(series, stage, done, exporter)
    return list(done.values())
