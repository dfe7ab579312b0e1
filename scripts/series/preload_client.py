# SPDX-License-Identifier: Apache-2.0
"""``python preload_client.py ARGV...``: ``python ARGV...`` (``-c CODE ...``,
``-m MODULE ...`` or ``SCRIPT ...``) forked from the test run's preload server
(``preload_server.py``), on this process's stdin, stdout and stderr, with
its environment and folder; its exit status is this process's.

A test run forked from a server finds the server's socket in
``$DSA_PRELOAD_SOCKET``. Without one, or if the server will not serve the
command (its environment differs, less the per-run variables), this process
becomes ``python ARGV...`` itself: the same command, only slower to start.
A server that started the command and then stopped answering is an error
(exit status 1): the command may have run, and it is not run twice.
Standard library only: it runs from any folder, with nothing on its path.
"""

import json
import os
import signal
import socket
import sys

SOCKET_ENV = "DSA_PRELOAD_SOCKET"
# Where the server logs a command's CPU time, for the run that started it.
CPU_LOG_ENV = "DSA_PRELOAD_CPU_LOG"


def forked(path: str, argv: list[str]) -> int | None:
    """The command's exit status, run by the server at ``path``; None if it
    was not started there. A server that started it and then stopped
    answering is an error: the command may have run, so it is not run again."""
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    started = False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(path)
            socket.send_fds(conn, [b"F"], [0, 1, 2])
            conn.sendall((json.dumps(request) + "\n").encode())
            with conn.makefile("r") as lines:
                first = json.loads(lines.readline() or "{}")
                if "refused" in first or not first.get("started"):
                    return None
                started = True
                answer = lines.readline()
    except OSError:
        answer = ""
    if not started:
        return None
    if not answer:
        sys.exit(
            f"preload_client.py: the preload server at {path} stopped answering "
            "while it ran the command; it is not run again"
        )
    return json.loads(answer)["returncode"]


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(
            "usage: python preload_client.py (-c CODE | -m MODULE | SCRIPT) [ARG...]"
        )
    path = os.environ.get(SOCKET_ENV)
    code = forked(path, argv) if path else None
    if code is not None and code < 0:
        # Killed by a signal: so is this process, as the command would be.
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    if code is not None:
        sys.exit(code)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
