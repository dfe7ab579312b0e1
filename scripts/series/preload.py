# SPDX-License-Identifier: Apache-2.0
"""pytest runs forked from a process that has imported torch and vLLM's
other third-party dependencies once.

A fresh interpreter spends about 6 of the 8-10 s it takes to import vLLM's
indexer op in torch, torch._inductor, transformers and the like; a warm run
of every stage's tests starts 18 of them. Those modules do not depend on
which vLLM tree a run tests, so the runs that share every environment
variable but the tree's (``TREE_VARS``) are forked from one server process
(``preload_server.py``) that imported them under that environment. Nothing
of the project or of a run's PYTHONPATH is imported before the fork; the
run then gets its own environment, folder and ``sys.path`` as ``python -m
pytest`` would, and its output and CPU time come back as from a
subprocess.

A test can start a Python command of its own the same way: ``python_command``
runs it through ``preload_client.py``, which the run finds its server for in
``$DSA_PRELOAD_SOCKET``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.contract import (
    BASE_TREE_ENV,
    COMPILE_SUMMARY_ENV,
    PLUGIN_FILES_ENV,
    STAGES_ENV,
    TREE_ENV,
)
from scripts.series.preload_client import CPU_LOG_ENV, SOCKET_ENV
from scripts.series.testcache import VOLATILE_ENV

# Third-party modules vLLM's import pulls in, the slowest first (measured
# with ``python -X importtime`` on vLLM 0.32.0's indexer op).
MODULES = (
    "torch",
    "torch._dynamo",
    "torch._inductor",
    "torch._inductor.compile_fx",
    "transformers",
    "triton",
    "numpy",
    "sympy",
    "pydantic",
    "fastapi",
    "openai",
    "aiohttp",
    "huggingface_hub",
    "xgrammar",
    "zmq",
    "msgspec",
    "cbor2",
    "psutil",
    "safetensors",
    "tokenizers",
    "prometheus_client",
    "pytest",
    # Submodules the packages above do not import themselves but vLLM's
    # indexer, models, benchmarks and test conftest do (found by listing
    # what a forked run still imported from site-packages): about 1.5 s of
    # each run's CPU time, 0.7 s once here. None reads a per-run variable
    # (SET_BY_THE_RUN, TREE_VARS) as it is imported (checked by recording
    # os.environ's reads during the import).
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.processing_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.deepseek_v2.configuration_deepseek_v2",
    "transformers.models.deepseek_v3.configuration_deepseek_v3",
    "transformers.models.whisper.tokenization_whisper",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "torch.utils.cpp_extension",
    "torch._inductor.compiler_bisector",
    "torch._dynamo.repro.after_dynamo",
    "torch._subclasses.schema_check_mode",
    "triton.experimental.gluon",
    "requests",
    "zmq.asyncio",
    "safetensors.torch",
    "cloudpickle",
    "cpuinfo",
    "uvloop",
    "cachetools",
    "einops",
    "llguidance",
    "partial_json_parser",
    "openai_harmony",
    "pybase64",
    "tblib.pickling_support",
    "prometheus_client.multiprocess",
)
# What tells runs of one server apart: they are set per run, after the fork.
TREE_VARS = (
    TREE_ENV,
    STAGES_ENV,
    BASE_TREE_ENV,
    COMPILE_SUMMARY_ENV,
    PLUGIN_FILES_ENV,
    "PYTHONPATH",
    SOCKET_ENV,
    CPU_LOG_ENV,
)
# What a test process sets in its own environment after it starts, which a
# command it runs inherits: variables of pytest's, vLLM's and AITER's own
# namespaces (``*`` ends a prefix), which none of the preloaded modules
# reads, and those vLLM's env_override.py sets at import, after importing
# torch (and its compilation's Inductor cache folder). The preloaded modules
# read those when used, not when imported, all but
# TORCHINDUCTOR_COMPILE_THREADS, which only torch.compile uses and which the
# pytest runs see the same way.
SET_BY_THE_RUN = (
    "PYTEST_*",
    "VLLM_*",
    "AITER_*",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_COMPILE_THREADS",
    "TRITON_CACHE_AUTOTUNING",
    "TILELANG_CLEANUP_TEMP_FILES",
)
_SERVER = Path(__file__).with_name("preload_server.py")
_CLIENT = Path(__file__).with_name("preload_client.py")
# transformers imports anyio, whose pytest plugin pytest then cannot rewrite
# the asserts of (it warns, once per run). Only that plugin's own asserts
# lose pytest's introspection; the tests' are rewritten as ever.
_ALREADY_IMPORTED = (
    "-W",
    "ignore:Module already imported so cannot be rewritten; anyio"
    ":pytest.PytestAssertRewriteWarning",
)


@dataclass(frozen=True)
class Finished:
    returncode: int
    cpu_s: float
    output: str


def python_command(*argv: str) -> list[str]:
    """``python ARGV`` (``-c CODE ...``, ``-m MODULE ...`` or ``SCRIPT ...``)
    as a command line that, inside a run forked from a preload server, is
    forked from that server too; otherwise it is that command."""
    if os.environ.get(SOCKET_ENV):
        return [sys.executable, str(_CLIENT), *argv]
    return [sys.executable, *argv]


def server_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The environment a run's server is started with: the run's, less the
    per-run variables."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in TREE_VARS))


class Server:
    """One server process, started on first use."""

    def __init__(self, python: str, env: Mapping[str, str], folder: Path):
        self._python = python
        self._env = dict(env)
        self._socket = folder / "server.sock"
        self._process: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            if self._process is not None:
                return
            process = subprocess.Popen(
                [
                    self._python,
                    "-c",
                    _SERVER.read_text(),
                    str(self._socket),
                    ",".join(TREE_VARS + SET_BY_THE_RUN + tuple(sorted(VOLATILE_ENV))),
                    *MODULES,
                ],
                env=self._env,
                cwd=self._socket.parent,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert process.stdout is not None
            # A module may print on import: "ready" is the last line.
            if not any(line.strip() == "ready" for line in process.stdout):
                process.wait()
                raise SeriesError(
                    f"the preload server exited {process.returncode} before "
                    "serving (run with --no-preload to see the runs' own errors)"
                )
            self._process = process

    def run(
        self, args: Sequence[str], env: Mapping[str, str], cwd: Path, output: Path
    ) -> Finished:
        """``python -m pytest ARGS`` with ``env`` in ``cwd``, forked; its CPU
        time includes that of the commands it had forked here."""
        self._start()
        cpu_log = output.with_suffix(".cpu")
        request = {
            "args": [*_ALREADY_IMPORTED, *args],
            "env": {**env, SOCKET_ENV: str(self._socket), CPU_LOG_ENV: str(cpu_log)},
            "cwd": str(cwd),
            "output": str(output),
        }
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(str(self._socket))
                conn.sendall((json.dumps(request) + "\n").encode())
                with conn.makefile("r") as lines:
                    answer = lines.readline()
        except OSError as exc:
            answer = ""
            cause = f": {exc}"
        else:
            cause = ""
        if not answer:
            raise SeriesError(
                f"the preload server stopped answering{cause} (run again, or "
                "with --no-preload)"
            )
        result = json.loads(answer)
        try:
            commands_cpu_s = sum(float(line) for line in cpu_log.read_text().split())
            cpu_log.unlink()
        except FileNotFoundError:
            commands_cpu_s = 0.0
        return Finished(
            result["returncode"],
            result["cpu_s"] + commands_cpu_s,
            output.read_text(errors="replace"),
        )

    def close(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            self._process = None


class Servers:
    """One server per distinct ``server_key``, all closed at the end."""

    def __init__(self, python: str):
        self._python = python
        self._folder = Path(tempfile.mkdtemp(prefix="dsa-preload-"))
        self._servers: dict[tuple[tuple[str, str], ...], Server] = {}
        self._lock = threading.Lock()

    def run(self, args: Sequence[str], env: Mapping[str, str], cwd: Path) -> Finished:
        key = server_key(env)
        with self._lock:
            if key not in self._servers:
                folder = self._folder / str(len(self._servers))
                folder.mkdir()
                self._servers[key] = Server(self._python, dict(key), folder)
            server = self._servers[key]
        output = Path(tempfile.mkstemp(dir=self._folder, suffix=".log")[1])
        try:
            return server.run(args, env, cwd, output)
        finally:
            output.unlink(missing_ok=True)

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        for path in sorted(self._folder.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        os.rmdir(self._folder)
