# SPDX-License-Identifier: Apache-2.0
"""``check``'s glue budget: hunk sizes from the patch files, re-indented lines
not counted, large hunks allowed only with a reason in series.toml."""

from __future__ import annotations

import pytest
from conftest import Project

from scripts.series.config import SeriesFileError
from scripts.series.stages.check import HUNK_BUDGET, format_hunk_sizes, hunk_budget
from scripts.series.stages.overview import (
    BEGIN,
    END,
    readme_table_is_current,
    stage_table,
)

# 30 functions of two lines each in the synthetic vllm/ops.py.
NEW_LINES = "".join(f"EXTRA_{i} = {i}\n" for i in range(HUNK_BUDGET + 1))


def _allow(project: Project, entries: str) -> None:
    text = project.series_file.read_text()
    project.series_file.write_text(text + f"large_hunks = [{entries}]\n")


def _large_stage(project: Project) -> None:
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\n" + NEW_LINES)},
        title="Large",
    )


def test_a_hunk_over_the_budget_is_named(project: Project):
    _large_stage(project)
    sizes, problems = hunk_budget(project.series())
    assert [(s.hunk.path, s.hunk.number, s.hunk.changed) for s in sizes] == [
        ("vllm/envs.py", 1, HUNK_BUDGET + 1)
    ]
    assert problems == [
        f"stage 0001: vllm/envs.py hunk 1 changes {HUNK_BUDGET + 1} lines (budget "
        f"{HUNK_BUDGET}); move its logic into an overlay module, or allow it in "
        "series.toml (large_hunks, with a reason)"
    ]
    assert "OVER BUDGET" in format_hunk_sizes(sizes)


def test_a_hunk_of_exactly_the_budget_passes_and_one_line_more_fails(
    project: Project,
):
    """The budget is inclusive: HUNK_BUDGET changed lines are glue, one more
    is not; and an allowance for a hunk of exactly the budget allows nothing
    (it must name a hunk over the budget)."""
    at_budget = "".join(f"EXTRA_{i} = {i}\n" for i in range(HUNK_BUDGET))
    project.add_stage(
        "0001",
        {"vllm/ops.py": ("    return 20\n", "    return 20\n" + NEW_LINES)},
        title="One over",
    )
    project.add_stage(
        "0002",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\n" + at_budget)},
        title="At budget",
    )
    sizes, problems = hunk_budget(project.series())
    assert [(s.stage.id, s.hunk.changed, s.over_budget) for s in sizes] == [
        ("0001", HUNK_BUDGET + 1, True),
        ("0002", HUNK_BUDGET, False),
    ]
    assert problems == [
        f"stage 0001: vllm/ops.py hunk 1 changes {HUNK_BUDGET + 1} lines (budget "
        f"{HUNK_BUDGET}); move its logic into an overlay module, or allow it in "
        "series.toml (large_hunks, with a reason)"
    ]
    _allow(project, '{ file = "vllm/envs.py", hunk = 1, reason = "r" }')  # 0002's
    _, problems = hunk_budget(project.series())
    assert problems[1:] == [
        "stage 0002: large_hunks names vllm/envs.py hunk 1, which is not over the "
        f"budget of {HUNK_BUDGET} lines (or no longer exists); remove the entry"
    ]


def test_a_large_hunk_with_a_reason_passes(project: Project):
    _large_stage(project)
    _allow(project, '{ file = "vllm/envs.py", hunk = 1, reason = "a table" }')
    sizes, problems = hunk_budget(project.series())
    assert problems == []
    assert "allowed: a table" in format_hunk_sizes(sizes)


def test_an_allowance_that_names_no_large_hunk_is_an_error(project: Project):
    project.add_stage(
        "0001", {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 30\n")}, title="Small"
    )
    _allow(project, '{ file = "vllm/envs.py", hunk = 2, reason = "gone" }')
    _, problems = hunk_budget(project.series())
    assert problems == [
        "stage 0001: large_hunks names vllm/envs.py hunk 2, which is not over the "
        f"budget of {HUNK_BUDGET} lines (or no longer exists); remove the entry"
    ]


def test_lines_only_reindented_do_not_count(project: Project):
    """Wrapping 20 unchanged lines in a new ``if``/``else`` is glue: the hunk
    counts the two new lines, not the 40 that git shows."""
    ops = (project.scratch / "vllm/ops.py").read_text()
    body = ops[ops.index("def op_5") : ops.index("def op_15")]
    wrapped = "if NEW:\n    pass\nelse:\n" + "".join(
        f"    {line}\n" if line else "\n" for line in body.splitlines()
    )
    project.add_stage("0001", {"vllm/ops.py": (body, wrapped)}, title="Wrap")
    sizes, problems = hunk_budget(project.series())
    (size,) = sizes
    assert size.hunk.reindented == len([x for x in body.splitlines() if x])
    assert size.hunk.changed == 3
    assert problems == []


@pytest.mark.parametrize(
    "entry, field",
    [
        ('{ file = "vllm/envs.py", hunk = 0, reason = "r" }', "hunk"),
        ('{ file = "vllm/envs.py", hunk = 1 }', "reason"),
        ('{ file = "../envs.py", hunk = 1, reason = "r" }', "file"),
        ('{ file = "vllm/envs.py", hunk = 1, reason = "r", lines = 3 }', "lines"),
    ],
)
def test_a_malformed_allowance_names_its_field(project: Project, entry, field):
    _large_stage(project)
    _allow(project, entry)
    with pytest.raises(SeriesFileError, match=rf"large_hunks\[0\]\.{field}"):
        project.series()


def test_the_readme_stage_table_is_generated_and_checked(two_stages: Project):
    series = two_stages.series()
    table = stage_table(series)
    row = "| **0001** | Striped indexer | none | not submitted |"
    assert table.splitlines()[2] == row
    # A stage with a results page links to it.
    (two_stages.root / "docs").mkdir()
    (two_stages.root / "docs" / "stage_0002.md").write_text("# 0002\n")
    assert "| [**0002**](docs/stage_0002.md) | Top-k gate |" in stage_table(series)
    table = stage_table(series)
    readme = two_stages.root / "README.md"
    readme.write_text(f"# Series\n\n{BEGIN}\n{table}\n{END}\n\nMore.\n")
    assert readme_table_is_current(series, readme)
    readme.write_text(readme.read_text().replace("Striped indexer", "Striped"))
    assert not readme_table_is_current(series, readme)
    readme.write_text("# Series without the table\n")
    assert not readme_table_is_current(series, readme)
