"""Parse a request once into the frozen ``policies.base.RequestContext`` every plugin reads.

``build_context`` validates what routing needs (OpenAI-shaped 4xx via ``gateway.errors``),
extracts the session keys and hashes the canonical rendering (``gateway.prefix_hash``).
A model alias (``models.aliases``, ``gateway.models``) is resolved here, once: the
context's ``model`` is the served name. The body bytes themselves are forwarded
unchanged by the proxy (but for an alias, ``gateway.models.forwarded_body``); nothing
here re-serializes them.

Nesting is bounded: a body nested deeper than ``MAX_JSON_DEPTH`` (128) levels of arrays
and objects is a 400. orjson parses up to 1024 levels but serializes at most 254 (the
canonical rendering of tools and content parts would fail), and no OpenAI or SGLang
request needs more than a dozen. The check costs one C-speed ``orjson.dumps`` of the
parsed body wrapped in ``254 - 128`` lists, which fails exactly when the body is deeper
than 128 (~3 % of a 400 KB request's parse and hash), and is skipped for bodies too short
to nest that deep.

Ids the client may not choose (issue 41): ``rid`` and ``request_id`` become a request's
id upstream in SGLang (``/generate``, chat and completions' ``rid``; a Responses body's
``request_id`` is the id of the stored response it creates), so a client choosing one
could take over another tenant's response id, or collide with another's request.
``refuse_client_ids`` refuses them (400, ``param`` the field; ``null`` is the default
and passes) on the full path and, in the same checks, on the later-turn path below
(the validation of a resumed body's top-level values), so both answer alike.

A coding agent's later turn re-sends its history: with the cache of earlier turns on
(``HashingConfig.prefix_cache_entries`` / ``prefix_cache_bytes``, bodies of at least
``prefix_cache_min_bytes``), chat, Messages, count_tokens and Responses bodies go through
``gateway.context_turns``, which parses, checks, renders and hashes only what is new and
gives the same ``RequestContext`` (and, by falling back to this module's full path on
anything unexpected, the same errors).
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Protocol

import orjson
import xxhash
from pydantic import BaseModel, Field, PrivateAttr

from gateway import api_agents as agent_api
from gateway import context_turns, conversation, prefix_hash
from gateway.context_cache import CacheSlot, ContextCache
from gateway.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from gateway.models import ModelsConfig
from policies.base import RequestContext, SessionKeys
from policies.routing import ANY_MODEL

ENDPOINTS = {
    "chat": "chat", "/v1/chat/completions": "chat",
    "completions": "completions", "/v1/completions": "completions",
    "generate": "generate", "/generate": "generate",
    "messages": "messages", "/v1/messages": "messages",
    "count_tokens": "count_tokens", "/v1/messages/count_tokens": "count_tokens",
    "responses": "responses", "/v1/responses": "responses",
}
AGENT_ENDPOINTS = agent_api.ENDPOINTS  # messages, count_tokens, responses: validated by gateway.api_agents
CLIENT_ID_FIELDS = ("rid", "request_id")  # ids an upstream takes as its own: refused in every body
MAX_KEY_CHARS = 128  # longer session keys / request ids are replaced by a digest
MAX_JSON_DEPTH = 128  # arrays/objects nested deeper are refused (see the module docstring)
_ORJSON_MAX_DEPTH = 254  # orjson.dumps raises beyond this
DEPTH_PAD = _ORJSON_MAX_DEPTH - MAX_JSON_DEPTH  # lists around a document in check_depth


class HashingConfig(BaseModel):
    block_chars: int = Field(default=256, gt=0, description="bytes of canonical text per block (~64 tokens)")
    max_blocks: int = Field(default=8192, ge=0, description="blocks hashed at most (~2M characters)")
    chars_per_token: float = Field(default=4.0, gt=0, description="estimate of characters per token")
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0, description="larger bodies get 413")
    keep_routing_text: bool = Field(default=False, description="build routing_text (sglang-cache-aware baseline)")
    routing_key_blocks: int = Field(default=1, ge=1, description="prefix blocks named by a session-less routing key")
    prefix_cache_entries: int = Field(
        default=4096, ge=0, description="request states kept so a later turn costs only its new part (0: off)")
    prefix_cache_bytes: int = Field(
        default=128 * 1024 * 1024, ge=0, description="estimated bytes those states may hold (0: off)")
    prefix_cache_min_bytes: int = Field(
        default=16 * 1024, ge=0, description="smaller bodies skip that cache (the full path is as cheap)")
    _cache: CacheSlot = PrivateAttr(default_factory=CacheSlot)

    def context_cache(self) -> ContextCache | None:
        """This configuration's cache of earlier turns (``gateway.context_cache``), None when off."""
        return self._cache.get(self.prefix_cache_entries, self.prefix_cache_bytes)


class SessionConfig(BaseModel):
    """Which headers name a conversation, first match wins (header names in lower case).

    Order: our explicit ``x-kvgate-session``; Claude Code's ``x-claude-code-agent-id``
    before its ``x-claude-code-session-id`` (a subagent is its own conversation with its
    own prefix, inside the session); Codex ``session-id`` / ``session_id``; OpenCode
    ``x-session-id``. Then, when ``use_user_field``, the body's own key (as
    ``user:<value>``): chat's ``user``; Anthropic's ``metadata.user_id`` (Claude Code puts
    its session id in it); Responses' ``prompt_cache_key``, else ``user``.
    """

    headers: list[str] = Field(default_factory=lambda: [
        "x-kvgate-session", "x-claude-code-agent-id", "x-claude-code-session-id", "session-id", "session_id",
        "x-session-id",
    ])
    parent_headers: list[str] = Field(default_factory=lambda: [
        "x-kvgate-parent-session", "x-claude-code-parent-agent-id", "x-parent-session-id",
    ])
    parent_fallback: dict[str, str] = Field(
        default_factory=lambda: {"x-claude-code-agent-id": "x-claude-code-session-id"},
        description="session header -> header naming the parent when no parent header was sent",
    )
    use_user_field: bool = True

    @cached_property
    def named(self) -> frozenset[str]:
        """Every header ``session_keys`` reads (read once: the settings do not change)."""
        return frozenset((*self.headers, *self.parent_headers, *self.parent_fallback.values()))


class ContextSettings(Protocol):
    """What ``build_context`` reads from the gateway's settings (``Settings`` satisfies it)."""

    @property
    def hashing(self) -> HashingConfig: ...

    @property
    def sessions(self) -> SessionConfig: ...

    @property
    def models(self) -> ModelsConfig: ...


class ContextConfig(BaseModel):
    """A standalone ``ContextSettings`` (tests, benchmarks)."""

    hashing: HashingConfig = Field(default_factory=HashingConfig)
    sessions: SessionConfig = Field(default_factory=SessionConfig)
    models: ModelsConfig = Field(default_factory=ModelsConfig)


NO_SESSION = SessionKeys()  # (a frozen value: one for every request that names no session)
_ID_PREFIX = os.urandom(8).hex()  # this process's request ids: a random prefix and a counter
_ids = itertools.count()


def _reseed_ids() -> None:
    global _ID_PREFIX, _ids
    _ID_PREFIX, _ids = os.urandom(8).hex(), itertools.count()


os.register_at_fork(after_in_child=_reseed_ids)  # (a forked process gets its own prefix)


def new_request_id() -> str:
    """A request id for a request that brings none: hex digits (24 for the first 2**32
    requests), unique within this process and (its 64-bit random prefix) across
    processes, with no system call."""
    return f"{_ID_PREFIX}{next(_ids):08x}"


def _bounded(value: str) -> str:
    return value if len(value) <= MAX_KEY_CHARS else "h:" + xxhash.xxh3_128_hexdigest(value.encode())


def _session_header(headers: Mapping[str, str], cfg: SessionConfig) -> tuple[str, str] | None:
    """The first session header present (``SessionConfig.headers`` order): (name, bounded value)."""
    for name in cfg.headers:
        value = headers.get(name)
        if value:
            return name, _bounded(value)
    return None


def session_keys(headers: Mapping[str, str], user: Any, cfg: SessionConfig) -> SessionKeys:
    """The conversation's key and its parent's (see ``SessionConfig``)."""
    named = not cfg.named.isdisjoint(headers.keys())  # (most requests name none by header)
    session = source = None
    if named and (found := _session_header(headers, cfg)) is not None:
        source, session = found
    if session is None and cfg.use_user_field and isinstance(user, str) and user:
        session = _bounded("user:" + user)
    if not named:
        return SessionKeys(session=session, parent=None) if session is not None else NO_SESSION
    parent = next((_bounded(v) for name in cfg.parent_headers if (v := headers.get(name))), None)
    if parent is None and source is not None and (fallback := cfg.parent_fallback.get(source)):
        value = headers.get(fallback)
        parent = _bounded(value) if value else None
    return SessionKeys(session=session, parent=parent if parent != session else None)


def per_model(keys: SessionKeys, model: str) -> SessionKeys:
    """The session keys of ``model``'s conversation: ``key@model`` (bounded as any key), so
    a session id an agent reuses for two models (a main and a small one) is two entries of
    the session table, each on a replica of its own model. A request naming no model
    (``ANY_MODEL``) keeps the keys as they are."""
    if model == ANY_MODEL or keys is NO_SESSION:
        return keys
    return SessionKeys(*(None if k is None else _bounded(f"{k}@{model}") for k in (keys.session, keys.parent)))


def _check_content_type(content_type: str | None) -> None:
    if content_type is None or content_type == "application/json":
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise UnsupportedMediaType(f"content type must be application/json, got {content_type!r}")


def _parse(body: bytes) -> dict[str, Any]:
    """The body as a JSON object (its size was checked by ``build_context``)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("the JSON body must be an object")
    if len(body) >= 2 * MAX_JSON_DEPTH:  # shorter bodies cannot nest that deep
        check_depth(data)
    return data


def check_depth(document: Any) -> bytes:
    """Raise ``InvalidRequest`` when ``document`` nests deeper than ``MAX_JSON_DEPTH``.

    Returns what the check serialized: orjson's spelling of ``document`` inside
    ``DEPTH_PAD`` brackets each side (``gateway.context_turns`` compares it with the body)."""
    wrapped = document
    for _ in range(DEPTH_PAD):
        wrapped = [wrapped]
    try:
        return orjson.dumps(wrapped)
    except orjson.JSONEncodeError as exc:
        raise InvalidRequest(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from exc


def refuse_client_ids(data: Mapping[str, Any]) -> None:
    """Raise ``InvalidRequest`` when the body chooses an id the replica would take as its
    own (``CLIENT_ID_FIELDS``): the gateway never lets one tenant name another's response
    or request. A top-level key lookup: cheap on every path."""
    for name in CLIENT_ID_FIELDS:
        if data.get(name) is not None:
            raise InvalidRequest(f"'{name}' is chosen by the server; a request may not set it", param=name)


def _optional_int(data: Mapping[str, Any], name: str) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"'{name}' must be a non-negative integer", param=name)
    return value


def _stream(data: Mapping[str, Any]) -> bool:
    value = data.get("stream")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    return value


def _model(data: Mapping[str, Any]) -> str:
    model = data.get("model")
    if model is None or model == "":
        return ANY_MODEL  # SGLang serves a single model and accepts a missing one
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", param="model")
    return model


def _check_messages(messages: Any, cached: int = 0) -> list[Any]:
    """``cached``: messages before these, checked already (``gateway.context_turns``)."""
    if not isinstance(messages, list) or not (messages or cached):
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    for i, msg in enumerate(messages, cached):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(f"messages[{i}].content must be a string or an array", param="messages")
    return messages


def _is_text_prompt(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and bool(value) and all(isinstance(p, str) for p in value)
    )


def _render(endpoint: str, data: dict[str, Any], keep_text: bool) -> tuple[bytes, int, str, int | None]:
    """(bytes to hash, prompt characters, routing text, exact token count when ids were sent)."""
    if endpoint == "chat":
        messages = _check_messages(data.get("messages"))
        try:
            text = conversation.render_chat(messages, data.get("tools"))
        except conversation.ShapeError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        return text.encode(), len(text), prefix_hash.chat_routing_text(messages) if keep_text else "", None
    if endpoint in AGENT_ENDPOINTS:
        text = agent_api.render(endpoint, data)
        return text.encode(), len(text), text if keep_text else "", None
    field = "prompt" if endpoint == "completions" else ("text" if "text" in data else "input_ids")
    prompt: Any = data.get(field)
    if endpoint == "generate" and prompt is None:
        raise InvalidRequest("'text' or 'input_ids' is required", param="text")
    if prefix_hash.is_token_ids(prompt):
        try:
            raw, n_tokens = prefix_hash.render_token_ids(prompt)
        except ValueError as exc:
            raise InvalidRequest(f"'{field}': {exc}", param=field) from exc
        return raw, 0, "", n_tokens
    if not _is_text_prompt(prompt) or prompt == "":
        raise InvalidRequest(f"'{field}' must be a non-empty string, array of strings or token ids", param=field)
    text = prefix_hash.render_text_prompt(prompt)
    routing_text = (prompt if isinstance(prompt, str) else " ".join(prompt)) if keep_text else ""
    return text.encode(), len(text), routing_text, None


def _max_tokens(endpoint: str, data: Mapping[str, Any]) -> int | None:
    if endpoint == "generate":
        params = data.get("sampling_params")
        if params is None:
            return None
        if not isinstance(params, dict):
            raise InvalidRequest("'sampling_params' must be an object", param="sampling_params")
        return _optional_int(params, "max_new_tokens")
    if endpoint == "responses":
        return _optional_int(data, "max_output_tokens")
    value = _optional_int(data, "max_tokens")
    return _optional_int(data, "max_completion_tokens") if value is None and endpoint == "chat" else value


def build_context(
    endpoint: str, body: bytes, headers: Mapping[str, str], content_type: str | None, cfg: ContextSettings
) -> RequestContext:
    """Validate and parse ``body`` once; hash its canonical rendering; name its session.

    ``headers`` must have lower-case keys. Raises ``InvalidRequest`` (400),
    ``UnsupportedMediaType`` (415) or ``PayloadTooLarge`` (413). Chat, Messages,
    count_tokens and Responses bodies go through ``gateway.context_turns`` when the
    configuration's cache is on (same result, a later turn costs only its new part).
    """
    kind = ENDPOINTS.get(endpoint)
    if kind is None:
        raise ValueError(f"unknown endpoint {endpoint!r}")
    hcfg, aliases = cfg.hashing, cfg.models.aliases
    _check_content_type(content_type)
    if len(body) > hcfg.max_body_bytes:
        raise PayloadTooLarge(f"request body is {len(body)} bytes; the limit is {hcfg.max_body_bytes}")
    if (kind in conversation.LAYOUTS and len(body) >= hcfg.prefix_cache_min_bytes and type(body) is bytes
            and hcfg.max_blocks > 0 and not hcfg.keep_routing_text and (cache := hcfg.context_cache()) is not None):
        done = context_turns.resume(kind, body, _cache_key(kind, headers, body, cfg.sessions), cache,
                                    hcfg.block_chars, hcfg.max_blocks, _checks(kind, aliases))
        if done is not None:
            return _context(kind, headers, cfg, done.model, done.session_field, done.hashes, done.chars, None,
                            done.short_raw, done.max_tokens, done.stream, "", done.payload)
    data = _parse(body)
    refuse_client_ids(data)
    model = agent_api.check(kind, data) if kind in AGENT_ENDPOINTS else _model(data)
    model = aliases.get(model, model)  # the served name from here on (gateway.models)
    max_tokens, stream = _max_tokens(kind, data), _stream(data)
    try:
        raw, chars, routing_text, n_tokens = _render(kind, data, hcfg.keep_routing_text)
    except orjson.JSONEncodeError as exc:  # unreachable after check_depth; never a 500
        raise InvalidRequest(f"the JSON body cannot be rendered: {exc}") from exc
    hashes = prefix_hash.chain_hashes(raw, model, hcfg.block_chars, hcfg.max_blocks)
    return _context(kind, headers, cfg, model, agent_api.session_field(kind, data), hashes, chars, n_tokens, raw,
                    max_tokens, stream, routing_text, data)


def _context(kind: str, headers: Mapping[str, str], cfg: ContextSettings, model: str, session_field: Any,
             hashes: tuple[int, ...], chars: int, n_tokens: int | None, raw: bytes, max_tokens: int | None,
             stream: bool, routing_text: str, payload: Mapping[str, Any]) -> RequestContext:
    hcfg = cfg.hashing
    if n_tokens is not None:
        chars = int(n_tokens * hcfg.chars_per_token)
    session = per_model(session_keys(headers, session_field, cfg.sessions), model)
    request_id = headers.get("x-request-id") or new_request_id()
    return RequestContext(
        request_id=_bounded(request_id),
        endpoint=kind,
        model=model,
        session=session,
        block_hashes=hashes,
        prompt_chars=chars,
        est_prompt_tokens=n_tokens if n_tokens is not None else int(chars / hcfg.chars_per_token),
        block_tokens=max(1, int(hcfg.block_chars / hcfg.chars_per_token)),
        max_tokens=max_tokens,
        stream=stream,
        routing_key=session.session or _prefix_key(raw, model, hashes, hcfg.routing_key_blocks),
        routing_text=routing_text,
        payload=payload,
    )


_ANCHOR_BYTES = 512  # a session-less body's cache key: a digest of its first bytes


def _cache_key(kind: str, headers: Mapping[str, str], body: bytes, cfg: SessionConfig) -> tuple[str, str, Any]:
    """Where ``gateway.context_cache`` files a body: its session header, else its first bytes."""
    if (found := _session_header(headers, cfg)) is not None:
        return kind, *found
    return kind, "", xxhash.xxh3_64_intdigest(body[:_ANCHOR_BYTES])


def _checks(kind: str, aliases: Mapping[str, str]) -> context_turns.Checks:
    """What ``gateway.context_turns`` checks of a body: the same as the full path."""
    def items(messages: list[Any], cached: int) -> None:
        if kind in AGENT_ENDPOINTS:
            agent_api.check_items(kind, messages, cached)
        else:
            _check_messages(messages, cached)

    def depth(listed: list[Any]) -> None:  # a list at the messages' depth: inside the body's object
        check_depth([listed])

    return context_turns.Checks(_validate_turn(kind, aliases), items, depth,
                                lambda top: agent_api.session_field(kind, top))


def _validate_turn(kind: str, aliases: Mapping[str, str]) -> context_turns.Validate:
    """The full path's checks of a body, for the skeleton of a resumed one. Also says
    whether the skeleton is orjson's own spelling of what it parsed to (compact JSON, as
    JSON.stringify writes it), from the depth check's serialization."""
    def validate(parsed: Any, top: dict[str, Any], cached: int, skeleton: bytes
                 ) -> tuple[str, int | None, bool, bool]:
        spelled = check_depth(parsed) if len(skeleton) >= 2 * MAX_JSON_DEPTH else b""
        refuse_client_ids(top)  # (a hit of an Outer reuses an accepted body's top level: checked then)
        if kind in AGENT_ENDPOINTS:
            model = agent_api.check(kind, top, cached)
        else:
            model = _model(top)
            _check_messages(top.get("messages"), cached)
        own = len(spelled) == len(skeleton) + 2 * DEPTH_PAD and spelled.startswith(skeleton, DEPTH_PAD)
        return aliases.get(model, model), _max_tokens(kind, top), _stream(top), own
    return validate


def _prefix_key(raw: bytes, model: str, hashes: tuple[int, ...], depth: int) -> str:
    """A session-less request's stable key: its prefix hash at ``depth`` blocks (or whole text)."""
    if hashes:
        return f"p:{hashes[min(depth, len(hashes)) - 1]:016x}"
    return f"p:{xxhash.xxh3_64_intdigest(raw, prefix_hash.model_seed(model)):016x}"
