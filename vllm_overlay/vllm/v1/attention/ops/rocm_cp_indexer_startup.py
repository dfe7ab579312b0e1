# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 0001's decision at startup: whether the TP ranks split the
indexer prefill, and with which planner, the same on every rank.

The settings are read once, when the indexer metadata builder is created,
and checked there to agree across the TP group, through its store (no
collective): a rank that merges while another does not would hang in the
merge, and different chunk sizes would cut the rows differently.
``VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE`` is deprecated and ignored:
AITER's logits and top-k run one program per row, so a rank's rows need
no alignment.
"""

from __future__ import annotations

import json
from datetime import timedelta

import vllm.envs as envs
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed import get_tp_group
from vllm.distributed.parallel_state import model_parallel_is_initialized
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.attention.ops import rocm_cp_indexer_plan as plan

logger = init_logger(__name__)

STRIPE_SIZE_ENV = "VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE"


def unsafe_config_reason(
    vllm_config: VllmConfig, dcp_world_size: int, use_pcp: bool
) -> str | None:
    """Why splitting prefill rows is unsafe in this configuration, if it is."""
    if dcp_world_size > 1:
        return "decode context parallelism shards the indexer keys"
    if use_pcp:
        return "prefill context parallelism shards the prefill rows already"
    if envs.VLLM_BATCH_INVARIANT:
        return "batch invariance needs every rank to compute every row"
    if envs.VLLM_DISABLE_PYNCCL:
        return "the merge runs on PyNccl (VLLM_DISABLE_PYNCCL is set)"
    mode = vllm_config.compilation_config.cudagraph_mode or CUDAGraphMode.NONE
    if mode.mixed_mode() == CUDAGraphMode.FULL:
        return "FULL CUDA graphs capture mixed batches, which split rows cannot"
    return None


def _off_reason(
    vllm_config: VllmConfig, dcp_world_size: int, use_pcp: bool, fp4_cache: bool
) -> str | None:
    """Why this engine's prefill stays replicated with the flag on, if it
    does: an unsafe configuration, or an FP4 indexer cache, whose op scores
    every prefill row on every rank."""
    if fp4_cache:
        # Only rocm_aiter_sparse_attn_indexer (the FP8 cache) splits rows.
        return "the MXFP4 indexer cache's op does not split prefill rows"
    return unsafe_config_reason(vllm_config, dcp_world_size, use_pcp)


# Keys of the startup records in the TP group's store.
_STARTUP_KEY = "rocm_cp_indexer_startup"
# How long a rank with the flag on waits for the others' records: they come
# from the same point of every rank's start, after the same collectives.
_STARTUP_WAIT = timedelta(minutes=5)


def _publish_and_compare(settings: dict[str, object], compare: bool) -> None:
    """Publish this rank's settings in the TP group's store; with
    ``compare``, wait for every rank's and raise, naming what differs and
    each rank's value, if they do not all agree.

    Through the store rather than a collective, so that a rank with the flag
    off only writes and goes on: a collective it skipped would leave the
    others waiting for it, and one it joined would tax every deployment. The
    ranks with the flag on then see its record and fail at startup."""
    group = get_tp_group()
    rank = group.rank_in_group
    try:
        store = group.cpu_group.get_group_store()
        # Every rank creates as many builders, with the same settings: the
        # n-th call on one rank meets the n-th on the others.
        call = store.add(f"{_STARTUP_KEY}/calls/{rank}", 1)
        shown = {name: repr(value) for name, value in settings.items()}
        store.set(f"{_STARTUP_KEY}/{call}/{rank}", json.dumps(shown))
    except Exception as error:
        if compare:
            raise
        # With the flag off the record only lets other ranks see it; a store
        # that fails here must not stop a deployment that never asked for
        # the split.
        logger.warning_once("CP indexer: could not publish its flag: %s", error)
        return
    if not compare:
        return
    keys = [f"{_STARTUP_KEY}/{call}/{r}" for r in range(group.world_size)]
    try:
        # One wait for all of them: a wait per rank would add up to
        # world_size times _STARTUP_WAIT when several never come.
        store.wait(keys, _STARTUP_WAIT)
    except Exception:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if missing:
            raise RuntimeError(
                f"TP ranks {missing} published no CP indexer settings within "
                f"{_STARTUP_WAIT}; every rank must reach the indexer's startup"
            ) from None
        # Every record came just after the wait gave up: go on.
    gathered = [json.loads(store.get(key)) for key in keys]
    for name in settings:
        values = [ranks_settings.get(name) for ranks_settings in gathered]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(
                f"{name} differs across the TP ranks ({per_rank}); the CP "
                "indexer needs the same on every rank"
            )


def _pynccl_missing() -> bool:
    """Whether this rank's TP group lacks a working PyNccl, which the merge
    runs on (a library that failed to load, as well as
    VLLM_DISABLE_PYNCCL)."""
    communicator = get_tp_group().device_communicator
    pynccl = getattr(communicator, "pynccl_comm", None)
    return pynccl is None or pynccl.disabled


def _logits_fill_their_chunk() -> bool:
    """Whether the prefill logits kernel the op calls writes -inf over its
    chunk's whole [rows, keys] output, so that a row also costs its chunk's
    key width: vLLM calls gfx942's FlyDSL ``fp8_mqa_logits`` with its default
    ``clean_logits=True`` (which writes every position outside a row's range)
    and gfx950's Triton one with ``clean_logits=False`` (which skips them;
    vllm-project/vllm v0.34.0 ``rocm_fp8_mqa_logits``; ROCm/aiter
    ``flydsl_fp8_mqa_logits``'s docstring)."""
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse

    return bool(rocm_aiter_mla_sparse._ON_GFX942)


def cp_indexer_at_startup(
    vllm_config: VllmConfig,
    dcp_world_size: int,
    use_pcp: bool,
    *,
    fp4_cache: bool = False,
    compute_units: int = 0,
) -> plan.CPIndexerPlanner | None:
    """The planner of each step's split when this engine splits the indexer
    prefill, else None.

    Called once per indexer metadata builder at engine start, on every rank.
    Every rank publishes its flag in the TP group's store; with the flag off
    that is all (no collective, no wait). With it on, a rank decides (an
    unsafe configuration, or an FP4 indexer cache, ``fp4_cache``, whose op
    scores every prefill row on every rank), publishes the decision and
    every setting that shapes the plan, checks them against every rank's,
    and only then says why the split stays off. So a rank whose flag,
    decision or plan settings differ from another's is an error at startup
    on every rank with the flag on, not a hang in the merge.
    ``compute_units``: this GPU's, which set the rows of one wave (0: the
    plan counts no wave)."""
    # Imported here as vLLM's indexer backend does (dsa_indexer_uses_fp4):
    # vllm._aiter_ops imports the backend, which imports this module.
    from vllm._aiter_ops import rocm_aiter_ops

    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if tp_size < 2 or not current_platform.is_rocm():
        return None
    enabled = bool(rocm_aiter_ops.is_cp_indexer_enabled())
    settings: dict[str, object] = {"VLLM_ROCM_USE_AITER_CP_INDEXER": enabled}
    reason = fill = None
    if enabled:
        if envs.VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE is not None:
            logger.warning_once(
                "%s is deprecated and ignored: the CP indexer cuts its row "
                "ranges by cost, with no alignment.",
                STRIPE_SIZE_ENV,
            )
        reason = _off_reason(vllm_config, dcp_world_size, use_pcp, fp4_cache)
        if reason is None and model_parallel_is_initialized() and _pynccl_missing():
            reason = "the merge runs on PyNccl, which this TP group lacks"
        fill = _logits_fill_their_chunk()
        settings["the CP indexer's decision"] = reason or "split"
        if reason is None:
            # What shapes the plan: the chunks and the row costs.
            settings["VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"] = (
                envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB
            )
            settings["the logits kernel's -inf fill"] = fill
            settings["the GPU's compute units"] = compute_units
    # Engines always build the TP group before the attention backends; only
    # a builder made outside an engine (a unit test) has no group to ask.
    if model_parallel_is_initialized():
        _publish_and_compare(settings, compare=enabled)
    if not enabled:
        return None
    if reason is not None:
        logger.info_once("CP indexer stays off (replicated prefill): %s.", reason)
        return None
    logger.info_once(
        "CP indexer on: %d TP ranks, cost-balanced row ranges%s.",
        tp_size,
        "" if fill else ", long rows key-split",
    )
    # The floor is that of gfx950's logits grid (WAVE_ROWS_PER_CU); the
    # logits that fill their chunk (gfx942's FlyDSL kernel) are not measured.
    wave_rows = 0 if fill else int(plan.WAVE_ROWS_PER_CU * compute_units)
    logits_bytes = envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB * 1024 * 1024
    return plan.CPIndexerPlanner(
        tp_size,
        plan.LOGITS_FILL_DIVISOR if fill else None,
        plan.ROW_COST_KEYS,
        plan.CALL_COST_KEYS,
        wave_rows,
        # gfx942 (MI300X, MI325X), whose logits fill, has the slower xGMI.
        plan.XGMI_GFX942 if fill else plan.XGMI_GFX950,
        plan.key_split_max_rows(logits_bytes),
        plan.key_split_max_owned(logits_bytes, tp_size),
    )
