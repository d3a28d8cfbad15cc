"""Which replica created each OpenAI Responses id: the pin of ``previous_response_id``.

A Responses request that names a ``previous_response_id`` continues a conversation the
replica that created that response holds in its own store (SGLang
``--enable-response-store``); ``GET``/``DELETE /v1/responses/{id}`` and ``.../cancel``
need the same replica. The gateway records ``response id -> replica`` when a response
is created (its JSON body's ``id``, or the ``response.created`` event of a stream) and
looks it up before routing.

Two backends behind one small Protocol:

- ``MemoryResponsesStore``: a bounded LRU (``responses.max_entries``, default 200,000
  entries, ~150 B each: ~30 MB) whose entries expire ``responses.ttl_s`` after they were
  written (default 24 h: a coding session rarely resumes a response older than a day,
  and a replica restart loses its store anyway). Embedded, per gateway process.
- ``RedisResponsesStore``: the same LRU in front of Redis (``SET <prefix>:resp:<id>
  <replica> EX ttl``), so every gateway on one Redis (``index.redis_url``) sees every
  other's responses. A Redis call gets ``responses.redis_timeout_s`` (0.5 s: a pin is
  worth a slower answer, unlike an index read); a failing Redis degrades to the local
  copy (this gateway's own responses), counted in ``degraded_total`` and logged, never
  failing the request by itself.

``make_responses_store(config, redis_url, key_prefix)`` chooses one.

**Ownership (issue 41).** Every entry records, beside its replica, the *tenant* that
created the response, and only that tenant may continue, read, cancel or delete it
(``gateway.api_routes``); another tenant gets the very 404 of an unknown id, so an id
learnt elsewhere is worth nothing. A tenant (``Tenants.of``) is:

- the value of ``responses.tenant_header`` when that is set and the request carries it:
  a header an authenticating proxy in front of the gateway sets (and strips from its
  clients), for deployments where the proxy, not the client's key, names the tenant;
- else the credential the client presented (``Authorization`` and ``x-api-key``), as an
  HMAC-SHA256 under a key of the gateway's: the secret itself is never stored, and a
  store dump does not let anyone test guesses of keys without the HMAC key;
- else ``anonymous``: every client without a credential is one tenant.

The HMAC key is ``responses.tenant_hash_key`` when set (the same on every gateway of one
store). Unset, an embedded store uses a random key per process (its entries die with
the process anyway); a Redis store must give every gateway the same key, so the first
gateway creates a random one with ``SET NX <prefix>:tenant-hash-key`` and every gateway
reads it back (the key then lives as long as the Redis data: rotating it, by deleting
it, orphans every stored response, which then answers 404 to everyone). While Redis
cannot be asked, a gateway hashes with its own per-process key and asks again on the
next request: responses created in that window are owned by a hash no one else
computes (fail closed: a 404, never another tenant's response).

An entry written before ownership existed (a bare replica URL in Redis) has no tenant:
owned by nobody, it answers 404. A response id is recorded by its first creator only
(``SET NX``; the embedded copy keeps an existing entry of another tenant): a replica
that reuses an id cannot move another tenant's pin.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import orjson
from pydantic import BaseModel, Field, SecretStr, field_validator

from prefix_index.base import ReplicaId

log = logging.getLogger("kvgate.responses")


class ResponsesStoreConfig(BaseModel):
    """The ``responses`` section: where the gateway remembers Responses ids."""

    max_entries: int = Field(default=200_000, ge=1, description="response ids kept per gateway (LRU, ~150 B each)")
    ttl_s: float = Field(default=86400.0, gt=0, description="forget a response id this long after it was created")
    redis_timeout_s: float = Field(default=0.5, gt=0, description="Redis budget per call (pins are worth waiting for)")
    tenant_hash_key: SecretStr | None = Field(
        default=None, description="HMAC key of client credentials (unset: random per process, or shared in Redis)")
    tenant_header: str | None = Field(
        default=None, description="a header set by a trusted authenticating proxy that names the tenant")

    @field_validator("tenant_header")
    @classmethod
    def _lower(cls, value: str | None) -> str | None:
        """Header maps are read with lower-case names; an empty name means unset."""
        return value.strip().lower() or None if value is not None else None


ANONYMOUS = "anonymous"  # the one tenant of every client without a credential
TENANT_KEY = "tenant-hash-key"  # under the key prefix, in Redis: the shared HMAC key
CREDENTIAL_HEADERS = ("authorization", "x-api-key")


class Stored(NamedTuple):
    """A stored response id: the replica holding it and the tenant owning it (None: nobody)."""

    replica: ReplicaId
    tenant: str | None


def owned_by(entry: Stored | None, tenant: str) -> bool:
    """Whether ``tenant`` may see the entry (constant-time: no hash prefix leaks by timing).
    An entry without a tenant (or an empty one) is nobody's."""
    return entry is not None and bool(entry.tenant) and hmac.compare_digest(entry.tenant or "", tenant)


def encode_entry(replica: ReplicaId, tenant: str) -> bytes:
    return orjson.dumps({"replica": replica, "tenant": tenant})


def decode_entry(raw: bytes | str) -> Stored:
    """A Redis value; an old bare replica URL (or anything unexpected) is owned by nobody."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        return Stored(ReplicaId(text), None)
    if isinstance(data, dict) and isinstance(data.get("replica"), str):
        tenant = data.get("tenant")
        return Stored(ReplicaId(data["replica"]), tenant if isinstance(tenant, str) and tenant else None)
    return Stored(ReplicaId(text), None)


class ResponsesStore(Protocol):
    async def put(self, response_id: str, replica: ReplicaId, tenant: str) -> None: ...

    async def get(self, response_id: str) -> Stored | None: ...

    async def delete(self, response_id: str) -> None: ...

    async def close(self) -> None: ...


class MemoryResponsesStore:
    """A bounded LRU with expiry (see the module docstring)."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, tuple[Stored, float]] = OrderedDict()
        self.key = os.urandom(32)  # the per-process HMAC key of tenants (see the module docstring)

    def __len__(self) -> int:
        return len(self._entries)

    def put_local(self, response_id: str, entry: Stored, ttl_s: float | None = None) -> bool:
        """Record the entry unless another tenant's live entry holds the id (first writer
        wins: a reused id never moves another tenant's pin). True when recorded."""
        entries = self._entries
        old = self.get_local(response_id)
        if old is not None and old.tenant != entry.tenant:
            return False
        entries[response_id] = (entry, self.clock() + (self.ttl_s if ttl_s is None else ttl_s))
        entries.move_to_end(response_id)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
        return True

    def get_local(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            del self._entries[response_id]
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    async def put(self, response_id: str, replica: ReplicaId, tenant: str) -> None:
        self.put_local(response_id, Stored(replica, tenant))

    async def get(self, response_id: str) -> Stored | None:
        return self.get_local(response_id)

    async def tenant_key(self) -> tuple[bytes, bool]:
        """(HMAC key, final): one random key per process, final from the start."""
        return self.key, True

    async def delete(self, response_id: str) -> None:
        self._entries.pop(response_id, None)

    async def close(self) -> None:
        return None


class RedisResponsesStore:
    """The embedded LRU in front of a shared Redis (see the module docstring)."""

    def __init__(self, url: str, key_prefix: str, config: ResponsesStoreConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import redis.asyncio as aioredis  # imported only when a Redis is configured

        self.local = MemoryResponsesStore(config.max_entries, config.ttl_s, clock)
        self.redis: Any = aioredis.from_url(url, socket_timeout=config.redis_timeout_s,
                                            socket_connect_timeout=config.redis_timeout_s)
        self.prefix = f"{key_prefix}:resp:"
        self.ttl_s = config.ttl_s
        self.timeout_s = config.redis_timeout_s
        self.degraded_total = 0
        self.key_name = f"{key_prefix}:{TENANT_KEY}"
        self._shared_key: bytes | None = None

    async def _call(self, what: str, op: Callable[[], Any], failed: Any = None) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await op()
        except Exception as exc:  # noqa: BLE001 - Redis down or slow: the local copy answers
            self.degraded_total += 1
            log.warning("responses store: redis %s failed (%s: %s); using the local copy", what,
                        type(exc).__name__, exc)
            return failed

    async def put(self, response_id: str, replica: ReplicaId, tenant: str) -> None:
        """First writer wins, in Redis (``SET NX``) as locally: a reused id stays its owner's."""
        entry = Stored(replica, tenant)
        ttl = max(1, int(self.ttl_s))
        written = await self._call("set", lambda: self.redis.set(self.prefix + response_id,
                                                                 encode_entry(replica, tenant), ex=ttl, nx=True),
                                   failed=True)
        if written:  # (or Redis failed: the local copy is all there is)
            self.local.put_local(response_id, entry)

    async def get(self, response_id: str) -> Stored | None:
        mine = self.local.get_local(response_id)
        if mine is not None:
            return mine
        raw = await self._call("get", lambda: self.redis.get(self.prefix + response_id))
        if raw is None:
            return None
        entry = decode_entry(raw)
        self.local.put_local(response_id, entry)
        return entry

    async def tenant_key(self) -> tuple[bytes, bool]:
        """(HMAC key, final): the key every gateway on this Redis shares, created once
        (``SET NX``) and read back; this process's own key, not final, while Redis fails."""
        if self._shared_key is not None:
            return self._shared_key, True
        fresh = os.urandom(32).hex()

        async def create_and_read() -> Any:
            await self.redis.set(self.key_name, fresh, nx=True)
            return await self.redis.get(self.key_name)

        raw = await self._call("tenant key", create_and_read)
        if raw is None:
            return self.local.key, False
        self._shared_key = raw if isinstance(raw, bytes) else str(raw).encode()
        return self._shared_key, True

    async def delete(self, response_id: str) -> None:
        await self.local.delete(response_id)
        await self._call("delete", lambda: self.redis.delete(self.prefix + response_id))

    async def close(self) -> None:
        await self.redis.aclose()


class Tenants:
    """Who a request's client is, as stored with its responses (see the module docstring)."""

    def __init__(self, config: ResponsesStoreConfig, store: MemoryResponsesStore | RedisResponsesStore) -> None:
        self.header = config.tenant_header
        secret = config.tenant_hash_key
        self._key: bytes | None = secret.get_secret_value().encode() if secret is not None else None
        self.store = store

    async def key(self) -> bytes:
        """The configured key, else the store's (random per process, or shared in Redis)."""
        if self._key is not None:
            return self._key
        key, final = await self.store.tenant_key()
        if final:
            self._key = key
        return key

    async def of(self, headers: Mapping[str, str]) -> str:
        """The tenant of a request with these (lower-case) headers."""
        if self.header is not None and (named := headers.get(self.header)):
            return "h:" + await self._mac(b"header\0" + named.encode("utf-8", "surrogateescape"))
        credentials = [headers.get(name) or "" for name in CREDENTIAL_HEADERS]
        if not any(credentials):
            return ANONYMOUS
        material = b"credential\0" + "\0".join(credentials).encode("utf-8", "surrogateescape")
        return "k:" + await self._mac(material)

    async def _mac(self, material: bytes) -> str:
        return hmac.new(await self.key(), material, hashlib.sha256).hexdigest()


def make_responses_store(config: ResponsesStoreConfig, redis_url: str | None,
                         key_prefix: str) -> MemoryResponsesStore | RedisResponsesStore:
    """Redis-backed when the gateway has a Redis (``index.redis_url``), else embedded."""
    if redis_url:
        return RedisResponsesStore(redis_url, key_prefix, config)
    return MemoryResponsesStore(config.max_entries, config.ttl_s)
