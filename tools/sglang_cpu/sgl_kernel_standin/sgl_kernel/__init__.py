"""A stand-in for ``sgl_kernel`` (the CPU build of sgl-kernel is not on PyPI).

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 imports a few names from ``sgl_kernel``
at module level; on the tiny-model CPU path only ``assign_req_to_token_pool_cpu`` is
ever called, so it gets a plain-torch implementation here and every other name is a
function that raises ``NotImplementedError`` when called (so a new code path fails
loudly instead of silently). It has no submodules: SGLang falls back on its own
code when ``sgl_kernel.scalar_type`` and friends cannot be imported.
Installed into the SGLang CPU venv by ``tools/sglang_cpu/install.sh``.
"""
from __future__ import annotations

from typing import Any

import torch

from sgl_kernel._missing import missing_attr

__version__ = "0.0.0+kvgate.cpu.standin"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Copy each request's slice of ``out_cache_loc`` into ``req_to_token[row, start:end]``."""
    del pool_len  # the row length of req_to_token; implied by the tensor itself
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def __getattr__(name: str) -> Any:
    return missing_attr(__name__, name)
