# SPDX-License-Identifier: Apache-2.0
"""`roll`: the newest release from a package index on loopback, a rebase
onto it when it is newer than the pin, and a no-op otherwise; `rebase
--version` without a hash says the index's."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import socket
import subprocess
import sys
import threading

import pytest
from conftest import run_cli, sh

from scripts.series import SeriesError
from scripts.series.cli import main
from scripts.series.layout import rebase_dir
from scripts.series.rebase import rehearsal, roll
from scripts.series.rebase.state import state_file
from scripts.series.stages.fetch import CACHE_ENV, INDEX_ENV


class Releases:
    """A simple-API index (JSON) listing sdists, plus a wheel, a
    pre-release and a signature file that roll must not follow."""

    def __init__(self, sdists: dict[str, bytes]):
        self.sdists = sdists
        releases = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                store = {f"/files/vllm-{v}.tar.gz": d for v, d in sdists.items()}
                if self.path == "/simple/vllm/":
                    kind, body = "application/vnd.pypi.simple.v1+json", releases.page()
                elif self.path in store:
                    kind, body = "application/octet-stream", store[self.path]
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
        threading.Thread(
            target=self.server.serve_forever,
            kwargs={"poll_interval": 0.01},
            daemon=True,
        ).start()

    def page(self) -> bytes:
        files = [
            {
                "filename": f"vllm-{version}.tar.gz",
                "url": f"../../files/vllm-{version}.tar.gz",
                "hashes": {"sha256": self.sha(version)},
                "size": len(data),
            }
            for version, data in self.sdists.items()
        ]
        files += [
            {
                "filename": "vllm-9.0.0rc1.tar.gz",
                "url": "/x",
                "hashes": {"sha256": "0" * 64},
            },
            {"filename": "vllm-9.0.0-cp38-abi3-manylinux_2_28_x86_64.whl", "url": "/x"},
            # A signature beside an sdist: not a release of its own.
            {
                "filename": "vllm-9.0.0.tar.gz.asc",
                "url": "/x",
                "hashes": {"sha256": "1" * 64},
            },
        ]
        return json.dumps({"files": files}).encode()

    def sha(self, version: str) -> str:
        return hashlib.sha256(self.sdists[version]).hexdigest()


def _sdist(project, rev: str, version: str) -> bytes:
    """The synthetic upstream at ``rev`` as a release's sdist."""
    return subprocess.run(
        [
            "git",
            "-C",
            str(project.upstream),
            "archive",
            "--format=tar.gz",
            f"--prefix=vllm-{version}/",
            rev,
        ],
        capture_output=True,
        check=True,
    ).stdout


@pytest.fixture
def released(two_stages, monkeypatch, tmp_path):
    """The series pinned to release 0.9.0 (upstream v1); 0.10.0 (v1 plus an
    upstream change) is on the index too: newer by release order, older by
    string order."""
    up = two_stages.upstream
    (up / "vllm/ops.py").write_text(
        (up / "vllm/ops.py").read_text().replace("return 5\n", "return 55\n", 1)
    )
    sh(up, "git", "commit", "-qam", "upstream 0.10.0")
    sh(up, "git", "tag", "v2")
    index = Releases(
        {
            "0.9.0": _sdist(two_stages, "v1", "0.9.0"),
            "0.10.0": _sdist(two_stages, "v2", "0.10.0"),
        }
    )
    monkeypatch.setenv(INDEX_ENV, index.url)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    text = two_stages.series_file.read_text()
    pin = f'version = "0.9.0"\nsha256 = "{index.sha("0.9.0")}"\n'
    two_stages.series_file.write_text(text.replace(f'git = "{up}"\nrev = "v1"\n', pin))
    two_stages.commit_all()
    yield two_stages, index
    index.server.shutdown()
    index.server.server_close()


def test_roll_rebases_onto_a_newer_release_once(released, capsys):
    project, index = released
    assert roll.roll(project.series()) == 0
    out = capsys.readouterr().out
    assert f"vllm 0.10.0 is out (sdist sha256 {index.sha('0.10.0')}): rebasing" in out
    assert (
        "Needs a person: review docs/rebased_onto_vllm-0.10.0.md on the branch "
        "rebase/vllm-0.10.0"
    ) in out
    written = sh(project.root, "git", "show", "rebase/vllm-0.10.0:patches/series.toml")
    assert f'version = "0.10.0"\nsha256 = "{index.sha("0.10.0")}"' in written
    message = sh(project.root, "git", "log", "-1", "--format=%B", "rebase/vllm-0.10.0")
    assert message.startswith(
        "Rebase the series onto vllm-0.10.0\n\nWritten by `nox -s rebase`; the "
        "report is docs/rebased_onto_vllm-0.10.0.md. Merging this branch adopts "
        "the new pin.\n\n| stage | outcome | evidence |"
    ), message
    # On a schedule: the next run finds the branch and does nothing.
    assert roll.roll(project.series()) == 0
    assert "already rebased onto it on the branch rebase/vllm-0.10.0" in (
        capsys.readouterr().out
    )


def test_roll_is_a_no_op_on_the_newest_release(released, capsys):
    project, index = released
    text = project.series_file.read_text()
    project.series_file.write_text(
        text.replace('"0.9.0"', '"0.10.0"').replace(
            index.sha("0.9.0"), index.sha("0.10.0")
        )
    )
    assert roll.roll(project.series()) == 0
    assert "vllm 0.10.0 is the newest release: nothing to do" in capsys.readouterr().out
    assert sh(project.root, "git", "branch", "--list", "rebase/*") == ""


def test_roll_reports_a_stopped_rebase_as_needing_a_person(released, capsys):
    """A conflict stops the rebase: roll says so and exits 1."""
    project, index = released
    up = project.upstream
    envs = up / "vllm/envs.py"
    envs.write_text(envs.read_text().replace("VAR_3 = 3\n", "VAR_3 = 33\n", 1))
    sh(up, "git", "commit", "-qam", "upstream 0.100.0")
    index.sdists["0.100.0"] = _sdist(project, "HEAD", "0.100.0")
    assert roll.roll(project.series()) == 1
    out = capsys.readouterr().out
    assert "Needs a person: the rebase onto vllm 0.100.0 stopped." in out
    assert "stage 0001 has conflicts" in out


def test_rebase_version_without_a_hash_names_the_index_hash(released, capsys):
    project, index = released
    code = main(["--series", str(project.series_file), "rebase", "--version", "0.10.0"])
    out = capsys.readouterr().out
    assert code == 0, "an answer, not an error"
    sha = index.sha("0.10.0")
    assert (
        f"the package index lists sha256 {sha} for vllm 0.10.0's sdist; check it "
        f"against the release page, then run\n  `nox -s rebase -- --version 0.10.0 "
        f"--sha256 {sha}`\n"
    ) in out
    with pytest.raises(SeriesError, match="lists no sdist"):
        roll.sdist_sha256("vllm", "7.7.7")


def _refusing_url() -> str:
    """An index URL on a loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/simple"


@pytest.mark.parametrize(
    "index_of, why",
    [
        (lambda index: _refusing_url(), "Connection refused"),
        (lambda index: index.url.replace("/simple", "/nothing-here"), "Not Found"),
    ],
    ids=["refuses connections", "answers 404"],
)
def test_an_unreachable_index_is_one_sentence_naming_it(
    released, monkeypatch, index_of, why
):
    """roll cannot read the index: one line naming the index URL, why, and
    what to set; nothing is written."""
    project, index = released
    url = index_of(index)
    monkeypatch.setenv(INDEX_ENV, url)
    with pytest.raises(SeriesError) as error:
        roll.roll(project.series())
    message = str(error.value)
    assert message == (
        f"cannot read vllm's releases from the package index at {url}/vllm/ "
        f"({why}); nothing was changed. Connect to the network, or set "
        f"{INDEX_ENV} to an index this machine can reach"
    )
    assert sh(project.root, "git", "branch", "--list", "rebase/*") == ""


def _field(name, value):
    """A damage: the state file's field ``name`` set to ``value`` (or, for
    ``...``, left out)."""

    def damage(raw: str) -> str:
        state = json.loads(raw)
        if value is ...:
            del state[name]
        else:
            state[name] = value
        return json.dumps(state)

    return damage


DAMAGES = {
    "cut short": lambda raw: raw[: len(raw) // 2],
    "a version out of build/": lambda raw: raw.replace(
        '"version": "0.11.0"', '"version": "0.11.0/../../.."'
    ),
    "a commit not a commit": lambda raw: raw.replace('"old_tip": "', '"old_tip": "x'),
    "a flag": lambda raw: raw.replace('"rehearsal": false', '"rehearsal": "no"'),
    # Field by field, each of the wrong type or range.
    "reports an object": _field("reports", {}),
    "a report's hunk a number": _field(
        "reports",
        [{"id": "0001", "title": "t", "outcome": "o", "evidence": "", "hunks": [3]}],
    ),
    "drop a string": _field("drop", "0001"),
    "test_python a number": _field("test_python", 3),
    "test_python a relative path": _field("test_python", "../../evil"),
    "drop a stage it has not": _field("drop", ["0009"]),
    "a commit of a stage it has not": _field("commits", {"0009": "a" * 40}),
    "next beyond the stages": _field("next", 99),
    "next negative": _field("next", -1),
    "next a flag": _field("next", True),
    "pending a string": _field("pending", "yes"),
    "commits not commits": _field("commits", {"0001": "HEAD"}),
    "regression_gone a string": _field("regression_gone", "tests/x.py"),
    "target_commit short": _field("target_commit", "abc123"),
    "branch_commit a list": _field("branch_commit", []),
    "project_head a number": _field("project_head", 7),
    "series_digest empty": _field("series_digest", ""),
    "old_tip missing": _field("old_tip", ...),
    "a field it never writes": _field("stage", 1),
    "not an object": lambda raw: "[1, 2]",
}


@pytest.mark.parametrize("damage", list(DAMAGES.values()), ids=list(DAMAGES))
def test_a_damaged_state_file_is_named_and_nothing_is_touched(released, damage):
    """The state of a stopped rebase is read back as untrusted: damaged, or
    with a target whose folder would lead out of build/rebase/, --continue,
    --abort and the rehearsal refuse it, naming the file and the `rm` that
    drops it, and delete nothing."""
    project, index = released
    ops = project.upstream / "vllm/envs.py"
    ops.write_text(ops.read_text().replace("VAR_3 = 3\n", "VAR_3 = 33\n", 1))
    sh(project.upstream, "git", "commit", "-qam", "upstream 0.11.0")
    index.sdists["0.11.0"] = _sdist(project, "HEAD", "0.11.0")
    sha = index.sha("0.11.0")
    stopped = _cli(project, "rebase", "--version", "0.11.0", "--sha256", sha)
    assert "has conflicts" in stopped.stderr
    series = project.series()
    state = state_file(series)
    state.write_text(damage(state.read_text()))
    before = sorted(p.name for p in rebase_dir(series).iterdir())
    for args in (["--continue"], ["--abort"]):
        done = _cli(project, "rebase", *args)
        assert done.returncode == 1
        assert done.stderr.startswith(f"error: {state} ")
        assert f"`rm {state}` drops it" in done.stderr
    with pytest.raises(SeriesError, match="`rm .*state.json` drops it"):
        rehearsal.rehearse(series, sys.executable)
    assert sorted(p.name for p in rebase_dir(series).iterdir()) == before
    state.unlink()
    again = _cli(project, "rebase", "--version", "0.11.0", "--sha256", sha)
    assert "has conflicts" in again.stderr, "the next rebase starts afresh"


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        # Exactly the stages the series has not, none of those it has.
        (
            _field("drop", ["0001", "0009", "0008"]),
            "names stages the series has not (0008, 0009)",
        ),
        # No folder name (a space), with no ".." in it; and ".." inside a
        # name that is otherwise one: each refused for what it is.
        (
            lambda raw: raw.replace('"0.11.0"', '"0.11.0 x"'),
            "is no folder name of build/rebase/",
        ),
        (
            lambda raw: raw.replace('"0.11.0"', '"0.11..0"'),
            "is no folder name of build/rebase/",
        ),
        (_field("next", 3), "its next stage, 3, is past the 2 stages"),
    ],
)
def test_the_state_file_damage_is_named_exactly(released, damage, said):
    """What the message says is wrong is what is wrong (a mutant that lists
    every stage, or lets a half-valid name through, says otherwise)."""
    project, index = released
    ops = project.upstream / "vllm/envs.py"
    ops.write_text(ops.read_text().replace("VAR_3 = 3\n", "VAR_3 = 33\n", 1))
    sh(project.upstream, "git", "commit", "-qam", "upstream 0.11.0")
    index.sdists["0.11.0"] = _sdist(project, "HEAD", "0.11.0")
    stopped = _cli(
        project, "rebase", "--version", "0.11.0", "--sha256", index.sha("0.11.0")
    )
    assert "has conflicts" in stopped.stderr
    state = state_file(project.series())
    state.write_text(damage(state.read_text()))
    done = _cli(project, "rebase", "--continue")
    assert done.returncode == 1
    assert said in " ".join(done.stderr.split()), done.stderr


def _cli(project, *args: str):
    return run_cli(["--series", str(project.series_file), *args])


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({}, None),
        ({"drop": ["0002"]}, None),
        ({"commits": {"0009": "c" * 40}}, "it names stages the series has not (0009)"),
        (
            {"target": {"name": "vllm", "version": "0.11.0", "sha256": "a" * 63}},
            "its release is no version with a sha256",
        ),
    ],
)
def test_a_state_file_holds_only_the_fields_it_needs(change, said):
    """The fields a rebase may not have written yet (``drop``, ``commits``
    and the rest) are optional: a state with only the four it needs is
    sound, and what it names is still checked."""
    from scripts.series.rebase.state import _state_problem

    raw = {
        "target": {"name": "vllm", "version": "0.11.0", "sha256": "a" * 64},
        "old_tip": "b" * 40,
        "series_digest": "digest",
        "reports": [],
    }
    problem = _state_problem({**raw, **change}, ["0001", "0002"])
    assert problem == (said and f"is damaged: {said}")


def test_roll_on_a_git_pin_says_to_rebase_onto_a_checkout(two_stages):
    """roll follows releases: a series pinned to a git checkout is told the
    command that rebases it onto another commit."""
    with pytest.raises(SeriesError) as refused:
        roll.roll(two_stages.series())
    assert str(refused.value) == (
        "roll follows vLLM's releases; this series is pinned to a git checkout "
        "(vllm-git-v1): rebase it with `nox -s rebase -- --git PATH --rev REV`"
    )


def test_roll_lists_a_stage_upstream_took_as_needing_a_person(released, capsys):
    """A release that took stage 0001 verbatim: roll rebases, and under what
    needs a person lists that the stage leaves the series, and why."""
    project, index = released
    up = project.upstream
    envs = up / "vllm/envs.py"
    envs.write_text(
        envs.read_text().replace("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = False\n", 1)
    )
    (up / "vllm/cp_indexer.py").write_text("def split():\n    return 'striped'\n")
    sh(up, "git", "add", "-A")
    sh(up, "git", "commit", "-qm", "upstream 0.11.0")
    index.sdists["0.11.0"] = _sdist(project, "HEAD", "0.11.0")
    assert roll.roll(project.series()) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"on the branch rebase/vllm-0\.11\.0\n- stage 0001 is already upstream "
        r"\([^\n]*reverse-applies[^\n]*\): it leaves the series\nthen test the branch",
        out,
    ), out
