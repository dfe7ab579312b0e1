# SPDX-License-Identifier: Apache-2.0
"""The test plan for a stage and the summary of JUnit results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.series.config import REPO_ROOT, load_series
from scripts.series.contract import OWN_TREE_RAN_ENV
from scripts.series.testing import testrun
from scripts.series.testing.results import (
    Tally,
    format_summary,
    format_verdict,
    read_junit,
)
from scripts.series.testing.testrun import stage_runs, tooling_runs
from tests.tooling.conftest import Project

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="{errors}" failures="1" skipped="3"
 tests="7">
<testcase classname="t.a" name="ok1"/>
<testcase classname="t.a" name="ok2"/>
<testcase classname="t.a" name="bad"><failure message="boom"/></testcase>
<testcase classname="t.b" name="s1"><skipped message="needs gfx950"/></testcase>
<testcase classname="t.b" name="s2"><skipped message="needs gfx950"/></testcase>
<testcase classname="t.b" name="s3"><skipped message="Skipped: CUDA required"/>
</testcase>
<testcase classname="t.c" name="err"><error message="fixture"/></testcase>
</testsuite></testsuites>
"""


def test_junit_is_counted_with_skip_reasons(tmp_path: Path):
    path = tmp_path / "r.xml"
    path.write_text(JUNIT.format(errors=1))
    tally = read_junit(path)
    assert (tally.passed, tally.failed, tally.skipped) == (2, 2, 3)
    assert tally.skip_reasons == {"needs gfx950": 2, "CUDA required": 1}
    assert tally.failures == ["t.a::bad", "t.c::err"]


def test_collection_errors_count_as_failures(tmp_path: Path):
    path = tmp_path / "r.xml"
    path.write_text(JUNIT.format(errors=3))
    tally = read_junit(path)
    assert tally.failed == 4
    assert "r.xml: 2 collection error(s)" in tally.failures


def test_missing_results_are_a_failure(tmp_path: Path):
    tally = read_junit(tmp_path / "never-written.xml")
    assert tally.failed == 1 and "no results" in tally.failures[0]


def test_summary_table_lists_every_stage_and_reason():
    good = Tally(passed=5, skipped=2)
    good.skip_reasons.update({"needs gfx950": 2})
    bad = Tally(passed=1, failed=1, failures=["t::x"])
    table = format_summary([("base", good), ("0001", bad)])
    assert "| base | 5 | 0 | 2 | 2× needs gfx950 |" in table
    assert "| 0001 | 1 | 1 | 0 | - |" in table
    assert table.endswith("Failed:\n- t::x")


ALL3 = ("base", "0001", "0002", "0003")
ALL = ("base", *(s.id for s in load_series().stages))


def _series_folders(runs) -> list[str]:
    """The test folders of a tree's series tests, which are one run."""
    (run,) = [run for run in runs if run.label.startswith("series tests")]
    return [a for a in run.args if not a.startswith("-")]


def test_a_middle_stage_runs_its_tests_only_where_a_repeat_can_catch_more(
    project: Project,
):
    """Below the top, a stage's tests run on its own tree only when a later
    stage patches one of its files (stage 0002 patches 0001's envs.py, not
    0002's ops.py), and never the base tests; tested alone, a tree is the
    top and runs the base tests and every stage's up to it."""
    project.add_stage("0001", {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 33\n")})
    project.add_stage("0002", {"vllm/ops.py": ("return 7\n", "return 77\n")})
    project.add_stage("0003", {"vllm/envs.py": ("VAR_9 = 9\n", "VAR_9 = 99\n")})
    series = project.series()
    tests = series.tests_dir
    runs = stage_runs(series, "0001", Path("/t"), Path("/b"), tested=ALL3)
    assert _series_folders(runs) == [str(tests / "stage_0001")]
    assert stage_runs(series, "0002", Path("/t"), Path("/b"), tested=ALL3) == []
    alone = stage_runs(series, "0002", Path("/t"), Path("/b"), tested=("0002",))
    assert _series_folders(alone) == [
        str(tests / "base"),
        str(tests / "stage_0001"),
        str(tests / "stage_0002"),
    ]
    base = stage_runs(series, "base", Path("/b"), Path("/b"), tested=ALL3)
    assert _series_folders(base) == [str(tests / "base")]
    # The top run leaves out the own_tree tests of stage 0001 only where
    # its own tree ran beside it.
    (top,) = stage_runs(series, "0003", Path("/t"), Path("/b"), tested=ALL3)
    assert top.env[OWN_TREE_RAN_ENV] == "stage_0001"
    (top,) = stage_runs(series, "0003", Path("/t"), Path("/b"), tested=("0003",))
    assert top.env[OWN_TREE_RAN_ENV] == ""


def test_own_tree_tests_are_left_out_only_where_their_stage_tree_ran(
    tmp_path: Path,
):
    """With the project's hook, a test marked ``own_tree`` in stage_0001's
    folder is deselected when DSA_OWN_TREE_RAN names that folder, and runs
    otherwise; an unmarked test always runs."""
    tests = tmp_path / "tests"
    (tests / "stage_0001").mkdir(parents=True)
    (tests / "conftest.py").write_text(
        "from scripts.harness.own_tree import (  # noqa: F401\n"
        "    pytest_collection_modifyitems,\n    pytest_configure,\n)\n"
    )
    (tests / "stage_0001" / "test_x.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.own_tree\n\n"
        "def test_bench():\n    pass\n"
    )
    (tests / "stage_0001" / "test_y.py").write_text("def test_op():\n    pass\n")

    def ran(value: str) -> str:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), OWN_TREE_RAN_ENV: value}
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "--strict-markers", str(tests)],
            cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip

    assert "2 passed" in ran("")
    assert "2 passed" in ran("stage_0003")
    assert "1 passed, 1 deselected" in ran("stage_0003,stage_0001")


def test_a_kernel_group_compiles_where_the_trees_stage_patches_a_caller(
    two_stages: Project,
):
    """Stage 0002 patches vllm/ops.py, a caller of group A's kernels: its
    tree compiles A, not B; stage 0001's compiles C (its overlay). The top
    tree tested without 0001's compiles C too. A group that names no
    callers is an error."""
    from scripts.series import SeriesError

    folder = two_stages.root / "tests" / "gfx_compile"
    folder.mkdir()
    (folder / "test_a.py").write_text('KERNEL_CALLERS = ("vllm/ops.py",)\n')
    (folder / "test_b.py").write_text('KERNEL_CALLERS = ("vllm/other.py",)\n')
    (folder / "test_c.py").write_text('KERNEL_CALLERS = ("vllm/cp_indexer.py",)\n')
    series = two_stages.series()

    def compiled(stage_id: str, tested=("base", "0001", "0002")) -> list[str]:
        runs = stage_runs(series, stage_id, Path("/t"), Path("/b"), tested=tested)
        return [
            Path(a).name
            for run in runs
            if run.label.startswith("compile")
            for a in run.args
            if a.endswith(".py")
        ]

    assert compiled("0002") == ["test_a.py"]
    assert compiled("0001") == ["test_c.py"]
    assert compiled("0002", tested=("0002",)) == ["test_a.py", "test_c.py"]
    (folder / "test_d.py").write_text("CALLERS = ()\n")
    with pytest.raises(SeriesError, match="test_d.py names no KERNEL_CALLERS"):
        compiled("0002")


def test_the_top_stage_tree_runs_every_stages_tests(two_stages: Project):
    series = two_stages.series()
    tree = Path("/trees/0002")
    runs = stage_runs(
        series, "0002", tree, Path("/trees/base"), tested=("base", "0001", "0002")
    )
    own = runs[0]
    assert _series_folders(runs) == [
        str(series.tests_dir / "base"),
        str(series.tests_dir / "stage_0001"),
        str(series.tests_dir / "stage_0002"),
    ]
    assert len({run.junit for run in runs}) == len(runs)
    assert own.env["DSA_VLLM_TREE"] == str(tree)
    assert own.env["DSA_STAGES"] == "base,0001,0002"
    assert own.env["CUDA_VISIBLE_DEVICES"] == ""
    assert own.env["DSA_BASE_TREE"] == "/trees/base"
    base = stage_runs(series, "base", tree, tree, tested=("base", "0001", "0002"))
    assert base[0].env["DSA_STAGES"] == "base"


def test_the_regression_selection_runs_with_the_series_tests():
    """vLLM's own tests: every suite in the tree's series run, without
    vLLM's conftest files; a suite's plugin is loaded and told which files
    are its own."""
    from scripts.series.config import load_series

    series = load_series()
    tree = Path("/trees/x")
    runs = stage_runs(series, "base", tree, tree, tested=ALL)
    assert len(runs) == 1
    run = runs[0]
    assert [a for a in run.args if a.startswith("/trees")] == [
        str(tree / p) for suite in series.regression for p in suite.paths
    ]
    (cut,) = [a for a in run.args if a.startswith("--confcutdir=")]
    assert Path(cut.split("=", 1)[1]).is_relative_to(tree / "tests")
    assert Path(cut.split("=", 1)[1]) != tree / "tests"
    plugin_files = json.loads(run.env["DSA_PLUGIN_FILES"])
    for suite in series.regression:
        if suite.plugin:
            assert run.args[run.args.index(suite.plugin) - 1] == "-p"
            assert plugin_files[suite.plugin] == [str(tree / p) for p in suite.paths]
    assert sum(len(files) for files in plugin_files.values()) < sum(
        len(suite.paths) for suite in series.regression
    )


def test_a_vllm_conftest_the_cut_would_not_keep_out_stops_the_run(tmp_path: Path):
    """vLLM's tests ran without its conftest files: one in a folder of the
    selection that --confcutdir does not cut is an error, not loaded."""
    from dataclasses import replace

    from scripts.series import SeriesError
    from scripts.series.config import load_series

    series = load_series()
    suite = series.regression[0]
    other = tmp_path / "tests" / "elsewhere"
    other.mkdir(parents=True)
    (other / "conftest.py").write_text("")
    series = replace(
        series, regression=(suite, replace(suite, paths=("tests/elsewhere/t.py",)))
    )
    with pytest.raises(SeriesError, match="conftest"):
        stage_runs(series, "base", tmp_path, tmp_path, tested=("base",))


def test_pr_tests_run_with_plain_pytest_in_the_tree():
    """The tests stages add to vLLM's tests/, every stage's, on the top tree
    only (a PR alone: export's CPU view); from the tree's root, with vLLM's
    conftest and nothing of this project on the path."""
    from scripts.series.config import load_series

    series = load_series()
    first, top = series.stages[0], series.stages[-1]
    assert first.vllm_tests and all(t.startswith("tests/") for t in first.vllm_tests)
    tree = Path("/trees/x")

    def pr_runs(stage_id: str, top_id: str):
        runs = stage_runs(series, stage_id, tree, tree, tested=(stage_id, top_id))
        return [r for r in runs if r.cwd == tree]

    assert pr_runs(first.id, top.id) == []
    (every,) = pr_runs(top.id, top.id)
    assert every.env["PYTHONPATH"] == ""
    assert "--noconftest" not in every.args
    assert [a for a in every.args if a.startswith("tests/")] == [
        t for stage in series.stages for t in stage.vllm_tests
    ]
    (alone,) = pr_runs(first.id, first.id)
    assert [a for a in alone.args if a.startswith("tests/")] == list(first.vllm_tests)
    assert pr_runs("base", top.id) == []


def test_junit_counts_only_the_modules_asked_for(tmp_path: Path):
    junit = tmp_path / "r.xml"
    junit.write_text(JUNIT.format(errors=1))
    tally = read_junit(junit, ["t.b"])
    assert (tally.passed, tally.failed, tally.skipped) == (0, 0, 3)
    other = read_junit(junit, ["t.x"])  # nothing of t.x ran: nothing failed
    assert (other.passed, other.failed, other.skipped) == (0, 0, 0)
    # A module that does not collect counts as failed, not as "not run".
    junit.write_text(
        '<testsuites><testsuite errors="1"><testcase classname="" name="t.x">'
        '<error message="collection failure"/></testcase></testsuite></testsuites>'
    )
    assert read_junit(junit, ["t.x"]).failed == 1


def test_the_tools_tests_are_one_run_of_the_whole_folder():
    """The tooling tests run as one pytest run of tests/tooling: no file is
    left out."""
    from scripts.series.config import load_series

    series = load_series()
    (run,) = tooling_runs(series)
    assert [a for a in run.args if not a.startswith("-")] == [
        str(series.tests_dir / "tooling")
    ]
    assert run.row == "tooling"


def test_with_no_earlier_results_the_longest_runs_start_first(
    two_stages: Project, monkeypatch, tmp_path: Path
):
    """A fresh clone has no run's last time: the tooling tests (the longest
    run) and the top tree's series tests start first, so that no long run
    is left for the end while the other CPU idles."""
    started: list[str] = []

    def run_one(run, python, extra, cwd):
        started.append(f"{run.row}: {run.label}")
        return Tally()

    monkeypatch.setattr(testrun, "stage_tree", lambda series, sid: tmp_path / sid)
    monkeypatch.setattr(testrun, "_run_one", run_one)
    monkeypatch.setattr(testrun, "results_dir", lambda series: tmp_path / "results")
    series = two_stages.series()
    testrun.run_tests(series, ["base", "0001", "0002"], tooling=True)
    assert started[0].startswith("tooling: ")
    assert started[1].startswith("0002: series tests")


def test_the_console_ends_with_the_verdict_per_stage_in_one_screen(tmp_path):
    good = Tally(passed=5, skipped=2)
    good.skip_reasons.update({"needs a gfx950 GPU (MI355X) with AITER " * 5: 2})
    bad = Tally(passed=1, failed=12, failures=[f"t::x{i}" for i in range(12)])
    kernels = [
        {"target": t, "kernel": f"k{i}", "compiled": 2, "failed": 0}
        for t in ("gfx942", "gfx950")
        for i in range(20)
    ]
    text = format_verdict(
        "vllm-9.9.9", [("base", good), ("0001", bad)], [("0001", kernels)],
        tmp_path / "summary.md",
    )  # fmt: skip
    lines = text.splitlines()
    assert len(lines) <= 24, text
    assert max(len(line) for line in lines if "summary.md" not in line) <= 100, text
    assert lines[-3:] == [
        "| base | ok | 5 | 0 | 2 |",
        "| 0001 | FAILED | 1 | 12 | 0 |",
        "FAILED: 0001",
    ]
    assert "- ... and 2 more" in lines
    assert (
        "Triton kernels compiled for gfx942/gfx950: 80 variants of 40 "
        "kernel-targets, 0 failed." in lines
    )
    assert f"  {tmp_path / 'summary.md'}" in lines
    passed = format_verdict("v", [("base", good)], [], tmp_path / "s.md")
    assert passed.endswith(
        "| base | ok | 5 | 0 | 2 |\nEvery test passed or skipped with a reason."
    )
