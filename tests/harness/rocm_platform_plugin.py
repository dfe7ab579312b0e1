# SPDX-License-Identifier: Apache-2.0
"""pytest plugin for vLLM's own ROCm-gated planning tests (pure Python).

They skip at import unless ``current_platform.is_rocm()`` and
``is_aiter_found_and_supported()`` are true; nothing they run needs ROCm.
Loaded with ``-p harness.rocm_platform_plugin`` for those files only.
"""


def pytest_configure(config):
    import vllm._aiter_ops as aiter_ops
    from vllm.platforms import current_platform

    current_platform.is_rocm = lambda: True
    aiter_ops.is_aiter_found_and_supported = lambda: True
