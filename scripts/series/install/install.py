# SPDX-License-Identifier: Apache-2.0
"""``install``: the stages' changes written into an installed vLLM package
(no rebuild: every change is Python), all or nothing, with a record beside
it for ``--undo``; docs/guarantees.md says what it checks first."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import SdistBase, Series, Stage
from scripts.series.files import lock, sha256_of, write_synced, write_whole
from scripts.series.git import git
from scripts.series.install.record import (
    FORMAT,
    PACKAGE,
    installed_version,
    load,
    recovery,
)
from scripts.series.layout import (
    INSTALL_ORIGINALS,
    INSTALL_RECORD,
    INSTALL_RECORD_DIR,
    INSTALL_STAGED,
    install_staged,
    workdir,
)
from scripts.series.stages.state import Chain, read_chain


@dataclass(frozen=True)
class StageFiles:
    """What installing the series up to ``stage`` means for the package."""

    version: str  # the pinned vLLM release
    stage: str  # "base" or a stage id: the last one installed
    commits: dict[str, str]  # stage id: its commit in the work repo
    # path under SITE: (the pinned base's sha256, None when the base has no
    # such file; the stage's content, None when the stage deletes it)
    files: dict[str, tuple[str | None, bytes | None]]
    outside: tuple[str, ...]  # files the stages change outside the package


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chosen_stages(
    series: Series, upto: str | None, only: list[str] | None
) -> list[Stage]:
    """The stages to install: those up to ``upto`` (default: all), or the
    ones named in ``only``, in the series' order, refused where one needs
    a stage left out (its ``depends_on``)."""
    if only is None:
        stage_id = upto or (series.stages[-1].id if series.stages else "base")
        return [] if stage_id == "base" else list(series.stages_upto(stage_id))
    chosen = [stage for stage in series.stages if stage.id in only]
    for stage in chosen:
        needed = [dep for dep in stage.depends_on if dep not in only]
        if needed:
            raise SeriesError(
                f"stage {stage.id} needs stage {', '.join(needed)} (its "
                "depends_on in patches/series.toml): name it too, or leave "
                f"{stage.id} out"
            )
    return chosen


def _tree_of(series: Series, repo: Path, chain: Chain, chosen: list[Stage]) -> str:
    """The commit or tree holding the base with ``chosen`` applied: the
    stage commit where they are the series' first stages, else each stage's
    own change applied in turn, refused where one does not apply without
    the stages left out."""
    if not chosen:
        return chain.base
    if [s.id for s in chosen] == [s.id for s in series.stages[: len(chosen)]]:
        return chain.current_commit(chosen[-1].id)
    with tempfile.TemporaryDirectory() as tmp:
        index = Path(tmp) / "index"
        git(repo, "read-tree", chain.base, index_file=index)
        for stage in chosen:
            commit = chain.current_commit(stage.id)
            diff = git(repo, "diff", "--full-index", "--binary", f"{commit}^", commit)
            applied = git(
                repo, "apply", "--cached", "-", input=diff.stdout, index_file=index,
                check=False,
            )  # fmt: skip
            if applied.returncode != 0:
                before = series.stages[: series.stages.index(stage)]
                left = [s.id for s in before if s not in chosen]
                said = applied.stderr.decode(errors="replace").strip().splitlines()
                raise SeriesError(
                    f"stage {stage.id} does not apply without stage "
                    f"{', '.join(left)} ({said[-1] if said else 'git apply failed'}): "
                    "install it with the stages before it"
                )
        return git(repo, "write-tree", index_file=index).stdout.decode().strip()


def stage_files(
    series: Series, upto: str | None, only: list[str] | None = None
) -> StageFiles:
    """The package files the chosen stages change (``chosen_stages``), read
    from the work repo's stage commits."""
    if not isinstance(series.base, SdistBase):
        raise SeriesError(
            "install writes the stages into a released vLLM, checked against "
            "that release; this series is pinned to a vLLM git commit (a "
            "rebase/vllm-git-* branch, for testing against vLLM main). Install "
            "from a checkout pinned to a release (main), or build vLLM from "
            "the stage tree (docs/serving.md, 'A build of your own, from source')"
        )
    stages = chosen_stages(series, upto, only)
    repo = workdir(series)
    chain = read_chain(series, repo)
    commits = {s.id: chain.current_commit(s.id) for s in stages}
    tip = _tree_of(series, repo, chain, stages)
    if only is None:
        stage_id = stages[-1].id if stages else "base"
    else:
        stage_id = ",".join(commits) or "base"
    raw = git(
        repo, "diff", "--raw", "--no-renames", "--no-abbrev", "-z", chain.base, tip
    )
    fields = raw.stdout.decode().split("\0")
    files: dict[str, tuple[str | None, bytes | None]] = {}
    outside = []
    for meta, path in zip(fields[0:-1:2], fields[1::2], strict=True):
        old_mode, new_mode, old_blob, new_blob, _ = meta.lstrip(":").split(" ")
        if not path.startswith(f"{PACKAGE}/"):
            outside.append(path)
            continue
        if {old_mode, new_mode} - {"000000", "100644", "100755"}:
            raise SeriesError(
                f"{path}: the stages make it a link or a submodule; install "
                "writes plain files only"
            )
        base_sha = None if set(old_blob) == {"0"} else sha256(_blob(repo, old_blob))
        content = None if set(new_blob) == {"0"} else _blob(repo, new_blob)
        files[path] = (base_sha, content)
    return StageFiles(
        series.base.version, stage_id, commits, files, tuple(sorted(outside))
    )


def _blob(repo: Path, blob: str) -> bytes:
    return git(repo, "cat-file", "blob", blob).stdout


@dataclass(frozen=True)
class Outcome:
    changed: tuple[str, ...]  # package files written or deleted
    record: dict | None  # what is installed now (None: the install as shipped)
    note: str  # what happened, in a line


def install(site: Path, want: StageFiles | None) -> Outcome:
    """Bring the package in ``site`` to ``want`` (None: undo, the package as
    it was before the first install), all or nothing."""
    site = check_site(site)
    with _site_lock(site):
        finished = _finish_interrupted(site)
        record = load(site / INSTALL_RECORD_DIR / INSTALL_RECORD)
        recorded = record["files"] if record else {}
        if want is None and record is not None and _as_released(site, recorded):
            # An undo stopped while removing its record (before this tool
            # removed it at once): nothing is left to undo but the record.
            _remove_record_folder(site)
            return Outcome(
                (),
                None,
                finished + f"the package files in {site} are as vLLM shipped them "
                "already; removed the install record left behind",
            )
        if record is not None:
            _check_originals(site, record)
        edited = [
            p for p, f in recorded.items() if _file_sha(site / p) != f["installed"]
        ]
        if edited:
            raise SeriesError(
                "changed since the series was installed (by hand, or by "
                "reinstalling vLLM), so they are left alone: "
                + ", ".join(str(site / p) for p in edited)
                + f". Restore them, or if vLLM was reinstalled delete "
                f"{site / INSTALL_RECORD_DIR} (it describes the old install)"
            )
        if (want is None or not want.files) and record is None:
            return Outcome((), None, finished + f"nothing is installed in {site}")
        if want is not None:
            _check_version(site, want.version)
        wanted = want.files if want else {}
        _check_pristine(site, wanted, recorded, want.version if want else "")
        plan = _plan(site, wanted, recorded)
        new_record = _record(want, recorded, site) if want and want.files else None
        if not plan and new_record == record:
            what = f"stage {want.stage}" if want else "nothing"
            return Outcome((), record, finished + f"already installed: {what}")
        _check_writable(site, plan, new_record)
        _stage(site, plan, new_record, record)
        changed = _roll_forward(site)
        return Outcome(changed, new_record, finished + _summary(want, changed))


def check_site(site: Path) -> Path:
    site = site.resolve()
    if not (site / PACKAGE / "__init__.py").is_file():
        raise SeriesError(
            f"{site} holds no {PACKAGE} package (no {PACKAGE}/__init__.py); give "
            'the folder that holds vllm/: python -c "import vllm, pathlib; '
            'print(pathlib.Path(vllm.__file__).parents[1])"'
        )
    return site


@contextmanager
def _site_lock(site: Path) -> Iterator[None]:
    """One install at a time per package (a lock on its folder: nothing is
    left behind)."""
    fd = os.open(site / PACKAGE, os.O_RDONLY)
    try:
        lock(fd, lambda: f"waiting for another install into {site}...")
        yield
    finally:
        os.close(fd)


def _file_sha(path: Path) -> str | None:
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_file():
        raise SeriesError(f"{path} is not a plain file; install leaves it alone")
    return sha256_of(path)


def _as_released(site: Path, recorded: dict) -> bool:
    """Whether every file the record names is as vLLM shipped it (a file the
    install added: absent)."""
    try:
        return all(
            _file_sha(site / path) == hashes["original"]
            for path, hashes in recorded.items()
        )
    except SeriesError:  # not a plain file: not as shipped
        return False


def _check_originals(site: Path, record: dict) -> None:
    """Every original the record keeps is byte for byte the file it replaced
    (the sha256 in the record): an undo, or a move to a stage that leaves a
    file alone, writes it back into the package."""
    root = site / INSTALL_RECORD_DIR
    damaged = []
    for path, hashes in record["files"].items():
        if hashes["original"] is None:
            continue
        saved = root / INSTALL_ORIGINALS / path
        try:
            intact = _file_sha(saved) == hashes["original"]
        except (OSError, SeriesError):
            intact = False
        if not intact:
            damaged.append(str(saved))
    if damaged:
        version = record["vllm"]
        raise SeriesError(
            "the saved originals of the files install replaced are damaged or "
            f"missing (not the sha256 that {root / INSTALL_RECORD} gives): "
            f"{', '.join(damaged)}; nothing was changed (an undo would write "
            f"them into vLLM). To recover, copy vLLM {version}'s own files "
            "there (each is the release's file of the same path) and run "
            f"again; or {recovery(site, version)}"
        )


def _device(path: Path) -> int:
    return os.stat(path).st_dev


def _check_writable(site: Path, plan: list[dict], new_record: dict | None) -> None:
    """Before anything is written: every folder the install writes in can be
    written, and every file it replaces or deletes is on its folder's
    filesystem. The new contents are staged beside their targets, so each
    swap is a rename within one folder; a file mounted on its own (from
    another filesystem) cannot be replaced by one."""
    root = site / INSTALL_RECORD_DIR
    folders = {site} if new_record is None or not root.is_dir() else set()
    if root.is_dir():
        folders.add(root)
    apart = []
    for entry in plan:
        target = site / entry["path"]
        folders.add(target.parent)
        cache = target.parent / "__pycache__"
        if any(cache.glob(f"{target.stem}.*.pyc")):
            folders.add(cache)
        if entry["before"] is not None and _device(target) != _device(target.parent):
            apart.append(str(target))
    blocked = sorted(str(f) for f in folders if not os.access(f, os.W_OK | os.X_OK))
    if blocked:
        raise SeriesError(
            f"cannot write in {', '.join(blocked)} (read-only, or another "
            "user's), so nothing was changed: install adds, replaces and deletes "
            "files there. Make it writable, or run as its owner, then run again"
        )
    if apart:
        raise SeriesError(
            f"{', '.join(apart)} is on another filesystem than its folder (a "
            "file mounted on its own), so no rename can replace it; nothing was "
            "changed. Install into a vLLM whose files are not mounted one by one"
        )


def _check_version(site: Path, pinned: str) -> None:
    version = installed_version(site)
    # A local label (a ROCm build's "+rocm...") does not change the files.
    if version.split("+", 1)[0] != pinned:
        raise SeriesError(
            f"{site} holds vLLM {version}; the series is pinned to vLLM {pinned}, "
            "and installs only onto that release"
        )


def _pristine_sha(site: Path, path: str, recorded: dict) -> str | None:
    """The file as shipped: its original from the record, else on disk."""
    if path in recorded:
        return recorded[path]["original"]
    return _file_sha(site / path)


def _check_pristine(site: Path, wanted: dict, recorded: dict, version: str) -> None:
    problems = []
    for path, (base_sha, _) in wanted.items():
        have = _pristine_sha(site, path, recorded)
        if have == base_sha:
            continue
        if base_sha is None:
            problems.append(f"{path} exists, though vLLM {version} has no such file")
        elif have is None:
            problems.append(f"{path} is missing")
        else:
            problems.append(f"{path} differs from vLLM {version}'s")
    if problems:
        raise SeriesError(
            f"{site} is not vLLM {version} as released, so nothing was changed: "
            + "; ".join(problems)
        )
    for path, (_, content) in wanted.items():
        if content is not None and not (site / path).parent.is_dir():
            raise SeriesError(
                f"{site / path}: its folder does not exist, and install does "
                "not create folders"
            )


def _original(site: Path, path: str, recorded: dict) -> bytes | None:
    if path in recorded:
        if recorded[path]["original"] is None:
            return None
        return (site / INSTALL_RECORD_DIR / INSTALL_ORIGINALS / path).read_bytes()
    file = site / path
    return file.read_bytes() if file.exists() else None


def _plan(site: Path, wanted: dict, recorded: dict) -> list[dict]:
    """Per file whose content changes: its hash now, its hash after, and the
    content after (None: delete it)."""
    plan = []
    for path in sorted(set(wanted) | set(recorded)):
        after = wanted[path][1] if path in wanted else _original(site, path, recorded)
        before_sha = _file_sha(site / path)
        after_sha = None if after is None else sha256(after)
        if before_sha != after_sha:
            plan.append(
                {
                    "path": path,
                    "before": before_sha,
                    "after": after_sha,
                    "content": after,
                }
            )
    return plan


def _record(want: StageFiles, recorded: dict, site: Path) -> dict:
    files = {
        path: {
            "original": _pristine_sha(site, path, recorded),
            "installed": None if content is None else sha256(content),
        }
        for path, (_, content) in sorted(want.files.items())
    }
    return {
        "format": FORMAT,
        "tool": "python -m scripts.series install (the DSA indexer series)",
        "vllm": want.version,
        "stage": want.stage,
        "commits": want.commits,
        "files": files,
        "not_installed": list(want.outside),
    }


def _stage(
    site: Path, plan: list[dict], new_record: dict | None, record: dict | None
) -> None:
    """Everything the roll-forward needs, on disk, before the record that
    says what is being installed (the point from which the install happens)
    is written: the originals it replaces, and each new content beside its
    target (a hidden name in the same folder, so that the swap is a rename
    within the folder). A run stopped before that record, or one that fails
    here, leaves nothing behind (``_discard_staging``).

    The record in flight is the new one (an undo's: no files) with the
    swaps still to make under ``pending``: the record is the journal."""
    root = site / INSTALL_RECORD_DIR
    recorded = record["files"] if record else {}
    if new_record is None:
        assert record is not None  # an undo undoes a record
        new_record = {**record, "stage": "base", "files": {}}
    in_flight = {
        **new_record,
        "pending": [{k: e[k] for k in ("path", "before", "after")} for e in plan],
    }
    try:
        for path in in_flight["files"]:
            source = site / path
            if path not in recorded and source.exists():
                saved = root / INSTALL_ORIGINALS / path
                write_whole(saved, source.read_bytes(), source.stat().st_mode)
        for entry in plan:
            if entry["content"] is not None:
                target = site / entry["path"]
                mode = target.stat().st_mode if target.exists() else 0o644
                write_synced(install_staged(target), entry["content"], mode)
        write_whole(root / INSTALL_RECORD, json.dumps(in_flight, indent=1).encode())
    except OSError as exc:
        _discard_staging(site)
        raise SeriesError(
            f"cannot stage the new files ({exc}); nothing was changed"
        ) from None


def _discard_staging(site: Path) -> None:
    """Undo a run that stopped, or failed, before its record: its staged
    files go, and the originals it saved that the record does not name
    (with no record, the whole record folder)."""
    for staged in (site / PACKAGE).rglob(f".*{INSTALL_STAGED}"):
        staged.unlink()
    root = site / INSTALL_RECORD_DIR
    if not root.exists():
        return
    record = load(root / INSTALL_RECORD)
    if record is None:
        _remove_record_folder(site)
        return
    _prune_originals(root, record["files"])
    for partial in root.glob(".*.partial"):
        partial.unlink()


def _remove_record_folder(site: Path) -> None:
    """The record folder goes at once (renamed out of the way, then
    deleted): a run killed while deleting it leaves no half record, only
    the renamed folder, which the next run deletes."""
    removed = site / f"{INSTALL_RECORD_DIR}.removed"
    shutil.rmtree(removed, ignore_errors=True)
    os.replace(site / INSTALL_RECORD_DIR, removed)
    shutil.rmtree(removed)


def _finish_interrupted(site: Path) -> str:
    # What a run killed while removing its record folder left.
    shutil.rmtree(site / f"{INSTALL_RECORD_DIR}.removed", ignore_errors=True)
    record = load(site / INSTALL_RECORD_DIR / INSTALL_RECORD)
    if record is None or "pending" not in record:
        _discard_staging(site)
        return ""
    changed = _roll_forward(site, record)
    return f"finished an interrupted install ({len(changed)} files); "


def _roll_forward(site: Path, record: dict | None = None) -> tuple[str, ...]:
    """Carry out the record's pending swaps; each is skipped once done, so a
    run stopped anywhere is finished by the next. Every file still to swap,
    and the new content staged for it, is checked before the first swap."""
    root = site / INSTALL_RECORD_DIR
    record = record or load(root / INSTALL_RECORD)
    assert record is not None
    entries = record.pop("pending")
    pending: dict[str, Path | None] = {}  # path: its staged content (None: delete)
    for entry in entries:
        target = site / entry["path"]
        now = _file_sha(target)
        if now == entry["after"]:
            continue
        if now != entry["before"]:
            raise SeriesError(
                f"{target} changed while an install was unfinished (neither its "
                f"old nor its new content); restore it, then run `nox -s install` "
                f"again to finish ({root / INSTALL_RECORD})"
            )
        source = None
        if entry["after"] is not None:
            source = install_staged(target)
            try:
                intact = _file_sha(source) == entry["after"]
            except (OSError, SeriesError):
                intact = False
            if not intact:
                raise SeriesError(
                    f"{source}, the new content staged for {target}, is damaged "
                    "or missing, so the interrupted install cannot be finished; "
                    f"nothing more was changed. To recover, "
                    f"{recovery(site, record['vllm'])}"
                )
        pending[entry["path"]] = source
    swapped = 0
    for entry in entries:
        target = site / entry["path"]
        try:
            if entry["path"] in pending:
                source = pending[entry["path"]]
                if source is None:
                    target.unlink()
                else:
                    os.replace(source, target)
                swapped += 1
            # Also for a file swapped by a run stopped before this step.
            _drop_bytecode(target)
        except OSError as exc:
            raise SeriesError(
                f"{target}: {exc.strerror or exc}; the install stopped with "
                f"{swapped} of {len(pending)} files swapped, its record "
                f"({root / INSTALL_RECORD}) kept: once the cause is fixed, run "
                "install (or --undo) again, which finishes it first"
            ) from None
    for entry in entries:
        install_staged(site / entry["path"]).unlink(missing_ok=True)
    if not record["files"]:
        _remove_record_folder(site)  # undone: the install is as shipped again
        return tuple(e["path"] for e in entries)
    write_whole(root / INSTALL_RECORD, json.dumps(record, indent=1).encode())
    _prune_originals(root, record["files"])
    return tuple(e["path"] for e in entries)


def _prune_originals(root: Path, recorded: dict) -> None:
    """The originals of files the record no longer names go; deepest first,
    so that a folder emptied of originals goes too."""
    for original in sorted((root / INSTALL_ORIGINALS).rglob("*"), reverse=True):
        rel = original.relative_to(root / INSTALL_ORIGINALS).as_posix()
        if original.is_file() and rel not in recorded:
            original.unlink()
        elif original.is_dir() and not any(original.iterdir()):
            original.rmdir()


def _drop_bytecode(source: Path) -> None:
    """The replaced file's compiled bytecode: Python rebuilds it (a cache
    checked by hash, or not checked at all, would keep the old code)."""
    cache = source.parent / "__pycache__"
    for pyc in cache.glob(f"{source.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def _summary(want: StageFiles | None, changed: tuple[str, ...]) -> str:
    if want is None or want.stage == "base":
        return f"undone: {len(changed)} files back as vLLM shipped them"
    which = (
        f"stages {want.stage.replace(',', ', ')}"
        if "," in want.stage
        else f"up to stage {want.stage}"
    )
    return (
        f"installed {which}: {len(changed)} files changed; "
        f"{len(want.files)} of the package's files now carry the series"
    )


def installed_record(site: Path) -> dict | None:
    """What ``install`` last wrote into ``site`` (None: nothing)."""
    return load(check_site(site) / INSTALL_RECORD_DIR / INSTALL_RECORD)
