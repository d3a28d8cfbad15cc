"""Loaded by a kvgate child of ``tools/profile/critical_path.py`` (this directory on its
PYTHONPATH): wraps the steps of a small request on the callbacks path with
``perf_counter_ns`` marks. SIGUSR1 starts recording (one row of marks a request), SIGUSR2
stops and writes, for each pair of consecutive marks, the median gap and its count to
``$KVGATE_CRIT_OUT`` (JSON). Nothing happens without that variable. A step that is not
found (a renamed function) fails the import loudly: the tool then finds no output."""
from __future__ import annotations

import itertools
import json
import os
import signal
import types
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

_OUT = os.environ.get("KVGATE_CRIT_OUT")

# (module, object, attribute, mark before, mark after, a coroutine function): mark names sort in path order
STEPS: list[tuple[str, str, str, str | None, str | None, bool]] = [
    ("gateway.callback_path", "CallbackPath", "take", "b_take", None, False),
    ("gateway.callback_path", "", "build_context", None, "c_context", False),
    ("gateway.callback_path", "", "finished", None, "d_snapshot", False),
    ("gateway.router", "Router", "choose", None, "e_decided", False),
    ("gateway.h1_upstream", "H1Upstream", "sending_now", "f_client_headers", "g_request_head", False),
    ("gateway.h1_upstream", "_Connection", "request", None, "h_written", False),
    ("gateway.proxy", "Proxy", "lease_now", None, "i_routed", False),
    ("gateway.h1_upstream", "_Connection", "on_headers_complete", "k_answer_head", None, False),
    ("gateway.h1_upstream", "_Connection", "on_message_complete", "l_answer_end", None, False),
    ("gateway.push_relay", "ChunkWriter", "answer", "m_answer_in", "n_answer_written", False),
    ("gateway.callback_path", "Flight", "_headed", "p0_bookkeeping", None, False),
    ("gateway.proxy", "Proxy", "_sink_answered", None, "p1_answer_noted", False),
    ("gateway.proxy", "", "usage_of_body", "p2_usage_in", "p3_usage", False),
    ("replicas.registry", "Registry", "report_success", None, "p4_passive_health", False),
    ("gateway.proxy", "Proxy", "_close", "p5_close_in", None, True),
    ("gateway.metrics", "GatewayMetrics", "usage", "p6_usage_metrics_in", "p7_usage_metrics", False),
    ("gateway.metrics", "GatewayMetrics", "timing", None, "p8_timing_metrics", False),
    ("gateway.router", "Router", "completed", None, "p9_feedback", True),
    ("gateway.metrics", "GatewayMetrics", "request_done", None, "q_done", False),
]
FIRST, LAST = "a_bytes_in", "q_done"

_rows: list[dict[str, int]] = []
_cur: dict[str, int] = {}
_on = False


def _mark(name: str) -> None:
    _cur[name] = perf_counter_ns()


def _wrapped(orig: Callable[..., Any], before: str | None, after: str | None, is_async: bool) -> Callable[..., Any]:
    if is_async:
        async def marked_async(*args: Any, **kwargs: Any) -> Any:
            if before:
                _mark(before)
            result = await orig(*args, **kwargs)
            if after:
                _mark(after)
            return result
        return marked_async

    def marked(*args: Any, **kwargs: Any) -> Any:
        if before:
            _mark(before)
        result = orig(*args, **kwargs)
        if after:
            _mark(after)
        return result
    return marked


def _install() -> None:
    import importlib

    from gateway.edge import EdgeProtocol
    from gateway.h1_upstream import _Connection

    for module_name, owner_name, attr, before, after, is_async in STEPS:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        setattr(owner, attr, _wrapped(getattr(owner, attr), before, after, is_async))

    edge_data = EdgeProtocol.data_received

    def data_received(self: EdgeProtocol, data: bytes) -> None:  # a new request's bytes: a new row
        if _on and FIRST in _cur and LAST in _cur:
            _rows.append(dict(_cur))
        _cur.clear()
        _mark(FIRST)
        edge_data(self, data)

    EdgeProtocol.data_received = data_received  # type: ignore[method-assign]
    upstream_data = _Connection.data_received

    def upstream_data_received(self: _Connection, data: bytes) -> None:
        if "j_answer_bytes_in" not in _cur:
            _mark("j_answer_bytes_in")
        upstream_data(self, data)

    _Connection.data_received = upstream_data_received  # type: ignore[method-assign]


def _start(signum: int, frame: types.FrameType | None) -> None:
    global _on
    _rows.clear()
    _on = True


def _stop(signum: int, frame: types.FrameType | None) -> None:
    global _on
    _on = False
    keys = sorted(set().union(*_rows)) if _rows else []
    out: dict[str, list[float]] = {}
    for a, b in itertools.pairwise(keys):
        gaps = sorted((r[b] - r[a]) / 1000 for r in _rows if a in r and b in r)
        if gaps:
            out[f"{a} -> {b}"] = [gaps[len(gaps) // 2], len(gaps)]
    assert _OUT is not None
    with open(_OUT + ".part", "w") as f:
        json.dump({"requests": len(_rows), "steps": out}, f, indent=1)
    os.replace(_OUT + ".part", _OUT)


if _OUT:
    _install()
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
