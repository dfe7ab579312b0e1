# SPDX-License-Identifier: Apache-2.0
"""``nox -s mutate`` never writes the user's checkout: mutmut's mutants
are made and run in a scratch worktree, so a kill while a mutant's tests
run leaves the checkout byte for byte as it was, and the next run clears
the scratch.

The project here is a small git repository holding the real
``scripts/mutate.py`` and one module whose test can be held running."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import sh, write_files

from scripts.series.config import REPO_ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mutmut") is None,
    reason="no mutmut in this Python (tests/requirements-cpu.txt has it)",
)

DECIDE = """\
def grant(age, limit):
    if age >= limit:
        return "yes"
    return "no"
"""
# A test that writes a marker (the mutant it runs with, if any) and, while
# HOLD names a file that does not exist yet, waits.
TEST = """\
import os
import subprocess
import time
from pathlib import Path

from toy.decide import grant


def test_the_project_is_its_git_top_level():
    # As the tool's own tests find the project (its series file's checkout).
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True).stdout.strip()
    assert Path(top).resolve() == Path.cwd().resolve()


def test_grant():
    marker = os.environ.get("HOLD")
    if marker:
        mutant = os.environ.get("MUTANT_UNDER_TEST", "none")
        Path(marker + ".running").write_text(mutant)
        while not Path(marker).exists():
            time.sleep(0.1)
    assert grant(18, 18) == "yes"
    assert grant(17, 18) == "no"
"""


def _snapshot(root: Path) -> dict[str, str]:
    """Every file of the work tree but build/ (where the tool keeps its own
    work), hashed; git's refs are compared apart."""
    files = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(("build/", ".git/")):
            continue
        if path.is_file() and not path.is_symlink():
            files[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    for name in ("scripts/__init__.py", "scripts/mutate.py", "scripts/mutmut_forks.py",
                 "scripts/series/__init__.py", "scripts/series/config.py"):  # fmt: skip
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, root / name)
    write_files(root, {".gitignore": "/build/\n__pycache__/\n", "toy/__init__.py": ""})
    write_files(root, {"toy/decide.py": DECIDE.replace(">=", ">")})
    sh(root, "git", "init", "-q", "-b", "main")
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-qm", "toy")
    # An uncommitted edit (the fix) and an untracked test: both are what the
    # user has, and the mutants must be tested with them.
    write_files(root, {"toy/decide.py": DECIDE, "tests/test_decide.py": TEST})
    return root


def _mutate(root: Path, hold: Path | None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if hold:
        env["HOLD"] = str(hold)
    return subprocess.Popen(
        [sys.executable, "-m", "scripts.mutate", "toy/decide.py", "--",
         "tests/test_decide.py", "-p", "no:cacheprovider"],
        cwd=root, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def test_a_kill_mid_mutant_leaves_the_checkout_as_it_was(toy: Path) -> None:
    before = _snapshot(toy)
    status = sh(toy, "git", "status", "--porcelain")
    refs = sh(toy, "git", "show-ref", "--head")
    hold = toy.parent / "hold"
    run = _mutate(toy, hold)
    try:
        deadline = time.monotonic() + 120
        # mutmut's first test runs are without a mutant (its baseline and
        # its map of tests to functions); wait for one that holds a mutant.
        while True:
            seen = Path(f"{hold}.running")
            if seen.exists() and "__mutmut_" in seen.read_text():
                break
            if seen.exists():
                seen.unlink()
                hold.write_text("")
                time.sleep(0.2)
                hold.unlink(missing_ok=True)
            assert run.poll() is None, run.communicate()[0]
            assert time.monotonic() < deadline, "no mutant was ever tested"
            time.sleep(0.05)
        assert (toy / "toy/decide.py").read_text() == DECIDE
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert _snapshot(toy) == before
    assert sh(toy, "git", "status", "--porcelain") == status
    assert sh(toy, "git", "show-ref", "--head") == refs

    # The next run clears what the killed one left, tests the checkout's
    # own edits (the fixed module kills mutants the committed one would
    # not), and removes its scratch when done.
    again = _mutate(toy, None)
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out
    assert "mutation score of toy/decide.py" in out, out
    assert " 0 of " not in out and "(0 of" not in out, out
    killed = out.split("mutation score of toy/decide.py: ")[1]
    assert not killed.startswith("0.0%"), out
    assert _snapshot(toy) == before
    assert sh(toy, "git", "worktree", "list", "--porcelain").count("worktree ") == 1
    assert not (toy / "build/mutate/work/toy_decide.py").exists()


def test_lines_name_the_functions_that_hold_them() -> None:
    """``--since`` and ``--lines`` become the functions mutmut mutates:
    those whose lines (decorators included) meet a range, by mutmut's
    names; a range between functions names none."""
    from scripts.mutate import _functions

    source = (
        "LIMIT = 3\n"  # 1
        "def first(a):\n"  # 2
        "    return a\n"  # 3
        "\n"  # 4
        "class Rule:\n"  # 5
        "    @property\n"  # 6
        "    def strict(self):\n"  # 7
        "        return True\n"  # 8
        "    def loose(self):\n"  # 9
        "        return False\n"  # 10
    )
    assert _functions(source, ["3-3"]) == ["x_first"]
    assert _functions(source, ["6-6"]) == ["x\u01c1Rule\u01c1strict"]
    assert _functions(source, ["1-1", "4-5"]) == []
    assert _functions(source, ["3-9"]) == [
        "x_first",
        "x\u01c1Rule\u01c1strict",
        "x\u01c1Rule\u01c1loose",
    ]


FORKED = """\
import os

from toy.double import double


def test_double_in_a_forked_child():
    pid = os.fork()
    if pid == 0:  # as the gloo harness's ranks: every error reported, then out
        try:
            os._exit(0 if double(2) == 4 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
"""


SUBPROCESS = """\
import subprocess
import sys


def test_half_in_a_subprocess():
    # As the tool's tests run its commands: another Python, from the project.
    subprocess.run(
        [sys.executable, "-c", "from toy.half import half; assert half(5) == 2"],
        check=True,
    )
"""


@pytest.mark.parametrize(
    ("module", "source", "test"),
    [
        ("double", "def double(x):\n    return x * 2\n", FORKED),
        ("half", "def half(x):\n    return x // 2\n", SUBPROCESS),
    ],
    ids=["a forked rank", "a subprocess"],
)
def test_a_function_only_another_process_calls_is_tested(
    toy: Path, module: str, source: str, test: str
) -> None:
    """The gloo tests call the op's merge only in forked ranks, and the
    tool's tests run its commands in another Python, as a user does: those
    functions' mutants are run against the test that started the process,
    not left untested."""
    write_files(toy, {f"toy/{module}.py": source, f"tests/test_{module}.py": test})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "scripts.mutate", f"toy/{module}.py", "--",
         f"tests/test_{module}.py", "-p", "no:cacheprovider"],
        cwd=toy, env=env, text=True, capture_output=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no tests" not in done.stdout, done.stdout
    assert f"mutation score of toy/{module}.py: 100.0%" in done.stdout, done.stdout


def test_an_empty_also_copy_is_left_out(tmp_path: Path) -> None:
    """mutmut reads an empty ``also_copy`` as ".": a whole vLLM test tree
    (and the mutants folder inside it) copied again. With nothing to add,
    the setting is left out, and mutmut copies its defaults."""
    from configparser import ConfigParser

    from scripts.mutate import _config

    for extra in ([], ["README.md", "patches"]):
        (tmp_path / "setup.cfg").write_text("[egg_info]\ntag_build =\n")
        _config(tmp_path, Path("vllm/v1/plan.py"), ["tests/test_plan.py"], extra)
        config = ConfigParser()
        config.read(tmp_path / "setup.cfg")
        assert config.get("mutmut", "only_mutate") == "vllm/v1/plan.py"
        copied = config.get("mutmut", "also_copy", fallback=None)
        assert copied == ("\nREADME.md\npatches" if extra else None)


def test_a_line_range_or_a_sample_that_is_none_is_refused_plainly() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "scripts.mutate", "scripts/mutate.py", "--lines",
         "12", "--", "tests"],
        cwd=REPO_ROOT, text=True, capture_output=True,
    )  # fmt: skip
    assert done.returncode == 2
    assert "'12' is no A-B line range" in done.stderr
    assert "Traceback" not in done.stderr
    for count in ("0", "-3", "a"):
        done = subprocess.run(
            [sys.executable, "-m", "scripts.mutate", "scripts", "--sample", count,
             "--", "tests"],
            cwd=REPO_ROOT, text=True, capture_output=True,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert f"{count!r} is no count of mutants" in done.stderr


def test_a_sample_of_a_folder_runs_only_the_mutants_drawn(toy: Path) -> None:
    """``--sample N`` over a folder: N of every module's mutants, drawn by
    the seed (the same draw again with it), each run, and the score with
    its interval over those alone."""
    write_files(toy, {"toy/double.py": "def double(x):\n    return x * 2\n"})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    record = toy / "build/mutate/toy.json"
    drawn = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "scripts.mutate", "toy", "--sample", "3",
             "--seed", "5", "--", "tests/test_decide.py", "-p", "no:cacheprovider"],
            cwd=toy, env=env, text=True, capture_output=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        outcomes = json.loads(record.read_text())["outcomes"]
        made = json.loads(record.read_text())["sample"]["of"]
        assert made > 3, done.stdout
        assert f"3 of {made} mutants, seed 5" in done.stdout, done.stdout
        assert f"of 3 sampled mutants of {made} killed; 95% interval" in done.stdout
        assert len(outcomes) == 3 and "not checked" not in outcomes.values()
        # mutmut ran those three alone (it lists the mutants it was given).
        ran = done.stdout.split("Mutant results")[1].split("mutation score")[0]
        assert sorted(re.findall(r"^\S+ (toy\.\S+)$", ran, re.M)) == sorted(outcomes)
        assert {k.split(".x_")[0] for k in outcomes} <= {"toy.decide", "toy.double"}
        drawn.append(sorted(outcomes))
    assert drawn[0] == drawn[1]
