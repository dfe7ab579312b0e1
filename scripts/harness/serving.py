# SPDX-License-Identifier: Apache-2.0
"""A stand-in for ``vllm serve``, for the validation kit's tests: an
OpenAI-style server on loopback that answers ``/health`` and streams
``/v1/completions`` as vLLM's OpenAI server does (server-sent events, a
final usage chunk, ``[DONE]``), and prints the engine-config line the kit
checks. Misbehaviour on demand, by environment: ``DIE_AFTER=n`` exits
after n completions (a server that dies mid-sweep), ``TRUNCATE=n`` reports
n prompt tokens fewer than it was sent (one whitespace-separated word is
one token), as a server that did not take the whole prompt would.
``SERVED_FILE=path`` prints the sha256 of that file as the server starts
(which code it serves)."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

SERVER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[1])
die_after = int(os.environ.get("DIE_AFTER", "0"))
short = int(os.environ.get("TRUNCATE", "0"))
served = []
print("engine config: enable_prefix_caching=False", flush=True)
if os.environ.get("SERVED_FILE"):
    import hashlib
    path = os.environ["SERVED_FILE"]
    digest = "absent"
    if os.path.exists(path):
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    print(f"served {path}: {digest}", flush=True)
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens = int(body.get("max_tokens") or 1)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        def send(event):
            data = ("data: " + event + "\\n\\n").encode()
            self.wfile.write(f"{len(data):x}\\r\\n".encode() + data + b"\\r\\n")
            self.wfile.flush()
        for i in range(tokens):
            send(json.dumps({"choices": [{"index": 0, "text": f" w{i}"}]}))
        usage = {"prompt_tokens": len(body["prompt"].split()) - short,
                 "completion_tokens": tokens}
        send(json.dumps({"choices": [], "usage": usage}))
        send("[DONE]")
        self.wfile.write(b"0\\r\\n\\r\\n")
        self.wfile.flush()
        served.append(1)
        if die_after and len(served) >= die_after:
            os._exit(1)
    def log_message(self, *args):
        pass
try:
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
except KeyboardInterrupt:
    pass
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def write_matrix(
    folder: Path,
    port: int,
    bench: list[str],
    points: str,
    variants: str,
    evals: list[list[str]] = (),  # type: ignore[assignment]
) -> Path:
    """A stage-0001 matrix file serving the stand-in on ``port``, with the
    given bench command (placeholders as in seeds.toml), TOML ``points``
    and ``variants`` arrays, and eval commands."""
    server = folder / "server.py"
    server.write_text(SERVER)
    matrix = folder / "matrix.toml"
    lines = [
        "[stage_0001]",
        'model = "stand-in"',
        f"port = {port}",
        f"serve = {json.dumps([sys.executable, str(server), '{port}'])}",
        f"bench = {json.dumps(bench)}",
        f"points = {points}",
        f"variants = {variants}",
        f"evals = {json.dumps([list(e) for e in evals])}",
    ]
    matrix.write_text("\n".join(lines) + "\n")
    return matrix
