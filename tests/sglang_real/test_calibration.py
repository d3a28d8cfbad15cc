"""The simulated replica calibrated against a REAL SGLang CPU server (issue 11, item 6).

`loadtest.calibrate` replays the same seeded multi-session workload (shared prefixes,
overflowing the 16,384-token pool, so eviction decides the later hits) one request at a
time through the package's real server 0 and the package's simulated ``tiny-cpu``
replica (same pool, page size 1), and compares per-request ``cached_tokens``: at least
95% of the requests must agree within one page. The report is in the failure message
(and ``python -m loadtest.calibrate`` prints it).
"""
from __future__ import annotations

import pytest

from loadtest.calibrate import WorkloadParams, replay, report
from tests.sglang_real.conftest import MAX_TOTAL_TOKENS

pytestmark = pytest.mark.sglang_real

PAGE_SIZE = 1  # what the CPU server resolves (and the tiny-cpu profile states)


def test_simulated_cached_tokens_match_the_real_server(real_urls: list[str], sim_url: str) -> None:
    params = WorkloadParams()
    rows = replay(real_urls[0], sim_url, params)
    rep = report(rows, PAGE_SIZE)
    final = max(r.prompt_tokens for r in rows if r.session == 0)
    assert params.sessions * final > 1.5 * MAX_TOTAL_TOKENS  # the workload overflows the pool
    evicted = [r for r in rows if r.turn > 0 and r.real_cached < 0.5 * r.prompt_tokens]
    assert evicted, rep.text()  # eviction matters: some later turns lost most of their prefix
    assert rep.within_page >= 0.95, rep.text() + "\n" + "\n".join(map(str, rows))
