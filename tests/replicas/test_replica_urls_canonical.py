"""Canonical replica identity (replicas.urls): one replica, one id, whatever the spelling.

Issue 41, item 7: ``HTTP://...``, ``0.0.0.0`` and ``0x7f000001`` spellings of one replica
became three replicas, and metadata addresses were accepted. These pin the normalizer
(with hypothesis over every IPv4 / IPv6 address), the link-local and metadata refusal
and its setting, and that the config and both discovery sources use the same form.
"""
from __future__ import annotations

import ipaddress
import socket
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_index.base import ReplicaId
from replicas.config import RegistryConfig
from replicas.discovery import DnsDiscovery
from replicas.discovery_k8s import EndpointState, slice_endpoints
from replicas.urls import ReplicaUrlError, address_replica_url, inet_aton, parse_replica_url

LOOPBACK = "http://127.0.0.1:30000"


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:30000", "HTTP://127.0.0.1:30000", "Http://127.0.0.1:30000/", "http://0.0.0.0:30000",
    "http://0x7f000001:30000", "http://0X7F000001:30000", "http://2130706433:30000", "http://127.1:30000",
    "http://127.0.1:30000", "http://0177.0.0.1:30000", "http://0x7f.0.0.1:30000", "http://[::ffff:127.0.0.1]:30000",
    "http://[::ffff:7f00:1]:30000", "http://[0:0:0:0:0:FFFF:7F00:0001]:30000", "http://127.0.0.1.:30000",
    "http://127.0.0.1:030000", "http://0:30000",
])
def test_spellings_of_one_loopback_replica_are_one_id(url: str) -> None:
    assert parse_replica_url(url) == LOOPBACK


@pytest.mark.parametrize("url,expected", [
    ("http://R.Example.COM:30000/", "http://r.example.com:30000"),
    ("http://r.example.com.:30000", "http://r.example.com.:30000"),  # trailing dot kept: search domains
    ("http://replica:80", "http://replica"), ("https://replica:443/", "https://replica"),
    ("https://replica:80", "https://replica:80"), ("http://replica:443", "http://replica:443"),
    ("http://[FD00:0:0:0::1]:8080", "http://[fd00::1]:8080"), ("http://[::]:1", "http://[::1]:1"),
    ("http://[0000::0001]:1", "http://[::1]:1"), ("http://h:1/v1//", "http://h:1/v1"),
    ("http://h:1/Prefix", "http://h:1/Prefix"), ("http://localhost:1", "http://localhost:1"),
    ("http://127.0.0.2:1", "http://127.0.0.2:1"),
])
def test_canonical_forms(url: str, expected: str) -> None:
    assert parse_replica_url(url) == expected


@pytest.mark.parametrize("url", [
    "http://169.254.169.254", "http://169.254.169.254:80/latest", "http://0xa9fea9fe", "http://2852039166",
    "http://169.254.43518", "http://[::ffff:169.254.169.254]", "http://[64:ff9b::a9fe:a9fe]",
    "http://169.254.170.2", "http://169.254.0.1:30000", "http://[fe80::1]:30000", "http://[FE80::1%25eth0]:1",
    "http://[fd00:ec2::254]", "http://[fd00:ec2:0::254]:80", "http://100.100.100.200",
    "http://metadata.google.internal", "http://METADATA.Google.Internal.", "http://metadata", "http://metadata.goog",
    "http://instance-data", "http://instance-data.ec2.internal:80",
])
def test_link_local_and_metadata_are_refused_unless_allowed(url: str) -> None:
    with pytest.raises(ReplicaUrlError, match="allow_link_local_replicas"):
        parse_replica_url(url)
    assert parse_replica_url(url, allow_link_local=True)  # the setting lets an operator opt in


@pytest.mark.parametrize("url", [
    "http://999.1.1.1:1", "http://1.2.3.4.5:1", "http://1.2.3.256:1", "http://4294967296:1", "http://foo.0x1:1",
    "http://0x:1", "http://08.0.0.1:1", "http://+1.1.1.1:1", "http://1_0.1.1.1:1", "http://1..1:1",
    "http://h:1/../x", "http://h:1/a/./b", "http://[fe80::1:1", "http://[::1]]:1",
])
def test_not_addresses_are_refused(url: str) -> None:
    with pytest.raises(ReplicaUrlError):
        parse_replica_url(url)


def _expected_v4(address: ipaddress.IPv4Address) -> str:
    return "127.0.0.1" if address.is_unspecified else str(address)


def _v4_spellings(address: ipaddress.IPv4Address) -> list[str]:
    """Forms every inet_aton accepts for one address, and its IPv4-mapped IPv6 forms."""
    value, b = int(address), address.packed
    return [str(address), str(value), hex(value), hex(value).upper().replace("0X", "0x"),
            ".".join(f"0{x:o}" for x in b), f"{b[0]}.{int.from_bytes(b[1:], 'big')}",
            f"{b[0]}.{b[1]}.{int.from_bytes(b[2:], 'big')}", f"0x{b[0]:x}.{b[1]}.0{b[2]:o}.{b[3]}",
            f"[::ffff:{address}]", f"[::FFFF:{value >> 16:x}:{value & 0xFFFF:x}]",
            f"[0:0:0:0:0:ffff:{address}]"]


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1), st.sampled_from(["http", "HTTP", "https"]),
       st.integers(min_value=1, max_value=65535))
def test_every_ipv4_spelling_is_one_id(value: int, scheme: str, port: int) -> None:
    address = ipaddress.IPv4Address(value)
    ids = {parse_replica_url(f"{scheme}://{host}:{port}/", allow_link_local=True) for host in _v4_spellings(address)}
    assert len(ids) == 1, ids
    only = ids.pop()
    assert only.split("//", 1)[1].split(":")[0].split("/")[0] == _expected_v4(address)
    assert parse_replica_url(only, allow_link_local=True) == only  # idempotent


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**128 - 1), st.integers(min_value=1, max_value=65535))
def test_every_ipv6_spelling_is_one_id(value: int, port: int) -> None:
    address = ipaddress.IPv6Address(value)
    spellings = {address.exploded, address.compressed, address.exploded.upper(), address.compressed.upper()}
    ids = {parse_replica_url(f"http://[{s}]:{port}", allow_link_local=True) for s in spellings}
    assert len(ids) == 1, ids
    only = ids.pop()
    assert parse_replica_url(only, allow_link_local=True) == only
    if address.ipv4_mapped is not None:
        assert "[" not in only  # written as its IPv4 address


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="compares with glibc's inet_aton")
@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="0123456789abcdefxX.", min_size=1, max_size=24))
def test_inet_aton_matches_the_c_library(text: str) -> None:
    """What the resolver would connect to is what the id says (no DNS lookup is made)."""
    try:
        expected: str | None = socket.inet_ntoa(socket.inet_aton(text))
    except OSError:
        expected = None
    got = inet_aton(text)
    assert (None if got is None else str(got)) == expected


def test_config_keeps_one_canonical_entry_per_replica() -> None:
    config = RegistryConfig(replicas=["HTTP://127.0.0.1:30000/", "http://0x7f000001:30000", "http://0.0.0.0:30000",
                                      "http://R2:80"])
    assert config.replicas == [LOOPBACK, "http://r2"]


def test_config_refuses_metadata_unless_allowed() -> None:
    with pytest.raises(ValueError, match="metadata"):
        RegistryConfig(replicas=["http://169.254.169.254"])
    allowed = RegistryConfig(replicas=["http://[fd00:ec2::254]"], allow_link_local_replicas=True)
    assert allowed.replicas == ["http://[fd00:ec2::254]"]


def test_discovery_addresses_use_the_same_form() -> None:
    assert address_replica_url("::ffff:10.0.0.1", 30000) == "http://10.0.0.1:30000"
    assert address_replica_url("FD00:0::3", 30000) == "http://[fd00::3]:30000"
    with pytest.raises(ReplicaUrlError):
        address_replica_url("169.254.169.254", 80)


def test_endpointslice_addresses_are_canonical_and_metadata_skipped() -> None:
    obj = {"ports": [{"port": 30000}], "endpoints": [
        {"addresses": ["fd00:0:0::1", "169.254.169.254"], "conditions": {"ready": True}},
        {"addresses": ["fd00::1"], "conditions": {"ready": False, "serving": True}},
    ]}
    assert slice_endpoints(obj, None) == {ReplicaId("http://[fd00::1]:30000"): EndpointState.READY}
    allowed = slice_endpoints(obj, None, allow_link_local=True)
    assert ReplicaId("http://169.254.169.254:30000") in allowed


class _Recorder:
    def __init__(self) -> None:
        self.added: list[str] = []

    async def add(self, url: ReplicaId) -> None:
        self.added.append(url)

    async def drain(self, url: ReplicaId) -> None:
        raise AssertionError(url)

    async def remove(self, url: ReplicaId) -> None:
        raise AssertionError(url)


async def test_dns_answers_are_canonical_and_metadata_skipped() -> None:
    async def resolve(host: str, port: int) -> set[str]:
        return {"::ffff:10.0.0.1", "10.0.0.1", "169.254.169.254", "fd00:ec2::254"}

    target = _Recorder()
    await DnsDiscovery("sglang.svc", 30000, target, resolver=resolve).poll_once()
    assert target.added == ["http://10.0.0.1:30000"]
