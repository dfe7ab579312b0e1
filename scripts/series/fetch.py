# SPDX-License-Identifier: Apache-2.0
"""Fetch the pinned vLLM sdist from the package index and verify its sha256.

``pip download`` cannot fetch vLLM's sdist without building its metadata
(which needs CUDA), so the file is taken straight from the index's simple API
(JSON form, PEP 691). It is kept in a cache so later runs work offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import BinaryIO

from scripts.series import SeriesError
from scripts.series.config import SdistBase

CACHE_ENV = "DSA_SERIES_CACHE_DIR"
INDEX_ENV = "DSA_SERIES_INDEX_URL"
DEFAULT_INDEX = "https://pypi.org/simple"
_JSON_ACCEPT = "application/vnd.pypi.simple.v1+json"
_CHUNK = 1 << 20
_TIMEOUT_S = 60


def cache_dir() -> Path:
    """The sdist cache: $DSA_SERIES_CACHE_DIR, else the user's cache dir."""
    if override := os.environ.get(CACHE_ENV):
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "dsa-indexer-series" / "sdists"


def index_url() -> str:
    return os.environ.get(INDEX_ENV, DEFAULT_INDEX).rstrip("/")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _open(url: str, accept: str | None = None) -> BinaryIO:
    request = urllib.request.Request(url)
    if accept:
        request.add_header("Accept", accept)
    return urllib.request.urlopen(request, timeout=_TIMEOUT_S)  # noqa: S310


def _find_file_url(base: SdistBase) -> tuple[str, int | None]:
    """Ask the simple API where the sdist lives; check the index's hash too."""
    project_url = f"{index_url()}/{base.name}/"
    with _open(project_url, _JSON_ACCEPT) as response:
        listing = json.load(response)
    for entry in listing.get("files", []):
        if entry.get("filename") != base.filename:
            continue
        listed = entry.get("hashes", {}).get("sha256")
        if listed and listed != base.sha256:
            raise SeriesError(
                f"the index lists {base.filename} with sha256 {listed}, but "
                f"series.toml pins {base.sha256}; refusing to download"
            )
        url = urllib.parse.urljoin(project_url, entry["url"])
        return url, entry.get("size")
    raise SeriesError(f"{project_url} has no file named {base.filename}")


class _Progress:
    """One status line on a terminal; a line per 10% otherwise (CI logs)."""

    def __init__(self, name: str, total: int | None):
        self.name = name
        self.total = total
        self.tty = sys.stderr.isatty()
        self.last_decile = -1

    def update(self, done: int) -> None:
        mib = done / (1 << 20)
        if not self.total:
            if self.tty:
                print(f"\r{self.name}: {mib:.1f} MiB", end="", file=sys.stderr)
            return
        percent = 100 * done / self.total
        if self.tty:
            print(
                f"\r{self.name}: {percent:5.1f}% of {self.total / (1 << 20):.1f} MiB",
                end="",
                file=sys.stderr,
            )
        elif int(percent // 10) > self.last_decile:
            self.last_decile = int(percent // 10)
            print(f"{self.name}: {percent:3.0f}% ({mib:.1f} MiB)", file=sys.stderr)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def _download(url: str, size: int | None, dest: Path, base: SdistBase) -> None:
    partial = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    done = 0
    progress = _Progress(f"downloading {base.filename}", size)
    try:
        with _open(url) as response, partial.open("wb") as out:
            while block := response.read(_CHUNK):
                out.write(block)
                digest.update(block)
                done += len(block)
                progress.update(done)
    finally:
        progress.close()
    if size is not None and done != size:
        partial.unlink()
        raise SeriesError(
            f"download of {base.filename} was truncated ({done} of {size} bytes); "
            "deleted it, run again"
        )
    if digest.hexdigest() != base.sha256:
        partial.unlink()
        raise SeriesError(
            f"downloaded {base.filename} has sha256 {digest.hexdigest()}, expected "
            f"{base.sha256}; deleted it"
        )
    partial.replace(dest)


def fetch_sdist(base: SdistBase, *, offline: bool = False) -> Path:
    """Return the path of the verified sdist, downloading it if needed.

    A cached file whose hash does not match (truncated, corrupted, replaced)
    is deleted and reported, then fetched again unless ``offline``.
    """
    cache = cache_dir()
    dest = cache / base.filename
    if dest.exists():
        actual = sha256_of(dest)
        if actual == base.sha256:
            return dest
        dest.unlink()
        print(
            f"warning: cached {dest} had sha256 {actual}, expected {base.sha256}; "
            "deleted it",
            file=sys.stderr,
        )
    if offline:
        raise SeriesError(
            f"{base.filename} is not in the cache ({cache}) and --offline was given"
        )
    cache.mkdir(parents=True, exist_ok=True)
    try:
        url, size = _find_file_url(base)
        _download(url, size, dest, base)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        dest.with_name(dest.name + ".part").unlink(missing_ok=True)
        reason = getattr(exc, "reason", exc)
        raise SeriesError(
            f"cannot download {base.filename} from {index_url()} ({reason}) and "
            f"the cache ({cache}) has no verified copy; connect to the network, "
            f"set {INDEX_ENV}, or put the file in {CACHE_ENV}"
        ) from None
    return dest
