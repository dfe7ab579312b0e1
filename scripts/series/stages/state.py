# SPDX-License-Identifier: Apache-2.0
"""Which stage commits the work repo holds, and whether they are current:
a record in .git/ of each stage's commit and a fingerprint of its inputs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series, Stage
from scripts.series.files import write_whole
from scripts.series.git import git, rev_parse
from scripts.series.layout import (
    BASE_REF,
    STATE_FILE,
    git_file,
    stage_tag_ref,
)


def _state_path(repo: Path) -> Path:
    return git_file(repo, STATE_FILE)


def load_state(repo: Path) -> dict[str, dict[str, str]]:
    path = _state_path(repo)
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def save_state(repo: Path, state: dict[str, dict[str, str]]) -> None:
    write_whole(_state_path(repo), json.dumps(state, indent=1, sort_keys=True).encode())


def fingerprint(series: Series, stage: Stage, parent: str) -> str:
    digest = hashlib.sha256(parent.encode())
    patch = series.patch_file(stage)
    digest.update(patch.read_bytes() if patch.exists() else b"<missing>")
    for overlay in stage.overlays:
        digest.update(overlay.encode() + b"\0")
        source = series.overlay_file(overlay)
        digest.update(source.read_bytes() if source.exists() else b"<missing>")
    return digest.hexdigest()


def parent_of(repo: Path, commit: str) -> str | None:
    result = git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^", check=False)
    return result.stdout.decode().strip() or None


@dataclass(frozen=True)
class Chain:
    """The stage commits on top of the base, as recorded and validated."""

    base: str
    applied: tuple[tuple[Stage, str], ...]  # (stage, commit) in series order
    current: int  # how many of ``applied`` still match their inputs

    @property
    def tip(self) -> str:
        return self.applied[-1][1] if self.applied else self.base

    def current_commit(self, stage_id: str) -> str:
        """The commit of ``stage_id`` ("base" or a stage applied and current)."""
        if stage_id == "base":
            return self.base
        for stage, commit in self.applied[: self.current]:
            if stage.id == stage_id:
                return commit
        raise SeriesError(
            f"stage {stage_id} is not applied and current; run `nox -s apply`"
        )

    def commit_of(self, stage_id: str) -> str | None:
        for stage, commit in self.applied:
            if stage.id == stage_id:
                return commit
        return None


def read_chain(series: Series, repo: Path) -> Chain:
    """Follow the recorded stages from the base while each one's parent links."""
    base = rev_parse(repo, BASE_REF) if (repo / ".git").exists() else None
    if base is None:
        raise SeriesError(f"{repo} is not prepared yet; run `nox -s apply` first")
    state = load_state(repo)
    applied: list[tuple[Stage, str]] = []
    current = 0
    parent = base
    for stage in series.stages:
        record = state.get(stage.id)
        if not record or rev_parse(repo, stage_tag_ref(stage.id)) != record["commit"]:
            break
        if parent_of(repo, record["commit"]) != parent:
            break
        if current == len(applied) and record["inputs"] == fingerprint(
            series, stage, parent
        ):
            current += 1
        applied.append((stage, record["commit"]))
        parent = record["commit"]
    return Chain(base=base, applied=tuple(applied), current=current)
