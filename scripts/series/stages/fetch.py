# SPDX-License-Identifier: Apache-2.0
"""Fetch the pinned vLLM sdist from the package index and verify its sha256.

``pip download`` cannot fetch vLLM's sdist without building its metadata
(which needs CUDA), so the file is taken straight from the index's simple API
(JSON, PEP 691, or HTML, PEP 503). It is kept in a cache so later runs work
offline.
"""

from __future__ import annotations

import hashlib
import html.parser
import http.client
import json
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import CACHE_ENV, GitBase, SdistBase, cache_dir
from scripts.series.files import sha256_of
from scripts.series.git import git

INDEX_ENV = "DSA_SERIES_INDEX_URL"
DEFAULT_INDEX = "https://pypi.org/simple"
# JSON (PEP 691) preferred; a mirror that serves only HTML (PEP 503) works too.
_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
_CHUNK = 1 << 20
_TIMEOUT_S = 60


def index_url() -> str:
    return os.environ.get(INDEX_ENV, DEFAULT_INDEX).rstrip("/")


def _open(url: str, accept: str | None = None) -> http.client.HTTPResponse:
    request = urllib.request.Request(url)
    if accept:
        request.add_header("Accept", accept)
    return urllib.request.urlopen(request, timeout=_TIMEOUT_S)  # noqa: S310


class _Links(html.parser.HTMLParser):
    """The file links of a PEP 503 (HTML) project page: {text: href}."""

    def __init__(self) -> None:
        super().__init__()
        self.links: dict[str, str] = {}
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None and data.strip():
            self.links[data.strip()] = self._href
            self._href = None


def listed_files(project_url: str) -> dict[str, tuple[str, str | None, int | None]]:
    """{filename: (url, sha256, size)} from the index's JSON (PEP 691) or
    HTML (PEP 503) project page; an HTML page gives the hash in the link's
    ``#sha256=`` fragment and no size."""
    with _open(project_url, _ACCEPT) as response:
        kind = response.headers.get("Content-Type", "")
        body = response.read()
    if "json" in kind:
        return {
            entry["filename"]: (
                entry["url"],
                entry.get("hashes", {}).get("sha256"),
                entry.get("size"),
            )
            for entry in json.loads(body).get("files", [])
        }
    parser = _Links()
    parser.feed(body.decode("utf-8", errors="replace"))
    files: dict[str, tuple[str, str | None, int | None]] = {}
    for name, href in parser.links.items():
        url, _, fragment = href.partition("#")
        hash_name, _, value = fragment.partition("=")
        files[name] = (url, value if hash_name == "sha256" else None, None)
    return files


def _find_file_url(base: SdistBase) -> tuple[str, str | None, int | None]:
    """Where the index keeps the sdist: its URL, listed sha256 and size."""
    project_url = f"{index_url()}/{base.name}/"
    files = listed_files(project_url)
    if base.filename not in files:
        raise SeriesError(f"{project_url} has no file named {base.filename}")
    url, listed, size = files[base.filename]
    return urllib.parse.urljoin(project_url, url), listed, size


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


def _make_cache_folder(folder: Path, use: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SeriesError(
            f"cannot use {folder} {use} ({exc.strerror}); set {CACHE_ENV} to a "
            "writable folder"
        ) from None


def fetch_sdist(base: SdistBase, *, offline: bool = False) -> Path:
    """Return the path of the verified sdist, downloading it if needed.

    A cached file whose hash differs from the pin is replaced only when the
    index confirms the pin (the copy is damaged); when the index lists the
    cached copy's hash instead, the pin is wrong and the copy is kept.
    """
    cache = cache_dir()
    dest = cache / base.filename
    cached = sha256_of(dest) if dest.exists() else None
    if cached == base.sha256:
        return dest
    if offline:
        found = (
            f"the cached copy has sha256 {cached}, not {base.sha256} (kept: "
            "delete it if the pin is right)"
            if cached
            else f"it is not in the cache ({cache})"
        )
        raise SeriesError(f"{base.filename}: {found}, and --offline was given")
    _make_cache_folder(cache, "as the sdist cache")
    try:
        url, listed, size = _find_file_url(base)
        if listed and listed != base.sha256:
            kept = (
                "; the cached copy has the index's hash and is kept"
                if cached == listed
                else ""
            )
            raise SeriesError(
                f"the index lists {base.filename} with sha256 {listed}, but "
                f"series.toml pins {base.sha256}: check the pin{kept}; refusing "
                "to download"
            )
        if cached:
            print(
                f"warning: cached {dest} had sha256 {cached}, expected "
                f"{base.sha256} (as the index says); replacing it",
                file=sys.stderr,
            )
            dest.unlink()
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


def fetch_git_commit(base: GitBase) -> None:
    """Bring a git URL pin's commit into its own cache repository
    (``base.path``), once: only that commit and its files (``--depth 1``), as
    any clone of the project can; GitHub serves a commit by its id, and so
    does a file:// URL. It is fetched into a fresh folder beside it and
    renamed into place when whole, so a fetch killed part way (git leaves
    its lock files) or another command fetching the same commit at once
    never leaves, or meets, a half-made one."""
    assert base.url is not None
    repo = base.path
    if repo.is_dir():
        return
    _make_cache_folder(repo.parent, "for the git pin's commits")
    scratch = Path(tempfile.mkdtemp(prefix=f".{repo.name}.", dir=repo.parent))
    try:
        git(scratch, "init", "-q", "--bare")
        print(f"fetching {base.rev[:12]} from {base.url}", file=sys.stderr)
        fetched = git(
            scratch, "fetch", "-q", "--depth", "1", base.url, base.rev, check=False
        )
        if fetched.returncode != 0:
            said = fetched.stderr.decode(errors="replace").strip().splitlines()
            way_on = (
                "that folder is on the machine the branch was made on; apply "
                "it there, or rebase again from a checkout whose remote is a URL"
                if base.url.startswith("file://")
                else "connect to the network, or check that the repository has "
                "that commit"
            )
            raise SeriesError(
                f"cannot fetch commit {base.rev} from {base.url} "
                f"({said[-1] if said else 'git fetch failed'}); the pin in "
                f"patches/series.toml names it: {way_on}"
            )
        try:
            scratch.rename(repo)
        except OSError:
            if not repo.is_dir():  # not another fetch of the same commit
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
