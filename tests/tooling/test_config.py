# SPDX-License-Identifier: Apache-2.0
"""A malformed series file is refused with the file and the field named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.series.config import (
    SERIES_FILE,
    GitBase,
    SdistBase,
    SeriesFileError,
    load_series,
)

BASE = '[base]\nname = "vllm"\nversion = "0.32.0"\nsha256 = "' + "ab" * 32 + '"\n'
STAGE = (
    '[[stage]]\nid = "0001"\ntitle = "CP indexer"\npatch = "0001-cp.patch"\n'
    'overlays = ["vllm/cp.py"]\ntests = "stage_0001"\n'
)


def _load(tmp_path: Path, text: str):
    path = tmp_path / "patches" / "series.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return load_series(path)


def test_the_repository_series_file_is_valid():
    series = load_series(SERIES_FILE)
    # The pin moves with vLLM's releases: its form, not its value. A
    # rebase's branch onto a git checkout pins it by its commit.
    if isinstance(series.base, SdistBase):
        assert re.fullmatch(r"\d+(\.\d+)+", series.base.version)
        assert re.fullmatch(r"[0-9a-f]{64}", series.base.sha256)
    else:
        assert re.fullmatch(r"[0-9a-f]{40}", series.base.rev)
    assert series.regression, "the regression selection is listed in series.toml"


def test_a_valid_file_parses(tmp_path):
    series = _load(
        tmp_path,
        BASE
        + STAGE
        + STAGE.replace("0001", "0002").replace(
            'overlays = ["vllm/cp.py"]', 'depends_on = ["0001"]'
        ),
    )
    assert [s.id for s in series.stages] == ["0001", "0002"]
    assert series.stages[1].depends_on == ("0001",)
    assert series.stages[0].upstream_status == "not-submitted"
    assert [s.id for s in series.stages_upto("0001")] == ["0001"]
    assert series.stages_upto("base") == ()


def test_a_git_base_parses(tmp_path):
    series = _load(tmp_path, '[base]\nname = "vllm"\ngit = "../vllm"\nrev = "main"\n')
    assert isinstance(series.base, GitBase)
    assert series.base.path == (tmp_path / "vllm").resolve()
    assert series.base.label == "vllm-git-main"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("", "base: missing"),
        ("[base\n", "not valid TOML"),
        (BASE.replace('version = "0.32.0"\n', ""), "base.version: missing"),
        (BASE.replace("ab" * 32, "abc"), "base.sha256: expected 64 hex digits"),
        (BASE + 'git = "/x"\nrev = "y"\n', "either version + sha256 or git + rev"),
        (BASE + "mirror = 1\n", "base.mirror: unknown field"),
        (BASE + STAGE.replace('id = "0001"', 'id = "1"'), "stage[0].id: expected four"),
        (BASE + STAGE + STAGE, "stage[1].id: duplicate stage id"),
        (
            BASE + STAGE.replace("0001", "0002") + STAGE,
            "stage[1].id: '0001' comes after",
        ),
        (BASE + STAGE.replace('title = "CP indexer"\n', ""), "stage[0].title: missing"),
        (
            BASE + STAGE.replace('"0001-cp.patch"', "3"),
            "stage[0].patch: expected a non-empty",
        ),
        (
            BASE + STAGE.replace('"0001-cp.patch"', '"cp.diff"'),
            "stage[0].patch: expected a .patch",
        ),
        (
            BASE + STAGE.replace('"vllm/cp.py"', '"../cp.py"'),
            "stage[0].overlays: '../cp.py' must be",
        ),
        (
            BASE + STAGE.replace('overlays = ["vllm/cp.py"]', "overlays = 3"),
            "stage[0].overlays: expected a list",
        ),
        (
            BASE + STAGE + 'depends_on = ["0009"]\n',
            "stage[0].depends_on: '0009' is not",
        ),
        (
            BASE + STAGE + 'upstream = { status = "maybe" }\n',
            "stage[0].upstream.status: expected one of",
        ),
        (BASE + STAGE + "colour = 1\n", "stage[0].colour: unknown field"),
        ("stage = 1\n" + BASE, "stage: expected an array"),
        (BASE + '[[regression]]\nname = "x"\npaths = []\n', "regression[0].paths"),
    ],
)
def test_malformed_files_name_the_field(tmp_path, text, field):
    with pytest.raises(SeriesFileError) as error:
        _load(tmp_path, text)
    assert "series.toml: " in str(error.value)
    assert field in str(error.value)


def test_a_missing_file_is_reported(tmp_path):
    with pytest.raises(SeriesFileError, match="series file not found"):
        load_series(tmp_path / "nope.toml")


def test_the_project_is_the_checkout_the_series_file_is_in(tmp_path):
    """The series file sits in a folder of the checkout's root (build/ would
    otherwise be written elsewhere), and a symlinked patches/ folder may not
    move the project to where the link points."""
    clone = tmp_path / "clone"
    (clone / ".git").mkdir(parents=True)
    assert _load(clone, BASE + STAGE).root == clone.resolve()
    deeper = clone / "patches" / "old" / "series.toml"
    deeper.parent.mkdir(parents=True)
    deeper.write_text(BASE + STAGE)
    with pytest.raises(SeriesFileError, match="must sit in a folder of the checkout"):
        load_series(deeper)
    for key in ("project", "overlays", "rebased_from"):
        with pytest.raises(SeriesFileError, match=f"series.{key}: unknown field"):
            _load(clone, f'{key} = ".."\n' + BASE + STAGE)
    elsewhere = tmp_path / "elsewhere" / "patches"
    elsewhere.mkdir(parents=True)
    (elsewhere / "series.toml").write_text(BASE + STAGE)
    linked = tmp_path / "linked"
    (linked / ".git").mkdir(parents=True)
    (linked / "patches").symlink_to(elsewhere)
    with pytest.raises(SeriesFileError, match="outside the project .* symlink"):
        load_series(linked / "patches" / "series.toml")
