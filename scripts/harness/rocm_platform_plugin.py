# SPDX-License-Identifier: Apache-2.0
"""pytest plugin for vLLM's own ROCm-gated planning tests (pure Python).

They skip at import unless ``current_platform.is_rocm()`` and
``is_aiter_found_and_supported()`` are true; nothing they run needs ROCm.
The two checks answer true only while one of this plugin's files is
collected or one of its tests runs, so vLLM's other tests in the same run
keep the CPU platform. The files are listed under this module's name in the
JSON of ``DSA_PLUGIN_FILES`` (the series tool sets it from series.toml). A
listed file that still skips as a whole is reported as a failure: the shim
did not take, and its tests would silently stop running.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_FILES = {
    Path(path).resolve()
    for path in json.loads(os.environ.get("DSA_PLUGIN_FILES", "{}")).get(__name__, [])
}


@contextmanager
def _rocm_checks(path: Path) -> Iterator[None]:
    if Path(path).resolve() not in _FILES:
        yield
        return
    import vllm._aiter_ops as aiter_ops
    from vllm.platforms import current_platform

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
        monkeypatch.setattr(aiter_ops, "is_aiter_found_and_supported", lambda: True)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    with _rocm_checks(collector.path):
        report = yield
    if (
        isinstance(collector, pytest.Module)
        and Path(collector.path).resolve() in _FILES
        and report.skipped
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.path}: skipped although the ROCm shim covers it "
            f"({report.longrepr}); the shim no longer makes it run"
        )
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _rocm_checks(item.path):
        return (yield)
