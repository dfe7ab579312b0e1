# SPDX-License-Identifier: Apache-2.0
"""vLLM's startup path on an emulated gfx950 box, in a fresh interpreter.

``python -m scripts.harness.rocm_startup`` reads scenarios (JSON on stdin) and prints
one result each (JSON on stdout). The modules startup uses are imported
on the CPU platform first (on ROCm, ``vllm._custom_ops`` registers fakes for
the compiled ops at import, and there is no compiled ``vllm._C`` here); then
the platform object becomes vLLM's own ``RocmPlatform``
(``vllm/platforms/rocm.py`` with the AMD SMI stand-in) with AITER's
stand-in, through ``rocm_platform.emulate_rocm``. A fresh process makes the
import order the same on every run, whatever tests ran before.

Each scenario is what ``vllm serve`` takes: EngineArgs -> create_engine_config
-> model construction (as the model loader does it: default dtype set, no
weights) -> ``update_block_size_for_backend`` -> each layer's KV-cache spec.
What this machine lacks is replaced: tensors are created on the CPU, and the
compiled ops layers look up (``torch.ops._C``) fail only if called.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest.mock import patch

from scripts.harness import compiled_stub
from scripts.harness.indexer_batch import ensure_workspace
from scripts.harness.multiproc import free_port
from scripts.harness.rocm_platform import emulate_rocm

ARCH = "gfx950"


class _UncompiledOp:
    """A compiled op this machine lacks; fails when called. Its overloads
    (``.default``) are itself, as modules resolve them at import."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, overload: str) -> _UncompiledOp:
        return self

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"torch.ops._C.{self.name} is not compiled here")


class _UncompiledOps:
    """``torch.ops._C`` with a placeholder for each op that is not compiled."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name: str):
        try:
            return getattr(self._ops, name)
        except AttributeError:
            return _UncompiledOp(name)


def _start_as_rocm(stack: ExitStack) -> None:
    import torch

    import vllm.engine.arg_utils  # noqa: F401
    import vllm.model_executor.model_loader.utils  # noqa: F401
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform

    stack.enter_context(emulate_rocm(ARCH))
    rocm = sys.modules["vllm.platforms.rocm"]
    # Every module holds the one platform object: give it the ROCm class.
    current_platform.__class__ = rocm.RocmPlatform
    torch.ops._C = _UncompiledOps(torch.ops._C)
    # vLLM inspects a model class in a fresh interpreter (to keep CUDA out of
    # the engine's process) unless its on-disk cache has it: ~15 s per
    # architecture there, to import vLLM again, on every cold cache (CI's).
    # There is no GPU to keep out here, so the same inspection runs in this
    # process.
    stack.enter_context(
        patch.object(registry, "_run_in_subprocess", lambda inspect: inspect())
    )


def _run(scenario: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One startup; the stage it stopped at and why, or what it chose."""
    import torch

    import vllm._aiter_ops as aiter_ops
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.mla import rocm_dsa_mxfp4_config

    aiter_ops.IS_AITER_FOUND = scenario.get("aiter_installed", True)
    os.environ["VLLM_ROCM_USE_AITER"] = scenario.get("use_aiter", "1")
    aiter_ops.rocm_aiter_ops.refresh_env_variables()
    model = workdir / scenario["name"]
    model.mkdir()
    (model / "config.json").write_text(json.dumps(scenario["hf_config"]))
    stage = "config"
    try:
        config = EngineArgs(
            model=str(model),
            skip_tokenizer_init=True,
            load_format="dummy",
            max_model_len=1024,
            attention_config=scenario["attention_config"],
            **scenario.get("engine_args", {}),
        ).create_engine_config()
        stage = "model"
        # No GPU here: the model's tensors go to the CPU.
        config.device_config.device = torch.device("cpu")
        current_platform.device_type = "cpu"
        ensure_workspace(torch.device("cpu"))
        # Count the MXFP4 startup checks model construction runs, and keep
        # what the MXFP4 cache module logs at INFO.
        checks = patch.object(
            rocm_dsa_mxfp4_config,
            "check_dsa_mxfp4_indexer_config",
            wraps=rocm_dsa_mxfp4_config.check_dsa_mxfp4_indexer_config,
        )
        with (
            set_current_vllm_config(config),
            checks as counted,
            _kept_log(MXFP4_CACHE_LOGGER) as logged,
        ):
            parallel_state.init_distributed_environment(
                1, 0, f"tcp://127.0.0.1:{free_port()}", 0, backend="gloo"
            )
            try:
                parallel_state.initialize_model_parallel(1)
                with set_default_torch_dtype(config.model_config.dtype):
                    initialize_model(vllm_config=config)
            finally:
                parallel_state.destroy_model_parallel()
                parallel_state.destroy_distributed_environment()
        current_platform.update_block_size_for_backend(config)
        layers = {
            name: [
                layer.get_attn_backend().get_name(),
                layer.get_kv_cache_spec(config).page_size_bytes,
            ]
            for name, layer in config.compilation_config.static_forward_context.items()
        }
    except Exception as exc:  # the result to compare, not a failure here
        return {
            "stopped_at": stage,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    finally:
        vars(current_platform).pop("device_type", None)
    return {
        "block_size": config.cache_config.block_size,
        "layers": layers,
        "mxfp4_checks": counted.call_count,
        "mxfp4_log": logged,
    }


# The module that says, once, that the MXFP4 indexer cache is on.
MXFP4_CACHE_LOGGER = "vllm.v1.attention.ops.rocm_dsa_mxfp4_cache"


@contextmanager
def _kept_log(name: str) -> Iterator[list[str]]:
    """The messages logger ``name`` emits at INFO and above while open, kept
    instead of printed (vLLM's own level here is WARNING)."""
    kept: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: kept.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    saved = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield kept
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def main() -> None:
    scenarios = json.load(sys.stdin)
    compiled_stub.install()
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        _start_as_rocm(stack)
        results = [_run(scenario, Path(tmp)) for scenario in scenarios]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
