# SPDX-License-Identifier: Apache-2.0
"""The Dockerfile, read without Docker (no daemon on the CI machine): it
starts from vLLM's ROCm image of the pinned release, and each series
command its RUN lines run parses with the tool's parser, for the default
build and for every --build-arg the README shows. The image itself is not
built here."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.series.config import REPO_ROOT, SERIES_FILE, SdistBase, load_series
from tests.tooling.conftest import needs_release_pin
from tests.tooling.test_commands import series_error

DOCKERFILE = REPO_ROOT / "Dockerfile"
README = REPO_ROOT / "README.md"
PIN = load_series(SERIES_FILE).base


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined,
    comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def _substitutions(text: str) -> list[tuple[int, int]]:
    """Where each $(...) starts and ends (quotes inside it skipped)."""
    spans = []
    i = text.find("$(")
    while i != -1:
        depth, j, quote = 1, i + 2, ""
        while depth:
            c = text[j]
            if quote:
                quote = "" if c == quote else quote
            elif c in "'\"":
                quote = c
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
            j += 1
        spans.append((i, j))
        i = text.find("$(", j)
    return spans


def command_substitutions(text: str) -> list[str]:
    return [text[start + 2 : end - 1] for start, end in _substitutions(text)]


def series_commands(run: str, args: dict[str, str]) -> list[list[str]]:
    """The python3 -m scripts.series commands of a RUN line, with the build
    arguments' values expanded (unquoted, so split into words)."""
    text = run
    for start, end in reversed(_substitutions(run)):
        text = text[:start] + "/SITE" + text[end:]
    for name, value in args.items():
        text = re.sub(rf"\$\{{?{name}\}}?", value, text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in ("&&", "||", ";", "|"):
            commands.append([])
        else:
            commands[-1].append(word)
    return [c[3:] for c in commands if c[:3] == ["python3", "-m", "scripts.series"]]


def readme_build_args() -> list[dict[str, str]]:
    """The --build-arg sets of the README's docker build lines."""
    sets = []
    text = re.sub(r"\\\n\s*", " ", README.read_text(encoding="utf-8"))
    for line in text.splitlines():
        if line.strip().startswith("docker build"):
            words = shlex.split(line, comments=True)
            pairs = [words[i + 1] for i, w in enumerate(words) if w == "--build-arg"]
            sets.append(dict(p.split("=", 1) for p in pairs))
    return sets


DOCKER = instructions(DOCKERFILE.read_text(encoding="utf-8"))
ARGS = {
    name: value.strip('"')
    for kind, rest in DOCKER
    if kind == "ARG"
    for name, _, value in [rest.partition("=")]
}


@needs_release_pin
def test_it_starts_from_vllms_rocm_image_of_the_pinned_release():
    assert isinstance(PIN, SdistBase), "the image tag follows a release pin"
    bases = [rest for kind, rest in DOCKER if kind == "FROM"]
    assert bases == [f"vllm/vllm-openai-rocm:v{PIN.version}"]
    text = README.read_text(encoding="utf-8")
    for tag in re.findall(r"vllm/vllm-openai-rocm:v?([\w.]+)", text):
        assert tag == PIN.version, f"README names vllm-openai-rocm:{tag}"


def test_the_readme_builds_what_the_dockerfile_takes():
    for build in readme_build_args():
        assert set(build) <= set(ARGS), f"unknown --build-arg: {build}"


@pytest.mark.parametrize(
    "build",
    [{}, *readme_build_args()],
    ids=lambda b: " ".join(f"{k}={v}" for k, v in b.items()) or "default",
)
def test_its_series_commands_parse_apply_first(build: dict[str, str]):
    args = {**ARGS, **build}
    runs = [rest for kind, rest in DOCKER if kind == "RUN"]
    commands = [c for run in runs for c in series_commands(run, args)]
    assert [c[0] for c in commands] == ["apply", "install"]
    for command in commands:
        assert series_error(command) is None, shlex.join(command)
    assert commands[1][-2:] == ["--into", "/SITE"]
    if "INSTALL_ARGS" in build:
        assert shlex.split(build["INSTALL_ARGS"]) == commands[1][1:-2]


def test_its_apt_step_comes_before_the_project_is_copied():
    """Docker reruns every step after a changed COPY: an edit to a doc must
    not run apt again."""
    kinds = [(kind, rest) for kind, rest in DOCKER if kind in ("RUN", "COPY")]
    apt = next(i for i, (_, rest) in enumerate(kinds) if "apt-get" in rest)
    copy = next(i for i, (kind, _) in enumerate(kinds) if kind == "COPY")
    assert apt < copy


def test_it_finds_the_vllm_package_without_importing_it(tmp_path: Path):
    """The --into folder comes from a python3 -c line in the RUN: given a
    folder with a vllm package that cannot be imported, it prints that
    folder."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("raise ImportError('no GPU')\n")
    runs = [rest for kind, rest in DOCKER if kind == "RUN"]
    [inner] = [c for run in runs for c in command_substitutions(run)]
    words = shlex.split(inner)
    assert words[:2] == ["python3", "-c"]
    found = subprocess.run(
        [sys.executable, "-c", words[2]],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == str(site)


def test_the_build_leaves_out_local_work_trees():
    ignored = (REPO_ROOT / ".dockerignore").read_text(encoding="utf-8").split()
    assert {"build", ".nox", ".git"} <= set(ignored)
