# SPDX-License-Identifier: Apache-2.0
"""The process pytest runs are forked from (see ``preload.py``).

Run as ``python -c <this file's text> SOCKET MODULE...``: it imports the
given third-party modules, then serves one request per connection on the
Unix socket SOCKET. A request (one JSON line) is a pytest
run: its arguments, environment, folder and output file. A supervisor is
forked for it, which forks the run, waits for it and answers with its exit
status and CPU time (children included). This process imports nothing of
the project and nothing from a run's PYTHONPATH, so what a run sees differs
from a fresh ``python -m pytest`` only in modules already being imported.
"""

import contextlib
import importlib
import json
import os
import signal
import socket
import sys

# The interpreter's own path, less the first entry (set by main).
_SITE_PATH: list[str] = []


def _run(request: dict) -> None:
    """In the forked run: become ``python -m pytest ARGS`` in its folder."""
    cwd, env = request["cwd"], request["env"]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    # What ``python -m`` starts with: the folder, PYTHONPATH, then site.
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *_SITE_PATH]
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    import atexit

    import pytest
    import pytest.__main__

    sys.argv = [pytest.__main__.__file__, *request["args"]]

    try:
        code = int(pytest.main(request["args"]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 3
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _supervise(conn: socket.socket) -> None:
    with conn.makefile("r") as lines:
        request = json.loads(lines.readline())
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(request)
    _, status, usage = os.wait4(pid, 0)
    answer = {
        "returncode": os.waitstatus_to_exitcode(status),
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }
    conn.sendall((json.dumps(answer) + "\n").encode())
    conn.close()


def main(socket_path: str, modules: list[str]) -> None:
    for name in modules:
        # A module missing here is the run's to import, or fail to.
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # ``-c`` puts "" first; a run's own path replaces it.
    _SITE_PATH[:] = sys.path[1:]
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
    main(sys.argv[1], sys.argv[2:])
