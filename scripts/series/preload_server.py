# SPDX-License-Identifier: Apache-2.0
"""The process pytest runs are forked from (see ``preload.py``).

Run as ``python -c <this file's text> SOCKET PER_RUN MODULE...``: it
imports the given third-party modules, then serves one request per
connection on the Unix socket SOCKET. A request (one JSON line) is either a
pytest run (its arguments, environment, folder and output file) or, from
``preload_client.py``, a ``python -c CODE ...``, ``-m MODULE ...`` or
``SCRIPT ...`` command that brings its stdin, stdout and stderr along
(SCM_RIGHTS) and is served only if its environment is the server's, less
the per-run variables (PER_RUN: comma-separated names, and prefixes ending
in ``*``). A supervisor is forked for it, which forks the run, waits for it
and answers with its exit status and CPU time (children included). This
process imports nothing of the project and nothing from a run's PYTHONPATH,
so what a run sees differs from a fresh interpreter only in modules already
being imported.
"""

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys

# The interpreter's own path, less the first entry (set by main).
_SITE_PATH: list[str] = []
# The variables set per run (passed by the tool; a name ending in "*" is a
# prefix) and the server's environment less those: a command's must match
# it to be served.
_PER_RUN: list[str] = []
_OWN_ENV: dict[str, str] = {}


def _per_run(name: str) -> bool:
    return any(
        name.startswith(p[:-1]) if p.endswith("*") else name == p for p in _PER_RUN
    )


def _become(cwd: str, env: dict, first_path: str) -> None:
    """The forked run's folder, environment and ``sys.path`` as a fresh
    interpreter's: ``first_path``, PYTHONPATH, then site."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first_path, *extra, *_SITE_PATH]
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))


def _exit(code: int) -> None:
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _run_pytest(request: dict) -> None:
    """In the forked run: become ``python -m pytest ARGS`` in its folder."""
    cwd = request["cwd"]
    _become(cwd, request["env"], cwd)
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    import pytest
    import pytest.__main__

    sys.argv = [pytest.__main__.__file__, *request["args"]]

    try:
        code = int(pytest.main(request["args"]))
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 3
    _exit(code)


def _run_python(request: dict, fds: list[int]) -> None:
    """In the forked run: become ``python ARGV`` (``-c CODE ...``, ``-m
    MODULE ...`` or ``SCRIPT ...``) on the client's stdin, stdout and
    stderr."""
    import runpy
    import types

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # New streams on the client's descriptors, buffered as a fresh
    # interpreter's are (stdout line by line on a terminal only).
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1 if os.isatty(1) else -1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    argv, cwd, env = request["argv"], request["cwd"], request["env"]
    if argv[0] == "-m":
        # The folder first; runpy sets argv[0] and __main__ as ``-m`` does.
        sys.argv = argv[1:]
        _become(cwd, env, cwd)

        def main() -> None:
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)

    else:
        if argv[0] == "-c":
            code, filename, first_path = argv[1], "<string>", ""
            sys.argv = ["-c", *argv[2:]]
        else:
            filename = os.path.abspath(os.path.join(cwd, argv[0]))
            with open(filename) as source:
                code = source.read()
            first_path, sys.argv = os.path.dirname(filename), list(argv)
        _become(cwd, env, first_path)
        main_module = types.ModuleType("__main__")
        if argv[0] != "-c":
            main_module.__file__ = filename
        main_module.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main_module

        def main() -> None:
            exec(compile(code, filename, "exec"), main_module.__dict__)

    try:
        main()
        result = 0
    except SystemExit as exc:
        result = _exit_code(exc)
    except BaseException as exc:
        import traceback

        # As a fresh interpreter prints it: from the command's own frames,
        # past this function's and main's.
        frames = exc.__traceback__
        for _ in range(2):
            frames = frames and frames.tb_next
        traceback.print_exception(exc.with_traceback(frames))
        result = 1
    _exit(result)


def _refusal(request: dict) -> str | None:
    """Why a command is not served here, if it is not."""
    env = {k: v for k, v in request["env"].items() if not _per_run(k)}
    if env != _OWN_ENV:
        differ = sorted(set(env.items()) ^ set(_OWN_ENV.items()))
        return "environment differs in " + ", ".join(sorted({k for k, _ in differ}))
    return None


def _supervise(conn: socket.socket) -> None:
    fds: list[int] = []
    if conn.recv(1, socket.MSG_PEEK) == b"F":
        # A command: its three descriptors first, then the request.
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    with conn.makefile("r") as lines:
        request = json.loads(lines.readline())
    if fds and (refused := _refusal(request)):
        conn.sendall((json.dumps({"refused": refused}) + "\n").encode())
        return
    pid = os.fork()
    if pid == 0:
        conn.close()  # the supervisor's, to answer on
        if fds:
            _run_python(request, fds)
        _run_pytest(request)
    for fd in fds:
        os.close(fd)
    if fds:
        # From here on the command runs: a client that gets no answer must
        # not run it again.
        conn.sendall(b'{"started": true}\n')
    # A client that goes away (killed at a timeout) takes its run along.
    finished = os.pidfd_open(pid)
    ready, _, _ = select.select([finished, conn.fileno()], [], [])
    if finished not in ready:
        os.kill(pid, signal.SIGKILL)
    _, status, usage = os.wait4(pid, 0)
    answer = {
        "returncode": os.waitstatus_to_exitcode(status),
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }
    if fds and (cpu_log := request["env"].get("DSA_PRELOAD_CPU_LOG")):
        # A command's CPU time counts to the run it came from (preload.py).
        with open(cpu_log, "a") as log:
            log.write(f"{answer['cpu_s']}\n")
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps(answer) + "\n").encode())


def main(socket_path: str, per_run: list[str], modules: list[str]) -> None:
    _PER_RUN[:] = per_run
    _OWN_ENV.update({k: v for k, v in os.environ.items() if not _per_run(k)})
    for name in modules:
        # A module missing here is the run's to import, or fail to.
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # ``-c`` puts "" first; a run's own path replaces it.
    _SITE_PATH[:] = sys.path[1:]
    # What is imported now lives as long as the runs: their collections
    # (pytest runs two as it exits) need not walk it again.
    gc.collect()
    gc.freeze()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen()
    # Supervisors are reaped by the kernel.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _supervise(conn)
            finally:
                os._exit(0)
        conn.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), sys.argv[3:])
