# SPDX-License-Identifier: Apache-2.0
"""The gfx950/gfx942 compile matrix: the Triton kernels the stages add,
change or route new shapes into, compiled for the AMD targets from the
specialisations vLLM's own call sites give them (scripts/harness/
gfx_compile.py).

These tests run in their own pytest process per stage tree, without
TRITON_INTERPRET (the tool's ``test`` sets that up): a kernel decorated under
the interpreter is never compiled. Each variant compiles once per process;
Triton's on-disk cache keeps the binaries between runs. At the end, one line
per kernel and target says how many variants compiled and how many failed,
also written as JSON to ``$DSA_COMPILE_SUMMARY`` for the run's summary.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from scripts.harness import gfx_compile
from scripts.series.contract import COMPILE_SUMMARY_ENV


@dataclass
class CompileMatrix:
    """Every variant compiled in this process, with its result."""

    results: dict[tuple[str, gfx_compile.Variant], str | None] = field(
        default_factory=dict
    )
    labels: dict[tuple[str, gfx_compile.Variant], list[str]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def compile(self, arch: str, recorder: gfx_compile.Recorder) -> list[str]:
        """Compile what ``recorder`` saw for ``arch``; one message per
        failing variant: the kernel, the layer kinds that reach it and the
        compiler's own message."""
        failures = []
        for variant, labels in recorder.variants.items():
            key = (arch, variant)
            if key not in self.results:
                self.results[key] = gfx_compile.compile_variant(variant, arch)
            self.labels[key] += [
                label for label in labels if label not in self.labels[key]
            ]
            if (error := self.results[key]) is not None:
                where = "; ".join(labels[:3])
                if len(labels) > 3:
                    where += f" (and {len(labels) - 3} more layer kinds)"
                failures.append(
                    f"{variant.name} does not compile for {arch} in {where} "
                    f"({variant.describe()}):\n{error}"
                )
        return failures

    def per_kernel(self) -> list[dict]:
        rows: dict[tuple[str, str], dict] = {}
        for (arch, variant), error in self.results.items():
            row = rows.setdefault(
                (variant.name, arch),
                {"kernel": variant.name, "target": arch, "compiled": 0, "failed": 0},
            )
            row["compiled" if error is None else "failed"] += 1
        return [rows[key] for key in sorted(rows)]


_MATRIX = CompileMatrix()


@pytest.fixture(scope="session")
def compile_matrix() -> CompileMatrix:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip(
            "the compile matrix needs Triton's compiler: run it without "
            "TRITON_INTERPRET (python -m scripts.series test does)"
        )
    return _MATRIX


def pytest_terminal_summary(terminalreporter) -> None:
    rows = _MATRIX.per_kernel()
    if not rows:
        return
    terminalreporter.section("compiled for AMD targets")
    for row in rows:
        terminalreporter.write_line(
            f"{row['target']} {row['kernel']}: {row['compiled']} variants "
            f"compiled, {row['failed']} failed"
        )
    if path := os.environ.get(COMPILE_SUMMARY_ENV):
        Path(path).write_text(json.dumps(rows, indent=1) + "\n")
