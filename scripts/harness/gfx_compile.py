# SPDX-License-Identifier: Apache-2.0
"""Compile vLLM's Triton kernels for an AMD GPU on a machine without one.

Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests run kernels)
executes a kernel as Python, so it never sees what only the compiler sees: a
branch under a false ``tl.constexpr`` is still traced by the compiler, and
every shape must be a power of two there. The pip ``triton`` package carries
the AMD backend, which compiles through TTIR, TTGIR, LLIR and AMDGCN to a
HSACO on any machine (``GPUTarget("hip", "gfx950", 64)``).

``recording(arch)`` runs real vLLM host code (the model's attention glue,
the indexer op) with a compile-only driver in place of a GPU's: every kernel
launch goes through Triton's own JIT, which derives the launch's
specialisation (argument types, pointer and integer divisibility,
constexprs, ``num_warps`` and the other options) exactly as on the target;
the launch is recorded as a ``Variant`` and not executed, or, with
``interpret=True``, executed by the interpreter so that host code after it
sees real values. ``compile_variant`` then compiles a recorded variant for
the target through Triton's own path (``JITFunction.preload``, as a cached
kernel is loaded); Triton's on-disk cache (``TRITON_CACHE_DIR``) keeps the
result, so a variant compiled once costs nothing the next time.

The process must not run the interpreter for everything
(``TRITON_INTERPRET`` unset), since kernels decorated under it are never
compiled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

ARCHS = ("gfx950", "gfx942")
WAVEFRONT = 64  # both targets' wavefront size


@dataclass(frozen=True)
class Variant:
    """One specialisation of one kernel, as Triton serialises it for
    ``JITFunction.preload``: the kernel, the signature, the constexprs, the
    argument attributes, the options and the target."""

    kernel: str  # "module:qualname", as Triton registers the function
    data: str  # Triton's specialisation data (JSON)

    @property
    def name(self) -> str:
        return self.kernel.rpartition(":")[2]

    def describe(self) -> str:
        """The constexprs and scalar types that tell variants apart."""
        spec = json.loads(self.data)
        names = list(spec["signature"])
        constants = {
            names[key[0]]: value
            for key, value in zip(
                spec["constant_keys"], spec["constant_vals"], strict=True
            )
            if len(key) == 1
        }
        return ", ".join(f"{k}={v}" for k, v in constants.items())


@dataclass
class Recorder:
    """The variants launched while recording, each with the layer kinds
    (labels) that reached it, in launch order."""

    label: str = ""
    variants: dict[Variant, list[str]] = field(default_factory=dict)

    def add(self, variant: Variant) -> None:
        labels = self.variants.setdefault(variant, [])
        if self.label not in labels:
            labels.append(self.label)


def _compile_only_driver(target: Any) -> Any:
    """A Triton driver that names ``target`` and owns no device: the JIT asks
    it only for the target, a device number and a stream."""
    import torch
    from triton.backends.driver import DriverBase

    class CompileOnlyDriver(DriverBase):
        def __init__(self) -> None:
            self.target = target

        @classmethod
        def is_active(cls) -> bool:
            return False

        def get_current_target(self) -> Any:
            return self.target

        def get_active_torch_device(self) -> Any:
            return torch.device("cpu")

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_benchmarker(self) -> Any:
            raise RuntimeError("no device to benchmark on: compile-only driver")

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

    return CompileOnlyDriver()


# Set inside ``recorded_only``: launches are recorded, not interpreted.
_RECORDED_ONLY: list[bool] = [False]


@contextmanager
def recorded_only() -> Iterator[None]:
    """Inside ``recording(interpret=True)``: record the launches made here
    without interpreting them (the caller computes their results)."""
    _RECORDED_ONLY[0] = True
    try:
        yield
    finally:
        _RECORDED_ONLY[0] = False


@contextmanager
def recording(
    arch: str, *, interpret: bool = False, into: Recorder | None = None
) -> Iterator[Recorder]:
    """Record every Triton launch as a variant for ``arch`` (into ``into``,
    or a new recorder); launch nothing, or (``interpret``) run each launch
    through the interpreter, but within ``recorded_only``."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if knobs.runtime.interpret:
        raise RuntimeError(
            "TRITON_INTERPRET=1: the kernels are interpreted, not compiled; "
            "record in a process without it"
        )
    recorder = Recorder() if into is None else into
    interpreted: dict[int, Any] = {}

    def hook(*, fn: Any, compile: dict, **_: Any) -> bool:
        kernel = f"{fn.module}:{fn.name}"
        recorder.add(Variant(kernel, compile["specialization_data"]))
        return True  # handled: Triton compiles and launches nothing

    real_run, real_call = JITFunction.run, JITFunction.__call__

    def as_interpreted(fn: Any) -> Any:
        if id(fn) not in interpreted:
            interpreted[id(fn)] = InterpretedFunction(fn.fn)
        return interpreted[id(fn)]

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        # A kernel keeps the target of its first launch in its per-device
        # cache; not every kernel object is in Triton's registry.
        launched[id(self)] = self
        if self.device_caches and self.device_caches[0][2] != target:
            self.device_caches.clear()
        real_run(self, *args, grid=grid, warmup=True, **kwargs)
        if interpret and not warmup and not _RECORDED_ONLY[0]:
            with _language_restored():
                as_interpreted(self).run(*args, grid=grid, warmup=False, **kwargs)
        return None

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        # A kernel's call of another jitted function, while interpreting.
        return as_interpreted(self)(*args, **kwargs)

    saved_hook, saved_driver = knobs.runtime.jit_cache_hook, driver._active
    target = GPUTarget("hip", arch, WAVEFRONT)
    driver.set_active(_compile_only_driver(target))
    launched: dict[int, Any] = {}
    knobs.runtime.jit_cache_hook = hook
    JITFunction.run = run
    JITFunction.__call__ = call
    try:
        yield recorder
    finally:
        JITFunction.run = real_run
        JITFunction.__call__ = real_call
        knobs.runtime.jit_cache_hook = saved_hook
        for fn in launched.values():
            fn.device_caches.clear()
        driver._active = saved_driver


@contextmanager
def _language_restored() -> Iterator[None]:
    """Undo every change the interpreter makes to ``triton.language`` while
    it runs a kernel. A kernel's call of another jitted function patches the
    language for good (interpreter.py, ``InterpretedFunction.__call__``),
    which is harmless when everything is interpreted and breaks the compiler
    afterwards."""
    from triton.runtime import interpreter

    missing = object()
    originals: dict[tuple[int, str], tuple[object, str, object]] = {}
    real_set_attr = interpreter._LangPatchScope.set_attr

    def set_attr(scope: Any, obj: object, name: str, value: object) -> None:
        own = vars(obj).get(name, missing)  # a module's or a class's own
        originals.setdefault((id(obj), name), (obj, name, own))
        real_set_attr(scope, obj, name, value)

    interpreter._LangPatchScope.set_attr = set_attr
    try:
        yield
    finally:
        interpreter._LangPatchScope.set_attr = real_set_attr
        for obj, name, original in originals.values():
            if original is missing:
                if name in vars(obj):
                    delattr(obj, name)
            else:
                setattr(obj, name, original)


def compile_variant(variant: Variant, arch: str) -> str | None:
    """Compile ``variant`` for ``arch`` to a HSACO; the compiler's message if
    it fails, else None."""
    from triton import knobs
    from triton.runtime.jit import _triton_jit_function_registry

    fn = _triton_jit_function_registry[variant.kernel]
    fn.device_caches.clear()  # made for another target, perhaps
    with recording(arch):
        knobs.runtime.jit_cache_hook = None  # compile for real this time
        try:
            kernel = fn.preload(variant.data)
        except Exception as error:  # the compiler's own error, whatever its type
            return f"{type(error).__name__}: {error}"
        finally:
            # A compiled kernel in its cache would launch, unrecorded, next time.
            fn.device_caches.clear()
    if "hsaco" not in kernel.asm:
        return f"no HSACO produced (stages: {', '.join(kernel.asm)})"
    return None
