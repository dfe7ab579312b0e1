# SPDX-License-Identifier: Apache-2.0
"""Run a function on N ranks of a real vLLM TP group: gloo on the CPU, or
NCCL with one GPU per rank.

Workers are forked after the parent has imported vLLM (8 ranks start in well
under a second; spawning would re-import vLLM in each). Each worker joins
vLLM's distributed state, so ``get_tp_group()`` and its ``device_group`` are
the real objects the patched code uses.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

WORKER_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def default_vllm_config(device: str) -> Any:
    """A default VllmConfig on ``device``. Building one takes seconds, so the
    parent builds it once and the forked ranks inherit it."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device=device))


class GlooPyNccl:
    """PyNccl's ``all_gatherv`` and ``all_to_all_single`` on gloo, for the
    TP group of gloo ranks, which have no PyNccl (vllm-project/vllm v0.34.0,
    vllm/distributed/device_communicators/pynccl.py L329-362: inside one
    NCCL group, one ``ncclBroadcast`` per root from the root's input into
    its slice of the output, the slices in rank order, ``sizes[r]`` rows
    each). What NCCL leaves undefined fails here instead of passing: a
    non-contiguous buffer (NCCL reads and writes raw memory), and a root's
    input that overlaps the output other than as exactly its own slice
    (NCCL's broadcast runs in place only when the root's send and receive
    buffers are the same)."""

    disabled = False

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator

    def all_gatherv(self, output_tensor, input_tensor, sizes, stream=None):
        import torch

        group = self.coordinator
        rank = group.rank_in_group
        assert output_tensor.is_contiguous() and input_tensor.is_contiguous()
        assert len(sizes) == group.world_size
        assert output_tensor.shape[0] == sum(sizes)
        assert input_tensor.shape == (sizes[rank], *output_tensor.shape[1:])
        parts = output_tensor.split(sizes)
        own = parts[rank]
        in_place = input_tensor.data_ptr() == own.data_ptr()
        if not in_place:
            lo, hi = (
                input_tensor.data_ptr(),
                input_tensor.data_ptr() + (input_tensor.nbytes),
            )
            out_lo = output_tensor.data_ptr()
            out_hi = out_lo + output_tensor.nbytes
            assert hi <= out_lo or lo >= out_hi, "input overlaps the output"
            own.copy_(input_tensor)
        for root, part in enumerate(parts):
            torch.distributed.broadcast(
                part, src=group.ranks[root], group=group.device_group
            )

    def all_to_all_single(
        self, output_tensor, input_tensor, output_split_sizes, input_split_sizes,
        stream=None,
    ):  # fmt: skip
        """PyNccl's ``all_to_all_single`` (vllm-project/vllm v0.34.0,
        vllm/distributed/device_communicators/pynccl.py L489-541: inside one
        NCCL group, the next ``input_split_sizes[peer]`` rows to each peer,
        the next ``output_split_sizes[peer]`` rows from it), on gloo."""
        import torch

        group = self.coordinator
        assert output_tensor.is_contiguous() and input_tensor.is_contiguous()
        assert len(input_split_sizes) == len(output_split_sizes) == group.world_size
        assert input_tensor.shape[0] == sum(input_split_sizes)
        assert output_tensor.shape[0] == sum(output_split_sizes)
        torch.distributed.all_to_all_single(
            output_tensor,
            input_tensor,
            list(output_split_sizes),
            list(input_split_sizes),
            group=group.device_group,
        )


def _stand_in_pynccl() -> None:
    """Give the gloo TP group's device communicator a PyNccl stand-in."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    group.device_communicator.pynccl_comm = GlooPyNccl(group)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    try:
        import torch

        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state

        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(rank)
        backend = "nccl" if device == "cuda" else "gloo"
        with set_current_vllm_config(default_vllm_config(device)):
            parallel_state.init_distributed_environment(
                world_size, rank, f"tcp://127.0.0.1:{port}", rank, backend=backend
            )
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=world_size
            )
            if backend == "gloo":
                _stand_in_pynccl()
            try:
                # Pickled by value: the queue's own pickler would share tensor
                # storage through a file descriptor this process serves, and
                # it exits right after (the parent then reads a reset socket).
                value = pickle.dumps(fn(rank, world_size, *args))
                results.put((rank, "ok", value))
            finally:
                parallel_state.destroy_model_parallel()
                parallel_state.destroy_distributed_environment()
    except BaseException:  # report everything, including assertion errors
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # flush the result before the hard exit below
        os._exit(0)  # skip atexit/pytest teardown inherited through fork


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    device: str = "cpu",
    timeout_s: float = WORKER_TIMEOUT_S,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on every rank; return the results
    in rank order. A failure on any rank raises with that rank's traceback.

    ``device="cuda"`` gives each rank its own GPU and NCCL; the parent must
    not have initialised CUDA before (forked children cannot use it then)."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    port = free_port()
    default_vllm_config(device)
    workers = [
        context.Process(
            target=_worker, args=(r, world_size, port, device, fn, args, results)
        )
        for r in range(world_size)
    ]
    for worker in workers:
        worker.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(collected) < world_size and not errors:
            try:
                rank, status, value = results.get(timeout=1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout_s} s waiting for ranks")
                elif not any(w.is_alive() for w in workers) and results.empty():
                    errors.append("every rank exited, some without a result")
                continue
            if status == "ok":
                collected[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
                worker.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [collected[r] for r in range(world_size)]
