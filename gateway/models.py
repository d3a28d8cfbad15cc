"""Several models behind one endpoint: aliases, the served-model check, ``/v1/models``.

Each replica's served model ids come from its ``/v1/models`` (``replicas.probe``, kept
on ``ReplicaView.models``); the routing core sends a request only to replicas serving
its model (``policies.routing.serving``). Around that, this module holds:

- ``ModelsConfig.aliases`` (settings section ``models``): a public name -> a served one.
  ``gateway.context`` applies it once, when the request is parsed: ``ctx.model`` is the
  served name (routing, the prefix hashes' seed and the metrics' label all see it), so a
  request by alias and one by the served name share cached prefixes. One step only (an
  alias of an alias is not followed). ``default``, the model of a request naming none,
  can be aliased too: model-less requests then go to that model's replicas.
- ``forwarded_body``: the body sent upstream names the served model when the client
  named an alias. SGLang 0.5.23 answers 404 to a Responses request for a model it does
  not serve, and reads ``name:adapter`` in chat and completions as a LoRA adapter, so an
  alias cannot be forwarded as it is. The rewritten body is orjson's serialization of
  the parsed one with ``model`` replaced (same fields, same order); a body naming a
  served model is forwarded byte for byte, as before.
- ``require_served``: a model no replica serves is a 404 ``model_not_found`` in the
  API's shape (``gateway.errors.ModelNotFound``), decided before routing; a served
  model with no routable replica stays the router's 503. While no replica has reported
  its models (a fleet of one model whose replicas answer no ``/v1/models``), nothing is
  refused and every replica serves every model, as before model-aware routing.
- ``model_list``: ``GET /v1/models``, the union of the replicas' cards (deduplicated by
  id) plus one card per alias of a served model (the target's card under the alias id).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from pydantic import BaseModel, Field, field_validator

from gateway.errors import ModelNotFound
from policies.base import RequestContext
from policies.routing import ANY_MODEL


class ModelsConfig(BaseModel):
    aliases: dict[str, str] = Field(
        default_factory=dict, description="public model name -> the served name it routes to "
        "(and is forwarded as); e.g. {\"kimi\": \"kimi-k2.6\"}. 'default' names requests without a model")

    @field_validator("aliases")
    @classmethod
    def _names(cls, aliases: dict[str, str]) -> dict[str, str]:
        for public, served in aliases.items():
            if not public or not served or public == served:
                raise ValueError(f"alias {public!r} -> {served!r}: both names non-empty and different")
        return aliases


def require_served(model: str, served: frozenset[str]) -> None:
    """Raise ``ModelNotFound`` when replicas report their models and none serves ``model``."""
    if served and model not in served and model != ANY_MODEL:
        raise ModelNotFound(model)


def forwarded_body(ctx: RequestContext, body: bytes, aliases: Mapping[str, str]) -> bytes:
    """``body`` as the replica gets it: naming the served model when it named an alias."""
    if not aliases or ctx.payload is None:
        return body
    sent = ctx.payload.get("model")
    if not isinstance(sent, str) or sent not in aliases:
        return body
    data = orjson.loads(body)
    data["model"] = aliases[sent]
    return orjson.dumps(data)


def model_list(cards: Sequence[Mapping[str, Any]], aliases: Mapping[str, str]) -> list[dict[str, Any]]:
    """The cards of ``GET /v1/models``: ``cards`` (deduplicated by id, first wins) and one
    per alias whose target is among them."""
    by_id: dict[str, dict[str, Any]] = {}
    for card in cards:
        by_id.setdefault(str(card["id"]), dict(card))
    out = list(by_id.values())
    out.extend({**by_id[served], "id": public} for public, served in aliases.items()
               if served in by_id and public not in by_id)
    return out
