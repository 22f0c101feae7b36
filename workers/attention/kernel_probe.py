"""Watch Triton kernel launches without touching their call sites (tests and benchmarks only).

``probe_launches(on_launch)`` swaps every launchable kernel (a module attribute named ``*_kernel``) of
``KERNEL_MODULES`` for a proxy that reports each launch and then launches the real kernel; the launch
sites look their kernels up as module attributes at call time, so they see the proxies. With
``label=True`` each launch also runs inside ``torch.profiler.record_function("triton::<name>")``, so a
profiler trace shows one event per Triton kernel (on CPU the interpreter's own work nests under it).

``specialization_key(kernel, args, kwargs)`` is the key Triton's JIT looks a compiled variant up by for
an sm_90 target: the argument types, the specialisations of integer and pointer arguments (== 1,
divisible by 16, 16-byte aligned) that ``do_not_specialize`` did not turn off, the constexprs and the
launch options. A launch whose key was never seen compiles a new variant on the GPU; under
``TRITON_INTERPRET=1`` nothing is compiled, so tests count these keys instead.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

KERNEL_MODULES = ("workers.attention.triton_kernels",)

LaunchHook = Callable[[str, Any, tuple[Any, ...], dict[str, Any]], None]


class _LaunchProxy:
    """Stands in for one kernel: ``proxy[grid](*args, **kwargs)`` reports, then launches the real one."""

    def __init__(self, name: str, kernel: Any, on_launch: LaunchHook, label: bool) -> None:
        self.name, self.kernel, self.on_launch, self.label = name, kernel, on_launch, label

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            self.on_launch(self.name, self.kernel, args, kwargs)
            if not self.label:
                return launch(*args, **kwargs)
            with torch.profiler.record_function(f"triton::{self.name}"):
                return launch(*args, **kwargs)

        return run


def _is_kernel(name: str, obj: Any) -> bool:
    from triton.runtime.jit import KernelInterface

    return name.endswith("_kernel") and isinstance(obj, KernelInterface)


@contextlib.contextmanager
def probe_launches(on_launch: LaunchHook, label: bool = False) -> Iterator[None]:
    """Report every launch of a kernel of ``KERNEL_MODULES`` while the context is open."""
    patched: list[tuple[Any, str, Any]] = []
    try:
        for module_name in KERNEL_MODULES:
            module = importlib.import_module(module_name)
            for name, obj in list(vars(module).items()):
                if _is_kernel(name, obj):
                    patched.append((module, name, obj))
                    setattr(module, name, _LaunchProxy(name, obj, on_launch, label))
        yield
    finally:
        for module, name, obj in patched:
            setattr(module, name, obj)


_BINDERS: dict[int, Callable[..., Any]] = {}


def _binder(kernel: Any) -> Callable[..., Any]:
    """Triton's own argument binder of ``kernel``, built for a CUDA sm_90 target (no GPU needed)."""
    binder = _BINDERS.get(id(kernel))
    if binder is None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        # NOTE: an interpreted kernel keeps its decorator options in .kwargs; a compiled one as attributes.
        options = getattr(kernel, "kwargs", None) or {
            "do_not_specialize": kernel.do_not_specialize,
            "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment,
        }
        jit = JITFunction(
            kernel.fn,
            do_not_specialize=options.get("do_not_specialize"),
            do_not_specialize_on_alignment=options.get("do_not_specialize_on_alignment"),
        )
        backend = make_backend(GPUTarget("cuda", 90, 32))
        binder = _BINDERS[id(kernel)] = create_function_from_signature(jit.signature, jit.params, backend)
    return binder


def specialization_key(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The compiled-variant key of one launch (see the module docstring)."""
    _, specialization, options = _binder(kernel)(*args, **kwargs)
    return f"{specialization}|{sorted(options.items())}"


class SpecializationLog:
    """Collects, per kernel name, the distinct specialization keys and the values every integer argument
    took; ``hook`` goes to ``probe_launches``."""

    def __init__(self) -> None:
        self.keys: dict[str, set[str]] = {}
        self.int_values: dict[str, dict[str, set[int]]] = {}
        self.num_launches = 0

    def hook(self, name: str, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.keys.setdefault(name, set()).add(specialization_key(kernel, args, kwargs))
        self.num_launches += 1
        values = self.int_values.setdefault(name, {})
        for param, value in zip(kernel.arg_names, args, strict=False):
            if isinstance(value, int) and not isinstance(value, bool):
                values.setdefault(param, set()).add(value)

    def snapshot(self) -> dict[str, set[str]]:
        return {name: set(keys) for name, keys in self.keys.items()}

    def new_since(self, before: dict[str, set[str]]) -> dict[str, set[str]]:
        """Keys (per kernel) that were not in ``before``: variants a GPU would compile now."""
        return {
            name: keys - before.get(name, set())
            for name, keys in self.keys.items()
            if keys - before.get(name, set())
        }
