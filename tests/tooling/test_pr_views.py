# SPDX-License-Identifier: Apache-2.0
"""The export's maintainer check runs each PR's tests as each CI machine
would: on a CPU, and under vLLM's ROCm platform emulated as MI300 (gfx942)
and MI355 (gfx950), each with VLLM_ROCM_USE_AITER=1 and =0
(scripts/series/export/pr_views.py, scripts/harness/rocm_view_plugin.py).

The synthetic PR brings what the plugin needs of vLLM (a platform object,
``vllm/platforms/rocm.py`` reading the arch from AMD SMI, ``vllm/_aiter_ops.py``
finding AITER) and a rule with the shape of stage 0003's MXFP4 startup check;
its test is the one issue 45 found, before and after its fix."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest

from scripts.series import SeriesError
from scripts.series.export.export import export_stages
from scripts.series.export.pr_check import check_prs
from scripts.series.export.pr_views import AMD_CI, CPU, run_view, verdict
from scripts.series.git import Identity
from scripts.series.stages.apply import apply
from scripts.series.testing.results import Tally
from tests.tooling.conftest import Project

EXPORTER = Identity("Eve Exporter", "eve@example.org", "")

VLLM_FILES = {
    "vllm/platforms/__init__.py": (
        "class Platform:\n"
        "    def is_rocm(self):\n        return False\n\n"
        "    def fp8_dtype(self):\n        return 'e4m3'\n\n"
        "    def is_fp8_fnuz(self):\n        return False\n\n\n"
        "current_platform = Platform()\n"
    ),
    # As vllm/platforms/rocm.py: the arch from AMD SMI, read at import.
    "vllm/platforms/rocm.py": (
        "import amdsmi\n\n"
        "amdsmi.amdsmi_init()\n"
        "_GPU = amdsmi.amdsmi_get_processor_handles()[0]\n"
        "_ARCH = amdsmi.amdsmi_get_gpu_asic_info(_GPU)['target_graphics_version']\n\n\n"
        "def on_gfx950():\n    return _ARCH == 'gfx950'\n\n\n"
        "def get_cdna_version():\n    return {'gfx942': 3, 'gfx950': 4}[_ARCH]\n\n\n"
        "class RocmPlatform:\n"
        "    @classmethod\n    def is_fp8_fnuz(cls):\n"
        "        return 'gfx94' in _ARCH\n\n"
        "    @classmethod\n    def fp8_dtype(cls):\n"
        "        return 'e4m3fnuz' if cls.is_fp8_fnuz() else 'e4m3'\n"
    ),
    "vllm/_aiter_ops.py": (
        "import os\nfrom importlib.util import find_spec\n\n"
        "IS_AITER_FOUND = find_spec('aiter') is not None\n\n\n"
        "class rocm_aiter_ops:\n"
        "    _ON = os.environ.get('VLLM_ROCM_USE_AITER') == '1'\n\n"
        "    @classmethod\n    def refresh_env_variables(cls):\n"
        "        cls._ON = os.environ.get('VLLM_ROCM_USE_AITER') == '1'\n\n"
        "    @classmethod\n    def is_enabled(cls):\n"
        "        return cls._ON and IS_AITER_FOUND\n"
    ),
    # The shape of dsa_indexer_uses_fp4 (stage 0003).
    "vllm/mxfp4.py": (
        "from vllm._aiter_ops import rocm_aiter_ops\n"
        "from vllm.platforms import current_platform\n\n\n"
        "def indexer_uses_fp4():\n"
        "    if current_platform.is_rocm():\n"
        "        from vllm.platforms.rocm import get_cdna_version\n\n"
        "        if get_cdna_version() != 4:\n"
        "            raise ValueError('requires CDNA4')\n"
        "        if not rocm_aiter_ops.is_enabled():\n"
        "            raise ValueError('enable aiter with VLLM_ROCM_USE_AITER=1')\n"
        "        return True\n"
        "    raise ValueError('requires Blackwell')\n"
    ),
}

TEST_HEAD = (
    "import pytest\n\n"
    "from vllm.mxfp4 import indexer_uses_fp4\n"
    "from vllm.platforms import current_platform\n\n\n"
    "@pytest.mark.skipif(not current_platform.is_rocm(), reason='ROCm-only')\n"
    "def test_on_rocm():\n"
    "    from vllm._aiter_ops import rocm_aiter_ops\n"
    "    from vllm.platforms.rocm import get_cdna_version\n\n"
    "    if get_cdna_version() == 4 and rocm_aiter_ops.is_enabled():\n"
    "        assert indexer_uses_fp4()\n"
    "    else:\n"
    "        with pytest.raises(ValueError, match='CDNA4|enable aiter'):\n"
    "            indexer_uses_fp4()\n\n\n"
)
# Issue 45's test as it was: it never leaves the platform it runs on.
BROKEN = (
    "def test_off_rocm_the_rules_are_unchanged():\n"
    "    with pytest.raises(ValueError, match='Blackwell'):\n"
    "        indexer_uses_fp4()\n"
)
# ...and as fixed: a platform that is not ROCm.
FIXED = (
    "def test_off_rocm_the_rules_are_unchanged(monkeypatch):\n"
    "    monkeypatch.setattr(current_platform, 'is_rocm', lambda: False)\n"
    "    with pytest.raises(ValueError, match='Blackwell'):\n"
    "        indexer_uses_fp4()\n"
)


def _export(project: Project, test: str):
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nMXFP4 = True\n")},
        {**VLLM_FILES, "tests/v1/test_mxfp4.py": TEST_HEAD + test},
        title="[ROCm] MXFP4 rule",
    )
    apply(project.series())
    return export_stages(project.series(), EXPORTER)


def test_the_fixed_test_passes_or_skips_with_a_reason_in_every_view(
    project: Project,
):
    (pr,) = _export(project, FIXED)
    check_prs(project.series(), [pr], sys.executable)
    review = pr.review.read_text()
    rows = [line for line in review.splitlines() if "its tests" in line]
    assert len(rows) == 5, review
    assert rows[0].startswith(
        "| its tests with plain pytest on a CPU (tests/v1/test_mxfp4.py) | ok | "
        "1 passed, 0 failed, 1 skipped (1x ROCm-only)"
    )
    for view, row in zip(AMD_CI, rows[1:], strict=True):
        assert row.startswith(
            f"| its tests as {view.label} runs them, emulated on a CPU "
            "(tests/v1/test_mxfp4.py) | ok | 2 passed, 0 failed, 0 skipped"
        ), row


def test_reverting_the_fix_fails_the_export_under_every_amd_view(
    project: Project,
):
    """Issue 45: on a CPU box the test passes; on MI300 it meets "requires
    CDNA4", on MI355 without AITER "enable aiter", on MI355 with AITER no
    error at all."""
    (pr,) = _export(project, BROKEN)
    with pytest.raises(SeriesError) as failed:
        check_prs(project.series(), [pr], sys.executable)
    message = str(failed.value)
    assert "plain pytest on a CPU" not in message
    for view in AMD_CI:
        assert f"its tests as {view.label} runs them" in message
    assert "1 passed, 1 failed" in message
    review = pr.review.read_text()
    assert "| its tests with plain pytest on a CPU (tests/v1/test_mxfp4.py) | ok |" in (
        review
    )
    mi355 = next(
        line
        for line in review.splitlines()
        if "MI355 (gfx950), VLLM_ROCM_USE_AITER=1" in line
    )
    assert "| FAILED |" in mi355 and "DID NOT RAISE" in mi355, mi355


def test_a_skip_without_a_reason_fails_a_view():
    tally = Tally(passed=1, skipped=1, skip_reasons=Counter({"no reason given": 1}))
    ok, detail = verdict(AMD_CI[0], tally)
    assert not ok and "1 skipped without a reason" in detail
    # Everything skipped, each with its reason, passes on an AMD view...
    tally = Tally(skipped=2, skip_reasons=Counter({"needs 2 GPUs": 2}))
    assert verdict(AMD_CI[0], tally)[0]
    # ...but on the CPU box the PR's tests must run somewhere.
    assert not verdict(CPU, tally)[0]
    assert verdict(AMD_CI[0], Tally()) == (
        False,
        "0 passed, 0 failed, 0 skipped; no test ran",
    )


# What a test sees of the machine: the platform, the arch vLLM's ROCm module
# read from AMD SMI, and whether AITER is on.
PROBE = (
    "import json\nimport os\n\n\n"
    "def test_probe():\n"
    "    from vllm._aiter_ops import rocm_aiter_ops\n"
    "    from vllm.platforms import current_platform\n"
    "    from vllm.platforms.rocm import _ARCH\n\n"
    "    seen = {'rocm': current_platform.is_rocm(), 'arch': _ARCH,\n"
    "            'aiter': rocm_aiter_ops.is_enabled()}\n"
    "    with open(os.environ['DSA_VIEW_PROBE'], 'w') as out:\n"
    "        json.dump(seen, out)\n"
)


@pytest.mark.parametrize("view", AMD_CI, ids=lambda view: view.key)
def test_each_amd_view_is_the_machine_it_names(project: Project, tmp_path, view):
    """Each AMD view's tests see the chip and the AITER setting of the CI
    machine it stands for (MI300: gfx942, MI355: gfx950; "-aiter": on), as
    its label says; read from the machine names, not from the views."""
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nPROBE = True\n")},
        {**VLLM_FILES, "tests/v1/test_probe.py": PROBE},
    )
    tree = apply(project.series())
    chip = {"mi300": "gfx942", "mi355": "gfx950"}[view.key.split("-")[0]]
    aiter = view.key.endswith("-aiter")
    machine = {"gfx942": "MI300", "gfx950": "MI355"}[chip]
    assert view.label == f"{machine} ({chip}), VLLM_ROCM_USE_AITER={int(aiter)}"
    seen, log = tmp_path / "seen.json", tmp_path / "view.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSA_VIEW_PROBE", str(seen))
        tally = run_view(
            view,
            sys.executable,
            tree,
            ["tests/v1/test_probe.py"],
            tmp_path / "junit.xml",
            log,
        )
    assert tally.passed == 1, log.read_text()
    assert json.loads(seen.read_text()) == {"rocm": True, "arch": chip, "aiter": aiter}
