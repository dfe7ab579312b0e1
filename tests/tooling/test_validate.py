# SPDX-License-Identifier: Apache-2.0
"""The MI355X validation kit without a GPU: its commands are the PR texts',
its checks catch what the PR texts checked, and a run against stand-in servers
keeps every result, reports a bad one, survives a server that dies and
always stops the server."""

from __future__ import annotations

import hashlib
import json
import shlex
import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from scripts.harness import serving
from scripts.series.config import SERIES_FILE, load_series
from scripts.series.install.install import install, installed_record, stage_files
from scripts.series.stages.trees import stage_tree
from scripts.validate import runner
from scripts.validate.__main__ import dry_run
from scripts.validate.checks import log_problems, result_problems
from scripts.validate.matrix import SEEDS, MatrixError, Point, load_experiment

# Quoted from stage 0001's PR text ("[FEAT] Context parallel indexer for
# GLM-5.x", not opened upstream yet): "All three use the same vllm serve
# command", "Env vars for all runs", "Benchmark command for each point".
SEED_0001_ENV = (
    "VLLM_USE_V2_MODEL_RUNNER=1 VLLM_ROCM_USE_AITER=1 "
    "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1 VLLM_ROCM_USE_AITER_FP8BMM=0 "
    "VLLM_ROCM_USE_AITER_FP4BMM=0"
)
SEED_0001_SERVE = """vllm serve amd/GLM-5.2-MXFP4 \\
  --kv-cache-dtype fp8_e4m3 --trust-remote-code --tensor-parallel-size 8 \\
  --linear-backend aiter --moe-backend aiter \\
  --tool-call-parser glm47 --enable-auto-tool-choice --reasoning-parser glm45 \\
  --no-enable-prefix-caching --port 8586"""
SEED_0001_BENCH = """\
vllm bench serve --backend openai --base-url http://127.0.0.1:8586 \\
  --endpoint /v1/completions --model amd/GLM-5.2-MXFP4 \\
  --tokenizer amd/GLM-5.2-MXFP4 --trust-remote-code \\
  --dataset-name random --random-input-len $ISL --random-output-len 1024 \\
  --max-concurrency $CONC --num-prompts $((CONC*10)) --num-warmups $((CONC*2)) \\
  --request-rate inf --ignore-eos --save-result \\
  --percentile-metrics ttft,tpot,e2el,itl --metric-percentiles 0,75,90,99,100"""
# Stage 0003's PR text (vllm-project/vllm#61985), its benchmark command.
SEED_0003_BENCH = """\
vllm bench serve --backend vllm --model amd/GLM-5.2-MXFP4 --dataset-name random \\
  --random-input-len 131072 --random-output-len 1024 --ignore-eos --temperature 0 \\
  --num-prompts $N --max-concurrency $C --seed 43"""


def _words(command: str, **values: int) -> list[str]:
    for name, value in values.items():
        command = command.replace(name, str(value))
    return shlex.split(command.replace("\\\n", " "))


def _without(words: list[str], *options: str) -> list[str]:
    """``words`` less the options the kit adds to keep each raw result."""
    out: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in options:
            skip = word != "--save-result"
        else:
            out.append(word)
    return out


def _lines(stage: str, tmp_path: Path) -> list[list[str]]:
    return [shlex.split(line) for line in dry_run(stage, SEEDS, tmp_path).splitlines()]


def test_the_dry_run_is_the_seeds_matrix_for_stage_0001(tmp_path):
    lines = _lines("0001", tmp_path)
    serves = [line for line in lines if "serve" in line and "bench" not in line]
    assert len(serves) == 2  # flag off, flag on
    flag = ["VLLM_ROCM_USE_AITER_CP_INDEXER=1"]
    expected = _words(SEED_0001_ENV) + flag
    assert serves[1] == expected + _words(SEED_0001_SERVE) + ["&"]
    benches = [line for line in lines if line[:3] == ["vllm", "bench", "serve"]]
    # 12 points per configuration, 24 runs in total (the seed ran a third
    # configuration, stripes of 1024 rows, now ignored)
    assert len(benches) == 24
    points = [(8192, c) for c in (4, 8, 16, 32, 64, 128, 256)]
    points += [(51200, c) for c in (4, 8, 16, 32, 64)]
    # Each server serves the code its variant names: the seed's baseline ran
    # without the stage.
    installs = [
        line
        for line in lines
        if line[:4] == ["python3", "-m", "scripts.series", "install"]
    ]
    assert [line[-1] for line in installs] == ["base", "0001"]
    assert lines[1] == installs[0] and lines[2] == serves[0]
    evals = [
        line
        for line in lines[:18]
        if line[0] == "lm_eval" or line[:3] == ["python3", "-m", "sglang.test.run_eval"]
    ]
    assert [
        line[line.index("--tasks") + 1] if "--tasks" in line else line[4]
        for line in evals
    ] == ["gsm8k", "niah_single_2", "gpqa"]
    for (isl, conc), words in zip(points, benches[:12], strict=True):
        seed = _words(
            SEED_0001_BENCH,
            **{"$((CONC*10))": conc * 10, "$((CONC*2))": conc * 2},
            **{"$ISL": isl, "$CONC": conc},
        )
        assert _without(words, "--result-dir", "--result-filename") == seed


def test_the_dry_run_is_the_seeds_matrix_for_stage_0003(tmp_path):
    lines = _lines("0003", tmp_path)
    serves = [line for line in lines if line[-1] == "&"]
    assert serves[1][-3:] == [
        "--attention-config",
        '{"indexer_kv_dtype": "mxfp4"}',
        "&",
    ]
    assert "--attention-config" not in serves[0]
    # The seed's baseline: the FP8 indexer with AITER top-k, without the stage.
    installs = [line[-1] for line in lines if line[:2] == ["python3", "-m"]]
    assert installs == ["0001", "0003"]
    benches = [line for line in lines if line[:3] == ["vllm", "bench", "serve"]]
    first = _without(benches[0], "--save-result", "--result-dir", "--result-filename")
    # 128K/1K at c1: num-prompts max(C, 3)
    assert first == _words(SEED_0003_BENCH, **{"$N": 3, "$C": 1})


def test_a_malformed_matrix_is_named(tmp_path):
    bad = tmp_path / "matrix.toml"
    bad.write_text(SEEDS.read_text().replace("per_c = 10 }", 'per_c = "ten" }'))
    with pytest.raises(MatrixError, match="per_c and min must be integers"):
        load_experiment("0001", bad)
    with pytest.raises(
        MatrixError, match=r"no \[stage_0002\] \(stages: 0001, 0001-serving, 0003\)"
    ):
        load_experiment("0002", SEEDS)


def test_the_seeds_checks():
    point = Point(isl=8192, osl=1024, conc=4, num_prompts=40, warmups=8, seed=None)
    good = {"completed": 40, "failed": 0, "total_input_tokens": 40 * 8192}
    assert result_problems(good, point) == []
    short = {**good, "total_input_tokens": 40 * 8192 - 512}
    assert "a cached prefix" in result_problems(short, point)[0]
    lost = {**good, "completed": 39, "failed": 1}
    assert result_problems(lost, point) == ["39 of 40 requests completed, 1 failed"]
    assert log_problems("... enable_prefix_caching=False, ...") == []
    assert log_problems("... enable_prefix_caching=True, ...")


def test_the_serving_experiments_checks_expect_prefix_caching_and_suffixes():
    """stage_0001-serving: prefix caching on, prompts of a shared prefix of
    ISL tokens plus a fresh suffix."""
    experiment = load_experiment("0001-serving")
    assert experiment.prefix_caching
    assert "--enable-prefix-caching" in experiment.serve
    assert "--no-enable-prefix-caching" not in experiment.serve
    point = experiment.points[0]
    assert point.suffix_len == 1024
    good = {
        "completed": point.num_prompts,
        "failed": 0,
        "total_input_tokens": point.num_prompts * (point.isl + 1024),
    }
    assert result_problems(good, point) == []
    assert result_problems({**good, "total_input_tokens": 0}, point)
    on, off = "enable_prefix_caching=True", "enable_prefix_caching=False"
    assert log_problems(on, prefix_caching=True) == []
    assert log_problems(off, prefix_caching=True)
    assert not load_experiment("0001").prefix_caching


# Reads one streamed completion from the stand-in server, then writes a
# result with the fields `vllm bench serve --save-result` writes
# (vllm/benchmarks/serve.py); an ISL of 999 loses a token. Results made by
# vLLM's own code: tests/base/test_validate_kit_vllm_bench.py.
STAND_IN_BENCH = """
import json, sys, urllib.request
result_dir, result_file, isl, n, port = sys.argv[1:]
request = urllib.request.Request(
    f"http://127.0.0.1:{port}/v1/completions",
    data=json.dumps({"prompt": "w1 w2", "max_tokens": 1}).encode(),
    headers={"Content-Type": "application/json"},
)
urllib.request.urlopen(request, timeout=5).read()
total = int(isl) * int(n) - (int(isl) == 999)
result = {"num_prompts": int(n), "completed": int(n), "failed": 0,
          "total_input_tokens": total, "output_throughput": 100.0,
          "mean_ttft_ms": 10.0, "mean_tpot_ms": 1.0}
with open(f"{result_dir}/{result_file}", "w") as f:
    json.dump(result, f)
"""


def _stand_in_matrix(tmp_path: Path, port: int, variants: str | None = None) -> Path:
    bench = tmp_path / "bench.py"
    bench.write_text(STAND_IN_BENCH)
    placeholders = ["{result_dir}", "{result_file}", "{isl}", "{num_prompts}", "{port}"]
    return serving.write_matrix(
        tmp_path,
        port,
        [sys.executable, str(bench), *placeholders],
        "[{isl = 128, osl = 8, concurrency = [1, 2], num_prompts = {per_c = 2}}, "
        "{isl = 999, osl = 8, concurrency = [1], num_prompts = {per_c = 2}}]",
        variants or '[{name = "steady"}, {name = "dies", env = {DIE_AFTER = "2"}}]',
    )


def test_a_run_keeps_every_result_and_reports_what_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "POLL_S", 0.05)
    port = serving.free_port()
    experiment = load_experiment("0001", _stand_in_matrix(tmp_path, port))
    out = tmp_path / "out"
    outcomes = runner.run_experiment(experiment, out)
    by_run = {(o.variant, o.run): o.problems for o in outcomes}
    assert by_run[("steady", "server")] == []
    assert by_run[("steady", "isl128-osl8-c1")] == []
    assert by_run[("steady", "isl128-osl8-c2")] == []
    assert "a cached prefix" in by_run[("steady", "isl999-osl8-c1")][0]
    # The second variant's server dies during its second point: reported,
    # the run goes no further with it, and nothing is left running.
    assert by_run[("dies", "isl128-osl8-c2")][-1] == "the server died during this run"
    assert ("dies", "isl999-osl8-c1") not in by_run
    assert serving.port_is_free(port)
    assert (out / "steady" / "server.log").read_text().startswith("engine config")
    assert (
        json.loads((out / "steady" / "isl128-osl8-c2.json").read_text())[
            "total_input_tokens"
        ]
        == 4 * 128
    )
    assert len(json.loads((out / "summary.json").read_text())) == len(outcomes)


def test_each_evals_output_is_kept_and_run_evals_score_reported(tmp_path, monkeypatch):
    """An eval's output goes to eval-<i>-<task>.log (run_eval writes no file
    the kit can name), and the report reads GPQA's score from it."""
    from scripts.validate.report import accuracy

    monkeypatch.setattr(runner, "POLL_S", 0.05)
    port = serving.free_port()
    stand_in = "print('Total latency: 1.000 s'); print('Score: 0.612')"
    bench = tmp_path / "bench.py"
    bench.write_text(STAND_IN_BENCH)
    placeholders = ["{result_dir}", "{result_file}", "{isl}", "{num_prompts}", "{port}"]
    matrix = serving.write_matrix(
        tmp_path,
        port,
        [sys.executable, str(bench), *placeholders],
        "[{isl = 128, osl = 8, concurrency = [1], num_prompts = {per_c = 2}}]",
        '[{name = "only"}]',
        [[sys.executable, "-c", stand_in, "--eval-name", "gpqa", "--port", "{port}"]],
    )
    outcomes = runner.run_experiment(load_experiment("0001", matrix), tmp_path / "out")
    (evaluated,) = [o for o in outcomes if o.run == "eval 0"]
    assert (evaluated.file, evaluated.problems) == ("eval-0-gpqa.log", [])
    log = tmp_path / "out" / "only" / "eval-0-gpqa.log"
    assert log.read_text() == "Total latency: 1.000 s\nScore: 0.612\n"
    assert accuracy(tmp_path / "out" / "only") == {"gpqa score": 0.612}


def test_ctrl_c_stops_the_server_and_keeps_the_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "POLL_S", 0.05)
    port = serving.free_port()
    experiment = load_experiment("0001", _stand_in_matrix(tmp_path, port))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.subprocess, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run_experiment(experiment, tmp_path / "out")
    assert serving.port_is_free(port)
    assert (tmp_path / "out" / "summary.json").exists()


def test_a_server_started_from_a_background_job_stops_on_sigint(tmp_path, monkeypatch):
    """Started from a background job (``&``, nohup), the kit inherits SIGINT
    ignored; the server it starts must not, or stopping it waits out
    SIGINT's minute and then kills it."""
    monkeypatch.setattr(runner, "POLL_S", 0.05)
    monkeypatch.setattr(
        runner, "STOP_SIGNALS", ((signal.SIGINT, 10), (signal.SIGKILL, 10))
    )
    port = serving.free_port()
    command = [sys.executable, "-c", serving.SERVER, str(port)]
    server = runner.Server(command, {}, port, tmp_path / "server.log")
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with server:
            pass
    finally:
        signal.signal(signal.SIGINT, ignored)
    # The stand-in ends on KeyboardInterrupt with status 0; SIGKILL is -9.
    assert server.process is not None
    assert server.process.returncode == 0
    assert serving.port_is_free(port)


def _outcome(variant: str, isl: int, conc: int, tput: float, problems=()) -> dict:
    return {
        "variant": variant,
        "run": f"isl{isl}-osl1024-c{conc}",
        "file": None,
        "problems": list(problems),
        "isl": isl,
        "conc": conc,
        "result": {
            "output_throughput": tput,
            "mean_ttft_ms": 100.0,
            "mean_tpot_ms": 10.0,
        },
    }


def test_the_report_sets_each_variant_against_its_baseline_and_the_pr(tmp_path):
    from scripts.validate.report import pr_figures, write_report

    quoted = pr_figures("0001")
    assert len(quoted) == 72  # 2 configurations x 12 points x 3 metrics, as in the PR
    assert quoted[("cp-indexer", 51200, "output_throughput", 4)] == (
        178.7,
        181.3,
        "+1.51%",
    )
    summary = [
        _outcome("baseline", 51200, 4, 200.0),
        _outcome("cp-indexer", 51200, 4, 204.0),
        _outcome("stripe-1024", 51200, 4, 999.0, ["1 failed"]),  # left out
    ]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    # What vLLM logs and lm_eval writes, per variant.
    for name, score in (("baseline", 0.9682), ("cp-indexer", 0.9719)):
        results = tmp_path / name / "gsm8k" / "model" / "results_1.json"
        results.parent.mkdir(parents=True)
        results.write_text(
            json.dumps(
                {
                    "results": {
                        "gsm8k": {
                            "exact_match,strict-match": score,
                            "exact_match_stderr,strict-match": 0.005,
                        }
                    }
                }
            )
        )
        (tmp_path / name / "server.log").write_text(
            "INFO GPU KV cache size: 1,000,000 tokens, Maximum concurrency ...\n"
        )
    variants = ["baseline", "cp-indexer", "stripe-1024"]
    report = write_report("0001", tmp_path, variants, "python -m scripts.validate")
    text = report.read_text()
    assert "| 4 | 200.0 | 204.0 | +2.00% | 178.7 | 181.3 | +1.51% | - | - |" in text
    assert "1 run(s) failed a check and are left out" in text
    assert (tmp_path / "report_isl51200.png").stat().st_size > 0
    assert "| KV cache (tokens) | 1,000,000 | 1,000,000 | - |" in text
    assert "| gsm8k exact_match,strict-match | 0.9682 | 0.9719 | - |" in text
    assert "stderr" not in text
    # stage 0003's PR has no tables: measured columns only
    report = write_report("0003", tmp_path, ["fp8", "mxfp4"], "python -m ...")
    assert "PR " not in report.read_text().split("## ISL")[1]


def test_a_missing_program_is_reported_not_a_traceback(tmp_path, monkeypatch):
    """vllm (or lm_eval) not installed where the kit runs: one clear line."""
    monkeypatch.setattr(runner, "POLL_S", 0.05)
    matrix = _stand_in_matrix(tmp_path, serving.free_port(), '[{name = "only"}]')
    experiment = load_experiment("0001", matrix)
    experiment = replace(experiment, serve=("no-such-vllm", "serve"))
    (outcome,) = runner.run_experiment(experiment, tmp_path / "out")
    missing = (
        "is not installed here (not on PATH): install the patched "
        "vLLM and the eval tools in this environment (README, 'On an MI355X')"
    )
    assert (outcome.run, outcome.problems) == ("server", [f"no-such-vllm {missing}"])
    no_client = replace(load_experiment("0001", matrix), bench=("no-such-bench",))
    outcomes = runner.run_experiment(no_client, tmp_path / "out2")
    assert outcomes[1].problems[0] == f"no-such-bench {missing}"


def test_a_report_of_a_folder_without_a_run_is_one_line(tmp_path, capsys):
    from scripts.validate.__main__ import main

    assert main(["--stage", "0001", "--report", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("error: No such file or directory (") and "summary.json" in err
    )


def test_each_variant_serves_the_code_it_names_and_the_box_is_put_back(
    tmp_path, monkeypatch, installed_vllm
):
    """The seeds' baseline ran on code without the stage: the kit installs
    each variant's code (the series tool's install) before its server starts,
    records it, and leaves the box's vLLM as it found it."""
    monkeypatch.setattr(runner, "POLL_S", 0.05)
    site, port = installed_vllm, serving.free_port()
    series = load_series(SERIES_FILE)
    probe = site / "vllm" / "v1" / "attention" / "ops" / "rocm_cp_indexer.py"
    env = f'env = {{ SERVED_FILE = "{probe}" }}'
    variants = (
        f'[{{name = "baseline", install = "base", {env}}}, '
        f'{{name = "split", install = "0001", {env}}}]'
    )
    experiment = load_experiment("0001", _stand_in_matrix(tmp_path, port, variants))
    install(site, stage_files(series, "0003"))  # what the box held before
    out = tmp_path / "out"
    outcomes = runner.run_experiment(experiment, out, site)
    assert {o.run for o in outcomes if o.problems} == {"isl999-osl8-c1"}
    assert f"served {probe}: absent" in (out / "baseline" / "server.log").read_text()
    tree_file = stage_tree(series, "0001") / probe.relative_to(site)
    digest = hashlib.sha256(tree_file.read_bytes()).hexdigest()
    assert f"served {probe}: {digest}" in (out / "split" / "server.log").read_text()
    served = json.loads((out / "split" / "served_code.json").read_text())
    assert served["stage"] == "0001" and served["record"]["stage"] == "0001"
    baseline = json.loads((out / "baseline" / "served_code.json").read_text())
    assert baseline["record"] is None  # vLLM as shipped
    assert installed_record(site)["stage"] == "0003"
    # An install that cannot be done: the variant is not served at all.
    with (site / "vllm" / "envs.py").open("a") as handle:
        handle.write("# a user's edit\n")
    outcomes = runner.run_experiment(experiment, tmp_path / "again", site)
    assert [(o.variant, o.run) for o in outcomes] == [
        ("baseline", "install"),
        ("split", "install"),
    ]
    assert "changed since the series was installed" in outcomes[0].problems[0]
    assert not (tmp_path / "again" / "baseline" / "server.log").exists()
