# SPDX-License-Identifier: Apache-2.0
"""The command line: results on stdout, errors as one line without traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from scripts.series.config import REPO_ROOT
from tests.tooling.conftest import Project, sh, write_files


def _cli(project: Project, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.series",
            "--series",
            str(project.series_file),
            *args,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )


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
    assert _cli(two_stages, "check").returncode == 0


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
        assert "not prepared yet; run apply first" in result.stderr


def test_unknown_stage_and_bad_series_file(project: Project):
    result = _cli(project, "apply", "--upto", "0042")
    assert result.returncode == 1
    assert "unknown stage '0042'" in result.stderr
    result = _cli(project, "tree", "0042")
    assert result.returncode == 1
    assert "unknown stage '0042'" in result.stderr
    project.series_file.write_text("[base]\nname = 1\n")
    result = _cli(project, "status")
    assert result.returncode == 1
    assert "base.name: expected a non-empty string" in result.stderr


def test_rebase_onto_a_git_checkout_from_the_command_line(two_stages: Project):
    """The local-checkout target as users give it, then --accept."""
    ops = two_stages.upstream / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("return 5\n", "return 55\n", 1))
    sh(two_stages.upstream, "git", "commit", "-q", "-am", "upstream main")
    missing = _cli(two_stages, "rebase", "--git", str(two_stages.upstream))
    assert missing.returncode == 1 and "give a target" in missing.stderr
    done = _cli(
        two_stages, "rebase", "--git", str(two_stages.upstream), "--rev", "main"
    )
    assert done.returncode == 0, done.stderr
    assert "| 0002 Top-k gate | applied cleanly |" in done.stdout
    review = two_stages.root / "patches/next/vllm-git-main/series.toml"
    assert review.exists()
    assert _cli(two_stages, "--series", str(review), "apply").returncode == 0
    # An edit to the project's series makes the review stale: apply and
    # test of it refuse, naming what to do.
    series_text = two_stages.series_file.read_text()
    two_stages.series_file.write_text(series_text + "# edited\n")
    for verb in ("apply", "test"):
        stale = _cli(two_stages, "--series", str(review), verb)
        assert stale.returncode == 1
        assert "was rebased from an older version of patches/" in stale.stderr
    two_stages.series_file.write_text(series_text)
    assert _cli(two_stages, "rebase", "--abort").returncode == 1  # nothing running
    accepted = _cli(two_stages, "rebase", "--accept")
    assert accepted.returncode == 0, accepted.stderr
    assert 'rev = "main"' in two_stages.series_file.read_text()
    assert _cli(two_stages, "apply").returncode == 0


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
                """),
            "stage_0002/test_two.py": (
                "def test_fails():\n    assert False\n\n\n"
                "def test_passes():\n    pass\n"
            ),
        },
    )
    result = _cli(two_stages, "test", "--jobs", "2")
    assert result.returncode == 1
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == [
        "| base | 1 | 0 | 0 | - |",
        "| 0001 | 2 | 0 | 0 | - |",
        "| 0002 | 3 | 1 | 0 | - |",
    ]
    assert "test_two::test_fails" in result.stdout.split("Failed:")[1]
    assert "=== 0002: series tests" in result.stdout
    # Arguments after -- go to every pytest run.
    only = _cli(two_stages, "test", "0002", "--", "-k", "not test_fails")
    assert only.returncode == 0, only.stdout
    assert "| 0002 | 3 | 0 | 0 | - |" in only.stdout
    assert _cli(two_stages, "test", "0009").returncode == 1


def test_test_without_pytest_or_with_no_jobs_says_so(
    two_stages: Project, monkeypatch, capsys
):
    jobs = _cli(two_stages, "test", "--jobs", "0")
    assert jobs.returncode == 2 and "expected a positive integer" in jobs.stderr
    from scripts.series import cli

    real_find_spec = cli.importlib.util.find_spec
    monkeypatch.setattr(
        cli.importlib.util,
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
