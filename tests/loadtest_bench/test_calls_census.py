"""tools/profile/calls.py: the per-request census of calls inside a running gateway (real
processes: one simulated replica, kvgate and the pass-through floor on the same server and client, profiled from inside by the
hook the tool puts on their PYTHONPATH)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.procs import ROOT


def test_the_census_counts_kvgates_request_work_above_its_stack(tmp_path: Path) -> None:
    out = tmp_path / "census.json"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "profile" / "calls.py"), "--targets",
                          "kvgate,python-floor", "--requests", "40", "--warmup", "10", "--json", str(out)],
                         capture_output=True, text=True, timeout=180, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    census = json.loads(out.read_text())
    kvgate, floor = census["targets"]["kvgate"], census["targets"]["python-floor"]
    # both profiled from inside: the stack's own modules ran in each, once or more a request
    for target in (kvgate, floor):
        assert any(m.endswith("aiohttp/client.py") for m in target["modules"]), sorted(target["modules"])
        assert target["python_calls"] > 0 and target["c_calls"] > 0
    # kvgate routes (context, policy, index) on top of the same stack
    assert "policies/framework.py" in kvgate["modules"] and "policies/framework.py" not in floor["modules"]
    assert kvgate["python_calls"] > floor["python_calls"]
