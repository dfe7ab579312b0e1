# SPDX-License-Identifier: Apache-2.0
"""Commands a preloaded test run starts through ``preload.python_command``:
forked from the run's server when their environment is the server's (less
the per-run variables), started fresh otherwise, the same command either
way; their CPU time counts to the run, and a command whose caller goes away
goes too. The server preloads one light module here (``csv``) in place of
torch, so that a command can tell whether it was forked."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from scripts.series import preload
from scripts.series.config import REPO_ROOT

# The command: whether it was forked (csv already imported), what it sees,
# and half a second of CPU; it exits 3.
COMMAND = """
import json, os, sys, time
forked = "csv" in sys.modules
start = time.process_time()
while time.process_time() - start < 0.5:
    pass
print(json.dumps({"forked": forked, "argv": sys.argv, "cwd": os.getcwd(),
                  "path0": sys.path[0], "marker": os.environ.get("DSA_BASE_TREE"),
                  "cpu_s": time.process_time()}))
sys.exit(3)
"""

# The run: the command from a folder of its own, with a per-run variable
# set (the server serves it) and, a second time, with a variable that is
# not per run (it is started fresh).
TEST_FILE = """
import json, os, subprocess, sys
from scripts.series import preload

COMMAND = {command!r}


def run(env):
    folder = os.path.join(os.getcwd(), "elsewhere")
    os.makedirs(folder, exist_ok=True)
    done = subprocess.run(
        preload.python_command("-c", COMMAND, "a", "b"),
        env=env, cwd=folder, capture_output=True, text=True,
    )
    assert done.returncode == 3, done.stderr
    return json.loads(done.stdout)


def test_commands(tmp_path):
    served = run({{**os.environ, "PYTEST_CURRENT_TEST": "x", "DSA_BASE_TREE": "m"}})
    fresh = run({{**os.environ, "NOT_PER_RUN": "1"}})
    # This process's CPU time so far, the fresh command's included.
    times = os.times()
    own = times.user + times.system + times.children_user + times.children_system
    with open(os.environ["RESULT"], "w") as out:
        json.dump([served, fresh, own], out)
"""


def _serve_one_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, test_file: str
) -> preload.Finished:
    monkeypatch.setattr(preload, "MODULES", ("csv",))
    (tmp_path / "test_it.py").write_text(test_file)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/"),
        "PYTHONPATH": str(REPO_ROOT),
        "RESULT": str(tmp_path / "result.json"),
    }
    servers = preload.Servers(sys.executable)
    try:
        return servers.run(
            [str(tmp_path / "test_it.py"), "-q", "-p", "no:cacheprovider"],
            env,
            tmp_path,
        )
    finally:
        servers.close()


def test_a_command_is_forked_only_where_its_environment_is_the_servers(
    tmp_path, monkeypatch
):
    done = _serve_one_run(tmp_path, monkeypatch, TEST_FILE.format(command=COMMAND))
    assert done.returncode == 0, done.output
    served, fresh, own = json.loads((tmp_path / "result.json").read_text())
    assert (served["forked"], fresh["forked"]) == (True, False)
    for seen in (served, fresh):
        assert seen["argv"] == ["-c", "a", "b"]
        assert seen["cwd"] == str(tmp_path / "elsewhere")
        # ``python -c`` puts "" first on the path.
        assert seen["path0"] == ""
    assert (served["marker"], fresh["marker"]) == ("m", None)
    # The forked command ran in the server, not under the run: its CPU time
    # is added to the run's own (which has the fresh command's).
    assert own >= fresh["cpu_s"]
    assert done.cpu_s >= own + served["cpu_s"]


def test_a_command_is_a_script_too(tmp_path, monkeypatch):
    script = tmp_path / "tool" / "script.py"
    script.parent.mkdir()
    script.write_text(
        "import os, sys\n"
        "print(sys.argv, sys.path[0], __name__, __file__)\n"
        "raise ValueError('from the script')\n"
    )
    test_file = textwrap.dedent(
        f"""
        import os, subprocess
        from scripts.series import preload

        def test_script():
            done = subprocess.run(
                preload.python_command({str(script)!r}, "x"),
                capture_output=True, text=True,
            )
            assert done.returncode == 1
            assert done.stdout.split() == [
                "['{script}',", "'x']", {str(script.parent)!r}, "__main__",
                {str(script)!r},
            ]
            # The traceback starts at the script, as a fresh one's does.
            lines = done.stderr.splitlines()
            assert lines[0] == "Traceback (most recent call last):"
            assert lines[1].startswith('  File "{script}"'), lines
            assert lines[-1] == "ValueError: from the script"
        """
    )
    done = _serve_one_run(tmp_path, monkeypatch, test_file)
    assert done.returncode == 0, done.output


def test_a_command_is_a_module_too_and_reads_its_stdin(tmp_path, monkeypatch):
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool" / "probe.py").write_text(
        "import csv, json, os, sys\n"
        "forked = 'csv' in sys.modules\n"
        "print(json.dumps([forked, sys.argv, sys.path[0], sys.stdin.read()]))\n"
    )
    test_file = textwrap.dedent(
        f"""
        import json, subprocess, sys
        from scripts.series import preload

        def test_module():
            done = subprocess.run(
                preload.python_command("-m", "probe", "x"),
                input="from stdin", capture_output=True, text=True,
                cwd={str(tmp_path / "tool")!r},
            )
            assert done.returncode == 0, done.stderr
            forked, argv, path0, read = json.loads(done.stdout)
            assert forked
            assert argv == [{str(tmp_path / "tool" / "probe.py")!r}, "x"]
            assert path0 == {str(tmp_path / "tool")!r}
            assert read == "from stdin"
        """
    )
    done = _serve_one_run(tmp_path, monkeypatch, test_file)
    assert done.returncode == 0, done.output


def test_a_server_that_stops_answering_does_not_run_the_command_twice(
    tmp_path, monkeypatch
):
    """The command kills its supervisor (the server side of the client's
    connection) after it has run: the client says so and exits 1; it does
    not start the command again on its own."""
    ran = tmp_path / "ran.log"
    command = tmp_path / "command.py"
    command.write_text(
        "import os, signal\n"
        f"open({str(ran)!r}, 'a').write('ran\\n')\n"
        "os.kill(os.getppid(), signal.SIGKILL)\n"
    )
    test_file = textwrap.dedent(
        f"""
        import subprocess
        from pathlib import Path
        from scripts.series import preload

        def test_once():
            done = subprocess.run(
                preload.python_command({str(command)!r}),
                capture_output=True, text=True,
            )
            assert done.returncode == 1
            assert "stopped answering" in done.stderr, done.stderr
            assert Path({str(ran)!r}).read_text().splitlines() == ["ran"]
        """
    )
    done = _serve_one_run(tmp_path, monkeypatch, test_file)
    assert done.returncode == 0, done.output


def test_a_command_whose_caller_is_killed_is_killed(tmp_path, monkeypatch):
    pid_file = tmp_path / "command.pid"
    test_file = textwrap.dedent(
        f"""
        import os, subprocess, time
        from pathlib import Path
        from scripts.series import preload

        PID = Path({str(pid_file)!r})
        SLEEP = (
            "import os, pathlib, time; "
            f"pathlib.Path({{str(PID)!r}}).write_text(str(os.getpid())); "
            "time.sleep(60)"
        )

        def test_killed():
            caller = subprocess.Popen(preload.python_command("-c", SLEEP))
            while not (PID.exists() and PID.read_text()):
                time.sleep(0.05)
            command = int(PID.read_text())
            assert command != caller.pid  # forked by the server
            caller.kill()
            caller.wait()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(command, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.05)
            raise AssertionError("the command outlived its caller")
        """
    )
    done = _serve_one_run(tmp_path, monkeypatch, test_file)
    assert done.returncode == 0, done.output
