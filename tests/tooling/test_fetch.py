# SPDX-License-Identifier: Apache-2.0
"""fetch: the simple API, sha256 before use, the cache, and no network."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import tarfile
import threading
from pathlib import Path

import pytest

from scripts.series import SeriesError
from scripts.series.config import SdistBase
from scripts.series.stages.fetch import CACHE_ENV, INDEX_ENV, fetch_sdist


def _sdist_bytes() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        data = b"print('vllm')\n"
        info = tarfile.TarInfo("vllm-9.9.9/vllm/__init__.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


SDIST = _sdist_bytes()
SHA = hashlib.sha256(SDIST).hexdigest()
BASE = SdistBase(name="vllm", version="9.9.9", sha256=SHA)


class Index:
    """A package index on loopback: the simple API (JSON, or HTML only with
    ``html``) and the file."""

    def __init__(self):
        self.html = False
        self.served = SDIST
        self.listed_sha = SHA
        self.listed_size = len(SDIST)
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                index.requests.append(self.path)
                kind = "application/octet-stream"
                if self.path == "/simple/vllm/" and index.html:
                    kind = "text/html"
                    body = (
                        '<html><body><a href="/x">vllm-9.9.8.tar.gz</a>'
                        '<a href="../../files/vllm-9.9.9.tar.gz#sha256='
                        f'{index.listed_sha}">vllm-9.9.9.tar.gz</a></body></html>'
                    ).encode()
                elif self.path == "/simple/vllm/":
                    kind = "application/vnd.pypi.simple.v1+json"
                    body = json.dumps(
                        {
                            "files": [
                                {
                                    "filename": "vllm-9.9.8.tar.gz",
                                    "url": "/x",
                                    "hashes": {},
                                },
                                {
                                    "filename": "vllm-9.9.9.tar.gz",
                                    "url": "../../files/vllm-9.9.9.tar.gz",
                                    "hashes": {"sha256": index.listed_sha},
                                    "size": index.listed_size,
                                },
                            ]
                        }
                    ).encode()
                elif self.path == "/files/vllm-9.9.9.tar.gz":
                    body = index.served
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/simple"
        # A short poll: ``stop`` waits for the serving loop's next turn.
        self.thread = threading.Thread(
            target=self.server.serve_forever,
            kwargs={"poll_interval": 0.01},
            daemon=True,
        )
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def index(monkeypatch, tmp_path):
    served = Index()
    monkeypatch.setenv(INDEX_ENV, served.url)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    yield served
    served.stop()


def _cached(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "vllm-9.9.9.tar.gz"


def test_download_verifies_and_caches(index, tmp_path, capsys):
    path = fetch_sdist(BASE)
    assert path == _cached(tmp_path)
    assert path.read_bytes() == SDIST
    assert "downloading vllm-9.9.9.tar.gz" in capsys.readouterr().err
    assert index.requests == ["/simple/vllm/", "/files/vllm-9.9.9.tar.gz"]
    assert not list(path.parent.glob("*.part"))


def test_warm_cache_works_offline(index, tmp_path):
    fetch_sdist(BASE)
    index.stop()
    assert fetch_sdist(BASE).read_bytes() == SDIST
    assert fetch_sdist(BASE, offline=True).read_bytes() == SDIST


def test_a_hash_mismatch_is_deleted_and_reported(index, tmp_path):
    index.served = SDIST[:-1] + bytes([SDIST[-1] ^ 1])
    with pytest.raises(SeriesError, match=f"has sha256 .*expected {SHA}; deleted it"):
        fetch_sdist(BASE)
    assert not _cached(tmp_path).exists()
    assert not list(_cached(tmp_path).parent.glob("*"))


def test_a_truncated_download_is_deleted_and_reported(index, tmp_path):
    index.served = SDIST[: len(SDIST) // 2]
    index.listed_size = len(SDIST)
    with pytest.raises(SeriesError, match="truncated"):
        fetch_sdist(BASE)
    assert not list(_cached(tmp_path).parent.glob("*"))


def test_the_index_listing_another_hash_is_refused(index, tmp_path):
    index.listed_sha = "0" * 64
    with pytest.raises(SeriesError, match="refusing to download"):
        fetch_sdist(BASE)
    assert index.requests == ["/simple/vllm/"]


def test_a_corrupted_cache_is_replaced(index, tmp_path, capsys):
    _cached(tmp_path).parent.mkdir(parents=True)
    _cached(tmp_path).write_bytes(b"half a file")
    assert fetch_sdist(BASE).read_bytes() == SDIST
    assert "(as the index says); replacing it" in capsys.readouterr().err


def test_a_corrupted_cache_offline_is_an_error_not_a_use(index, tmp_path):
    _cached(tmp_path).parent.mkdir(parents=True)
    _cached(tmp_path).write_bytes(b"half a file")
    with pytest.raises(SeriesError, match=r"the cached copy has sha256 .* \(kept"):
        fetch_sdist(BASE, offline=True)
    assert _cached(tmp_path).read_bytes() == b"half a file"


def test_a_mistyped_pin_keeps_the_genuine_cached_copy(index, tmp_path):
    """The index confirms the cached file: the pin is wrong, not the copy."""
    fetch_sdist(BASE)
    typo = SdistBase(name="vllm", version="9.9.9", sha256="ab" * 32)
    with pytest.raises(SeriesError, match="check the pin; the cached copy has the"):
        fetch_sdist(typo)
    with pytest.raises(SeriesError, match="kept: delete it if the pin is right"):
        fetch_sdist(typo, offline=True)
    assert _cached(tmp_path).read_bytes() == SDIST


def test_an_html_only_index_works(index, tmp_path):
    index.html = True
    assert fetch_sdist(BASE).read_bytes() == SDIST
    index.listed_sha = "0" * 64
    _cached(tmp_path).unlink()
    with pytest.raises(SeriesError, match="refusing to download"):
        fetch_sdist(BASE)


def test_a_cache_path_that_is_a_file_is_one_clear_line(index, tmp_path, monkeypatch):
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "not-a-folder"))
    with pytest.raises(SeriesError, match="cannot use .* as the sdist cache"):
        fetch_sdist(BASE)


def test_no_network_and_a_cold_cache_is_one_clear_line(index, tmp_path):
    index.stop()
    with pytest.raises(SeriesError) as error:
        fetch_sdist(BASE)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("cannot download vllm-9.9.9.tar.gz from http://127.0.0.1")
    assert "the cache" in message and CACHE_ENV in message


def test_an_unknown_file_is_reported(index):
    with pytest.raises(SeriesError, match="has no file named vllm-1.0.0.tar.gz"):
        fetch_sdist(SdistBase(name="vllm", version="1.0.0", sha256=SHA))
