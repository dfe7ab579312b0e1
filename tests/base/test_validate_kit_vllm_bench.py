# SPDX-License-Identifier: Apache-2.0
"""The validation kit over result files made by vLLM's own benchmark code:
`vllm bench serve` from the applied tree (vllm/benchmarks/serve.py) runs
against the stand-in OpenAI server (scripts/harness/serving.py) and writes
the results the kit checks and reports, in exactly the format it writes on
an MI355X."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from scripts.harness import serving
from scripts.harness.tree import applied_tree
from scripts.validate import runner
from scripts.validate.matrix import load_experiment
from scripts.validate.report import write_report

TREE = applied_tree("base")
# The kit does not depend on the stages: once, on the base tree, is enough.
pytestmark = pytest.mark.skipif(
    TREE.stage != "base", reason="the validation kit runs on the base tree only"
)
ROOT = Path(__file__).resolve().parents[2]

# vLLM's own `vllm bench serve` (its argument parser and main) from the tree.
BENCH = """
import argparse, sys
from scripts.harness import compiled_stub
compiled_stub.install()
from vllm.benchmarks.serve import add_cli_args, main
result_dir, result_file, isl, n, conc, port, tokenizer = sys.argv[1:]
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args([
    "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
    "--endpoint", "/v1/completions", "--model", "stand-in", "--tokenizer", tokenizer,
    "--dataset-name", "random", "--random-input-len", isl, "--random-output-len", "4",
    "--num-prompts", n, "--max-concurrency", conc, "--num-warmups", "0",
    "--ignore-eos", "--save-result", "--result-dir", result_dir,
    "--result-filename", result_file,
]))
"""


def _tokenizer(folder: Path) -> Path:
    """One word, one token: a 2,000-word vocabulary, whitespace-split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(2000)} | {"[UNK]": 2000}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]"
    ).save_pretrained(folder)
    return folder


def test_vllm_bench_results_are_checked_and_reported(tmp_path, monkeypatch):
    """The stand-in server (scripts/harness/serving.py) answers vLLM's own
    client; TRUNCATE makes it report fewer prompt tokens than it was sent."""
    monkeypatch.setattr(runner, "POLL_S", 0.05)
    monkeypatch.setenv("PYTHONPATH", f"{TREE.path}:{ROOT}")
    bench = tmp_path / "bench.py"
    bench.write_text(BENCH)
    tokenizer = _tokenizer(tmp_path / "tokenizer")
    placeholders = ["{result_dir}", "{result_file}", "{isl}", "{num_prompts}"]
    matrix = serving.write_matrix(
        tmp_path,
        serving.free_port(),
        [
            sys.executable,
            str(bench),
            *placeholders,
            "{conc}",
            "{port}",
            str(tokenizer),
        ],
        "[{isl = 32, osl = 4, concurrency = [2], num_prompts = {per_c = 2}}]",
        '[{name = "baseline"}, {name = "truncating", env = {TRUNCATE = "1"}}]',
    )
    out = tmp_path / "out"
    outcomes = runner.run_experiment(load_experiment("0001", matrix), out)
    problems = {(o.variant, o.run): o.problems for o in outcomes}
    assert problems[("baseline", "isl32-osl4-c2")] == []
    result = json.loads((out / "baseline" / "isl32-osl4-c2.json").read_text())
    assert (result["completed"], result["total_input_tokens"]) == (4, 4 * 32)
    assert (
        "total_input_tokens 124 != num_prompts * ISL = 128"
        in (problems[("truncating", "isl32-osl4-c2")][0])
    )
    report = write_report("0001", out, ["baseline", "truncating"], "test").read_text()
    assert "| 2 | " in report.split("## ISL 32: Output throughput (tok/s)")[1]
