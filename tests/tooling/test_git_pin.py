# SPDX-License-Identifier: Apache-2.0
"""A rebase onto a vLLM git checkout, as another clone of the project meets
its branch: pinned by a URL any clone can fetch when the checkout's remote
has the commit, by the folder otherwise; merged into main, CI's
check-patches and the Dockerfile's install refuse it with what to do."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from scripts.series.config import REPO_ROOT, GitBase, SeriesFileError, load_series
from scripts.series.stages.fetch import CACHE_ENV, fetch_git_commit
from tests.tooling.conftest import Project, run_cli, sh


def _cli(series_file: Path, *args: str):
    return run_cli(["--series", str(series_file), *args])


@pytest.fixture
def on_main(two_stages: Project, tmp_path: Path, monkeypatch) -> Project:
    """The project on its branch main, committed; upstream has moved on."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    two_stages.commit_all()
    sh(two_stages.root, "git", "branch", "-M", "main")
    ops = two_stages.upstream / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("return 5\n", "return 55\n", 1))
    sh(two_stages.upstream, "git", "commit", "-q", "-am", "upstream main")
    return two_stages


def _rebase_onto(project: Project, checkout: Path) -> tuple[str, str]:
    """Rebase onto ``checkout``'s main; (its branch, what the rebase said)."""
    done = _cli(project.series_file, "rebase", "--git", str(checkout), "--rev", "main")
    assert done.returncode == 0, done.stderr
    commit = sh(checkout, "git", "rev-parse", "main").strip()
    return f"rebase/vllm-git-{commit[:12]}", done.stdout


def _clone(project: Project, tmp_path: Path, branch: str, name: str) -> Path:
    """Another clone of the project, on main with ``branch`` merged."""
    clone = tmp_path / name
    sh(tmp_path, "git", "clone", "-q", "-b", "main", str(project.root), str(clone))
    sh(clone, "git", "merge", "-q", "--ff-only", f"origin/{branch}")
    return clone


def test_a_checkout_whose_remote_has_the_commit_pins_its_url(
    on_main: Project, tmp_path: Path
):
    """The branch names the remote's URL and the full commit; another clone
    applies it with the user's checkout gone (CI on the branch), and once
    merged into main, check-patches and install refuse, saying what to do."""
    checkout = tmp_path / "vllm-checkout"
    url = on_main.upstream.as_uri()
    sh(tmp_path, "git", "clone", "-q", url, str(checkout))
    branch, said = _rebase_onto(on_main, checkout)
    commit = sh(checkout, "git", "rev-parse", "main").strip()
    assert f"it pins {url}, the checkout's remote, a repository on this machine" in said
    assert " ".join(said.split()).endswith(
        ". It is for testing against vLLM main: install and the Dockerfile take a "
        "release, so never merge it (check-patches refuses a git pin outside the "
        "tool's rebase/ and rehearsal/ branches)"
    ), said
    pin = sh(on_main.root, "git", "show", f"{branch}:patches/series.toml")
    assert f'git = "{url}"\nrev = "{commit}"\n' in pin
    shutil.rmtree(checkout)

    on_branch = tmp_path / "ci-on-the-branch"
    sh(tmp_path, "git", "clone", "-q", "-b", branch, str(on_main.root), str(on_branch))
    series_file = on_branch / "patches/series.toml"
    applied = _cli(series_file, "apply")
    assert applied.returncode == 0, applied.stderr
    tree = on_branch / f"build/vllm-git-{commit[:12]}"
    assert "return 55" in (tree / "vllm/ops.py").read_text()
    assert "main pins" not in _cli(series_file, "check").stdout

    merged = _clone(on_main, tmp_path, branch, "main-after-the-merge")
    series_file = merged / "patches/series.toml"
    assert _cli(series_file, "apply").returncode == 0
    check = _cli(series_file, "check")
    assert check.returncode == 1
    assert (
        f"error: main pins a vLLM git commit ({url}, at {commit[:12]}), but "
        "install and the Dockerfile take a release: only the tool's rebase/"
    ) in check.stdout
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm/__init__.py").write_text("")
    install = _cli(series_file, "install", "--into", str(site))
    assert install.returncode == 1
    assert "this series is pinned to a vLLM git commit" in install.stderr
    assert "Install from a checkout pinned to a release (main)" in install.stderr
    assert sorted(p.name for p in site.iterdir()) == ["vllm"]


@pytest.mark.parametrize("remote", ["none", "a folder", "a relative folder"])
def test_a_checkout_whose_commit_is_on_this_machine_pins_a_file_url(
    on_main: Project, tmp_path: Path, remote: str
):
    """No remote, or a remote that is a folder (a clone of a local mirror):
    the branch pins an absolute file:// URL and says it is local; a clone
    at another depth applies it; main refuses it."""
    checkout = tmp_path / "vllm-checkout"
    if remote == "none":
        checkout = on_main.upstream
    else:
        sh(tmp_path, "git", "clone", "-q", str(on_main.upstream), str(checkout))
        if remote == "a relative folder":
            sh(checkout, "git", "remote", "set-url", "origin", "../upstream")
        assert not sh(checkout, "git", "remote", "get-url", "origin").startswith(
            "file:"
        )
    branch, said = _rebase_onto(on_main, checkout)
    said = " ".join(said.split())
    url = on_main.upstream.resolve().as_uri()
    pin = sh(on_main.root, "git", "show", f"{branch}:patches/series.toml")
    if remote == "none":
        url = checkout.resolve().as_uri()
        assert f"no remote of {checkout} has" in said
        assert f"so it pins the checkout itself, {url}" in said
    else:
        assert (
            f"it pins {url}, the checkout's remote, a repository on this machine"
            in said
        )
    assert re.search(
        r"\w: every clone on this machine applies it, other machines and CI "
        r"cannot( \(push the commit|\. It is for testing)",
        " ".join(said.split()),
    ), said
    assert f'git = "{url}"' in pin

    deeper = tmp_path / "elsewhere" / "and" / "deeper"
    deeper.mkdir(parents=True)
    merged = _clone(on_main, deeper, branch, "clone")
    series_file = merged / "patches/series.toml"
    applied = _cli(series_file, "apply")
    assert applied.returncode == 0, applied.stderr
    check = _cli(series_file, "check")
    assert check.returncode == 1
    assert f"main pins a vLLM git commit ({url}, at" in check.stdout


def test_a_url_pin_names_a_full_commit(on_main: Project):
    """A branch, or a commit abbreviated as git prints it (7 or 12 digits,
    or one digit short), is refused: another clone fetches the commit by
    its full id, and a short one may name another commit there."""
    text = on_main.series_file.read_text()
    for where in ("https://github.com/vllm-project/vllm", "git@github.com:v/vllm"):
        pinned = text.replace(
            f'git = "{on_main.upstream}"\nrev = "v1"', f'git = "{where}"\nrev = "main"'
        )
        for rev in ("main", "a" * 7, "a" * 12, "a" * 39, "a" * 41):
            on_main.series_file.write_text(pinned.replace('"main"', f'"{rev}"'))
            with pytest.raises(SeriesFileError, match="pinned by its full commit"):
                load_series(on_main.series_file)
        on_main.series_file.write_text(pinned.replace('"main"', f'"{"a" * 40}"'))
        base = load_series(on_main.series_file).base
        assert isinstance(base, GitBase) and base.url == where


def test_a_fetch_is_made_beside_the_cache_not_in_the_temp_folder(
    on_main: Project, tmp_path: Path, monkeypatch
):
    """The commit is fetched into a folder beside its cache folder and
    renamed into place: with the system's temporary folder on another
    filesystem (a tmpfs), the rename still works and the cache is whole."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem (/dev/shm) on this machine")
    elsewhere = Path(tempfile.mkdtemp(dir=shm))
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    try:
        commit = sh(on_main.upstream, "git", "rev-parse", "HEAD").strip()
        cache = tmp_path / "another-cache" / "vllm-git"
        base = GitBase("vllm", cache, commit, on_main.upstream.as_uri())
        fetch_git_commit(base)
        assert sh(cache, "git", "cat-file", "-t", commit).strip() == "commit"
        assert list(elsewhere.iterdir()) == []
        assert [p.name for p in cache.parent.iterdir()] == ["vllm-git"]
    finally:
        shutil.rmtree(elsewhere)


@pytest.mark.parametrize("kind", ["network", "local"])
def test_a_url_pin_that_cannot_be_fetched_says_why(on_main: Project, tmp_path, kind):
    """A URL no host answers (a closed port) is a network matter; a file://
    URL that is gone is another machine's folder."""
    text = on_main.series_file.read_text()
    gone = (
        "https://127.0.0.1:9/vllm.git"
        if kind == "network"
        else (tmp_path / "no-such-repo").as_uri()
    )
    old_pin = f'git = "{on_main.upstream}"\nrev = "v1"'
    on_main.series_file.write_text(
        text.replace(old_pin, f'git = "{gone}"\nrev = "{"a" * 40}"')
    )
    applied = _cli(on_main.series_file, "apply")
    assert applied.returncode == 1
    assert f"\nerror: cannot fetch commit {'a' * 40} from {gone} (" in applied.stderr
    said = " ".join(applied.stderr.split())
    if kind == "network":
        assert "connect to the network" in said
    else:
        assert "that folder is on the machine the branch was made on" in said
        assert "network" not in said


@pytest.mark.parametrize("where", ["a pull request's merge commit", "master"])
def test_a_git_pin_is_refused_off_the_tools_own_branches(
    on_main: Project, tmp_path: Path, where: str
):
    """CI checks a pull request on its merge commit, detached, and a default
    branch may be named otherwise: a git pin passes check only on the
    branches rebase and its rehearsal make."""
    checkout = tmp_path / "vllm-checkout"
    sh(tmp_path, "git", "clone", "-q", on_main.upstream.as_uri(), str(checkout))
    branch, _ = _rebase_onto(on_main, checkout)
    ci = tmp_path / "ci"
    sh(tmp_path, "git", "clone", "-q", "-b", "main", str(on_main.root), str(ci))
    if where == "master":
        sh(ci, "git", "merge", "-q", "--ff-only", f"origin/{branch}")
        sh(ci, "git", "branch", "-M", "master")
    else:
        # As a forge makes it: a merge commit of the branch into main,
        # checked out by its commit.
        sh(ci, "git", "merge", "-q", "--no-ff", "-m", "Merge PR", f"origin/{branch}")
        sh(ci, "git", "checkout", "-q", "--detach", "HEAD")
    series_file = ci / "patches/series.toml"
    assert _cli(series_file, "apply").returncode == 0
    check = _cli(series_file, "check")
    assert check.returncode == 1
    head = "master" if where == "master" else "a detached HEAD"
    assert f"error: {head}" in check.stdout
    assert "pins a vLLM git commit" in check.stdout
    # The undo it prints runs as typed, after a fast-forward or a merge.
    (undo,) = re.findall(r"`(git revert [^`]*)`", " ".join(check.stdout.split()))
    merged = series_file.read_text()
    who = {f"GIT_{w}_{f}": v for w in ("AUTHOR", "COMMITTER")
           for f, v in (("NAME", "Ada"), ("EMAIL", "ada@example.com"))}  # fmt: skip
    subprocess.run(undo, shell=True, cwd=ci, check=True, env={**os.environ, **who})
    sh(ci, "git", "diff", "--quiet", "origin/main", "--", "patches")
    sh(ci, "git", "reset", "-q", "--hard", "HEAD~1")
    assert series_file.read_text() == merged
    for allowed in (branch, "rehearsal/vllm-git-x"):
        sh(ci, "git", "checkout", "-q", "-B", allowed)
        assert "pins a vLLM git commit" not in _cli(series_file, "check").stdout


@pytest.mark.parametrize("damage", ["empty", "its objects deleted", "half its files"])
def test_a_damaged_pin_cache_says_to_delete_it(
    on_main: Project, tmp_path: Path, damage: str
):
    """A URL pin's commit is fetched once into the download cache; a cache
    folder left empty or part way (by hand, a disk, a kill) is named, with
    the way on: delete it, and the next command fetches the commit again."""
    checkout = tmp_path / "vllm-checkout"
    sh(tmp_path, "git", "clone", "-q", on_main.upstream.as_uri(), str(checkout))
    branch, _ = _rebase_onto(on_main, checkout)
    commit = sh(checkout, "git", "rev-parse", "main").strip()
    clone = tmp_path / "clone"
    sh(tmp_path, "git", "clone", "-q", "-b", branch, str(on_main.root), str(clone))
    series_file = clone / "patches/series.toml"
    assert _cli(series_file, "apply").returncode == 0
    (cache,) = (tmp_path / "cache/git").glob("*/*.git")
    if damage == "empty":
        shutil.rmtree(cache)
        cache.mkdir()
        # Inside a repository that has the commit (a home folder kept in
        # git, say): the emptied cache must not borrow it.
        sh(tmp_path / "cache", "git", "init", "-q")
        sh(tmp_path / "cache", "git", "fetch", "-q", str(checkout), "main")
    elif damage == "its objects deleted":
        shutil.rmtree(cache / "objects")
        (cache / "objects").mkdir()
    else:
        for path in sorted(p for p in cache.rglob("*") if p.is_file())[::2]:
            path.unlink()
    shutil.rmtree(clone / "build")
    applied = _cli(series_file, "apply")
    assert applied.returncode == 1
    said = " ".join(applied.stderr.split())
    assert f"the cache of the pinned commit {commit[:12]}, {cache}, is damaged" in said
    assert "delete that folder and run the command again" in said
    assert "A pin to a folder" not in said
    shutil.rmtree(cache)
    assert _cli(series_file, "apply").returncode == 0


def test_every_text_says_a_git_branch_is_never_merged(on_main: Project, tmp_path):
    """The branch's commit message, the rebase's last line, ``rebase --help``,
    the nox session and the README agree with what check enforces: a
    release's branch is merged to adopt its pin, a git checkout's never."""
    checkout = tmp_path / "vllm-checkout"
    sh(tmp_path, "git", "clone", "-q", on_main.upstream.as_uri(), str(checkout))
    branch, said = _rebase_onto(on_main, checkout)
    session = next(
        node
        for node in ast.walk(ast.parse((REPO_ROOT / "noxfile.py").read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "rebase"
    )
    readme_row = next(
        line
        for line in (REPO_ROOT / "README.md").read_text().splitlines()
        if "test on vLLM main" in line
    )
    texts = {
        "the branch's commit": sh(
            on_main.root, "git", "log", "-1", "--format=%B", branch
        ),
        "the rebase's last line": said.strip().splitlines()[-1],
        "rebase --help": run_cli(["rebase", "--help"]).stdout,
        "nox -s rebase": ast.get_docstring(session) or "",
        "the README": readme_row,
    }
    for where, text in texts.items():
        flat = " ".join(text.split())
        assert re.search(r"never (merge|merged)\b", flat), where
        assert not re.search(r"merg\w+ (it|this branch) (to )?adopts?", flat), where


def test_the_pinned_remote_is_upstream_then_origin_then_by_name(tmp_path: Path):
    """Of the remotes that have the commit, ``upstream``'s URL is pinned,
    else ``origin``'s, else the first by name."""
    from scripts.series.rebase.series_toml import fetchable_url

    checkout = tmp_path / "vllm"
    checkout.mkdir()
    sh(checkout, "git", "init", "-q")
    sh(checkout, "git", "commit", "-q", "--allow-empty", "-m", "one")
    commit = sh(checkout, "git", "rev-parse", "HEAD").strip()
    remotes = ["zeta", "origin", "upstream", "beta"]
    for name in remotes:
        url = f"https://example.invalid/{name}/vllm.git"
        sh(checkout, "git", "remote", "add", name, url)
        sh(checkout, "git", "update-ref", f"refs/remotes/{name}/main", commit)
    for expected in ["upstream", "origin", "beta", "zeta"]:
        assert fetchable_url(checkout, commit) == (
            f"https://example.invalid/{expected}/vllm.git"
        )
        sh(checkout, "git", "remote", "remove", expected)
    assert fetchable_url(checkout, commit) is None
