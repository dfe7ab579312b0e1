# SPDX-License-Identifier: Apache-2.0
"""The command line: results on stdout, errors as one line without traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

from scripts.series.config import REPO_ROOT, SERIES_FILE, load_series
from tests.tooling.conftest import Project, run_cli, sh, write_files


def _cli(
    project: Project, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_cli(["--series", str(project.series_file), *args], env)


def test_apply_status_tree_and_check(two_stages: Project):
    applied = _cli(two_stages, "apply")
    assert applied.returncode == 0, applied.stderr
    assert "stage 0002: applied (Top-k gate)" in applied.stdout
    status = _cli(two_stages, "status")
    assert "0002  applied" in status.stdout and "<- HEAD" in status.stdout
    tree = _cli(two_stages, "tree", "0001")
    assert tree.returncode == 0
    assert tree.stdout.strip().endswith("trees/vllm-git-v1/0001")
    check = _cli(two_stages, "check")
    assert check.returncode == 1
    assert "stale" in check.stdout
    assert _cli(two_stages, "refresh").returncode == 0
    # Stage 0002 flips the CP_INDEXER line stage 0001 adds: named, not fresh.
    check = _cli(two_stages, "check")
    assert "patch files match a fresh export" in check.stdout
    assert check.returncode == 1
    assert check.stdout.splitlines()[-1] == (
        "error: stage 0002 changes 1 line(s) of vllm/envs.py that stage 0001 "
        "adds; make that change in stage 0001 (the base tests and the PR tests "
        "run on the top tree only, so they would not see stage 0001's lines as "
        "its own PR has them)"
    )


def test_status_and_check_name_an_edited_overlay_alike(two_stages: Project):
    assert _cli(two_stages, "apply").returncode == 0
    overlay = two_stages.root / "vllm_overlay/vllm/cp_indexer.py"
    overlay.write_text(overlay.read_text() + "# edited\n")
    assert "0001  stale" in _cli(two_stages, "status").stdout
    check = _cli(two_stages, "check")
    assert check.returncode == 1
    assert check.stderr.startswith("error: stale stage(s) 0001, 0002: their patch")


def test_errors_are_one_line_without_a_traceback(two_stages: Project):
    (two_stages.root / "patches" / two_stages.stages[0]["patch"]).write_text("x\n")
    result = _cli(two_stages, "apply")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ")
    assert len(result.stderr.strip().splitlines()) == 1


def test_commands_before_any_apply_say_so(two_stages: Project):
    for command in (["tree", "base"], ["check"], ["refresh"], ["export"]):
        result = _cli(two_stages, *command)
        assert result.returncode == 1, command
        assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
        assert "not prepared yet; run `nox -s apply` first" in result.stderr


def test_unknown_stage_and_bad_series_file(project: Project):
    result = _cli(project, "apply", "--upto", "0042")
    assert result.returncode == 1
    assert "unknown stage '0042'" in result.stderr
    result = _cli(project, "tree", "0042")
    assert result.returncode == 1
    assert "unknown stage '0042' (known: base" in result.stderr
    project.series_file.write_text("[base]\nname = 1\n")
    result = _cli(project, "status")
    assert result.returncode == 1
    assert "base.name: expected a non-empty string" in result.stderr
    project.series_file.write_bytes(b'[base]\nname = "vllm\xff"\n')
    result = _cli(project, "status")
    assert "series.toml: not UTF-8 text" in result.stderr


def _one_line_error(result: subprocess.CompletedProcess[str], text: str) -> None:
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and text in result.stderr, result.stderr


def test_a_users_mistakes_are_one_line_errors(two_stages: Project, tmp_path):
    """No traceback for: git missing, build/ not a folder, `export base`, an
    old Python."""
    import shutil

    no_git = {**os.environ, "PATH": str(tmp_path)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.series",
            "--series",
            str(two_stages.series_file),
            "apply",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=no_git,
    )
    _one_line_error(result, "git is not installed")
    shutil.rmtree(two_stages.root / "build")
    (two_stages.root / "build").write_text("")
    _one_line_error(_cli(two_stages, "apply"), "cannot create the lock file")
    (two_stages.root / "build").unlink()
    _one_line_error(_cli(two_stages, "export", "base"), "the base is not a stage")
    old_python = subprocess.run(
        [
            sys.executable,
            "-c",
            "import runpy, sys; sys.version_info = (3, 10, 12); "
            "runpy.run_module('scripts.series', run_name='__main__')",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert old_python.returncode == 1
    assert old_python.stderr.startswith("error: the series tool needs Python 3.11")
    assert "sudo apt install python3.11 python3.11-venv" in old_python.stderr


def test_a_failed_extraction_leaves_nothing_half_made(two_stages: Project, monkeypatch):
    import errno

    import pytest

    import scripts.series.stages.prepare as prepare_module
    from scripts.series.stages.apply import apply

    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare_module, "_extract_git", disk_full)
    with pytest.raises(OSError, match="No space left"):
        apply(two_stages.series())
    assert list((two_stages.root / "build").iterdir()) == []
    monkeypatch.undo()
    assert apply(two_stages.series()).exists()  # the next run starts afresh


def test_rebase_onto_a_git_checkout_from_the_command_line(two_stages: Project):
    """The local-checkout target as users give it: the rebase ends on a
    branch whose pin is the commit (a branch moves), the path relative to
    the series file, and whose series file keeps its comments; merged, it
    applies on that commit."""
    two_stages.series_file.write_text(
        "# A comment of the user's\n" + two_stages.series_file.read_text()
    )
    two_stages.commit_all()
    ops = two_stages.upstream / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("return 5\n", "return 55\n", 1))
    sh(two_stages.upstream, "git", "commit", "-q", "-am", "upstream main")
    missing = _cli(two_stages, "rebase", "--git", str(two_stages.upstream))
    assert missing.returncode == 1 and "add --rev REV" in missing.stderr
    done = _cli(
        two_stages, "rebase", "--git", str(two_stages.upstream), "--rev", "main"
    )
    assert done.returncode == 0, done.stderr
    assert "| 0002 Top-k gate | applied cleanly |" in done.stdout
    main = sh(two_stages.upstream, "git", "rev-parse", "main").strip()
    branch = f"rebase/vllm-git-{main[:12]}"
    assert f"committed on the project's branch {branch}" in done.stdout
    assert _cli(two_stages, "rebase", "--abort").returncode == 1  # nothing running
    sh(two_stages.root, "git", "merge", "-q", "--ff-only", branch)
    merged = two_stages.series_file.read_text()
    assert f'rev = "{main}"' in merged
    assert f'git = "{two_stages.upstream.resolve().as_uri()}"' in merged
    assert merged.startswith("# A comment of the user's\n")
    sh(two_stages.upstream, "git", "commit", "-q", "--allow-empty", "-m", "moves on")
    assert _cli(two_stages, "apply").returncode == 0
    tree = two_stages.root / f"build/vllm-git-{main[:12]}"
    assert "return 55" in (tree / "vllm/ops.py").read_text()


def test_test_runs_each_stage_tree_side_by_side_and_sums_them(two_stages: Project):
    assert _cli(two_stages, "apply").returncode == 0
    write_files(
        two_stages.root / "tests",
        {
            "base/test_base.py": "def test_base():\n    pass\n",
            "stage_0001/test_one.py": textwrap.dedent("""\
                import os
                from pathlib import Path

                def test_sees_its_own_tree():
                    tree = Path(os.environ["DSA_VLLM_TREE"])
                    assert (tree / "vllm" / "cp_indexer.py").exists()
                    assert os.environ["DSA_STAGES"].startswith("base,0001")


                def test_starts_as_python_m_pytest():
                    import importlib.util
                    import sys

                    import pytest

                    main = importlib.util.find_spec("pytest.__main__")
                    assert sys.argv[0] == main.origin
                    # The folder first (python -m), site-packages after it.
                    assert sys.path.index(os.getcwd()) < sys.path.index(
                        os.path.dirname(os.path.dirname(pytest.__file__))
                    )
                    assert os.environ["TRITON_INTERPRET"] == "1"
                """),
            "stage_0002/test_two.py": (
                "def test_fails():\n    assert False\n\n\n"
                "def test_passes():\n    pass\n"
            ),
        },
    )
    result = _cli(two_stages, "test")
    assert result.returncode == 1
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == [
        "| base | ok | 1 | 0 | 0 |",
        "| 0001 | ok | 2 | 0 | 0 |",  # stage 0001's own: 0002 patches its files
        "| 0002 | FAILED | 4 | 1 | 0 |",
    ]
    assert "test_two::test_fails" in result.stdout.split("Failed:")[1]
    assert "=== 0002: series tests" in result.stdout
    # Arguments after -- go to every pytest run.
    only = _cli(two_stages, "test", "0002", "--", "-k", "not test_fails")
    assert only.returncode == 0, only.stdout
    assert "| 0002 | ok | 4 | 0 | 0 |" in only.stdout
    assert _cli(two_stages, "test", "0009").returncode == 1


def test_test_without_pytest_says_so(two_stages: Project, monkeypatch, capsys):
    from scripts.series import cli, commands

    real_find_spec = commands.importlib.util.find_spec
    monkeypatch.setattr(
        commands.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "pytest" else real_find_spec(name, *a),
    )
    code = cli.main(["--series", str(two_stages.series_file), "test"])
    assert code == 1
    assert "error: pytest is not installed" in capsys.readouterr().err


def test_env_prints_the_test_contract_a_shell_can_source(two_stages: Project):
    assert _cli(two_stages, "apply").returncode == 0
    assert _cli(two_stages, "stages").stdout.split() == ["base", "0001", "0002"]
    printed = _cli(two_stages, "env", "0001").stdout
    tree = _cli(two_stages, "tree", "0001").stdout.strip()
    base = _cli(two_stages, "tree", "base").stdout.strip()
    shown = subprocess.run(
        ["bash", "-c", printed + "\nenv"], capture_output=True, text=True
    ).stdout.splitlines()
    for line in (
        f"DSA_VLLM_TREE={tree}",
        "DSA_STAGES=base,0001",
        f"DSA_BASE_TREE={base}",
        "CUDA_VISIBLE_DEVICES=",
        "TRITON_INTERPRET=1",
    ):
        assert line in shown
    gpu = _cli(two_stages, "env", "0002", "--tree", "/copy of/tree", "--gpu").stdout
    assert gpu.splitlines() == [
        "export DSA_VLLM_TREE='/copy of/tree'",
        "export DSA_STAGES=base,0001,0002",
    ]


def _cli_process(project: Project, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "scripts.series", "--series", str(project.series_file)]
        + list(args),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stderr_until(process: subprocess.Popen[str], text: str) -> str:
    """What ``process`` wrote to stderr up to the line holding ``text``
    (all of it, if it exits first)."""
    assert process.stderr is not None
    said = ""
    while line := process.stderr.readline():
        said += line
        if text in line:
            break
    return said


def test_two_first_applies_at_once_build_one_good_base(two_stages: Project):
    """Released together on a fresh checkout (both wait on a lock held here
    first, so they truly start at once): one prepares and applies, the other
    waits for it, then finds the tree up to date."""
    from scripts.series.lock import project_lock

    with project_lock(two_stages.series(), "test holder"):
        runs = [_cli_process(two_stages, "apply") for _ in range(2)]
        said = [_stderr_until(run, "waiting for") for run in runs]
    outputs = []
    for run, before in zip(runs, said, strict=True):
        out, err = run.communicate(timeout=120)
        outputs.append((out, before + err))
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert all(
        "waiting for `python3 -m scripts.series test holder`" in e for _, e in outputs
    )
    # One applied, the other found its work done.
    assert sorted("stage 0002: up to date" in out for out, _ in outputs) == [
        False,
        True,
    ]
    status = _cli(two_stages, "status")
    assert "0002  applied" in status.stdout
    repo = two_stages.root / "build" / "vllm-git-v1"
    assert sh(repo, "git", "status", "--porcelain") == ""
    tracked = sh(repo, "git", "ls-files").split()
    assert "vllm/ops.py" in tracked and "vllm/cp_indexer.py" in tracked


def test_a_writer_waits_for_the_lock_and_readers_do_not(two_stages: Project):
    import time

    from scripts.series.lock import project_lock

    with project_lock(two_stages.series(), "test holder"):
        waiting = _cli_process(two_stages, "apply")
        assert _cli(two_stages, "stages").stdout.split() == ["base", "0001", "0002"]
        said = _stderr_until(waiting, "waiting for")
        # Long enough for an apply that did not wait to finish.
        time.sleep(1)
        assert waiting.poll() is None, "apply ran while another held the lock"
    out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, said + err
    assert "waiting for `python3 -m scripts.series test holder`" in said


def test_adding_a_stage_in_the_readmes_order(project: Project):
    """docs/maintaining.md, 'Add a stage', step by step through the command line: each
    step works as written, and the project ends where CI passes (check)."""
    from scripts.series.stages.overview import BEGIN, END

    # Two stages, neither changing the other's lines (check refuses that).
    project.add_stage(
        "0001", {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = 1\n")}
    )
    project.add_stage(
        "0002", {"vllm/ops.py": ("return 20\n", "return 2020\n")}, depends_on=("0001",)
    )
    two_stages = project

    assert _cli(two_stages, "apply").returncode == 0  # 1. the tree at the top
    repo = two_stages.root / "build" / "vllm-git-v1"
    # 2. the change: glue in a vLLM file, logic and its unit test in new files
    ops = repo / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("return 25\n", "return gate(25)\n"))
    write_files(
        repo,
        {
            "vllm/gate.py": "def gate(x):\n    return x + 1\n",
            "tests/test_gate.py": "from vllm.gate import gate\n\n\n"
            "def test_gate():\n    assert gate(1) == 2\n",
        },
    )
    # 3. commit it there, with the PR's title and description, signed off
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-q", "-s", "-m", "Gate", "-m", "Why the gate.")
    # 4. the [[stage]] entry, every key the README names
    with two_stages.series_file.open("a") as series_file:
        series_file.write(
            '\n[[stage]]\nid = "0003"\ntitle = "Gate"\n'
            'patch = "0003-gate.patch"\n'
            'overlays = ["vllm/gate.py", "tests/test_gate.py"]\n'
            'tests = "stage_0003"\ndepends_on = ["0002"]\n'
            'upstream = { pr = "not opened yet", status = "not-submitted" }\n'
            'switches = ["always on"]\nvalidated_on = "CPU"\n'
        )
    # 5. refresh: the commit becomes the stage's patch, its modules overlays
    refreshed = _cli(two_stages, "refresh")
    assert refreshed.returncode == 0, refreshed.stderr
    assert (two_stages.root / "patches/0003-gate.patch").is_file()
    assert (two_stages.root / "vllm_overlay/vllm/gate.py").is_file()
    assert (two_stages.root / "vllm_overlay/tests/test_gate.py").is_file()
    # 6.-7. its series tests and docs/stage_0003.md are the author's
    # 8. the stage table pasted into the README, then check passes
    overview = _cli(two_stages, "overview").stdout.strip()
    readme = two_stages.root / "README.md"
    readme.write_text(f"# Project\n\n{BEGIN}\n{overview}\n{END}\n")
    checked = _cli(two_stages, "check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "| **0003** | Gate | `always on` | not submitted |" in overview
    again = _cli(two_stages, "apply")  # the series files rebuild the same tree
    assert again.returncode == 0 and "stage 0003: up to date" in again.stdout


def test_marking_a_stage_merged_then_overview_write_keeps_check_green(
    two_stages: Project,
):
    """The drop-a-stage recipe's first step: a status change shows in the
    README's table; check names it, and `overview --write` writes it (only
    between the markers, once)."""
    from scripts.series.stages.overview import BEGIN, END

    readme = two_stages.root / "README.md"
    assert _cli(two_stages, "overview", "--write").returncode == 1  # no README
    readme.write_text(f"# Project\n\n{BEGIN}\nold\n{END}\n\nMore.\n")
    written = _cli(two_stages, "overview", "--write")
    assert written.returncode == 0 and "wrote the stage table" in written.stdout
    assert _cli(two_stages, "apply").returncode == 0
    assert _cli(two_stages, "refresh").returncode == 0
    text = two_stages.series_file.read_text()
    two_stages.series_file.write_text(
        text.replace(
            'tests = "stage_0001"\n',
            'tests = "stage_0001"\n'
            'upstream = { pr = "vllm-project/vllm#1", status = "merged" }\n',
        )
    )
    checked = _cli(two_stages, "check")
    assert (
        "stage table differs from series.toml; write it with `python3 -m "
        "scripts.series overview --write`" in checked.stdout
    )
    assert _cli(two_stages, "overview", "--write").returncode == 0
    table = readme.read_text()
    assert table.endswith(f"{END}\n\nMore.\n") and "\nold\n" not in table
    assert "merged: [vllm-project/vllm#1]" in table
    assert "stage table differs" not in _cli(two_stages, "check").stdout
    again = _cli(two_stages, "overview", "--write")
    assert "stage table is current" in again.stdout


def test_a_waiter_names_a_holder_that_writes_its_name_late(tmp_path):
    """A holder writes its name just after taking the lock: a waiter that
    reads the file in between still names it."""
    import threading

    from scripts.series.lock import _holder

    path = tmp_path / "series.lock"
    path.write_text("")
    with path.open("a+", encoding="utf-8") as handle:
        late = threading.Timer(0.2, path.write_text, ["`python -m x` (pid 1)"])
        late.start()
        assert _holder(handle) == "`python -m x` (pid 1)"
        late.join()


PINNED = load_series(SERIES_FILE).base


def _serving_block(marker: str) -> list[str]:
    """The command lines of docs/serving.md's bash block holding ``marker``."""
    text = (REPO_ROOT / "docs" / "serving.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return [line.split("  #")[0].strip() for line in block.splitlines()]


def test_the_documented_copy_to_build_from_and_its_update(
    two_stages: Project, tmp_path
):
    """docs/serving.md's git lines, run as written on a synthetic series: the
    copy holds every stage and no .git, a build's file in it stays, the
    update writes the new stage, and an edit it would overwrite stops it
    with nothing written."""
    assert _cli(two_stages, "apply").returncode == 0
    repo = two_stages.root / "build" / "vllm-git-v1"
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}

    def run(lines: list[str]) -> subprocess.CompletedProcess[str]:
        script = "\n".join(
            line.replace(f"build/{PINNED.label}", str(repo))
            for line in lines
            if line.startswith("git ")
        )
        return subprocess.run(
            ["bash", "-ec", script],
            cwd=two_stages.root,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )

    made = run(_serving_block("archive --prefix=vllm-dsa/"))
    assert made.returncode == 0, made.stderr
    dest = home / "vllm-dsa"
    assert (dest / "vllm/cp_indexer.py").exists() and not (dest / ".git").exists()
    assert "return 2020" in (dest / "vllm/ops.py").read_text()
    (dest / "vllm/_version.py").write_text("__version__ = '0.1.dev1'\n")
    # a stage change: stage 0002 now also changes op_21
    ops = repo / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("return 21\n", "return 2121\n"))
    assert _cli(two_stages, "refresh").returncode == 0
    update = _serving_block("diff-tree -p --binary copied series")
    copied = (dest / "vllm/ops.py").read_text()
    (dest / "vllm/ops.py").write_text(copied.replace("return 21\n", "return -21\n"))
    refused = run(update)
    assert refused.returncode != 0 and "vllm/ops.py" in refused.stderr
    assert "return -21" in (dest / "vllm/ops.py").read_text()
    (dest / "vllm/ops.py").write_text(copied + "# mine, away from the change\n")
    updated = run(update)
    assert updated.returncode == 0, updated.stderr
    assert "return 2121" in (dest / "vllm/ops.py").read_text()
    assert (dest / "vllm/ops.py").read_text().endswith("# mine, away from the change\n")
    assert (dest / "vllm/_version.py").read_text() == "__version__ = '0.1.dev1'\n"
    assert sh(repo, "git", "rev-parse", "copied") == sh(
        repo, "git", "rev-parse", "series"
    )


def test_export_signs_off_as_the_person_exporting(two_stages: Project, tmp_path):
    """No identity, no export (the DCO needs a real one); --signoff or the
    user's git identity signs each PR commit off."""

    assert _cli(two_stages, "apply").returncode == 0
    anonymous = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "HOME": str(tmp_path)}

    def export(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "scripts.series", "--series"]
            + [str(two_stages.series_file), "export", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            env=anonymous,
        )

    _one_line_error(export(), "export signs each PR off as you")
    signed = export("--signoff", "Eve Exporter <eve@example.org>")
    assert signed.returncode == 0, signed.stderr
    repo = two_stages.root / "build" / "vllm-git-v1"
    message = sh(repo, "git", "log", "-1", "--format=%B", "pr/0001")
    assert message.strip().endswith("Signed-off-by: Eve Exporter <eve@example.org>")
    _one_line_error(export("--signoff", "just a name"), "expected 'Name <email>'")


def test_every_test_runs_every_time(two_stages: Project):
    """No result is reported from an earlier run: a green run runs again."""
    assert _cli(two_stages, "apply").returncode == 0
    marker = two_stages.tmp / "ran.log"  # outside the project
    write_files(
        two_stages.root / "tests",
        {
            "base/test_base.py": textwrap.dedent(f"""\
                def test_base():
                    with open({str(marker)!r}, "a") as log:
                        log.write("ran\\n")
                """),
        },
    )
    for times in (1, 2):
        result = _cli(two_stages, "test", "base")
        assert result.returncode == 0, result.stdout
        assert "| base | ok | 1 | 0 | 0 |" in result.stdout
        assert len(marker.read_text().splitlines()) == times


def test_changing_a_lower_stage_is_apply_edit_refresh(two_stages: Project):
    """docs/maintaining.md, 'Change a stage': apply up to the stage, edit, refresh. The
    later stages follow in the same refresh (applied on the changed stage,
    their patch files written again), so nothing is stale after it."""
    assert _cli(two_stages, "apply").returncode == 0
    assert _cli(two_stages, "refresh").returncode == 0
    assert _cli(two_stages, "apply", "--upto", "0001").returncode == 0
    repo = two_stages.root / "build" / "vllm-git-v1"
    ops = repo / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("return 3\n", "return 33\n"))
    done = _cli(two_stages, "refresh")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("refreshed: 0001, 0002"), done.stdout
    assert done.stdout.count("refreshed") == 1, "one summary"
    text = ops.read_text()
    assert "return 33" in text and "return 2020" in text
    check = _cli(two_stages, "check")
    assert "patch files match a fresh export" in check.stdout, check.stdout
    # Nothing changed: nothing is written, and the tree stays where it is.
    assert _cli(two_stages, "apply", "--upto", "0001").returncode == 0
    again = _cli(two_stages, "refresh")
    assert again.stdout.strip().endswith("refreshed: no change"), again.stdout
    assert "return 2020" not in ops.read_text()
