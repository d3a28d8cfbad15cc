"""Fixtures shared by the safety tests."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
