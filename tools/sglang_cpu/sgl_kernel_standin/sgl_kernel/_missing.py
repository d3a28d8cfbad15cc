"""Placeholders for the kernels the stand-in does not implement."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


def missing_attr(module: str, name: str) -> Callable[..., NoReturn]:
    """A function that raises when called; dunder lookups stay AttributeErrors."""
    if name.startswith("__"):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    def missing(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{module}.{name} is not available in kvgate's CPU stand-in "
                                  "for sgl_kernel (tools/sglang_cpu/sgl_kernel_standin)")

    missing.__name__ = name
    return missing
