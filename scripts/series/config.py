# SPDX-License-Identifier: Apache-2.0
"""Read and validate patches/series.toml, the one description of the series."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from scripts.series import SeriesError

REPO_ROOT = Path(__file__).resolve().parents[2]
SERIES_FILE = REPO_ROOT / "patches" / "series.toml"

UPSTREAM_STATUSES = ("not-submitted", "open", "merged", "closed", "upstreamed")
_STAGE_ID = re.compile(r"^[0-9]{4}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# A release as PEP 440 spells it: it names folders under build/ (the work
# repo, a rebase's work area), so nothing in it may lead elsewhere.
_VERSION = re.compile(r"^[0-9][0-9A-Za-z+!_-]*(?:\.[0-9A-Za-z+!_-]+)*$")


def is_version(value: str) -> bool:
    return bool(_VERSION.match(value))


# A URL git fetches from (https://, ssh://, file://, ...) or scp's
# user@host:path; anything else names a folder on this machine.
_GIT_URL = re.compile(r"^([a-z][a-z0-9+.-]*://|[\w.-]+@[\w.-]+:)")
CACHE_ENV = "DSA_SERIES_CACHE_DIR"


def is_git_url(where: str) -> bool:
    return bool(_GIT_URL.match(where))


def cache_dir() -> Path:
    """The download cache: $DSA_SERIES_CACHE_DIR, else the user's cache
    dir; sdists in it, the commits fetched for a git URL pin, and the
    environments and mypy cache of vLLM's pre-commit (``pre-commit/``)."""
    if override := os.environ.get(CACHE_ENV):
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "dsa-indexer-series" / "sdists"


def git_cache_dir() -> Path:
    return cache_dir() / "git"


def _cache_name(url: str, commit: str) -> str:
    """The folder of ``url``'s ``commit``, fetched: readable, apart from any
    other URL's, and one per commit (it is made whole, then renamed into
    place, so nothing shares a half-made one)."""
    tail = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])
    return f"{tail}-{hashlib.sha256(url.encode()).hexdigest()[:12]}/{commit}.git"


class SeriesFileError(SeriesError):
    """series.toml is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class SdistBase:
    """A released vLLM taken from its PyPI sdist, verified by sha256."""

    name: str
    version: str
    sha256: str

    @property
    def label(self) -> str:
        return f"{self.name}-{self.version}"

    @property
    def filename(self) -> str:
        return f"{self.name}-{self.version}.tar.gz"


@dataclass(frozen=True)
class GitBase:
    """vLLM from git at a revision (how users follow vLLM main): a checkout
    on this machine (``path``), or a repository any clone can fetch
    (``url``, at a full commit) kept in the sdist cache (``path``)."""

    name: str
    path: Path
    rev: str
    url: str | None = None

    @property
    def label(self) -> str:
        if re.fullmatch(r"[0-9a-f]{40}", self.rev):
            return f"{self.name}-git-{self.rev[:12]}"
        safe_rev = re.sub(r"[^A-Za-z0-9._-]", "_", self.rev)
        return f"{self.name}-git-{safe_rev}"


Base = SdistBase | GitBase


@dataclass(frozen=True)
class LargeHunk:
    """A hunk allowed over the glue budget, and why (``check`` enforces it)."""

    path: str
    number: int  # 1-based, within its file, as ``check`` lists them
    reason: str


@dataclass(frozen=True)
class Stage:
    id: str
    title: str
    patch: str
    overlays: tuple[str, ...]
    depends_on: tuple[str, ...]
    tests: str
    upstream_pr: str
    upstream_status: str
    # Tests (under tests/) that show the stage's behaviour without naming its
    # own modules: passing on a newer vLLM without the stage means upstream
    # has it. Empty: the stage's whole tests folder.
    upstream_probe: tuple[str, ...] = ()
    large_hunks: tuple[LargeHunk, ...] = ()
    # For the README's stage table: how a user turns the stage on, and the
    # hardware its behaviour was checked on.
    switches: tuple[str, ...] = ()
    validated_on: str = "not stated"

    @property
    def vllm_tests(self) -> tuple[str, ...]:
        """The test files the stage adds to vLLM's own tests/ (overlays named
        tests/**/test_*.py): its PR's tests, run with plain pytest in the
        tree, as vLLM's CI would."""
        return tuple(
            overlay
            for overlay in self.overlays
            if overlay.startswith("tests/")
            and overlay.rsplit("/", 1)[-1].startswith("test_")
        )


@dataclass(frozen=True)
class RegressionSuite:
    """A selection of vLLM's own tests that must pass on every stage's tree."""

    name: str
    paths: tuple[str, ...]
    plugin: str | None


@dataclass(frozen=True)
class Series:
    """``root`` is the project (tests/, build/, docs/): the folder above the
    series file's (patches/), whose patch files sit beside it, and whose
    overlays are in ``overlay_dir`` (vllm_overlay/)."""

    root: Path
    base: Base
    stages: tuple[Stage, ...]
    regression: tuple[RegressionSuite, ...]
    patches_dir: Path
    overlay_dir: Path

    @property
    def tests_dir(self) -> Path:
        return self.root / "tests"

    def overlay_file(self, overlay: str) -> Path:
        """Where ``overlay`` is read from and refreshed to."""
        return self.inside(self.overlay_dir / overlay)

    def patch_file(self, stage: Stage) -> Path:
        return self.inside(self.patches_dir / stage.patch)

    def inside(self, path: Path) -> Path:
        """``path``, if it stays inside the project once symlinks are
        followed; the tool never reads or writes series files elsewhere."""
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError) as exc:
            # A symlink loop: RuntimeError before Python 3.13, OSError since.
            loop = (
                isinstance(exc, RuntimeError) or getattr(exc, "errno", 0) == errno.ELOOP
            )
            why = "a symlink loop" if loop else getattr(exc, "strerror", exc)
            raise SeriesError(
                f"{path} cannot be followed ({why}); the series' files must be "
                "plain files, or links to files, inside the project"
            ) from None
        if not resolved.is_relative_to(self.root):
            raise SeriesError(
                f"{path} leads outside the project ({self.root}), through "
                "'..' or a symlink; the series' files must live inside it"
            )
        return path

    def stage(self, stage_id: str) -> Stage:
        for stage in self.stages:
            if stage.id == stage_id:
                return stage
        known = ", ".join(["base", *(s.id for s in self.stages)])
        raise SeriesError(f"unknown stage {stage_id!r} (known: {known})")

    def stages_upto(self, stage_id: str | None) -> tuple[Stage, ...]:
        """Stages in order up to and including ``stage_id`` ("base": none)."""
        if stage_id is None:
            return self.stages
        if stage_id == "base":
            return ()
        index = self.stages.index(self.stage(stage_id))
        return self.stages[: index + 1]


class _Fields:
    """Typed access to one TOML table; errors name the file and the field."""

    def __init__(self, source: Path, where: str, table: Any):
        self.source = source
        self.where = where
        if not isinstance(table, dict):
            self.fail(where, f"expected a table, got {type(table).__name__}")
        self.table: dict[str, Any] = table

    def fail(self, field: str, problem: str) -> NoReturn:
        raise SeriesFileError(f"{self.source}: {field}: {problem}")

    def _field(self, key: str) -> str:
        return f"{self.where}.{key}"

    def check_keys(self, allowed: set[str]) -> None:
        for key in self.table:
            if key not in allowed:
                self.fail(
                    self._field(key),
                    f"unknown field (allowed: {', '.join(sorted(allowed))})",
                )

    def string(self, key: str, default: str | None = None) -> str:
        if key not in self.table:
            if default is not None:
                return default
            self.fail(self._field(key), "missing")
        value = self.table[key]
        if not isinstance(value, str) or not value.strip():
            self.fail(self._field(key), f"expected a non-empty string, got {value!r}")
        return value

    def string_list(self, key: str) -> tuple[str, ...]:
        value = self.table.get(key, [])
        if not isinstance(value, list) or not all(
            isinstance(v, str) and v for v in value
        ):
            self.fail(self._field(key), f"expected a list of strings, got {value!r}")
        return tuple(value)

    def relative_path(self, key: str, value: str) -> str:
        path = Path(value)
        if path.is_absolute() or ".." in path.parts:
            self.fail(self._field(key), f"{value!r} must be a relative path inside")
        return value


def _parse_base(source: Path, raw: Any) -> Base:
    fields = _Fields(source, "base", raw)
    fields.check_keys({"name", "version", "sha256", "git", "rev"})
    name = fields.string("name")
    if "git" in fields.table:
        if "sha256" in fields.table or "version" in fields.table:
            fields.fail("base", "give either version + sha256 or git + rev, not both")
        where, rev = fields.string("git"), fields.string("rev")
        if is_git_url(where):
            if not _COMMIT.match(rev):
                fields.fail(
                    "base.rev",
                    f"a repository URL is pinned by its full commit (40 hex "
                    f"digits; a branch moves), got {rev!r}",
                )
            return GitBase(name, git_cache_dir() / _cache_name(where, rev), rev, where)
        path = Path(where).expanduser()
        if not path.is_absolute():
            path = (source.parent / path).resolve()
        return GitBase(name=name, path=path, rev=rev)
    version = fields.string("version")
    if not is_version(version):
        fields.fail("base.version", f"expected a release (X.Y.Z), got {version!r}")
    sha256 = fields.string("sha256").lower()
    if not _SHA256.match(sha256):
        fields.fail("base.sha256", f"expected 64 hex digits, got {sha256!r}")
    return SdistBase(name=name, version=version, sha256=sha256)


def _parse_stage(source: Path, index: int, raw: Any, earlier: list[Stage]) -> Stage:
    fields = _Fields(source, f"stage[{index}]", raw)
    fields.check_keys(
        {
            "id",
            "title",
            "patch",
            "overlays",
            "depends_on",
            "tests",
            "upstream",
            "upstream_probe",
            "large_hunks",
            "switches",
            "validated_on",
        }
    )
    stage_id = fields.string("id")
    if not _STAGE_ID.match(stage_id):
        fields.fail(f"stage[{index}].id", f"expected four digits, got {stage_id!r}")
    earlier_ids = [s.id for s in earlier]
    if stage_id in earlier_ids:
        fields.fail(f"stage[{index}].id", f"duplicate stage id {stage_id!r}")
    if earlier_ids and stage_id < earlier_ids[-1]:
        fields.fail(
            f"stage[{index}].id",
            f"{stage_id!r} comes after {earlier_ids[-1]!r}; list stages in order",
        )
    patch = fields.relative_path("patch", fields.string("patch"))
    if not patch.endswith(".patch"):
        fields.fail(f"stage[{index}].patch", f"expected a .patch file, got {patch!r}")
    if patch in (s.patch for s in earlier):
        fields.fail(f"stage[{index}].patch", f"{patch!r} is used by another stage")
    overlays = tuple(
        fields.relative_path("overlays", o) for o in fields.string_list("overlays")
    )
    depends_on = fields.string_list("depends_on")
    for dep in depends_on:
        if dep not in earlier_ids:
            fields.fail(
                f"stage[{index}].depends_on",
                f"{dep!r} is not an earlier stage (earlier: {earlier_ids or 'none'})",
            )
    upstream = _Fields(source, f"stage[{index}].upstream", raw.get("upstream", {}))
    upstream.check_keys({"pr", "status"})
    status = upstream.string("status", default="not-submitted")
    if status not in UPSTREAM_STATUSES:
        upstream.fail(
            f"stage[{index}].upstream.status",
            f"expected one of {', '.join(UPSTREAM_STATUSES)}, got {status!r}",
        )
    large_hunks = _parse_large_hunks(source, f"stage[{index}]", raw)
    return Stage(
        id=stage_id,
        title=fields.string("title"),
        patch=patch,
        overlays=overlays,
        depends_on=depends_on,
        tests=fields.relative_path("tests", fields.string("tests")),
        upstream_pr=upstream.string("pr", default="none"),
        upstream_status=status,
        upstream_probe=tuple(
            fields.relative_path("upstream_probe", p)
            for p in fields.string_list("upstream_probe")
        ),
        large_hunks=large_hunks,
        switches=fields.string_list("switches"),
        validated_on=fields.string("validated_on", default="not stated"),
    )


def _parse_large_hunks(source: Path, where: str, raw: Any) -> tuple[LargeHunk, ...]:
    entries = raw.get("large_hunks", [])
    if not isinstance(entries, list):
        _Fields(source, where, raw).fail(
            f"{where}.large_hunks", "expected a list of {file, hunk, reason} tables"
        )
    allowed = []
    for i, entry in enumerate(entries):
        fields = _Fields(source, f"{where}.large_hunks[{i}]", entry)
        fields.check_keys({"file", "hunk", "reason"})
        number = fields.table.get("hunk")
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            fields.fail(
                f"{where}.large_hunks[{i}].hunk",
                f"expected a hunk number (1, 2, ...), got {number!r}",
            )
        path = fields.relative_path("file", fields.string("file"))
        allowed.append(LargeHunk(path, number, fields.string("reason")))
    return tuple(allowed)


def _parse_regression(source: Path, index: int, raw: Any) -> RegressionSuite:
    fields = _Fields(source, f"regression[{index}]", raw)
    fields.check_keys({"name", "paths", "plugin"})
    paths = fields.string_list("paths")
    if not paths:
        fields.fail(f"regression[{index}].paths", "expected at least one test path")
    for path in paths:
        fields.relative_path("paths", path)
    return RegressionSuite(
        name=fields.string("name"),
        paths=paths,
        plugin=fields.string("plugin") if "plugin" in fields.table else None,
    )


def load_series(path: Path = SERIES_FILE) -> Series:
    """Parse and validate a series file; raise SeriesFileError naming the field."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SeriesFileError(f"{path}: series file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise SeriesFileError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SeriesFileError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise SeriesFileError(f"{path}: cannot read it ({exc.strerror})") from None
    top = _Fields(path, "series", raw)
    top.check_keys({"base", "stage", "regression"})
    if "base" not in raw:
        top.fail("base", "missing")
    base = _parse_base(path, raw["base"])
    stages: list[Stage] = []
    raw_stages = raw.get("stage", [])
    if not isinstance(raw_stages, list):
        top.fail("stage", "expected an array of tables ([[stage]])")
    for index, raw_stage in enumerate(raw_stages):
        stages.append(_parse_stage(path, index, raw_stage, stages))
    raw_regression = raw.get("regression", [])
    if not isinstance(raw_regression, list):
        top.fail("regression", "expected an array of tables ([[regression]])")
    regression = tuple(
        _parse_regression(path, i, r) for i, r in enumerate(raw_regression)
    )
    # The project is the checkout the series file sits in, found from the
    # path as given: a symlinked folder on the way must not move it.
    folder = Path(os.path.abspath(path)).parent
    root = folder.parent
    checkout = next(
        (p for p in (folder, *folder.parents) if (p / ".git").exists()), None
    )
    if checkout is not None and root != checkout:
        top.fail(
            "series",
            f"the series file must sit in a folder of the checkout's root "
            f"({checkout}, as patches/series.toml), not in {folder}",
        )
    root = root.resolve()
    if not folder.resolve().is_relative_to(root):
        top.fail(
            "series",
            f"the series folder {folder} leads outside the project ({root}) "
            "through a symlink",
        )
    folder = folder.resolve()
    return Series(
        root=root,
        base=base,
        stages=tuple(stages),
        regression=regression,
        patches_dir=folder,
        overlay_dir=root / "vllm_overlay",
    )
