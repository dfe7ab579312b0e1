# SPDX-License-Identifier: Apache-2.0
"""Every command the README and the guides in docs/ show works as written:
each `nox -s NAME -- ARGS` names a session of the noxfile, and the session
accepts ARGS, checking them with the series tool's own parser before it
applies or installs anything; each `python -m scripts.series ...` parses
with that parser, stage ids included. `nox -l` shows whole sentences, and
every option of the tool has a plain help text."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import re
import shlex
import subprocess
import sys
import tomllib
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from scripts.series import cli
from scripts.series.config import REPO_ROOT, SERIES_FILE, load_series
from scripts.validate.__main__ import parser as validate_parser
from tests.tooling.conftest import run_cli

README = REPO_ROOT / "README.md"
# The guides a reader follows (reports of past runs keep the commands they ran).
GUIDES = [
    "docs/guarantees.md",
    "docs/gpu_runs.md",
    "docs/maintaining.md",
    "docs/serving.md",
    "docs/testing.md",
    "docs/tooling.md",
    "docs/validation_kit.md",
]
SERIES = load_series(SERIES_FILE)
FIRST_STAGE = SERIES.stages[0].id
# Words the documents use for a value the reader fills in, and one such value.
PLACEHOLDERS = {
    "STAGE": FIRST_STAGE,
    "<id>": FIRST_STAGE,
    "<stage>": FIRST_STAGE,
    "V": "0.35.0",
    "<release>": "0.35.0",
    "H": "0" * 64,
    "<sha256>": "0" * 64,
}
SERIES_PREFIXES = (
    ["python", "-m", "scripts.series"],
    ["python3", "-m", "scripts.series"],
)
VALIDATE_PREFIXES = (
    ["python", "-m", "scripts.validate"],
    ["python3", "-m", "scripts.validate"],
)


# -- the noxfile, read without nox (the tests' environment has none) --------


class _Started(Exception):
    """The session got past its checks: it ran or installed something."""


class _Refused(Exception):
    """The session stopped with an error (session.error)."""


class _Skipped(Exception):
    pass


@dataclass
class _Session:
    """What a session function sees of nox; it records instead of running."""

    name: str
    posargs: list[str]
    runs: list[tuple[str, ...]] = field(default_factory=list)
    virtualenv: types.SimpleNamespace = field(
        default_factory=lambda: types.SimpleNamespace(location="/nonexistent/venv")
    )
    venv_backend: str = "virtualenv"
    stop: bool = True  # at the first command run (False: record them all)
    logged: list[str] = field(default_factory=list)

    def run(self, *args: str, **_: object) -> None:
        self.runs.append(args)
        if self.stop:
            raise _Started

    def install(self, *args: str, **_: object) -> None:
        self.run("install", *args)

    def error(self, *args: object) -> None:
        raise _Refused(" ".join(map(str, args)))

    def skip(self, *args: object) -> None:
        raise _Skipped(" ".join(map(str, args)))

    def log(self, *args: object, **_: object) -> None:
        self.logged.append(" ".join(map(str, args)))

    warn = log


@dataclass
class _NoxSession:
    func: Callable[..., None]
    params: dict[str, str]  # a parametrized session's argument
    venv_backend: str | None = None  # as the decorator gives it (None: nox's)

    def session(self, name: str, posargs: list[str]) -> _Session:
        """What this session's function sees when run with ``posargs``."""
        return _Session(name, posargs, venv_backend=self.venv_backend or "virtualenv")


def _load_noxfile(
    argv: list[str] | None = None,
) -> tuple[types.ModuleType, dict[str, list[_NoxSession]]]:
    """Import noxfile.py with a stand-in for nox that records the sessions
    under the names nox gives them: name= or the function's name, and
    name(id) for each parameter of a parametrized one (the bare name runs
    them all). ``argv``: nox's command line as the noxfile sees it."""
    sessions: dict[str, list[_NoxSession]] = {}

    def session(
        func: Callable[..., None] | None = None, **kwargs: object
    ) -> Callable[..., None] | Callable[[Callable[..., None]], Callable[..., None]]:
        def register(f: Callable[..., None]) -> Callable[..., None]:
            name = str(kwargs.get("name") or f.__name__)
            backend = kwargs.get("venv_backend")
            assert backend is None or isinstance(backend, str)
            param = getattr(f, "_nox_param", None)
            if param is None:
                sessions[name] = [_NoxSession(f, {}, backend)]
                return f
            arg, ids = param
            every = [_NoxSession(f, {arg: i}, backend) for i in ids]
            sessions[name] = every
            for i, one in zip(ids, every, strict=True):
                sessions[f"{name}({i})"] = [one]
            return f

        return register(func) if func is not None else register

    def parametrize(arg: str, values: list[str], ids: list[str] | None = None):
        def mark(f: Callable[..., None]) -> Callable[..., None]:
            f._nox_param = (arg, list(ids or values))  # type: ignore[attr-defined]
            return f

        return mark

    stub = types.ModuleType("nox")
    stub.session = session  # type: ignore[attr-defined]
    stub.parametrize = parametrize  # type: ignore[attr-defined]
    stub.options = types.SimpleNamespace()  # type: ignore[attr-defined]
    stub.Session = _Session  # type: ignore[attr-defined]
    saved = sys.modules.get("nox")
    sys.modules["nox"] = stub
    saved_argv = sys.argv
    sys.argv = argv or ["nox"]
    try:
        spec = importlib.util.spec_from_file_location(
            "noxfile_read_by_tests", REPO_ROOT / "noxfile.py"
        )
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.argv = saved_argv
        if saved is None:
            del sys.modules["nox"]
        else:
            sys.modules["nox"] = saved
    # The sessions check their arguments with `python -m scripts.series
    # --check-args`: run that command in this process, the rest as they are.
    module.subprocess = types.SimpleNamespace(  # type: ignore[attr-defined]
        run=_run_series_in_process
    )
    return module, sessions


def _run_series_in_process(command: list[str], **kwargs: object):
    if command[:3] == [sys.executable, "-m", "scripts.series"]:
        return run_cli(command[3:])
    return subprocess.run(command, **kwargs)  # type: ignore[call-overload]


NOXFILE, SESSIONS = _load_noxfile()


# -- checking one command ----------------------------------------------------


def _parse_error(parse: Callable[[], object]) -> str | None:
    """Run an argparse-based check; its error message, or None."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = parse()
    except SystemExit as exc:
        code = exc.code
    if code in (0, None):
        return None
    return err.getvalue().strip().splitlines()[-1] if err.getvalue() else str(code)


def series_error(args: list[str]) -> str | None:
    """Why ``python -m scripts.series ARGS`` would refuse its arguments."""
    if args[:1] == ["--check-args"]:
        args = args[1:]
    if "--series" in args:
        cut = args.index("--series")
        argv = [*args[: cut + 2], "--check-args", *args[cut + 2 :]]
    else:
        argv = ["--check-args", *args]
    return _parse_error(lambda: cli.main(argv))


def validate_error(args: list[str]) -> str | None:
    def parse() -> int:
        options = validate_parser().parse_args(args)
        experiments = tomllib.loads(options.config.read_text(encoding="utf-8"))
        if f"stage_{options.stage}" not in experiments:
            print(f"error: no experiment {options.stage!r}", file=sys.stderr)
            return 1
        return 0

    return _parse_error(parse)


@functools.cache
def session_error(name: str, posargs: tuple[str, ...]) -> str | None:
    """Why ``nox -s NAME -- POSARGS`` would refuse: no such session, the
    session's own check, or the first command it runs not parsing. A
    session must check before it runs or installs anything."""
    if name not in SESSIONS:
        return f"no nox session {name!r} (nox -l lists them)"
    for one in SESSIONS[name]:
        session = one.session(name, list(posargs))
        try:
            one.func(session, **one.params)
        except _Refused as exc:
            return str(exc)
        except (_Started, _Skipped):
            pass
        if session.runs:
            first = list(session.runs[0])
            # A session runs the tool with its own interpreter's full path.
            module = ["python", *first[1:3]]
            if module in SERIES_PREFIXES:
                problem = series_error(first[3:])
            elif module in VALIDATE_PREFIXES:
                problem = validate_error(first[3:])
            else:
                problem = None
            if problem:
                return f"its first command {shlex.join(first)}: {problem}"
    return None


def _words(command: str) -> list[list[str]]:
    """The simple commands of a shell line (split at &&, ||, ; and |),
    without leading VAR=value assignments."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in ("&&", "||", ";", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(word)
    out = []
    for words in commands:
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if words:
            out.append([_fill(w) for w in words])
    return out


def _fill(word: str) -> str:
    """A placeholder word replaced by a value; <id> also inside a word, as
    in tests(<id>)."""
    for inner in ("<id>", "<stage>"):
        word = word.replace(inner, FIRST_STAGE) if word != inner else word
    return PLACEHOLDERS.get(word, word)


def command_error(words: list[str]) -> str | None:
    """Why a documented ``nox ...`` or ``python -m scripts.series ...``
    command would fail on its arguments; None for other programs."""
    if words in (*SERIES_PREFIXES, *VALIDATE_PREFIXES):
        return None  # the program named, as in "a wrapper over python -m ..."
    if words[:3] in SERIES_PREFIXES:
        return series_error(words[3:])
    if words[:3] in VALIDATE_PREFIXES:
        return validate_error(words[3:])
    if words[0] != "nox":
        return None
    rest = words[1:]
    posargs: list[str] = []
    if "--" in rest:
        cut = rest.index("--")
        rest, posargs = rest[:cut], rest[cut + 1 :]
    if rest in ([], ["-l"], ["--list"]) and not posargs:
        return None
    if len(rest) < 2 or rest[0] not in ("-s", "--session"):
        return f"not a nox form this test knows: {shlex.join(words)}"
    for name in rest[1:]:
        problem = session_error(name, tuple(posargs))
        if problem:
            return problem
    return None


# -- where the documents show commands ---------------------------------------

_FENCE = re.compile(r"^```[\w-]*\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_COMMAND_START = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:nox|python3? -m scripts\.)")


def documented_commands(text: str) -> list[str]:
    """Shell lines of the code blocks that run nox or the project's tools
    (continuation lines joined), then inline code spans that are such a
    command."""
    found = []
    for block in _FENCE.findall(text):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if re.search(r"(^|[\s;&|(])(nox|python3? -m scripts\.)", line):
                found.append(line.strip())
    for span in _SPAN.findall(_FENCE.sub("", text)):
        if _COMMAND_START.match(span):
            found.append(span)
    return found


def _documents() -> list[tuple[str, str]]:
    docs = [("README.md", README.read_text(encoding="utf-8"))]
    for guide in GUIDES:
        path = REPO_ROOT / guide
        if path.is_file():
            docs.append((guide, path.read_text(encoding="utf-8")))
    return docs


def _failures(text: str) -> list[str]:
    failures = []
    checked: set[tuple[str, ...]] = set()
    for line in documented_commands(text):
        for words in _words(line):
            if tuple(words) in checked:
                continue
            checked.add(tuple(words))
            problem = command_error(words)
            if problem:
                failures.append(f"{line}\n    -> {problem}")
    return failures


@pytest.mark.parametrize("name", [name for name, _ in _documents()])
def test_every_documented_command_works_as_written(name: str):
    text = dict(_documents())[name]
    assert documented_commands(text), f"{name} shows no command"
    failures = _failures(text)
    assert not failures, f"{name}:\n" + "\n".join(failures)


def test_a_documented_command_that_errors_is_caught():
    """The checks above fail on the forms a reader would see fail: a
    session that does not exist, arguments the tool does not take, a stage
    the series does not have."""
    bad = """
```bash
nox -s rebase -- TARGET
nox -s export -- 0002
nox -s test
nox -s install -- --into SITE --upto 0001 --undo
python -m scripts.series rebase --sha256 abc
python -m scripts.series overview --narrow
```
Or inline: `nox -s apply -- --upto`.
"""
    failures = _failures(bad)
    assert len(failures) == 7, "\n".join(failures)
    assert "unrecognized arguments: TARGET" in failures[0]
    assert "unknown stage '0002'" in failures[1]
    assert "no nox session 'test'" in failures[2]
    assert "not allowed with argument" in failures[3]
    assert "add --version V" in failures[4]
    assert "unrecognized arguments: --narrow" in failures[5]
    assert "expected one argument" in failures[6]
    good = """
```bash
nox -s apply -- 0001
nox -s "tests(<id>)" -- -k gate           # pytest's -k
```
"""
    assert _failures(good) == []


# -- sessions ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(n for n in SESSIONS if "(" not in n))
def test_nox_l_shows_a_whole_sentence_per_session(name: str):
    doc = SESSIONS[name][0].func.__doc__ or ""
    first = doc.strip().split("\n")[0]  # what nox -l prints
    assert first[:1].isupper() and first.endswith("."), repr(first)
    assert len(first) <= 80, f"{first!r} is {len(first)} characters"


@pytest.mark.parametrize(
    "name, posargs",
    [
        ("apply", ["--nope"]),
        ("apply", ["0002"]),
        ("apply", ["--carry", "--abort"]),
        ("rebase", ["TARGET"]),
        ("rebase", []),
        ("roll", ["now"]),
        ("install", ["--upto", "0001"]),
        ("install", ["--into", "SITE", "--upto", "9999"]),
        ("export", ["base"]),
        ("export", ["--signoff"]),
        ("refresh", ["--nope"]),
        ("lint", ["--all"]),
        ("check-patches", ["0001"]),
        ("status", ["-v"]),
        ("cost-model", ["x"]),
    ],
)
def test_a_session_refuses_bad_arguments_before_it_runs_anything(name, posargs):
    session = SESSIONS[name][0].session(name, posargs)
    with pytest.raises(_Refused, match=rf"nox -s {re.escape(name)}"):
        SESSIONS[name][0].func(session, **SESSIONS[name][0].params)
    assert session.runs == []


@pytest.mark.parametrize(
    "posargs, makes_a_venv",
    [
        (["--version", "0.35.0"], False),
        (["--version", "0.35.0", "--sha256", "a" * 64], True),
        (["--continue"], True),
        (["--abort"], False),
        (["--version", "0.35.0", "--git", "/x"], True),  # refused by the tool
    ],
)
def test_a_rebase_without_a_hash_only_asks_the_tool_for_it(posargs, makes_a_venv):
    """nox -s rebase -- --version V: the tool prints the index's sha256 and
    the command to run, in nox's own Python; nox makes no virtualenv for it
    (the decorator's backend, chosen from nox's command line) and the session
    applies and installs nothing first."""
    _, sessions = _load_noxfile(["nox", "-s", "rebase", "--", *posargs])
    (rebase,) = sessions["rebase"]
    assert (rebase.venv_backend != "none") is makes_a_venv
    if makes_a_venv:
        return
    session = rebase.session("rebase", posargs)
    with pytest.raises(_Started):
        rebase.func(session)
    assert session.runs == [
        (sys.executable, "-m", "scripts.series", "rebase", *posargs)
    ]


@pytest.mark.parametrize("posargs", [["--abort"], ["--continue"]])
def test_an_abort_or_continue_applies_nothing_first(posargs):
    """Applying would refuse the edits a stopped rebase's user has in the
    work tree, so an abort (or a --continue) would never run."""
    noxfile, sessions = _load_noxfile(["nox", "-s", "rebase", "--", *posargs])
    (rebase,) = sessions["rebase"]
    session = rebase.session("rebase", posargs)
    session.stop = False
    noxfile._install_cpu_deps = lambda session: session.runs.append(("deps",))
    rebase.func(session)
    assert not [run for run in session.runs if "apply" in run], session.runs
    assert session.runs[-1][-1] == posargs[0]


def test_help_after_the_double_dash_prints_the_commands_options(capsys):
    session = _Session("rebase", ["--help"])
    with pytest.raises(_Skipped):
        SESSIONS["rebase"][0].func(session)
    assert "--sha256 SHA256" in capsys.readouterr().out and session.runs == []


# -- the tool's help ---------------------------------------------------------


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    top = cli._parser()
    found = [("python -m scripts.series", top)]
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [(p.prog, p) for p in action.choices.values()]
    found.append(("python -m scripts.validate", validate_parser()))
    return found


@pytest.mark.parametrize(
    "prog, parser", _parsers(), ids=[prog for prog, _ in _parsers()]
)
def test_help_is_plain_text_with_a_line_for_every_option(prog, parser):
    text = parser.format_help()
    assert "`" not in text, f"{prog} --help quotes with backticks"
    assert "see --help" not in text, f"{prog} --help refers to itself"
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            assert all(a.help for a in action._choices_actions), prog
        else:
            assert action.help, f"{prog} {'/'.join(action.option_strings)}: no help"
