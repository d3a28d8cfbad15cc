"""`kvgate drain` against fake gateways and a fake replica (httpx MockTransport)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import pytest

from replicas import drain_cmd

REPLICA = "http://10.0.0.7:30000"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    drain_cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


class Fleet:
    """g1 knows the replica (in flight 2, 1, 0 across polls); g2 does not; the replica reports loads."""

    def __init__(self, g1_in_flight: list[int], replica_busy: list[int], deadline_s: float = 30.0) -> None:
        self.g1_in_flight, self.replica_busy, self.deadline_s = g1_in_flight, replica_busy, deadline_s
        self.log: list[tuple[str, str, str | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        self.log.append((host, f"{request.method} {path}", request.headers.get("authorization")))
        if host == "10.0.0.7":
            assert path == "/v1/loads"
            n = self.replica_busy.pop(0) if len(self.replica_busy) > 1 else self.replica_busy[0]
            return httpx.Response(200, json={"loads": [{"dp_rank": 0, "num_running_reqs": n, "num_waiting_reqs": 0}]})
        if host == "g2":
            return httpx.Response(404, json={"error": {"message": "unknown replica"}})
        if path == "/admin/replicas/drain":
            assert json.loads(request.content) == {"url": REPLICA, "deadline_s": self.deadline_s}
            return httpx.Response(200, json={"url": REPLICA, "state": "draining"})
        n = self.g1_in_flight.pop(0) if len(self.g1_in_flight) > 1 else self.g1_in_flight[0]
        rows = [{"url": "http://10.0.0.8:30000", "state": "active", "in_flight": 9},
                {"url": REPLICA, "state": "draining", "in_flight": n}]
        return httpx.Response(200, json={"object": "list", "data": rows})  # gateway/admin.py's shape


async def test_drains_waits_for_gateways_and_replica(tmp_path: Path) -> None:
    fleet = Fleet([2, 1, 0], [1, 1, 1, 0])
    done = tmp_path / "drain" / "done"
    args = parse("--gateway", "http://g1:8000/", "--gateway", "http://g2:8000", "--replica", REPLICA, "--wait",
                 "--timeout-s", "30", "--poll-interval-s", "0", "--admin-token", "s3cret", "--done-file", str(done))
    assert await drain_cmd.main_async(args, httpx.MockTransport(fleet)) == 0
    assert done.is_file()
    gateway_calls = [(h, what) for h, what, _ in fleet.log if h != "10.0.0.7"]
    assert gateway_calls[:2] == [("g1", "POST /admin/replicas/drain"), ("g2", "POST /admin/replicas/drain")]
    polls = [h for h, what, _ in fleet.log if what.startswith("GET")]
    assert polls.count("10.0.0.7") == 4  # waited until the replica itself was idle too
    assert {auth for h, _, auth in fleet.log if h != "10.0.0.7"} == {"Bearer s3cret"}
    assert {auth for h, _, auth in fleet.log if h == "10.0.0.7"} == {None}  # the token stays with the gateways


async def test_timeout_exits_1_and_still_writes_done_file(tmp_path: Path) -> None:
    done = tmp_path / "done"
    args = parse("--gateway", "http://g1:8000", "--replica", REPLICA, "--wait", "--timeout-s", "0.05",
                 "--poll-interval-s", "0.01", "--no-replica-loads", "--done-file", str(done))
    fleet = Fleet([1], [0], deadline_s=0.05)
    assert await drain_cmd.main_async(args, httpx.MockTransport(fleet)) == 1
    assert done.is_file()
    assert all(h != "10.0.0.7" for h, _, _ in fleet.log)


async def test_no_wait_unreachable_gateways_exit_2() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    args = parse("--gateway", "http://g1:8000", "--replica", REPLICA)
    assert await drain_cmd.main_async(args, httpx.MockTransport(refuse)) == 2


async def test_all_addresses_expands_gateway_host() -> None:
    got = await drain_cmd.expand_gateways(["http://localhost:8000", "http://no-such-host.invalid:1"], True)
    assert "http://127.0.0.1:8000" in got and got[-1] == "http://no-such-host.invalid:1"


def test_cli_wiring_and_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "from-env")
    args = parse("--gateway", "http://g", "--replica", REPLICA)
    assert args.admin_token == "from-env" and args.timeout_s == 840.0 and not args.wait


async def test_token_from_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGATE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("KVGATE_ADMIN__TOKEN", raising=False)
    secret = tmp_path / "token"
    secret.write_text("from-file\n")
    fleet = Fleet([0], [0], deadline_s=840.0)
    args = parse("--gateway", "http://g1:8000", "--replica", REPLICA, "--admin-token-file", str(secret))
    assert await drain_cmd.main_async(args, httpx.MockTransport(fleet)) == 0
    assert {auth for h, _, auth in fleet.log if h == "g1"} == {"Bearer from-file"}
    monkeypatch.setenv("KVGATE_ADMIN__TOKEN_FILE", str(tmp_path / "missing"))
    assert drain_cmd.run(parse("--gateway", "http://g1:8000", "--replica", REPLICA)) == 2
