# SPDX-License-Identifier: Apache-2.0
"""Run one stage's experiment: per variant, install the code it serves into
the box's vLLM (the series tool's ``install``), serve the model, wait for it,
run every benchmark point and the accuracy tasks, check each result, stop
the server (also on Ctrl-C or a failure); at the end the install is put back
as it was. Every raw file stays in the output folder: the install's output
and record of the code served, the server log, each result JSON, the evals'
output, summary.json."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType

from scripts.series.install.install import installed_record
from scripts.validate.checks import log_problems, result_problems
from scripts.validate.matrix import Experiment, Point, Variant, shell_line

PROJECT = Path(__file__).resolve().parents[2]  # where scripts.series runs

POLL_S = 5.0  # between health checks while the server starts
# How the server is stopped: each signal to its process group, then a wait.
STOP_SIGNALS = ((signal.SIGINT, 60), (signal.SIGTERM, 30), (signal.SIGKILL, 10))


class ServerError(Exception):
    """The server did not come up (or went away); its log says why."""


def _sigint_by_default() -> None:
    """In the server's process, before it runs: SIGINT at its default. A
    command started from a background job (``&``, nohup) inherits SIGINT
    ignored, and ``stop`` asks the server to shut down with SIGINT first."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Server:
    """``vllm serve`` in its own process group, logged to a file; healthy on
    entry, stopped on exit whatever happened."""

    def __init__(
        self, command: list[str], env: dict[str, str], port: int, log: Path
    ) -> None:
        self.command, self.env, self.port, self.log = command, env, port, log
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        with self.log.open("wb") as log:
            try:
                self.process = subprocess.Popen(
                    self.command,
                    env={**os.environ, **self.env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_sigint_by_default,
                )
            except FileNotFoundError:
                raise ServerError(_not_found(self.command[0])) from None
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _wait_healthy(self, timeout_s: float = 3600) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            if not self.alive():
                assert self.process is not None
                raise ServerError(
                    f"the server exited ({self.process.returncode}) before it was "
                    f"healthy; see {self.log}"
                )
            try:
                with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(POLL_S)
        raise ServerError(f"no healthy server on port {self.port}; see {self.log}")

    def stop(self) -> None:
        """SIGINT, then SIGTERM, then SIGKILL to the whole process group."""
        if self.process is None:
            return
        for sig, wait_s in STOP_SIGNALS:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue


@dataclass
class Outcome:
    variant: str
    run: str  # a benchmark point's name, or "server" / an eval's name
    file: str | None  # its raw result, relative to the output folder
    problems: list[str] = field(default_factory=list)
    result: dict = field(default_factory=dict)
    isl: int | None = None  # a benchmark point's
    conc: int | None = None


def install_command(site: Path | str, stage: str | None) -> list[str]:
    """The series tool writing the stages up to ``stage`` (None: undo) into
    the vLLM at ``site``."""
    upto = ["--undo"] if stage is None else ["--upto", stage]
    command = [sys.executable, "-m", "scripts.series", "install", "--into"]
    return [*command, str(site), *upto]


def run_experiment(
    experiment: Experiment, out: Path, site: Path | None = None
) -> list[Outcome]:
    """Every variant of ``experiment``; the outcomes, also in summary.json.
    ``site``: the box's vLLM (the folder that holds vllm/), where variants
    that name the code they serve have it installed."""
    outcomes: list[Outcome] = []
    before = installed_record(site) if site else None
    try:
        for variant in experiment.variants:
            outcomes += _run_variant(experiment, variant, out, site)
    finally:
        (out / "summary.json").write_text(
            json.dumps([asdict(o) for o in outcomes], indent=1) + "\n"
        )
        if site and any(v.install for v in experiment.variants):
            # Put the box's vLLM back as the run found it.
            stage = before["stage"] if before else None
            log = out / "install-restore.log"
            for problem in _install(site, stage, log):
                print(f"warning: {site} was not put back: {problem}", file=sys.stderr)
    return outcomes


def _install(site: Path, stage: str | None, log: Path) -> list[str]:
    """Run the install; what went wrong, if anything (its output in ``log``)."""
    command = install_command(site, stage)
    with log.open("wb") as handle:
        done = subprocess.run(
            command, cwd=PROJECT, stdout=handle, stderr=subprocess.STDOUT
        )
    if done.returncode == 0:
        return []
    last = (log.read_text(errors="replace").strip().splitlines() or [""])[-1]
    return [f"`{shell_line(command[1:])}` exited {done.returncode}: {last}"]


def _run_variant(
    experiment: Experiment, variant: Variant, out: Path, site: Path | None
) -> list[Outcome]:
    folder = out / variant.name
    folder.mkdir(parents=True, exist_ok=True)
    if variant.install:
        if site is None:
            problem = "it names the code it serves, and no --site was given"
            return [Outcome(variant.name, "install", None, [problem])]
        problems = _install(site, variant.install, folder / "install.log")
        if problems:  # never serve other code than the variant names
            return [Outcome(variant.name, "install", "install.log", problems)]
        served = {
            "site": str(site),
            "stage": variant.install,
            "record": installed_record(site),  # None: vLLM as shipped
        }
        (folder / "served_code.json").write_text(json.dumps(served, indent=1) + "\n")
    log = folder / "server.log"
    command = experiment.serve_command(variant)
    (folder / "serve.sh").write_text(
        shell_line(command, experiment.serve_env(variant)) + "\n"
    )
    outcomes: list[Outcome] = []
    try:
        server = Server(command, experiment.serve_env(variant), experiment.port, log)
        with server:
            outcomes.append(
                Outcome(
                    variant.name,
                    "server",
                    log.name,
                    log_problems(log.read_text(), experiment.prefix_caching),
                )
            )
            for point in experiment.points:
                outcomes.append(_bench(experiment, point, folder, variant))
                if not server.alive():
                    outcomes[-1].problems.append("the server died during this run")
                    return outcomes
            for index, command in enumerate(experiment.eval_commands(folder)):
                log = folder / f"eval-{index}-{eval_name(command)}.log"
                problems = _run(command, {**os.environ, **experiment.env}, log)
                outcomes.append(
                    Outcome(variant.name, f"eval {index}", log.name, problems)
                )
    except ServerError as exc:
        outcomes.append(Outcome(variant.name, "server", log.name, [str(exc)]))
    return outcomes


def _bench(
    experiment: Experiment, point: Point, folder: Path, variant: Variant
) -> Outcome:
    result_file = folder / f"{point.name}.json"
    outcome = Outcome(
        variant.name, point.name, result_file.name, isl=point.isl, conc=point.conc
    )
    outcome.problems += _run(experiment.bench_command(point, folder), None)
    if not result_file.exists():
        outcome.problems.append("no result file")
        return outcome
    outcome.result = json.loads(result_file.read_text())
    outcome.problems += result_problems(outcome.result, point)
    return outcome


def _run_logged(
    command: list[str], env: dict[str, str] | None, log: Path
) -> subprocess.CompletedProcess:
    """``command`` with its output copied, line by line, to ``log`` and to
    the terminal (an eval takes hours: its progress stays visible)."""
    with (
        log.open("w") as out,
        subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        ) as process,
    ):
        assert process.stdout is not None
        for line in process.stdout:
            out.write(line)
            sys.stdout.write(line)
    return subprocess.CompletedProcess(command, process.returncode)


def _not_found(program: str) -> str:
    return (
        f"{program} is not installed here (not on PATH): install the patched "
        "vLLM and the eval tools in this environment (README, 'On an MI355X')"
    )


def eval_name(command: list[str]) -> str:
    """An eval command's task: lm_eval's --tasks, run_eval's --eval-name."""
    for flag in ("--tasks", "--eval-name"):
        if flag in command[:-1]:
            return re.sub(r"[^\w.-]", "_", command[command.index(flag) + 1])
    return Path(command[0]).name


def _run(
    command: list[str], env: dict[str, str] | None, log: Path | None = None
) -> list[str]:
    """Run one client command, its output into ``log`` if given (and still
    on the terminal); what went wrong with it, if anything."""
    try:
        if log is None:
            done = subprocess.run(command, env=env)
        else:
            done = _run_logged(command, env, log)
    except FileNotFoundError:
        return [_not_found(command[0])]
    return (
        [f"`{' '.join(command[:3])}` exited {done.returncode}"]
        if done.returncode
        else []
    )
