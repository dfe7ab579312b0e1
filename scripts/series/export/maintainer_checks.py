# SPDX-License-Identifier: Apache-2.0
"""Two checks of a maintainer's first pass that vLLM has no hook for, run in
the hooks' virtualenv (``vllm_precommit``) on a PR applied to its target:

- **Buildkite wiring**: which steps run each test file the PR touches (parsed
  with the target's own ``tools/pre_commit/check_test_tethering.py``), and
  whether each such step's ``source_file_dependencies`` cover the PR's
  source files, so that editing them runs the test.
- **Layering**: module-level imports the PR adds to platform-neutral files
  (no ``rocm``/``amd``/``aiter`` in their path) of ROCm-only modules, and
  module-level imports of ``vllm.v1``/``vllm.model_executor`` it adds to
  ``vllm/config/``; imports inside functions or ``if TYPE_CHECKING:`` are
  lazy and fine.

``python3 -m scripts.series.export.maintainer_checks TREE BASE_REV FILE...`` prints
``[{"check", "ok", "detail"}]`` as JSON.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROCM_ONLY = re.compile(r"(^|[._/])(rocm\w*|amd|aiter\w*)($|[._/])")


def _tethering(tree: Path):
    path = tree / "tools" / "pre_commit" / "check_test_tethering.py"
    spec = importlib.util.spec_from_file_location("check_test_tethering", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wiring(tree: Path, files: list[str]) -> list[dict]:
    import yaml

    tests = [f for f in files if f.startswith("tests/") and f.endswith(".py")]
    if not tests:
        return []
    tether = _tethering(tree)
    sources = [f for f in files if f.startswith("vllm/")]
    steps = []
    for pipeline in tether._pipeline_yaml_paths():
        doc = yaml.safe_load(pipeline.read_text()) or {}
        for step in tether._iter_job_steps(doc):
            commands = list(step.get("commands") or [])
            if step.get("command"):
                commands.append(step["command"])
            selections = [
                s
                for c in commands
                if isinstance(c, str)
                for s in tether._parse_command(c)
            ]
            where = f"{pipeline.relative_to(tree)}: {step.get('label', '?')}"
            steps.append((where, selections, step.get("source_file_dependencies")))
    results = []
    for test in tests:
        name = tether.normalize_test_path(test)
        running = [
            (w, deps) for w, sel, deps in steps if any(s.runs(name) for s in sel)
        ]
        if not running:
            results.append(
                {
                    "check": f"Buildkite runs {test}",
                    "ok": False,
                    "detail": "no step runs it",
                }
            )
            continue
        # Each source file of the PR must start some step that runs the test
        # (a step without the list runs on every change).
        uncovered = [
            f
            for f in sources
            if not any(deps is None or f.startswith(tuple(deps)) for _, deps in running)
        ]
        detail = (
            "run by "
            + "; ".join(w for w, _ in running)
            + (
                f". No step that runs it starts on a change to {', '.join(uncovered)}"
                if uncovered
                else ". A change to any of the PR's source files starts one of them"
            )
        )
        results.append(
            {"check": f"Buildkite runs {test}", "ok": not uncovered, "detail": detail}
        )
    return results


def _module_level_imports(source: str, path: str) -> set[str]:
    """Modules imported when the file is imported (not in functions, classes'
    methods, or ``if TYPE_CHECKING:``)."""
    package = path.removesuffix(".py").replace("/", ".").rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(
                        parts[: len(parts) - node.level + 1] + [base]
                    ).strip(".")
                found.update(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.ClassDef):
                visit(node.body)

    visit(ast.parse(source).body)
    return found


def layering(tree: Path, base_rev: str, files: list[str]) -> list[dict]:
    results = []
    for path in files:
        if not (path.startswith("vllm/") and path.endswith(".py")):
            continue
        if ROCM_ONLY.search(path.removeprefix("vllm/")):
            continue  # a ROCm file may import ROCm modules
        new = _module_level_imports((tree / path).read_text(), path)
        old_source = subprocess.run(
            ["git", "show", f"{base_rev}:{path}"],
            cwd=tree,
            capture_output=True,
            text=True,
        ).stdout
        added = new - _module_level_imports(old_source, path) if old_source else new
        bad = sorted(m for m in added if ROCM_ONLY.search(m.removeprefix("vllm.")))
        if path.startswith("vllm/config/"):
            bad += sorted(
                m for m in added if m.startswith(("vllm.v1.", "vllm.model_executor."))
            )
        if bad:
            results.append(
                {
                    "check": f"imports of {path}",
                    "ok": False,
                    "detail": "adds module-level imports of " + ", ".join(bad),
                }
            )
    if not results:
        results.append(
            {
                "check": "imports of the platform-neutral files",
                "ok": True,
                "detail": "no module-level import of a ROCm-only module added "
                "(nor of vllm.v1 in vllm/config/)",
            }
        )
    return results


if __name__ == "__main__":
    tree_arg, base, *names = sys.argv[1:]
    tree = Path(tree_arg)
    print(json.dumps(wiring(tree, names) + layering(tree, base, names)))
