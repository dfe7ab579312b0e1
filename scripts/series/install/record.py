# SPDX-License-Identifier: Apache-2.0
"""The record ``install`` keeps next to the package (``record.json``, with
the swaps still to make while an install runs): read whole and checked
before anything is written, since the paths in it are what install writes
and deletes; and which vLLM a site holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.layout import INSTALL_ORIGINALS, INSTALL_RECORD_DIR

PACKAGE = "vllm"
FORMAT = 1  # of record.json; a settled record is as earlier versions wrote it
_SHA256 = re.compile(r"[0-9a-f]{64}")


def installed_version(site: Path) -> str:
    """The version of the vLLM in ``site``: its dist-info (a pip install),
    else its ``vllm/_version.py`` (a source checkout in develop mode)."""
    metas = sorted(site.glob(f"{PACKAGE}-*.dist-info/METADATA"))
    if len(metas) > 1:
        names = ", ".join(m.parent.name for m in metas)
        raise SeriesError(f"{site} holds several vLLM installs' metadata: {names}")
    if metas:
        for line in metas[0].read_text(encoding="utf-8").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    version_file = site / PACKAGE / "_version.py"
    if version_file.is_file():
        found = re.search(
            r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]",
            version_file.read_text(encoding="utf-8"),
            re.MULTILINE,
        )
        if found:
            return found.group(1)
    raise SeriesError(
        f"cannot tell which vLLM {site} holds (no {PACKAGE}-*.dist-info/METADATA, "
        f"no version in {version_file})"
    )


def recovery(site: Path, version: str | None) -> str:
    """How to get the package back as released, without the record, keeping
    the installed vLLM's own build (the ROCm image's, a source build): the
    files it changed put back, and the files it added deleted (the next
    install refuses them)."""
    version = version or "<version>"
    return (
        f"put vLLM {version}'s own files back where install changed or deleted "
        "them, and delete the files it added: in the project, `git -C "
        f"build/{PACKAGE}-{version} diff --name-status base series -- {PACKAGE}` "
        "lists them (M changed, D deleted, A added), and the release's copies "
        "are in the base tree, whose path `python3 -m scripts.series tree base` "
        "prints (they are Python files, the same in the release's sdist as in "
        "its builds). Or reinstall vLLM the way it was installed (the ROCm "
        "image: a new container from it; a source build: build it again), not "
        "from PyPI over a ROCm build (PyPI's wheel is the CUDA one). Then "
        f"delete {site / INSTALL_RECORD_DIR}, which describes the old install"
    )


def load(path: Path) -> dict | None:
    """The record, whole and well formed: the paths in it are what install
    writes and deletes."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        problem: str | None = f"cannot be read ({exc})"
    else:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            problem = "is not an install record this tool wrote"
        elif (problem := _record_problem(data) or _escape(path, data)) is None:
            return data
        else:
            problem = f"is damaged: {problem}"
    site = path.parent.parent
    raise SeriesError(
        f"{path} {problem}; nothing was changed. To recover, "
        f"{recovery(site, site_version(site))}"
    )


def _record_problem(record: dict) -> str | None:
    if not isinstance(record.get("files"), dict):
        return "no table of files"
    pending = record.get("pending", [])
    if not isinstance(pending, list):
        return "its pending swaps are not a list"
    for entry in pending:
        if not isinstance(entry, dict) or not _package_path(entry.get("path")):
            return _not_a_file(entry)
        if not (_is_hash(entry.get("before", "")) and _is_hash(entry.get("after", ""))):
            return f"{entry['path']}: no sha256 before and after"
    for path, hashes in record["files"].items():
        if not _package_path(path):
            return _not_a_file(path)
        if not isinstance(hashes, dict) or not all(
            _is_hash(hashes.get(key, "")) for key in ("original", "installed")
        ):
            return f"{path}: no original and installed sha256"
    if not isinstance(record.get("vllm"), str) or not isinstance(
        record.get("stage"), str
    ):
        return "no vLLM version, or no stage"
    return None


def _escape(record_file: Path, record: dict) -> str | None:
    """A path of the record that a symlink on the way leads out of the
    package, or out of the folder of saved originals: install and undo
    write both."""
    site = record_file.parent.parent.resolve()
    package = (site / PACKAGE).resolve()
    originals = site / INSTALL_RECORD_DIR / INSTALL_ORIGINALS
    paths = [*record["files"], *(e["path"] for e in record.get("pending", []))]
    for path in paths:
        if not (site / path).resolve().is_relative_to(package):
            return f"{path!r} leads out of the {PACKAGE} package through a symlink"
        if not (originals / path).resolve().is_relative_to(originals):
            return f"its saved {path!r} leads out of {originals} through a symlink"
    return None


def _package_path(value: object) -> bool:
    """A file path under the package, with no way out of it."""
    if not isinstance(value, str) or "\0" in value:
        return False
    parts = value.split("/")
    return (
        len(parts) > 1
        and parts[0] == PACKAGE
        and all(part not in ("", ".", "..") for part in parts)
    )


def _not_a_file(value: object) -> str:
    return f"{value!r} is not a file of the {PACKAGE} package"


def _is_hash(value: object) -> bool:
    return value is None or (isinstance(value, str) and bool(_SHA256.fullmatch(value)))


def site_version(site: Path) -> str | None:
    """The installed release (its local label dropped), if it can be told."""
    try:
        return installed_version(site).split("+", 1)[0]
    except (OSError, ValueError, SeriesError):
        return None
