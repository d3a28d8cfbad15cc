"""Precise mode's model directories and prompt hashing, for ``gateway.kv_wiring.PreciseMode``.

- ``model_dir(replica, info)``: the first local model directory of a replica's
  ``/server_info`` (``tokenizer_path``, ``model_path``, then ``index.tokenizer_dir``) whose
  tokenizer precise mode reproduces exactly (``gateway.precise_formats``); else None, and
  the replica's reason kept (``approximate_status``, the ``unreproducible`` counts of the
  gauge) and logged at WARNING when it changes. Tokenizers are loaded once per directory.
- ``await hashes(ctx, model_dir, page_size, bigram)``: the request's page hashes, computed
  in ``gateway.precise_pool``'s threads (heavy lane for a long prompt the gateway has not
  seen, light lane otherwise); None (routed approximately) past the pool's bounds or for a
  prompt that cannot be reproduced, each counted in ``kvgate_precise_tokenize_total{outcome}``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.metrics import GatewayMetrics
from gateway.precise_chat import NotReproducible
from gateway.precise_formats import Unreproducible
from gateway.precise_pool import PoolBusy, TokenizePool
from gateway.precise_tokens import ModelTokenizer, PromptHashes, SessionHasher
from policies.base import RequestContext
from prefix_index.base import ReplicaId
from prefix_index.config import IndexConfig

log = logging.getLogger("kvgate.precise")


class PreciseModels:
    """Tokenizers by model directory, page-hash chains by (directory, page, bigram), the pool."""

    def __init__(self, config: IndexConfig, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self._tokenizers: dict[str, ModelTokenizer] = {}
        self._hashers: dict[tuple[str, int, bool], SessionHasher] = {}
        self._unreproducible: dict[ReplicaId, Unreproducible] = {}
        self.pool = TokenizePool(config.precise_tokenize_workers, config.precise_tokenize_queue_requests,
                                 config.precise_tokenize_deadline_s)

    def model_dir(self, replica: ReplicaId, info: Mapping[str, Any]) -> str | None:
        failure: Unreproducible | None = None
        for candidate in (info.get("tokenizer_path"), info.get("model_path"), self.config.tokenizer_dir):
            if not isinstance(candidate, str) or not Path(candidate).is_dir():
                continue
            if candidate not in self._tokenizers:
                try:
                    self._tokenizers[candidate] = ModelTokenizer.from_dir(candidate)
                except Unreproducible as exc:
                    failure = failure or exc
                    continue
                except Exception as exc:  # noqa: BLE001 - any unusable tokenizer: approximate, with its reason
                    failure = failure or Unreproducible("unreadable", f"{candidate}: {type(exc).__name__}: {exc}")
                    continue
            self._unreproducible.pop(replica, None)
            return candidate
        if failure is None:
            failure = Unreproducible("no_local_tokenizer", f"model_path {info.get('model_path')!r}, "
                                                           f"index.tokenizer_dir {self.config.tokenizer_dir!r}")
        if str(self._unreproducible.get(replica)) != str(failure):
            log.warning("precise mode: %s cannot be reproduced exactly (%s); routed approximately", replica, failure)
        self._unreproducible[replica] = failure
        return None

    def kind(self, model_dir: str) -> str:
        return self._tokenizers[model_dir].form.kind

    def tool_declaration(self, model_dir: str) -> str:
        return self._tokenizers[model_dir].form.tool_declaration

    def approximate_status(self, replica: ReplicaId) -> dict[str, Any]:
        failure = self._unreproducible.get(replica)
        if failure is not None:
            return {"mode": "approximate", "reason": failure.reason, "detail": failure.detail}
        return {"mode": "approximate", "reason": "no_kv_events"}

    def unreproducible(self, reason: str) -> int:
        return sum(1 for e in self._unreproducible.values() if e.reason == reason)

    def forget(self, replica: ReplicaId) -> None:
        self._unreproducible.pop(replica, None)

    async def hashes(self, ctx: RequestContext, model_dir: str, page_size: int, bigram: bool) -> PromptHashes | None:
        tokenizer = self._tokenizers[model_dir]
        hasher = self._hashers.get((model_dir, page_size, bigram))
        if hasher is None:
            hasher = self._hashers[(model_dir, page_size, bigram)] = SessionHasher(page_size, bigram)
        payload, endpoint, session = ctx.payload, ctx.endpoint, ctx.session.session
        assert payload is not None

        def work() -> PromptHashes | None:
            segments = tokenizer.prompt_segments(endpoint, payload)
            return hasher.hash(segments, session) if segments is not None else None

        started = time.perf_counter()
        heavy = not hasher.knows(session) and ctx.prompt_chars > self.config.precise_heavy_chars
        try:
            prompt = await self.pool.run(work, heavy=heavy)
            outcome = "ok" if prompt is not None else "not_reproducible"
        except PoolBusy as exc:
            log.debug("precise mode: request %s routed approximately: %s", ctx.request_id, exc)
            prompt, outcome = None, exc.outcome
        except (NotReproducible, TypeError, ValueError) as exc:
            log.debug("precise mode: request %s not reproducible: %s", ctx.request_id, exc)
            prompt, outcome = None, "not_reproducible"
        if self.metrics is not None:
            self.metrics.precise_tokenize.labels(outcome).inc()
            self.metrics.precise_tokenize_seconds.observe(time.perf_counter() - started)
        return prompt

    def close(self) -> None:
        self.pool.close()
