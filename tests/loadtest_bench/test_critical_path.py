"""tools/profile/critical_path.py: a small request's steps timed inside a running kvgate (real
processes: one simulated replica and kvgate, marked from inside by the hook the tool puts on
its PYTHONPATH). The test holds the marks to the callbacks path's order, so a renamed step
fails here, not silently in the tool."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from tests.support.procs import ROOT

_spec = importlib.util.spec_from_file_location(  # the hook's own list of steps (inert without its variable)
    "critical_path_hook", ROOT / "tools" / "profile" / "critical_path_hook" / "sitecustomize.py")
assert _spec is not None and _spec.loader is not None
HOOK = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(HOOK)


def test_every_step_of_a_small_request_is_timed_in_path_order(tmp_path: Path) -> None:
    out = tmp_path / "path.json"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "profile" / "critical_path.py"), "--requests", "60",
                          "--warmup", "10", "--json", str(out)],
                         capture_output=True, text=True, timeout=180, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["requests"] >= 50  # (the first request after the start completes a row only at the next)
    marks = [HOOK.FIRST, *(m for step in HOOK.STEPS for m in step[3:5] if m)]
    marks.append("j_answer_bytes_in")
    steps = result["steps"]
    seen = {name for step in steps for name in step.split(" -> ")}
    assert seen == set(marks), sorted(set(marks) ^ seen)
    assert list(steps)[-1].endswith(HOOK.LAST)
    assert all(median >= 0 for median, _ in steps.values())  # sorted by name is the path's order
