"""DNS and static discovery, and make_discovery's choice of source."""
from __future__ import annotations

import socket

import pytest

from prefix_index.base import ReplicaId
from replicas.config import RegistryConfig
from replicas.discovery import DnsDiscovery, StaticDiscovery, make_discovery, resolve_addresses


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def add(self, url: ReplicaId) -> None:
        self.calls.append(("add", url))

    async def drain(self, url: ReplicaId) -> None:
        self.calls.append(("drain", url))

    async def remove(self, url: ReplicaId) -> None:
        self.calls.append(("remove", url))


class ScriptedDns:
    """Answers from a script, one entry per lookup; an exception entry is raised."""

    def __init__(self, answers: list[set[str] | Exception]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> set[str]:
        self.asked.append((host, port))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_dns_add_drain_remove_and_errors_keep_state() -> None:
    now = [0.0]
    dns = ScriptedDns([{"10.0.0.1", "10.0.0.2"}, socket.gaierror(-2, "Name or service not known"),
                       {"10.0.0.2"}, {"10.0.0.2", "fd00::3"}, {"10.0.0.2", "fd00::3"}, {"10.0.0.1", "10.0.0.2"}])
    target = Recorder()
    disc = DnsDiscovery("sglang.llm.svc", 30000, target, remove_after_s=60.0, resolver=dns, clock=lambda: now[0])
    for t in (0.0, 10.0, 20.0, 30.0, 80.0, 90.0):
        now[0] = t
        await disc.poll_once()
    u1, u2, u3 = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://[fd00::3]:30000"
    assert target.calls == [
        ("add", u1), ("add", u2),      # t=0
        ("drain", u1),                 # t=20 (t=10 failed: nothing changes)
        ("add", u3),                   # t=30
        ("remove", u1),                # t=80: absent for 60 s
        ("add", u1), ("drain", u3),    # t=90: back, and u3 gone
    ]
    assert dns.asked[0] == ("sglang.llm.svc", 30000)


async def test_resolve_localhost() -> None:
    assert "127.0.0.1" in await resolve_addresses("localhost", 30000)


async def test_static_and_make_discovery() -> None:
    target = Recorder()
    disc = make_discovery(RegistryConfig(replicas=["http://127.0.0.1:1/", "http://127.0.0.1:2"]), target)
    assert isinstance(disc, StaticDiscovery)
    await disc.run()
    assert target.calls == [("add", "http://127.0.0.1:1"), ("add", "http://127.0.0.1:2")]
    assert isinstance(make_discovery(RegistryConfig(discovery="dns", dns_name="x"), target), DnsDiscovery)
    with pytest.raises(ValueError, match="dns_name"):
        make_discovery(RegistryConfig(discovery="dns"), target)
    with pytest.raises(ValueError, match="k8s_service"):
        make_discovery(RegistryConfig(discovery="kubernetes"), target)
