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


def _sm90() -> Any:
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


KERNEL_MODULES = ("workers.attention.triton_kernels", "workers.models.triton_ops", "workers.sampling_kernels")

LaunchHook = Callable[[str, Any, tuple[Any, ...], dict[str, Any]], None]


class _LaunchProxy:
    """Stands in for one kernel: ``proxy[grid](*args, **kwargs)`` reports, then launches the real one
    (unless ``launch`` is False: then the launch only reports, and its outputs keep whatever they held)."""

    def __init__(self, name: str, kernel: Any, on_launch: LaunchHook, label: bool, launch: bool) -> None:
        self.name, self.kernel, self.on_launch = name, kernel, on_launch
        self.label, self.launch = label, launch

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            self.on_launch(self.name, self.kernel, args, kwargs)
            if not self.launch:
                return None
            if not self.label:
                return launch(*args, **kwargs)
            with torch.profiler.record_function(f"triton::{self.name}"):
                return launch(*args, **kwargs)

        return run


def _is_kernel(name: str, obj: Any) -> bool:
    from triton.runtime.jit import KernelInterface

    return name.endswith("_kernel") and isinstance(obj, KernelInterface)


@contextlib.contextmanager
def probe_launches(on_launch: LaunchHook, label: bool = False, launch: bool = True) -> Iterator[None]:
    """Report every launch of a kernel of ``KERNEL_MODULES`` while the context is open."""
    patched: list[tuple[Any, str, Any]] = []
    try:
        for module_name in KERNEL_MODULES:
            module = importlib.import_module(module_name)
            for name, obj in list(vars(module).items()):
                if _is_kernel(name, obj):
                    patched.append((module, name, obj))
                    setattr(module, name, _LaunchProxy(name, obj, on_launch, label, launch))
        yield
    finally:
        for module, name, obj in patched:
            setattr(module, name, obj)


def count_compiled_variants() -> int:
    """Compiled variants held by every kernel of ``KERNEL_MODULES`` (0 under the interpreter, which
    compiles nothing): a difference across a run is the number of mid-run compilations."""
    total = 0
    for module_name in KERNEL_MODULES:
        for name, obj in vars(importlib.import_module(module_name)).items():
            caches = getattr(obj, "device_caches", None) if _is_kernel(name, obj) else None
            for entry in (caches or {}).values():
                total += len(entry[0])  # NOTE: (kernel cache, key cache, target, backend, binder) per device
    return total


_BINDERS: dict[int, tuple[Any, Any, Callable[..., Any]]] = {}


def _binder(kernel: Any) -> tuple[Any, Any, Callable[..., Any]]:
    """(JITFunction, backend, Triton's own argument binder) of ``kernel`` for a CUDA sm_90 target (no GPU
    needed)."""
    entry = _BINDERS.get(id(kernel))
    if entry is None:
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
        from triton.compiler import make_backend

        backend = make_backend(_sm90())
        entry = (jit, backend, create_function_from_signature(jit.signature, jit.params, backend))
        _BINDERS[id(kernel)] = entry
    return entry


def specialization_key(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The compiled-variant key of one launch (see the module docstring)."""
    _, specialization, options = _binder(kernel)[2](*args, **kwargs)
    return f"{specialization}|{sorted(options.items())}"


def compile_for_sm90(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Compile the variant one launch would use to an sm_90 cubin, with Triton's bundled ptxas (no GPU
    needed; run with ``TRITON_INTERPRET=0`` so the kernels are compilable ``JITFunction`` objects)."""
    import triton
    from triton.compiler import ASTSource

    jit, backend, binder = _binder(kernel)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(
        ASTSource(jit, signature, constexprs, attrs), target=_sm90(), options=options.__dict__
    )


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
