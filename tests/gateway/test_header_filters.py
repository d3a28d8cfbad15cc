"""gateway.relay's header filters against the way they were written before they lowered each
name once (2026-12-04): the same headers kept, in the same order, for any header list."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.relay import (
    _OWN_PREFIX,
    CREDENTIALS,
    HOP_BY_HOP,
    NOT_RELAYED,
    HeaderPolicy,
    downstream_headers,
    upstream_headers,
)

Raw = list[tuple[bytes, bytes]]


# -- the filters as they were (a frozen copy: the reference) ------------------------------
def _old_named(raw: Raw) -> frozenset[bytes]:
    named = [t.strip().lower() for k, v in raw if k.lower() == b"connection" for t in v.split(b",")]
    return frozenset(n for n in named if n)


def _old_drop(name: bytes, named: frozenset[bytes]) -> bool:
    return name in HOP_BY_HOP or name in named or name.startswith((b"proxy-", _OWN_PREFIX))


def old_upstream(raw: Raw, policy: HeaderPolicy, client: str | None, scheme: str) -> Raw:
    named = _old_named(raw)
    keep_auth = policy.forward_authorization and policy.replica_authorization is None
    out: Raw = []
    forwarded_for: list[bytes] = []
    host = b""
    proto = fhost = False
    for k, v in raw:
        name = k.lower()
        if name == b"host":
            host = v
        if _old_drop(name, named) or (name in CREDENTIALS and not keep_auth):
            continue
        if name == b"x-forwarded-for":
            forwarded_for.append(v)
            continue
        proto = proto or name == b"x-forwarded-proto"
        fhost = fhost or name == b"x-forwarded-host"
        out.append((k, v))
    if client:
        forwarded_for.append(client.encode("latin-1"))
    if forwarded_for:
        out.append((b"x-forwarded-for", b", ".join(forwarded_for)))
    if not proto:
        out.append((b"x-forwarded-proto", scheme.encode("latin-1")))
    if host and not fhost:
        out.append((b"x-forwarded-host", host))
    if policy.replica_authorization is not None:
        out.append((b"authorization", policy.replica_authorization))
    return out


def old_downstream(raw: Raw) -> Raw:
    named = _old_named(raw)
    return [(k, v) for k, v in raw if not _old_drop(k.lower(), named) and k.lower() not in NOT_RELAYED]


# -- header lists that exercise every rule -------------------------------------------------
NAMES = [b"content-type", b"accept", b"user-agent", b"x-custom", b"x-other", b"Host", b"connection",
         b"Connection", b"keep-alive", b"TE", b"proxy-foo", b"Proxy-Authorization", b"x-kvgate-replica",
         b"X-KVGATE-x", b"authorization", b"X-Api-Key", b"x-forwarded-for", b"X-Forwarded-Proto",
         b"x-forwarded-host", b"date", b"Server", b"content-length", b"expect", b"transfer-encoding"]
name = st.sampled_from(NAMES).flatmap(lambda n: st.sampled_from([n, n.upper(), n.lower()]))
token = st.sampled_from([b"x-custom", b"X-Other", b"keep-alive", b"close", b"", b" ", b"accept", b"upgrade"])
connection_value = st.lists(token, max_size=4).map(lambda ts: b",".join(b" " + t + b" " for t in ts))
value = st.sampled_from([b"1", b"a, b", b"10.0.0.1", b"https", b"Bearer x", b"text/event-stream",
                         b"application/json"]) | connection_value
headers = st.lists(st.tuples(name, value), max_size=12)
policies = st.sampled_from([HeaderPolicy(), HeaderPolicy(forward_authorization=True),
                            HeaderPolicy(replica_authorization=b"Bearer k"),
                            HeaderPolicy(True, b"Bearer k")])


@settings(max_examples=400, deadline=None)
@given(headers, policies, st.sampled_from([None, "", "127.0.0.1"]), st.sampled_from(["http", "https"]))
def test_upstream_headers_keep_what_they_kept(raw: Raw, policy: HeaderPolicy, client: str | None,
                                              scheme: str) -> None:
    assert upstream_headers(raw, policy, client, scheme) == old_upstream(raw, policy, client, scheme)


@settings(max_examples=400, deadline=None)
@given(headers)
def test_downstream_headers_keep_what_they_kept(raw: Raw) -> None:
    assert downstream_headers(raw) == old_downstream(raw)
