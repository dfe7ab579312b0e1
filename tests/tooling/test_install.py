# SPDX-License-Identifier: Apache-2.0
"""``install`` on a real install of the pinned vLLM (pip's install of the wheel from the
package index): it writes exactly the stage trees' package files, re-runs as
a no-op, moves between stages, and undoes to the wheel's own bytes (checked
against the wheel's RECORD); it refuses an edited file, an unexpected file,
another vLLM version, a damaged original or record and a folder it cannot
write in with nothing written; an install stopped at any step is finished,
or undone, by the next run."""

from __future__ import annotations

import base64
import contextlib
import csv
import errno
import functools
import hashlib
import os
import py_compile
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.series import SeriesError
from scripts.series.config import SERIES_FILE, load_series
from scripts.series.git import git_out
from scripts.series.install import install as install_module
from scripts.series.install.install import install, installed_record, stage_files
from scripts.series.layout import (
    INSTALL_RECORD,
    INSTALL_RECORD_DIR,
    INSTALL_STAGED,
    workdir,
)
from scripts.series.stages.state import read_chain
from scripts.series.stages.trees import stage_tree

SERIES = load_series(SERIES_FILE)
STAGES = ["base", *(s.id for s in SERIES.stages)]
PINNED = getattr(SERIES.base, "version", None)  # None: a git pin (no install)


@functools.cache
def _wheel_hashes(site: Path) -> dict[str, str]:
    """{path: sha256 hex} from the wheel's RECORD (pip wrote it as installed)."""
    (record,) = site.glob("vllm-*.dist-info/RECORD")
    hashes = {}
    with record.open(newline="") as handle:
        for path, digest, _ in csv.reader(handle):
            if digest and not path.startswith(".."):
                raw = base64.urlsafe_b64decode(digest.split("=", 1)[1] + "==")
                hashes[path] = raw.hex()
    return hashes


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _inodes(folder: Path) -> dict[str, int]:
    """{path under folder's parent: inode} of every file below ``folder``
    (readdir's inode numbers: no stat per file, in a tree of 6,000)."""
    out, todo = {}, [folder]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    todo.append(Path(entry.path))
                else:
                    rel = Path(entry.path).relative_to(folder.parent).as_posix()
                    out[rel] = entry.inode()
    return out


_cached_inodes = functools.cache(_inodes)


def _not_as_shipped(site: Path, wheel_site: Path) -> dict[str, str | None]:
    """{path: sha256 or None when missing} of the files under site/vllm/ that
    are not the wheel's. A file still hard-linked to the cache is untouched."""
    wheel = _wheel_hashes(wheel_site)
    cached = _cached_inodes(wheel_site / "vllm")
    present = _inodes(site / "vllm")
    out: dict[str, str | None] = {}
    for rel, inode in present.items():
        if cached.get(rel) == inode:
            continue
        if wheel.get(rel) != (digest := _sha(site / rel)):
            out[rel] = digest
    for rel in wheel:
        if rel.startswith("vllm/") and rel not in present:
            out[rel] = None
    return out


@functools.cache
def _tree_package(stage: str) -> dict[str, str | None]:
    """{path: sha256, None when deleted} of the package files the stage tree
    holds differently from the base tree: read from the trees themselves,
    not from the git diff ``install`` reads."""
    base, tree = stage_tree(SERIES, "base"), stage_tree(SERIES, stage)
    out: dict[str, str | None] = {}
    for root in (base, tree):
        for path in (root / "vllm").rglob("*"):
            rel = path.relative_to(root).as_posix()
            if path.is_dir() or "__pycache__" in path.parts:
                continue
            old, new = base / rel, tree / rel
            before = _sha(old) if old.exists() else None
            after = _sha(new) if new.exists() else None
            if before != after:
                out[rel] = after
    return out


@pytest.fixture(scope="module")
def wanted() -> dict[str, install_module.StageFiles]:
    return {stage: stage_files(SERIES, stage) for stage in STAGES}


def test_install_writes_each_stage_trees_package_and_undo_restores_the_wheel(
    installed_vllm, wheel_site, wanted
):
    site = installed_vllm
    chain = read_chain(SERIES, workdir(SERIES))
    for stage in ("0001", "0003", "0001", "0003"):
        outcome = install(site, wanted[stage])
        assert outcome.changed, stage
        assert _not_as_shipped(site, wheel_site) == _tree_package(stage), stage
        record = installed_record(site)
        assert record is not None and record["stage"] == stage
        upto = [s.id for s in SERIES.stages_upto(stage)]
        assert record["commits"] == {s: chain.current_commit(s) for s in upto}
        wheel = _wheel_hashes(wheel_site)
        for rel, hashes in record["files"].items():
            assert hashes["original"] == wheel.get(rel), rel
        # The tree's files outside the package are not written there.
        assert not (site / "tests").exists() and not (site / ".buildkite").exists()
        assert any(p.startswith("tests/") for p in wanted[stage].outside)
    again = install(site, wanted["0003"])
    assert again.changed == () and again.note == "already installed: stage 0003"
    undone = install(site, None)
    assert undone.note.startswith("undone:")
    assert _not_as_shipped(site, wheel_site) == {}
    assert sorted(p.name for p in site.iterdir()) == sorted(
        p.name for p in wheel_site.iterdir()
    )
    assert install(site, None).note == f"nothing is installed in {site}"
    # "base" is vLLM as shipped: the same as an undo.
    install(site, wanted["0001"])
    assert install(site, wanted["base"]).note.startswith("undone:")
    assert _not_as_shipped(site, wheel_site) == {}
    assert not (site / INSTALL_RECORD_DIR).exists()


def test_install_upto_names_the_stages_it_leaves_out(installed_vllm):
    """`--upto` before the last stage says which stages (a fix among them)
    it does not install; all of them, nothing more."""
    from tests.tooling.conftest import run_cli

    first = SERIES.stages[0]
    done = run_cli(["install", "--into", str(installed_vllm), "--upto", first.id])
    assert done.returncode == 0, done.stderr
    left = ", ".join(f"{s.id} ({s.title})" for s in SERIES.stages[1:])
    assert f"not installed (after --upto {first.id}): {left}\n" in done.stdout
    every = run_cli(["install", "--into", str(installed_vllm)])
    assert every.returncode == 0 and "not installed" not in every.stdout


def test_the_bytecode_of_a_replaced_file_goes_with_it(installed_vllm, wanted):
    """A .pyc that Python does not check against its source (unchecked-hash,
    as some images compile theirs) would keep serving the old code."""
    source = installed_vllm / "vllm" / "envs.py"

    def compiled() -> Path:
        return Path(
            py_compile.compile(
                str(source),
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )
        )

    pyc = compiled()
    install(installed_vllm, wanted["0001"])
    assert not pyc.exists()
    pyc = compiled()
    install(installed_vllm, None)
    assert not pyc.exists()


def _append(path: Path, text: str) -> None:
    with path.open("a") as handle:  # in place, as an editor that keeps the inode
        handle.write(text)


@pytest.mark.parametrize(
    "edit, message",
    [
        ("vllm/envs.py", rf"vllm/envs.py differs from vLLM {PINNED}'s"),
        (
            "vllm/v1/attention/ops/rocm_cp_indexer.py",
            rf"rocm_cp_indexer.py exists, though vLLM {PINNED} has no such file",
        ),
    ],
)
def test_a_file_not_as_released_is_refused_and_nothing_is_written(
    installed_vllm, wheel_site, wanted, edit, message
):
    site = installed_vllm
    _append(site / edit, "# a user's edit\n")
    before = _not_as_shipped(site, wheel_site)
    with pytest.raises(SeriesError, match=message):
        install(site, wanted["0003"])
    assert _not_as_shipped(site, wheel_site) == before
    assert not (site / INSTALL_RECORD_DIR).exists()


def test_a_file_edited_after_the_install_is_left_alone(
    installed_vllm, wheel_site, wanted
):
    site = installed_vllm
    install(site, wanted["0003"])
    _append(site / "vllm/envs.py", "# a user's edit\n")
    before = _not_as_shipped(site, wheel_site)
    for target in (None, wanted["0001"], wanted["0003"]):
        with pytest.raises(SeriesError, match=r"changed since .*vllm/envs\.py"):
            install(site, target)
        assert _not_as_shipped(site, wheel_site) == before
    assert installed_record(site)["stage"] == "0003"


def _set_version(site: Path, wheel_site: Path, version: str) -> None:
    (metadata,) = site.glob("vllm-*.dist-info/METADATA")
    text = (wheel_site / metadata.relative_to(site)).read_text()
    assert f"\nVersion: {PINNED}\n" in text
    metadata.unlink()  # a hard link to the cache: write a new file
    metadata.write_text(text.replace(f"Version: {PINNED}", f"Version: {version}", 1))


def test_another_vllm_is_refused(installed_vllm, wheel_site, wanted, tmp_path):
    site = installed_vllm
    _set_version(site, wheel_site, "0.1.0")
    with pytest.raises(
        SeriesError, match=rf"holds vLLM 0.1.0; .* pinned to vLLM {PINNED}"
    ):
        install(site, wanted["0003"])
    assert _not_as_shipped(site, wheel_site) == {}
    # A local build label (ROCm images add one) is the same release.
    _set_version(site, wheel_site, f"{PINNED}+rocm700")
    install(site, wanted["0003"])
    assert installed_record(site)["stage"] == "0003"
    with pytest.raises(SeriesError, match="holds no vllm package"):
        install(tmp_path / "nowhere", wanted["0003"])


def test_a_series_on_a_git_checkout_is_refused(project):
    with pytest.raises(SeriesError, match="pinned to a vLLM git commit"):
        stage_files(project.series(), None)


class _Stop(BaseException):
    """A kill at one step of the install (nothing after it runs)."""


def test_an_install_stopped_at_any_step_is_finished_or_undone(
    installed_vllm, wheel_site, wanted, monkeypatch
):
    """Stop the install at each of its renames (each file it puts into the
    package, and each of its own records, lands by one), then run again:
    installing finishes it, undoing undoes it."""
    site = installed_vllm
    real_replace = os.replace
    calls = []

    def counting(src, dst):
        calls.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(install_module.os, "replace", counting)
    install(site, wanted["0001"])
    first = len(calls)
    install(site, wanted["0003"])  # a move: originals kept, more staged
    move = len(calls) - first
    install(site, None)
    monkeypatch.setattr(install_module.os, "replace", real_replace)
    assert first > 2 and move > 2
    expected = {None: {}, "0001": _tree_package("0001"), "0003": _tree_package("0003")}
    touched = sorted(set(_tree_package("0003")) | set(_tree_package("0001")))

    def state() -> dict[str, str | None]:
        """The files the series touches (a whole check ends the test)."""
        return {
            rel: _sha(site / rel)
            for rel in touched
            if (site / rel).exists() and _sha(site / rel) != wheel.get(rel)
        } | {rel: None for rel in touched if rel in wheel and not (site / rel).exists()}

    wheel = _wheel_hashes(wheel_site)
    notes: list[str] = []
    for start, target, count in (("0001", "0003", move), (None, "0001", first)):
        for stop_at in range(count):
            if start:
                install(site, wanted[start])
            done = []

            def stopping(src, dst, done=done, stop_at=stop_at):
                if len(done) == stop_at:
                    raise _Stop
                done.append(dst)
                real_replace(src, dst)

            monkeypatch.setattr(install_module.os, "replace", stopping)
            with pytest.raises(_Stop):
                install(site, wanted[target])
            monkeypatch.setattr(install_module.os, "replace", real_replace)
            # Finish it (an install of the same stage), or undo it.
            final = target if stop_at % 2 == 0 else None
            notes.append(install(site, wanted[final] if final else None).note)
            assert state() == expected[final], (start, stop_at, final)
            assert _record_folder_leftovers(site) == [], (start, stop_at, final)
            install(site, None)
            assert state() == {}
            assert not (site / INSTALL_RECORD_DIR).exists()
    assert _not_as_shipped(site, wheel_site) == {}
    # Stopped after its record in flight, a run was finished (or undone) from it.
    finished = [n for n in notes if n.startswith("finished an interrupted install")]
    assert len(finished) >= 4, notes


def _record_folder_leftovers(site: Path) -> list[str]:
    """Files in the record folder that its record does not account for (a
    temporary name a stopped write left), and staged files in the package."""
    import json

    root = site / INSTALL_RECORD_DIR
    staged = [str(p) for p in (site / "vllm").rglob(f".*{INSTALL_STAGED}")]
    if not root.exists():
        return staged
    record = json.loads((root / INSTALL_RECORD).read_text())
    kept = {INSTALL_RECORD} | {
        f"originals/{path}"
        for path, hashes in record["files"].items()
        if hashes["original"] is not None
    }
    return staged + sorted(
        rel
        for rel in (p.relative_to(root).as_posix() for p in root.rglob("*"))
        if (root / rel).is_file() and rel not in kept
    )


def test_an_install_stopped_before_its_record_lands_leaves_nothing_staged(
    installed_vllm, wheel_site, wanted, monkeypatch
):
    """Stop a move from stage 0001 to 0003 as it writes the record that
    names the new install (every new content staged beside its file, the
    originals saved): the next run, an undo or an install, first removes
    what was staged, so no hidden new content is left in the package."""
    site = installed_vllm
    install(site, wanted["0001"])
    real_replace = os.replace
    record = site / INSTALL_RECORD_DIR / INSTALL_RECORD

    def stopping(src, dst, *args, **kwargs):
        if Path(dst) == record:
            raise _Stop
        return real_replace(src, dst, *args, **kwargs)

    for final in (None, "0001"):
        with monkeypatch.context() as patched:
            patched.setattr(install_module.os, "replace", stopping)
            with pytest.raises(_Stop):
                install(site, wanted["0003"])
        staged = sorted((site / "vllm").rglob(".*.dsa-series-new"))
        assert len(staged) > len(_tree_package("0001")), "0003 stages more files"
        outcome = install(site, wanted[final] if final else None)
        assert not outcome.note.startswith("finished"), outcome.note
        assert sorted((site / "vllm").rglob(".*.dsa-series-new")) == []
        assert _not_as_shipped(site, wheel_site) == (
            _tree_package(final) if final else {}
        )
        install(site, wanted["0001"])


def _tree_state(folder: Path) -> dict[str, str]:
    """{path: sha256} of every file under ``folder`` (nothing when absent)."""
    if not folder.exists():
        return {}
    return {
        p.relative_to(folder).as_posix(): _sha(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.unlink()  # a new file: never write through a link into the cache
    path.write_bytes(bytes(data))


def test_a_damaged_original_stops_the_undo_with_nothing_changed(
    installed_vllm, wheel_site, wanted
):
    """An original the undo would write back is checked against its sha256
    in the record first: damaged by one byte, or missing, the undo (or a move
    to another stage) changes nothing and says how to recover."""
    site = installed_vllm
    version = SERIES.base.version
    install(site, wanted["0003"])
    records = site / INSTALL_RECORD_DIR
    original = records / "originals" / "vllm" / "envs.py"
    assert original.read_bytes() == (wheel_site / "vllm" / "envs.py").read_bytes()
    _flip_a_byte(original)
    (records / "originals" / "vllm" / "_aiter_ops.py").unlink()
    package, saved = _not_as_shipped(site, wheel_site), _tree_state(records)
    for target in (None, wanted["0001"]):
        with pytest.raises(SeriesError) as error:
            install(site, target)
        message = str(error.value)
        assert "\n" not in message
        assert f"{records}/originals/vllm/envs.py" in message
        assert f"{records}/originals/vllm/_aiter_ops.py" in message
        assert "nothing was changed" in message
        assert f"put vLLM {version}'s own files back" in message
        assert "scripts.series tree base" in message and "pip install" not in message
        assert _not_as_shipped(site, wheel_site) == package
        assert _tree_state(records) == saved
    # The release's own files put back, the undo goes through.
    for rel in ("vllm/envs.py", "vllm/_aiter_ops.py"):
        (records / "originals" / rel).unlink(missing_ok=True)
        (records / "originals" / rel).write_bytes((wheel_site / rel).read_bytes())
    assert install(site, None).note.startswith("undone:")
    assert _not_as_shipped(site, wheel_site) == {}


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda text: text[: len(text) // 2], r"record\.json cannot be read"),
        (
            lambda text: text.replace('"vllm/envs.py"', '"vllm/../../envs.py"', 1),
            r"record\.json is damaged: .*vllm/\.\./\.\./envs\.py",
        ),
        # The package folder itself, not a file in it.
        (
            lambda text: text.replace('"vllm/envs.py"', '"vllm"', 1),
            r"record\.json is damaged: 'vllm' is not a file",
        ),
    ],
    ids=["cut short", "a path out of the package", "the package folder"],
)
def test_a_damaged_record_changes_nothing(
    installed_vllm, wheel_site, wanted, damage, message
):
    site = installed_vllm
    install(site, wanted["0001"])
    record = site / INSTALL_RECORD_DIR / "record.json"
    record.write_text(damage(record.read_text()))
    package = _not_as_shipped(site, wheel_site)
    saved = _tree_state(site / INSTALL_RECORD_DIR)
    for target in (None, wanted["0003"]):
        with pytest.raises(SeriesError, match=message) as error:
            install(site, target)
        assert "own files back" in str(error.value)
        assert "pip install" not in str(error.value)
        assert _not_as_shipped(site, wheel_site) == package
        assert _tree_state(site / INSTALL_RECORD_DIR) == saved
    _recover_as_advised(site, str(error.value))
    assert _not_as_shipped(site, wheel_site) == {}
    assert install(site, wanted["0003"]).changed


def _recover_as_advised(site: Path, advice: str) -> None:
    """Follow a damaged record's advice word for word: its git command lists
    the files, the base tree holds the release's copies, the record goes."""
    import re
    import shlex
    import subprocess

    command = re.search(r"`(git -C [^`]+)`", advice)
    assert command, advice
    listed = subprocess.run(
        shlex.split(command[1]),
        cwd=SERIES.root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    base = stage_tree(SERIES, "base")
    for line in listed.splitlines():
        status, path = line.split("\t")
        if status == "A":
            (site / path).unlink(missing_ok=True)
        else:
            shutil.copyfile(base / path, site / path)
    shutil.rmtree(site / INSTALL_RECORD_DIR)


def _rekey(record: dict, old: str, new: str) -> None:
    record["files"][new] = record["files"].pop(old)


def _escape_link(site: Path, outside: Path) -> str:
    """A folder of the package that is a link to ``outside``."""
    (site / "vllm" / "escape").symlink_to(outside, target_is_directory=True)
    return "vllm/escape/envs.py"


HOSTILE = {
    "a hash with a newline after it": lambda r, site, out: r["files"][
        "vllm/envs.py"
    ].update(installed=r["files"]["vllm/envs.py"]["installed"] + "\n"),
    "a hash in capitals": lambda r, site, out: r["files"]["vllm/envs.py"].update(
        original=r["files"]["vllm/envs.py"]["original"].upper()
    ),
    "an absolute path": lambda r, site, out: _rekey(
        r, "vllm/envs.py", str(out / "envs.py")
    ),
    "a path through ..": lambda r, site, out: _rekey(
        r, "vllm/envs.py", "vllm/../outside/envs.py"
    ),
    "a path through a link out of the package": lambda r, site, out: _rekey(
        r, "vllm/envs.py", _escape_link(site, out)
    ),
    "a pending swap through a link": lambda r, site, out: r.update(
        pending=[
            {
                "path": _escape_link(site, out),
                "before": _sha(out / "envs.py"),
                "after": None,
            }
        ]
    ),
    "a pending swap at an absolute path": lambda r, site, out: r.update(
        pending=[{"path": str(out / "envs.py"), "before": None, "after": None}]
    ),
    "the saved originals a link out": lambda r, site, out: (
        shutil.move(site / INSTALL_RECORD_DIR / "originals", out / "originals"),
        (site / INSTALL_RECORD_DIR / "originals").symlink_to(out / "originals"),
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_record_touches_nothing_outside_the_package(
    installed_vllm, wanted, tmp_path, name
):
    """Each field of record.json is untrusted input: a value that is not
    exactly what install writes, or a path that leads out of the package (or
    out of the saved originals) by any way, is refused, naming it, before
    anything is written; an undo or install then changes nothing, inside the
    package or outside it."""
    import json

    site = installed_vllm
    install(site, wanted["0001"])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "envs.py").write_bytes((site / "vllm/envs.py").read_bytes())
    (outside / "keep.txt").write_text("the user's\n")
    record_file = site / INSTALL_RECORD_DIR / INSTALL_RECORD
    record = json.loads(record_file.read_text())
    HOSTILE[name](record, site, outside)
    record_file.write_text(json.dumps(record))
    before_outside = _tree_state(outside)
    before_package = _tree_state(site / "vllm")
    for target in (None, wanted["0003"]):
        with pytest.raises(SeriesError, match="record.json is damaged"):
            install(site, target)
        assert _tree_state(outside) == before_outside
        assert _tree_state(site / "vllm") == before_package


OPS = "vllm/v1/attention/ops"  # stage 0001 adds a file there, changes one
OPS = "vllm/v1/attention/ops"  # stage 0001 adds a file there, changes one


@contextlib.contextmanager
def _unwritable(folder: Path) -> Iterator[None]:
    """os.access reports ``folder`` unwritable, as for a read-only layer or
    mount, or another owner's folder (the tests may run as root, for whom a
    chmod changes nothing)."""
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        if Path(path) == folder and mode & os.W_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(os, "access", access)
        yield


def test_an_unwritable_folder_is_refused_before_anything_is_written(
    installed_vllm, wheel_site, wanted
):
    """A folder of the package that cannot be written (a read-only layer or
    mount, or another owner's) is found before the first file is swapped:
    the install, or the undo, is refused naming it, with nothing changed."""
    site = installed_vllm
    ops = site / OPS
    refused = pytest.raises(SeriesError, match=rf"cannot write in {ops} \(")
    with _unwritable(ops), refused as e:
        install(site, wanted["0003"])
    assert "nothing was changed" in str(e.value)
    assert _not_as_shipped(site, wheel_site) == {}
    assert not (site / INSTALL_RECORD_DIR).exists()
    install(site, wanted["0003"])
    saved = _tree_state(site / INSTALL_RECORD_DIR)
    with _unwritable(ops):
        # The undo writes back stage 0001's files in ops (a move between
        # stages may leave ops alone: stage 0003 writes nothing there).
        for target in (None,):
            with pytest.raises(SeriesError, match=rf"cannot write in {ops} \("):
                install(site, target)
            assert _not_as_shipped(site, wheel_site) == _tree_package("0003")
            assert _tree_state(site / INSTALL_RECORD_DIR) == saved


def test_an_unwritable_site_folder_is_refused_for_the_record(
    installed_vllm, wheel_site, wanted
):
    """The site folder itself holds the record folder: a first install
    creates it there and an undo removes it, so both are refused, naming
    the site folder, when it cannot be written, though every package
    folder can."""
    site = installed_vllm
    refused = rf"cannot write in {site} \("
    with _unwritable(site), pytest.raises(SeriesError, match=refused):
        install(site, wanted["0001"])
    assert _not_as_shipped(site, wheel_site) == {}
    assert not (site / INSTALL_RECORD_DIR).exists()
    install(site, wanted["0001"])
    saved = _tree_state(site / INSTALL_RECORD_DIR)
    with _unwritable(site), pytest.raises(SeriesError, match=refused):
        install(site, None)
    assert _not_as_shipped(site, wheel_site) == _tree_package("0001")
    assert _tree_state(site / INSTALL_RECORD_DIR) == saved


def test_a_read_only_folder_is_refused(installed_vllm, wheel_site, wanted):
    """As above, with a real chmod (which root, writing anyway, ignores)."""
    site = installed_vllm
    ops = site / OPS
    ops.chmod(0o555)
    try:
        if os.access(ops, os.W_OK):
            pytest.skip(
                "running as root (or with CAP_DAC_OVERRIDE): a folder made "
                "read-only by chmod stays writable; the os.access test covers it"
            )
        with pytest.raises(SeriesError, match=rf"cannot write in {ops} \("):
            install(site, wanted["0003"])
        assert _not_as_shipped(site, wheel_site) == {}
        assert not (site / INSTALL_RECORD_DIR).exists()
    finally:
        ops.chmod(0o755)


def _exdev(src, dst) -> OSError:
    return OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))


def test_new_contents_are_renamed_within_their_own_folder(
    installed_vllm, wheel_site, wanted, monkeypatch
):
    """A folder of the package that is a mount of its own takes no rename
    from another folder (EXDEV): the new contents are staged beside their
    targets, so installing and undoing still work. Simulated: a rename into
    or out of the ops folder from elsewhere fails as it would."""
    site = installed_vllm
    ops = site / OPS
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if (Path(src).parent == ops) != (Path(dst).parent == ops):
            raise _exdev(src, dst)
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(install_module.os, "replace", replace)
    for stage in ("0001", "0003"):
        install(site, wanted[stage])
        assert _not_as_shipped(site, wheel_site) == _tree_package(stage)
    install(site, None)
    assert _not_as_shipped(site, wheel_site) == {}
    assert not (site / INSTALL_RECORD_DIR).exists()


def test_a_file_on_another_filesystem_than_its_folder_is_refused(
    installed_vllm, wheel_site, wanted, monkeypatch
):
    """A package file mounted on its own (from another filesystem) cannot be
    replaced by a rename: found before the first swap, by its device number,
    and refused naming it, with nothing changed. Simulated: os.stat reports
    another device for it, and a rename onto it fails with EXDEV."""
    site = installed_vllm
    mounted = site / OPS / "rocm_aiter_mla_sparse.py"
    real_stat, real_replace = os.stat, os.replace

    def stat(path, *args, **kwargs):
        result = real_stat(path, *args, **kwargs)
        if Path(path) == mounted:
            fields = list(result[:10])
            fields[2] += 1  # st_dev
            return os.stat_result(fields)
        return result

    def replace(src, dst, *args, **kwargs):
        if Path(dst) == mounted:
            raise _exdev(src, dst)
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(install_module.os, "replace", replace)
    with pytest.raises(SeriesError, match=rf"{mounted} is on another filesystem"):
        install(site, wanted["0001"])
    assert _not_as_shipped(site, wheel_site) == {}
    assert not (site / INSTALL_RECORD_DIR).exists()


def test_a_file_to_delete_on_another_filesystem_is_refused(
    installed_vllm, wheel_site, wanted, monkeypatch
):
    """The undo deletes the files the stages added; one mounted on its own
    (another device than its folder) cannot be unlinked (EBUSY): found
    before the first change and refused naming it, with the install as it
    was. Simulated through os.stat and os.unlink."""
    site = installed_vllm
    install(site, wanted["0001"])
    added = [
        p
        for p in _tree_package("0001")
        if p.startswith(OPS) and not (wheel_site / p).exists()
    ]
    mounted = site / added[0]
    saved = _tree_state(site / INSTALL_RECORD_DIR)
    real_stat, real_unlink = os.stat, os.unlink

    def stat(path, *args, **kwargs):
        result = real_stat(path, *args, **kwargs)
        if Path(path) == mounted:
            fields = list(result[:10])
            fields[2] += 1  # st_dev
            return os.stat_result(fields)
        return result

    def unlink(path, *args, **kwargs):
        if Path(path) == mounted:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(SeriesError, match=rf"{mounted} is on another filesystem"):
        install(site, None)
    assert _not_as_shipped(site, wheel_site) == _tree_package("0001")
    assert _tree_state(site / INSTALL_RECORD_DIR) == saved


def test_an_undo_killed_while_removing_its_record_is_finished(
    installed_vllm, wheel_site, wanted, monkeypatch
):
    """Kill the undo while it deletes its record folder, part of it gone:
    the package is already as shipped, and the next undo finishes (no
    report of damaged originals, no advice to reinstall vLLM)."""
    site = installed_vllm
    install(site, wanted["0001"])
    real_rmtree = install_module.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name.startswith(INSTALL_RECORD_DIR) and Path(path).exists():
            # Part of the folder gone (its record, an original), then the kill.
            (Path(path) / INSTALL_RECORD).unlink(missing_ok=True)
            for original in sorted(Path(path).rglob("*.py"))[:1]:
                original.unlink()
            raise _Stop
        return real_rmtree(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(install_module.shutil, "rmtree", rmtree)
        with pytest.raises(_Stop):
            install(site, None)
    assert _not_as_shipped(site, wheel_site) == {}
    outcome = install(site, None)
    assert outcome.record is None
    assert _not_as_shipped(site, wheel_site) == {}
    assert [p.name for p in site.iterdir() if p.name.startswith(".dsa")] == []


def test_an_undo_finds_the_release_back_under_a_damaged_record(
    installed_vllm, wheel_site, wanted
):
    """A record whose originals were half deleted (an undo killed while an
    older version removed it) over files already as shipped: the undo
    removes the record instead of refusing on the damaged originals."""
    site = installed_vllm
    install(site, wanted["0001"])
    records = site / INSTALL_RECORD_DIR
    for path in _tree_package("0001"):
        shipped = wheel_site / path
        if shipped.exists():
            shutil.copyfile(shipped, site / path)
        else:
            (site / path).unlink()
    for original in sorted((records / "originals").rglob("*.py"))[:1]:
        original.unlink()
    outcome = install(site, None)
    assert "as vLLM shipped them already" in outcome.note
    assert not records.exists() and _not_as_shipped(site, wheel_site) == {}


def test_an_undo_stopped_right_after_a_deletion_is_finished(
    installed_vllm, wheel_site, wanted, monkeypatch
):
    """Stop the undo right after each file it deletes (the files the stages
    add), then run again: undoing finishes it, installing finishes it and
    installs. The deleted files' bytecode goes too, also for the file whose
    deletion was the last step before the stop."""
    site = installed_vllm
    added = sorted(p for p, s in wanted["0003"].files.items() if s[0] is None)
    assert len(added) > 2
    real_unlink = os.unlink
    for stop_after in range(len(added)):
        install(site, wanted["0003"])
        for rel in added:
            py_compile.compile(
                str(site / rel),
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )
        deleted: list[str] = []

        def stopping(path, *args, deleted=deleted, stop_after=stop_after, **kwargs):
            real_unlink(path, *args, **kwargs)
            if kwargs.get("dir_fd") is None and Path(path).is_relative_to(site):
                rel = Path(path).relative_to(site).as_posix()
                if rel in added:
                    deleted.append(rel)
                    if len(deleted) == stop_after + 1:
                        raise _Stop

        monkeypatch.setattr(os, "unlink", stopping)
        with pytest.raises(_Stop):
            install(site, None)
        monkeypatch.setattr(os, "unlink", real_unlink)
        assert not (site / deleted[-1]).exists()
        assert len([p for p in added if (site / p).exists()]) == len(added) - len(
            deleted
        )
        final = None if stop_after % 2 == 0 else "0001"
        note = install(site, wanted[final] if final else None).note
        assert note.startswith("finished an interrupted install"), note
        expected = _tree_package(final) if final else {}
        assert _not_as_shipped(site, wheel_site) == expected, (stop_after, final)
        install(site, None)
        assert _not_as_shipped(site, wheel_site) == {}, stop_after
        assert not (site / INSTALL_RECORD_DIR).exists()


def test_a_damaged_staged_file_stops_the_finish_of_an_interrupted_install(
    installed_vllm, wheel_site, wanted, monkeypatch
):
    """Stopped at its first swap, an install leaves its new contents staged;
    one damaged before the next run is found before that run swaps anything
    (it would land in vLLM as it is). Put back, the install is finished."""
    site = installed_vllm
    real_replace = os.replace

    def stopping(src, dst, *args, **kwargs):
        if Path(dst).is_relative_to(site / "vllm"):
            raise _Stop
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(install_module.os, "replace", stopping)
    with pytest.raises(_Stop):
        install(site, wanted["0001"])
    monkeypatch.setattr(install_module.os, "replace", real_replace)
    staged = sorted((site / "vllm").rglob(".*.dsa-series-new"))
    assert len(staged) == len(_tree_package("0001"))
    good = staged[0].read_bytes()
    _flip_a_byte(staged[0])
    package = _not_as_shipped(site, wheel_site)
    assert package == {p: s for p, s in package.items() if p.endswith("-new")}
    saved = _tree_state(site / INSTALL_RECORD_DIR)
    for target in (None, wanted["0001"]):
        with pytest.raises(SeriesError, match=rf"{staged[0]}, the new content") as e:
            install(site, target)
        assert "own files back" in str(e.value) and "pip install" not in str(e.value)
        assert _not_as_shipped(site, wheel_site) == package
        assert _tree_state(site / INSTALL_RECORD_DIR) == saved
    staged[0].write_bytes(good)
    assert install(site, None).note.startswith("finished an interrupted install")
    assert _not_as_shipped(site, wheel_site) == {}
    assert not (site / INSTALL_RECORD_DIR).exists()


def test_install_of_named_stages_writes_them_and_not_the_ones_left_out(
    installed_vllm, wheel_site
):
    """`--stages 0001,0004`: stage 0001 with the fix, without 0003. A file
    0003 changes is as after 0001 (or as shipped), every other one as in
    the top tree; the output names 0003 as not installed."""
    from tests.tooling.conftest import run_cli

    done = run_cli(["install", "--into", str(installed_vllm), "--stages", "0001,0004"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("installed stages 0001, 0004: ")
    left = SERIES.stage("0003")
    assert f"not installed (--stages 0001,0004): 0003 ({left.title})" in done.stdout
    record = installed_record(installed_vllm)
    assert record is not None and record["stage"] == "0001,0004"
    assert list(record["commits"]) == ["0001", "0004"]
    top, first = _tree_package("0004"), _tree_package("0001")
    repo = workdir(SERIES)
    only_0003 = set(
        git_out(repo, "diff", "--name-only", "stage/0003^", "stage/0003").split()
    )
    expected = {
        rel: (first.get(rel) if rel in only_0003 else sha)
        for rel, sha in top.items()
        if rel not in only_0003 or rel in first
    }
    assert _not_as_shipped(installed_vllm, wheel_site) == expected
    assert "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py" in expected
    assert not any("mxfp4" in rel for rel in expected)
    assert run_cli(["install", "--into", str(installed_vllm), "--undo"]).returncode == 0
    assert _not_as_shipped(installed_vllm, wheel_site) == {}


@pytest.mark.parametrize(
    ("stages", "said"),
    [
        ("0003", "stage 0003 needs stage 0001 (its depends_on"),
        ("0003,0004", "stage 0003 needs stage 0001 (its depends_on"),
    ],
)
def test_install_of_stages_that_need_one_left_out_is_refused(
    installed_vllm, wheel_site, stages, said
):
    from tests.tooling.conftest import run_cli

    done = run_cli(["install", "--into", str(installed_vllm), "--stages", stages])
    assert done.returncode == 1
    assert said in done.stderr, done.stderr
    assert _not_as_shipped(installed_vllm, wheel_site) == {}


def test_a_stage_that_does_not_apply_without_one_left_out_is_refused(two_stages):
    """Stage 0002 of this series changes a line stage 0001 wrote: without
    0001 it is refused with git's reason (the check behind --stages, below
    its depends_on check)."""
    from scripts.series.stages.apply import apply

    series = two_stages.series()
    apply(series)
    repo = workdir(series)
    chain = read_chain(series, repo)
    with pytest.raises(
        SeriesError,
        match=r"stage 0002 does not apply without stage 0001 \(.*vllm/envs.py",
    ):
        install_module._tree_of(series, repo, chain, [series.stage("0002")])
    both = install_module._tree_of(series, repo, chain, list(series.stages))
    assert both == chain.current_commit("0002")
