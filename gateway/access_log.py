"""The optional access log: one line per finished request with its routing decision.

Off by default (``server.access_log``): a gateway serving thousands of agent turns a
second should not pay for a log line nobody reads, and the same facts are in
``/metrics``. On, each request that reached a replica ends with one INFO line on the
``kvgate.access`` logger, in ``key=value`` form so log pipelines split it without a
parser of their own::

    request_id=... endpoint=chat status=200 replica=http://10.0.0.7:30000 reason=affinity
    predicted_cached=98304 cached=98240 prompt=100352 ttft_ms=412.7

``cached`` and ``prompt`` are what the replica reported (``-`` when it reported no
usage), ``ttft_ms`` the time to its first byte (``-`` without one). Requests the gateway
answered itself (a bad body, no replica) are not logged here: they carry no decision.
The cost when off is one ``isEnabledFor`` check per request.
"""
from __future__ import annotations

import logging

from policies.base import Decision, Outcome, RequestContext

log = logging.getLogger("kvgate.access")


def configure(enabled: bool) -> None:
    """Turn the access log on (INFO) or off (WARNING: nothing it writes passes)."""
    log.setLevel(logging.INFO if enabled else logging.WARNING)


configure(False)


def record(ctx: RequestContext, decision: Decision, outcome: Outcome) -> None:
    """Write the request's line when the access log is on."""
    if not log.isEnabledFor(logging.INFO):
        return
    ttft = "-" if outcome.ttft_s is None else f"{outcome.ttft_s * 1000:.1f}"
    log.info("request_id=%s endpoint=%s status=%d replica=%s reason=%s predicted_cached=%d cached=%s prompt=%s "
             "ttft_ms=%s", ctx.request_id, ctx.endpoint, outcome.status, decision.replica, decision.reason,
             decision.predicted_cached_tokens, _or_dash(outcome.cached_tokens), _or_dash(outcome.prompt_tokens), ttft)


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)
