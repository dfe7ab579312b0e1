# SPDX-License-Identifier: Apache-2.0
"""Where everything lives: every path under build/, and every tag, branch, ref
and state-file name the tool writes into a work repo. No other module spells
them out."""

from __future__ import annotations

from pathlib import Path

from scripts.series.config import Base, Series

BUILD_DIR = "build"
LOCK_FILE = "series.lock"  # build/series.lock: one writer at a time
RESOLUTIONS = "resolutions"  # git rerere's rr-cache, kept in patches/

# In a work repo (build/<base label>/).
BASE_TAG = "base"
SERIES_BRANCH = "series"
# Refs are read by their full names: a user's tag named "series" (or a
# branch named like a stage tag) must not stand in for the tool's own.
SERIES_REF = f"refs/heads/{SERIES_BRANCH}"
BASE_REF = f"refs/tags/{BASE_TAG}"
REBASED_BRANCH = "rebased"
REFRESH_BACKUP_REF = "refs/dsa-series/before-refresh"
REBASE_OLD_REF = "refs/dsa-rebase/old"
STATE_FILE = "dsa-series-state.json"  # under .git/

# Beside an installed vLLM package (SITE/vllm/): what `install` wrote there.
INSTALL_RECORD_DIR = ".dsa-series-install"
INSTALL_RECORD = "record.json"  # what is installed, with the original hashes
INSTALL_ORIGINALS = "originals"  # the package files it replaced
INSTALL_STAGED = ".dsa-series-new"  # suffix of a new content staged beside its file


def install_staged(target: Path) -> Path:
    """The new content of an installed package file while ``install`` runs:
    beside it, so that the rename putting it in place stays in one folder
    (and on one filesystem)."""
    return target.with_name(f".{target.name}{INSTALL_STAGED}")


def stage_tag(stage_id: str) -> str:
    return f"stage/{stage_id}"


def stage_tag_ref(stage_id: str) -> str:
    return f"refs/tags/{stage_tag(stage_id)}"


def pr_branch(stage_id: str) -> str:
    return f"pr/{stage_id}"


def exported_ref(stage_id: str) -> str:
    """The commit ``export`` last wrote to ``pr_branch(stage_id)``."""
    return f"refs/dsa-series/exported/{stage_id}"


def build_dir(series: Series) -> Path:
    return series.root / BUILD_DIR


def workdir(series: Series) -> Path:
    """The work repo: the base commit and one commit per stage."""
    return build_dir(series) / series.base.label


def staging_dir(repo: Path) -> Path:
    """Where ``prepare`` builds a work repo before moving it into place."""
    return repo.with_name(repo.name + ".preparing")


def git_file(repo: Path, name: str) -> Path:
    return repo / ".git" / name


def stage_tree_dir(series: Series, stage_id: str) -> Path:
    """The test tree of ``stage_id`` ("base" or a stage id)."""
    return build_dir(series) / "trees" / series.base.label / stage_id


def results_dir(series: Series) -> Path:
    return build_dir(series) / "results" / series.base.label


def export_dir(series: Series) -> Path:
    """One folder per base, so the PRs of a rebased series never mix with
    the pinned series' PRs."""
    return build_dir(series) / "export" / series.base.label


def pr_check_dir(series: Series) -> Path:
    """The vLLM worktrees ``export --test-python`` checks its PRs in; each
    export clears what a killed one left."""
    return build_dir(series) / "pr-checks" / series.base.label


def carry_path(repo: Path) -> Path:
    """A stage carried by a three-way merge and waiting for its conflicts to
    be resolved (``apply --carry``, then ``--continue``)."""
    return repo / ".git" / "dsa-series-carry.json"


def rebase_dir(series: Series) -> Path:
    return build_dir(series) / "rebase"


def rebase_branch(target: Base, rehearsal: bool = False) -> str:
    """The project branch a finished rebase onto ``target`` writes; the
    rehearsal's has a namespace of its own, never a user's branch."""
    return f"{'rehearsal' if rehearsal else 'rebase'}/{target.label}"


def kept_resolutions_dir(series: Series, target: Base) -> Path:
    """Where a rebase onto ``target`` that ended (on its branch, or aborted)
    keeps the conflict resolutions it made, for the next rebase from this
    checkout (under build/: the project stays as it was)."""
    return rebase_dir(series) / "resolutions" / target.label


def resolution_dirs(series: Series) -> list[Path]:
    """Every set of recorded conflict resolutions (git rerere's rr-cache):
    those of merged rebases (patches/resolutions/), then those kept under
    build/ by rebases that ended or were aborted here."""
    merged = series.patches_dir / RESOLUTIONS
    kept = sorted((rebase_dir(series) / "resolutions").glob("*"))
    return ([merged] if merged.is_dir() else []) + kept
