"""Triton bound at a kernel's first launch, never at import (see the package doc)."""

from __future__ import annotations

from typing import Any, Callable


def jit(fn: Callable[..., Any], module_globals: dict[str, Any], **options: Any) -> Any:
    """``triton.jit(fn, **options)``, first binding ``tl`` (``triton.language``) in the
    kernel module's globals, which the kernel's body and annotations name."""
    try:
        import triton
        import triton.language as language
    except ImportError as e:
        raise RuntimeError(f"{fn.__name__} needs Triton: pip install triton ({e})") from None
    module_globals["tl"] = language
    return triton.jit(fn, **options)
