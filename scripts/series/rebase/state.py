# SPDX-License-Identifier: Apache-2.0
"""A rebase in progress: its state file (build/rebase/state.json, so that
``--continue`` and ``--abort`` can pick it up) and its report, per stage and
per file and hunk."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Base, GitBase, SdistBase, Series, is_version
from scripts.series.files import partial_of, write_whole
from scripts.series.layout import rebase_dir

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A folder name under build/rebase/ (a target's label).
_LABEL = re.compile(r"^[A-Za-z0-9._+-]+$")


def rebase_command(args: str) -> str:
    """How a user types ``rebase ARGS``: through nox, as the README does."""
    return f"`nox -s rebase -- {args}`"


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
    # The options it started with, which --continue keeps.
    test_python: str | None = None
    drop: list[str] = field(default_factory=list)
    target_commit: str | None = None  # a git target's commit, pinned
    commits: dict[str, str] = field(default_factory=dict)
    # [[regression]] test paths the target no longer has (left out of the
    # rebased series.toml, and reported).
    regression_gone: list[str] = field(default_factory=list)
    # The rehearsal's own rebase: it may start from a project with
    # uncommitted edits, and its branch is rehearsal/<target>.
    rehearsal: bool = False
    # The project's HEAD when it started: the branch goes on a commit that
    # contains it.
    project_head: str = ""
    # The commit of the rebase's branch, once made (finish() after a kill).
    branch_commit: str | None = None


def state_file(series: Series) -> Path:
    return rebase_dir(series) / "state.json"


def target_dict(target: Base) -> dict[str, str]:
    if isinstance(target, SdistBase):
        return {"name": target.name, "version": target.version, "sha256": target.sha256}
    return {"name": target.name, "git": str(target.path), "rev": target.rev}


def target_from(data: dict[str, str]) -> Base:
    if "git" in data:
        return GitBase(data["name"], Path(data["git"]), data["rev"])
    return SdistBase(data["name"], data["version"], data["sha256"])


def load_state(series: Series) -> RebaseState:
    path = state_file(series)
    if not path.exists():
        raise SeriesError(
            "no rebase in progress; start one with "
            f"{rebase_command('--version RELEASE --sha256 SHA256')} or "
            f"{rebase_command('--git PATH --rev REV')}"
        )
    try:
        raw = json.loads(path.read_text())
        problem = _state_problem(raw, [stage.id for stage in series.stages])
    except (OSError, ValueError) as exc:
        problem = f"cannot be read ({type(exc).__name__}: {exc})"
    if problem:
        raise SeriesError(
            f"{path} {problem}, so the rebase it records cannot go on or be "
            f"aborted by the tool; `rm {path}` drops it (the next rebase replaces "
            "its work area; recorded conflict resolutions stay), then rebase "
            "again. Your checkout and branches are untouched"
        )
    reports = [
        StageReport(**{**r, "hunks": [HunkReport(**h) for h in r["hunks"]]})
        for r in raw.pop("reports")
    ]
    return RebaseState(**raw, reports=reports)


def _is_text(value) -> bool:
    return isinstance(value, str) and value != ""


def _is_commit(value) -> bool:
    return isinstance(value, str) and bool(_COMMIT.match(value))


def _is_texts(value) -> bool:
    return isinstance(value, list) and all(_is_text(v) for v in value)


def _is_report(value) -> bool:
    """A stage's report: its id, title and outcome, evidence, and per hunk
    its file, header and outcome, all text."""
    return (
        isinstance(value, dict)
        and set(value) == {"id", "title", "outcome", "evidence", "hunks"}
        and all(
            isinstance(value[k], str) for k in ("id", "title", "outcome", "evidence")
        )
        and isinstance(value["hunks"], list)
        and all(
            isinstance(h, dict)
            and set(h) == {"path", "header", "outcome"}
            and all(isinstance(v, str) for v in h.values())
            for h in value["hunks"]
        )
    )


# Every field of the state file: what it must be, and how a message says it.
_FIELDS = {
    "target": (lambda v: isinstance(v, dict), "a release or a git checkout"),
    "old_tip": (_is_commit, "a commit (40 hex digits)"),
    "series_digest": (_is_text, "text"),
    "next": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "a count of stages",
    ),
    "pending": (lambda v: isinstance(v, bool), "true or false"),
    "reports": (
        lambda v: isinstance(v, list) and all(map(_is_report, v)),
        "stage reports",
    ),
    # The Python --continue runs the stages' tests with: as the tool wrote it.
    "test_python": (
        lambda v: v is None or (_is_text(v) and Path(v).is_absolute()),
        "a Python's absolute path or null",
    ),
    "drop": (_is_texts, "a list of stage ids"),
    "target_commit": (lambda v: v is None or _is_commit(v), "a commit or null"),
    "commits": (
        lambda v: isinstance(v, dict) and all(map(_is_commit, v.values())),
        "stage ids and their commits",
    ),
    "regression_gone": (_is_texts, "a list of test paths"),
    "rehearsal": (lambda v: isinstance(v, bool), "true or false"),
    "project_head": (lambda v: v == "" or _is_commit(v), "a commit or empty"),
    "branch_commit": (lambda v: v is None or _is_commit(v), "a commit or null"),
}
_REQUIRED = ("target", "old_tip", "series_digest", "reports")


def _state_problem(raw, stages: list[str]) -> str | None:
    """What in a state file the tool did not write, field by field (its
    paths and commits name what --continue and --abort change and delete,
    ``test_python`` what it runs; ``next`` indexes the series' ``stages``,
    ``drop`` and ``commits`` name them), or None."""
    if not isinstance(raw, dict):
        return "is damaged: it holds no fields"
    # The name this field had before the rehearsal's branch had its own.
    if "allow_uncommitted" in raw:
        raw["rehearsal"] = raw.pop("allow_uncommitted")
    missing = [name for name in _REQUIRED if name not in raw]
    if missing:
        return f"is damaged: it has no {', '.join(missing)}"
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        return f"is damaged: it has fields the tool never writes ({', '.join(unknown)})"
    for name, value in raw.items():
        valid, what = _FIELDS[name]
        if not valid(value):
            return f"is damaged: its {name} is not {what}"
    if raw.get("next", 0) > len(stages):
        return (
            f"is damaged: its next stage, {raw['next']}, is past the "
            f"{len(stages)} stages"
        )
    named = set(raw.get("drop", [])) | set(raw.get("commits", {}))
    if not named <= set(stages):
        strangers = ", ".join(sorted(named - set(stages)))
        return f"is damaged: it names stages the series has not ({strangers})"
    return _target_problem(raw["target"])


def _target_problem(target: dict) -> str | None:
    if set(target) not in ({"name", "version", "sha256"}, {"name", "git", "rev"}):
        return "is damaged: its target is neither a release nor a git checkout"
    if not all(isinstance(v, str) and v for v in target.values()):
        return "is damaged: its target has an empty or non-text field"
    label = target_from(target).label
    if not _LABEL.match(label) or ".." in label:
        return f"is damaged: its target {label!r} is no folder name of build/rebase/"
    if "version" in target and not (
        is_version(target["version"]) and _SHA256.match(target["sha256"])
    ):
        return "is damaged: its release is no version with a sha256"
    return None


def save_state(series: Series, state: RebaseState) -> None:
    """Whole or not at all: a rebase killed while saving keeps the state it
    had, and ``--continue`` goes on from there."""
    write_whole(
        state_file(series), (json.dumps(asdict(state), indent=1) + "\n").encode()
    )


def remove_state(series: Series) -> None:
    """The rebase is over: its state goes, with a save a kill left half done."""
    partial_of(state_file(series)).unlink(missing_ok=True)
    state_file(series).unlink()


def work_repo(series: Series, state: RebaseState) -> Path:
    return rebase_dir(series) / target_from(state.target).label / "vllm"


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
