# SPDX-License-Identifier: Apache-2.0
"""Rebase the series onto a newer vLLM: a release's sdist or a local git
checkout at a revision.

The stages go onto the target one by one, in a work repo of their own
(build/rebase/<target>/vllm) that also holds the current series' commits, so
each stage merges three ways with the pinned base (or the stage before it)
as the merge base. Per stage, and per file and hunk, the report says:

- applied cleanly: the hunk applies on the target as it is;
- merged: the three-way merge placed it;
- conflicted: left with conflict markers for the user (then ``--continue``);
- already upstream: the target has the change (the hunk reverse-applies);
- dropped: the merge went through but the hunk's added lines are not in the
  result; reported, never silent.

Conflict resolutions are recorded (git rerere) and kept with the review, so
rebasing onto the same target again replays them.

A stage is upstreamed, and left out of the rebased series, when its changes
are all present on the target, or when its upstream probe (its behaviour
tests) passes on the target without it; the report keeps the evidence.

When every stage is through, the rebased series is written for review to
patches/next/<target>/ (its own series.toml, patches, the overlays the
rebase changed, and the report in REBASE.md; the other overlays are the
project's) and the rebase is over; ``nox -s rebased`` tests it on
its target. The committed series and pin change only on ``--accept``, and
only if they are still what the rebase started from. ``--abort``, while a
rebase is in progress, removes its work area and leaves everything else as
it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.apply import apply
from scripts.series.config import Base, GitBase, SdistBase, Series, Stage
from scripts.series.contract import tree_env
from scripts.series.git import commit_verbatim, git, git_out
from scripts.series.layout import (
    BASE_TAG,
    NEXT_DIR,
    REBASE_OLD_REF,
    REBASED_BRANCH,
    rebase_dir,
    review_dir,
    workdir,
)
from scripts.series.patchfile import read_patch
from scripts.series.prepare import prepare
from scripts.series.refresh import format_stage_patch, overlay_bytes
from scripts.series.state import read_chain
from scripts.series.testrun import read_junit

RESOLUTIONS = "resolutions"  # git rerere's rr-cache, kept with the review

# (passed, failed) of a stage's upstream probe on a tree that lacks the stage
Tester = Callable[[Series, Stage, Path, list[str]], tuple[int, int]]


@dataclass
class HunkReport:
    path: str
    header: str
    outcome: str


@dataclass
class StageReport:
    id: str
    title: str
    outcome: str
    evidence: str = ""
    hunks: list[HunkReport] = field(default_factory=list)


@dataclass
class RebaseState:
    target: dict[str, str]
    old_tip: str
    series_digest: str
    next: int = 0
    pending: bool = False
    reports: list[StageReport] = field(default_factory=list)
    commits: dict[str, str] = field(default_factory=dict)


def _state_file(series: Series) -> Path:
    return rebase_dir(series) / "state.json"


def _target_dict(target: Base) -> dict[str, str]:
    if isinstance(target, SdistBase):
        return {"name": target.name, "version": target.version, "sha256": target.sha256}
    return {"name": target.name, "git": str(target.path), "rev": target.rev}


def _target_from(data: dict[str, str]) -> Base:
    if "git" in data:
        return GitBase(data["name"], Path(data["git"]), data["rev"])
    return SdistBase(data["name"], data["version"], data["sha256"])


def _load_state(series: Series) -> RebaseState:
    path = _state_file(series)
    if not path.exists():
        raise SeriesError("no rebase in progress; start one with `rebase <target>`")
    raw = json.loads(path.read_text())
    reports = [
        StageReport(**{**r, "hunks": [HunkReport(**h) for h in r["hunks"]]})
        for r in raw.pop("reports")
    ]
    return RebaseState(**raw, reports=reports)


def _save_state(series: Series, state: RebaseState) -> None:
    path = _state_file(series)
    path.write_text(json.dumps(asdict(state), indent=1) + "\n")


def _series_digest(series: Series) -> str:
    """A fingerprint of the committed series files, so --accept never
    overwrites edits made while the rebase was under review."""
    digest = hashlib.sha256()
    files = [series.patches_dir / "series.toml"]
    for stage in series.stages:
        files.append(series.patch_file(stage))
        files += [series.overlay_file(o) for o in stage.overlays]
    for path in files:
        digest.update(str(path.relative_to(series.root)).encode() + b"\0")
        digest.update(path.read_bytes() if path.exists() else b"<missing>")
    return digest.hexdigest()


def _repo(series: Series, state: RebaseState) -> Path:
    return rebase_dir(series) / _target_from(state.target).label / "vllm"


def start(series: Series, target: Base, tester: Tester | None) -> list[StageReport]:
    """Begin a rebase of ``series`` onto ``target``; run as far as it goes."""
    if _state_file(series).exists():
        raise SeriesError(
            "a rebase is already in progress; finish it with `rebase --continue`, "
            "or drop it with `rebase --abort`"
        )
    if target == series.base:
        raise SeriesError(f"the series is already on {target.label}")
    old_repo = apply(series, quiet=True)
    old_tip = read_chain(series, old_repo).tip
    area = rebase_dir(series)
    work = area / target.label / "vllm"
    shutil.rmtree(area / target.label, ignore_errors=True)
    work.parent.mkdir(parents=True)
    prepare(replace(series, base=target), repo=work, quiet=True)
    git(work, "fetch", "-q", str(old_repo), f"+{old_tip}:{REBASE_OLD_REF}")
    git(work, "checkout", "-q", "-b", REBASED_BRANCH, BASE_TAG)
    git(work, "config", "rerere.enabled", "true")
    git(work, "config", "rerere.autoUpdate", "true")
    recorded = review_dir(series, target) / RESOLUTIONS
    if recorded.is_dir():
        shutil.copytree(recorded, work / ".git" / "rr-cache")
        print(f"replaying the conflict resolutions recorded in {recorded}")
    state = RebaseState(_target_dict(target), old_tip, _series_digest(series))
    _save_state(series, state)
    print(f"rebasing {len(series.stages)} stage(s) onto {target.label} in {work}")
    return _run(series, state, tester)


def resume(series: Series, tester: Tester | None) -> list[StageReport]:
    """``--continue``: take the user's resolution of the conflicted stage, or
    redo the stage an interrupted rebase was in the middle of."""
    state = _load_state(series)
    repo = _repo(series, state)
    if not state.pending:
        # Interrupted inside a stage: only the tool has touched the work repo
        # since the last recorded stage, so drop the half-made merge.
        git(repo, "cherry-pick", "--quit", check=False)
        git(repo, "reset", "-q", "--hard", "HEAD")
        git(repo, "clean", "-q", "-f", "-d")
        return _run(series, state, tester)
    git(repo, "add", "-A")
    changed = git_out(repo, "diff", "--cached", "--name-only", "HEAD").split()
    marked = git(
        repo,
        "grep",
        "--cached",
        "-l",
        "-E",
        "^(<<<<<<<|>>>>>>>) ",
        "--",
        *changed,
        check=False,
    )
    if leftover := marked.stdout.decode().split():
        raise SeriesError(
            "conflict markers are still in: " + ", ".join(leftover) + f" (in {repo})"
        )
    stage = series.stages[state.next]
    report = state.reports[-1]
    _commit_stage(series, repo, stage, state)
    for hunk in report.hunks:
        if hunk.outcome == "conflicted":
            hunk.outcome = "conflicted, resolved by hand"
    report.outcome = "conflicted, resolved by hand"
    state.pending = False
    state.next += 1
    _save_state(series, state)
    return _run(series, state, tester)


def abort(series: Series) -> None:
    """Drop the rebase in progress: its work area and record, nothing else."""
    state = _load_state(series)
    label = _target_from(state.target).label
    shutil.rmtree(rebase_dir(series) / label, ignore_errors=True)
    _state_file(series).unlink()
    print(f"rebase onto {label} aborted; the series and its tree are as before")


def _run(
    series: Series, state: RebaseState, tester: Tester | None
) -> list[StageReport]:
    repo = _repo(series, state)
    while state.next < len(series.stages):
        stage = series.stages[state.next]
        report = _rebase_stage(series, repo, stage, state, tester)
        state.reports.append(report)
        if report.outcome == "conflicted":
            state.pending = True
            _save_state(series, state)
            print(format_report(state.reports))
            raise SeriesError(
                f"stage {stage.id} has conflicts; resolve them in {repo} (the files "
                "listed as conflicted above), then run `rebase --continue`, or "
                "`rebase --abort` to drop the rebase"
            )
        state.next += 1
        _save_state(series, state)
    out = _write_review(series, state)
    # The review holds all that is kept (patches, resolutions, report).
    shutil.rmtree(rebase_dir(series) / _target_from(state.target).label)
    _state_file(series).unlink()
    print(format_report(state.reports))
    print(
        f"rebased series written for review to {out}; test it with "
        "`nox -s rebased`, adopt it with `rebase --accept`"
    )
    return state.reports


def _old_commit(repo: Path, series: Series, stage: Stage) -> str:
    """The current series' commit of ``stage`` (fetched into the rebase repo)."""
    back = len(series.stages) - 1 - series.stages.index(stage)
    return git_out(repo, "rev-parse", f"{REBASE_OLD_REF}~{back}")


def _rebase_stage(
    series: Series,
    repo: Path,
    stage: Stage,
    state: RebaseState,
    tester: Tester | None,
) -> StageReport:
    patch = series.patch_file(stage)
    report = StageReport(stage.id, stage.title, "")
    if tester is not None:
        kept = [s for s in series.stages[: state.next] if s.id in state.commits]
        passed, failed = tester(series, stage, repo, [s.id for s in kept])
        if passed and not failed:
            report.outcome = "already upstream"
            report.evidence = (
                f"its upstream probe passes on the target without it ({passed} "
                f"passed, 0 failed: {', '.join(_probe(stage))})"
            )
            return report
        report.evidence = f"upstream probe without it: {passed} passed, {failed} failed"
    hunks = split_hunks(patch.read_text(encoding="utf-8"))
    before = {id(h): _hunk_on(repo, h) for h in hunks}
    overlays_present = all(
        (repo / o).is_file()
        and (repo / o).read_bytes() == series.overlay_file(o).read_bytes()
        for o in stage.overlays
    )
    if all(v == "already upstream" for v in before.values()) and overlays_present:
        report.outcome = "already upstream"
        report.evidence = "every hunk reverse-applies and every overlay is present"
        report.hunks = [HunkReport(h.path, h.header, "already upstream") for h in hunks]
        return report
    result = git(
        repo,
        "cherry-pick",
        "--no-commit",
        _old_commit(repo, series, stage),
        check=False,
    )
    unmerged = set(git_out(repo, "diff", "--name-only", "--diff-filter=U").split())
    # Files git rerere resolved from recorded resolutions, also when other
    # files of the stage are still in conflict.
    stderr = result.stderr.decode(errors="replace")
    replayed = _replayed_paths(stderr) if result.returncode != 0 else set()
    if result.returncode != 0 and not unmerged and not replayed:
        raise SeriesError(f"stage {stage.id}: git cherry-pick failed: {stderr.strip()}")
    for hunk in hunks:
        outcome = before[id(hunk)]
        if outcome != "already upstream":
            placed = _added_lines_present(repo / hunk.path, hunk)
            if hunk.path in unmerged:
                # a hunk that applied on its own keeps that outcome when its
                # lines made it: the file's other hunks are in conflict
                if not (placed and outcome == "applied cleanly"):
                    outcome = "conflicted"
            elif hunk.path in replayed and outcome != "applied cleanly":
                outcome = "conflicted, recorded resolution replayed"
            elif not placed:
                outcome = "dropped"
            elif outcome != "applied cleanly":
                outcome = "merged"
        report.hunks.append(HunkReport(hunk.path, hunk.header, outcome))
    outcomes = {h.outcome for h in report.hunks}
    if unmerged:
        report.outcome = "conflicted"
        return report
    _commit_stage(series, repo, stage, state)
    if "dropped" in outcomes:
        report.outcome = "merged, with dropped hunks"
    elif replayed:
        report.outcome = "conflicted, recorded resolution replayed"
    elif outcomes <= {"applied cleanly", "already upstream"}:
        report.outcome = "applied cleanly"
    else:
        report.outcome = "merged"
    return report


_REPLAYED = re.compile(r"^(?:Staged|Resolved) '(.+)' using previous resolution\.$")


def _replayed_paths(git_stderr: str) -> set[str]:
    """Paths whose conflicts git rerere resolved from recorded resolutions
    (git runs with LC_ALL=C, so its messages are stable)."""
    return {
        m.group(1)
        for line in git_stderr.splitlines()
        if (m := _REPLAYED.match(line.strip()))
    }


def _commit_stage(series: Series, repo: Path, stage: Stage, state: RebaseState) -> None:
    info = read_patch(series.patch_file(stage))
    git(repo, "add", "-A")
    state.commits[stage.id] = commit_verbatim(
        repo, info.message, info.author, allow_empty=True
    )


@dataclass(frozen=True)
class PatchHunk:
    path: str
    header: str
    text: str  # a patch of this one hunk: its file's header, then the hunk


def split_hunks(patch_text: str) -> list[PatchHunk]:
    """Every hunk of a ``git format-patch`` file as a patch of its own."""
    hunks: list[PatchHunk] = []
    file_header: list[str] = []
    current: list[str] = []
    path = ""

    def flush() -> None:
        if current:
            text = "".join(file_header + current)
            hunks.append(PatchHunk(path, current[0].rstrip("\n"), text))
            current.clear()

    for line in patch_text.splitlines(keepends=True):
        if line.startswith("diff --git "):
            flush()
            file_header = [line]
            path = line.split(" b/", 1)[1].strip()
        elif line.startswith("@@") and file_header:
            flush()
            current.append(line)
        elif current:
            if line == "-- \n":  # format-patch's signature separator
                flush()
                file_header = []
            else:
                current.append(line)
        elif file_header:
            file_header.append(line)
    flush()
    return hunks


def _hunk_on(repo: Path, hunk: PatchHunk) -> str:
    """How one hunk stands on the tree before any merge."""

    def applies(*flags: str) -> bool:
        check = git(
            repo, "apply", "--check", *flags, "-", input=hunk.text.encode(), check=False
        )
        return check.returncode == 0

    if applies():
        return "applied cleanly"
    if applies("--reverse"):
        return "already upstream"
    return "needs a merge"


def _added_lines_present(path: Path, hunk: PatchHunk) -> bool:
    """Whether each run of the hunk's added lines is in the merged file."""
    if not path.exists():
        return False
    content = path.read_text(encoding="utf-8", errors="replace")
    runs: list[list[str]] = [[]]
    for line in hunk.text.splitlines(keepends=True)[1:]:
        if line.startswith("+") and not line.startswith("+++"):
            runs[-1].append(line[1:])
        elif runs[-1]:
            runs.append([])
    return all("".join(run) in content for run in runs if run)


def _probe(stage: Stage) -> tuple[str, ...]:
    return stage.upstream_probe or (stage.tests,)


def pytest_tester(python: str) -> Tester:
    """Run a stage's upstream probe with ``python -m pytest`` on a checkout
    of the rebase repo's HEAD (the target and the stages kept so far)."""

    if shutil.which(python) is None:
        raise SeriesError(f"--test-python {python}: no such Python")

    def run(
        series: Series, stage: Stage, repo: Path, kept: list[str]
    ) -> tuple[int, int]:
        probe_tree = repo.parent / "probe"
        shutil.rmtree(probe_tree, ignore_errors=True)
        git(repo, "worktree", "prune")
        git(repo, "worktree", "add", "-q", "--detach", str(probe_tree), "HEAD")
        junit = repo.parent / f"probe-{stage.id}.xml"
        env = tree_env(probe_tree, ["base", *kept, stage.id], probe_tree)
        paths = [str(series.tests_dir / p) for p in _probe(stage)]
        try:
            subprocess.run(
                [
                    python,
                    "-m",
                    "pytest",
                    *paths,
                    f"--junitxml={junit}",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                ],
                env={**os.environ, **env, "PYTHONPATH": str(probe_tree)},
                cwd=series.root,
                check=False,
            )
        finally:
            git(repo, "worktree", "remove", "--force", str(probe_tree))
        tally = read_junit(junit)
        return tally.passed, tally.failed

    return run


def _write_review(series: Series, state: RebaseState) -> Path:
    target = _target_from(state.target)
    repo = _repo(series, state)
    out = review_dir(series, target)
    shutil.rmtree(out, ignore_errors=True)
    kept = [s for s in series.stages if s.id in state.commits]
    dropped = {s.id for s in series.stages} - set(state.commits)
    kept = [replace(s, depends_on=_depends(series, s, dropped)) for s in kept]
    # The review keeps only the overlays that the rebase changed; the others
    # are read from the project's folder, which must stay as the rebase found
    # it (review_is_current).
    new = replace(
        series,
        base=target,
        stages=tuple(kept),
        patches_dir=out,
        overlay_dirs=(out / "vllm_overlay", *series.overlay_dirs),
    )
    out.mkdir(parents=True)
    changed_overlays = []
    for stage in kept:
        commit = state.commits[stage.id]
        (out / stage.patch).write_bytes(format_stage_patch(new, repo, stage, commit))
        for overlay in stage.overlays:
            data = overlay_bytes(repo, commit, overlay)
            assert data is not None
            if data != series.overlay_file(overlay).read_bytes():
                (out / "vllm_overlay" / overlay).parent.mkdir(
                    parents=True, exist_ok=True
                )
                (out / "vllm_overlay" / overlay).write_bytes(data)
                changed_overlays.append(f"`{overlay}`")
    folders = ["vllm_overlay"] + [os.path.relpath(d, out) for d in series.overlay_dirs]
    project = Path(*[".."] * len(out.relative_to(series.root).parts))
    (out / "series.toml").write_text(
        series_toml(new, review=(str(project), folders, state.series_digest))
    )
    rr_cache = repo / ".git" / "rr-cache"
    if rr_cache.is_dir() and any(rr_cache.iterdir()):
        shutil.copytree(rr_cache, out / RESOLUTIONS)
    overlays_note = (
        "Overlays changed by the rebase, kept in this folder's vllm_overlay/: "
        + ", ".join(changed_overlays)
        + ". The others are read from the project's vllm_overlay/.\n"
        if changed_overlays
        else "No overlay changed: all are read from the project's vllm_overlay/.\n"
    )
    (out / "REBASE.md").write_text(
        f"# Rebase onto {target.label}\n\n"
        + format_report(state.reports)
        + "\n\n"
        + overlays_note
    )
    return out


def _depends(series: Series, stage: Stage, dropped: set[str]) -> tuple[str, ...]:
    """A stage's dependencies with upstreamed stages replaced by theirs."""
    out: list[str] = []
    for dep in stage.depends_on:
        if dep in dropped:
            out += [
                d for d in _depends(series, series.stage(dep), dropped) if d not in out
            ]
        elif dep not in out:
            out.append(dep)
    return tuple(out)


def accept(series: Series, label: str | None = None) -> None:
    """Make a reviewed rebased series (patches/next/<label>) the committed
    series and pin."""
    if _state_file(series).exists():
        raise SeriesError("a rebase is in progress; finish it (--continue) first")
    folders = sorted(
        p.parent for p in (series.patches_dir / NEXT_DIR).glob("*/series.toml")
    )
    if label:
        folders = [f for f in folders if f.name == label]
    if len(folders) != 1:
        found = ", ".join(f.name for f in folders) or "none"
        where = series.patches_dir / NEXT_DIR
        raise SeriesError(f"name the rebased series to accept (under {where}: {found})")
    review = folders[0]
    if not review_is_current(series, review):
        raise SeriesError(
            "patches/ or vllm_overlay/ changed since this rebase started; refusing "
            "to overwrite them (rebase again from the current series)"
        )
    new = _load_review(review)
    # Read everything first: the review reads unchanged overlays from the
    # very files about to be replaced.
    files = {series.patch_file(s): (review / s.patch).read_bytes() for s in new.stages}
    for stage in new.stages:
        for overlay in stage.overlays:
            files[series.overlay_file(overlay)] = new.overlay_file(overlay).read_bytes()
    for stage in series.stages:
        (series.patch_file(stage)).unlink(missing_ok=True)
        for overlay in stage.overlays:
            series.overlay_file(overlay).unlink(missing_ok=True)
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (series.patches_dir / "series.toml").write_text(series_toml(new))
    shutil.rmtree(review)
    if not any((series.patches_dir / NEXT_DIR).iterdir()):
        (series.patches_dir / NEXT_DIR).rmdir()
    print(
        f"the series is now on {new.base.label}; run apply to build its tree "
        f"(the old tree {workdir(series)} is left as it was)"
    )


def review_is_current(series: Series, review: Path) -> bool:
    """Whether the rebased series in ``review`` was made from the committed
    series as it is now."""
    text = (review / "series.toml").read_text(encoding="utf-8")
    return tomllib.loads(text).get("rebased_from") == _series_digest(series)


def check_review_is_current(series: Series) -> None:
    """Raise if ``series`` is a rebased series under review (it has
    ``rebased_from``) made from an older version of the project's series."""
    project_dir = series.root / "patches"
    text = (series.patches_dir / "series.toml").read_text(encoding="utf-8")
    if series.patches_dir == project_dir or "rebased_from" not in tomllib.loads(text):
        return
    if not review_is_current(_load_review(project_dir), series.patches_dir):
        raise SeriesError(
            f"{series.patches_dir} was rebased from an older version of "
            "patches/; rebase again (nox -s rebase -- ...): the recorded "
            "conflict resolutions are replayed"
        )


def _load_review(path: Path) -> Series:
    from scripts.series.config import load_series

    return load_series(path / "series.toml")


def series_toml(
    series: Series, *, review: tuple[str, list[str], str] | None = None
) -> str:
    """``series`` as a series file (the fields load_series reads). A series
    for review names its project folder, its overlay folders (its own, then
    the project's) and the digest of the series it was rebased from."""

    def s(value: str) -> str:
        return json.dumps(value, ensure_ascii=False)

    def strings(values: tuple[str, ...]) -> str:
        return "[" + ", ".join(s(v) for v in values) + "]"

    lines = ["# The patch series: one pinned vLLM base and the ordered stages."]
    if review is not None:
        project, overlays, digest = review
        lines += [
            "# Written by `python -m scripts.series rebase` for review.",
            f"project = {s(project)}",
            f"overlays = {strings(tuple(overlays))}",
            f"rebased_from = {s(digest)}",
        ]
    lines += ["", "[base]", f"name = {s(series.base.name)}"]
    if isinstance(series.base, SdistBase):
        lines += [
            f"version = {s(series.base.version)}",
            f"sha256 = {s(series.base.sha256)}",
        ]
    else:
        lines += [f"git = {s(str(series.base.path))}", f"rev = {s(series.base.rev)}"]
    for suite in series.regression:
        lines += ["", "[[regression]]", f"name = {s(suite.name)}"]
        if suite.plugin:
            lines.append(f"plugin = {s(suite.plugin)}")
        lines.append(f"paths = {strings(suite.paths)}")
    for stage in series.stages:
        lines += [
            "",
            "[[stage]]",
            f"id = {s(stage.id)}",
            f"title = {s(stage.title)}",
            f"patch = {s(stage.patch)}",
            f"overlays = {strings(stage.overlays)}",
            f"depends_on = {strings(stage.depends_on)}",
            f"tests = {s(stage.tests)}",
        ]
        if stage.upstream_probe:
            lines.append(f"upstream_probe = {strings(stage.upstream_probe)}")
        if stage.switches:
            lines.append(f"switches = {strings(stage.switches)}")
        lines.append(f"validated_on = {s(stage.validated_on)}")
        if stage.large_hunks:
            lines.append("large_hunks = [")
            lines += [
                f"    {{ file = {s(h.path)}, hunk = {h.number}, "
                f"reason = {s(h.reason)} }},"
                for h in stage.large_hunks
            ]
            lines.append("]")
        lines.append(
            f"upstream = {{ pr = {s(stage.upstream_pr)}, "
            f"status = {s(stage.upstream_status)} }}"
        )
    return "\n".join(lines) + "\n"


def format_report(reports: list[StageReport]) -> str:
    """Per stage, then per file and hunk, as Markdown."""
    lines = ["| stage | outcome | evidence |", "|---|---|---|"]
    for r in reports:
        lines.append(f"| {r.id} {r.title} | {r.outcome} | {r.evidence or '-'} |")
    for r in reports:
        if not r.hunks:
            continue
        lines += [
            "",
            f"Stage {r.id}, per hunk:",
            "",
            "| file | hunk | outcome |",
            "|---|---|---|",
        ]
        lines += [f"| {h.path} | `{h.header}` | {h.outcome} |" for h in r.hunks]
    dropped = [h for r in reports for h in r.hunks if h.outcome == "dropped"]
    if dropped:
        lines += ["", f"**{len(dropped)} hunk(s) dropped by the merge: review them.**"]
    return "\n".join(lines)
