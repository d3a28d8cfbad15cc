"""Profile one ``kvgate serve`` under the overhead load: py-spy flame graphs and top frames.

Starts one simulated replica (the overhead bench's profile, compute ~0) and one gateway in
front of it (in-memory index, slow probes, as in ``kvgate bench peers --overhead``), then
for each body (a small chat request, a ``--kb`` KB agent-shaped one) drives ``--seconds``
of closed-loop load at ``--concurrency`` through the gateway while two py-spy samplers
attach to it (``--nonblocking``: the gateway is never paused): one writes the SVG flame
graph, the other the collapsed stacks this script sums into the top frames (self time per
function and inclusive time per function, as percentages of the gateway's non-idle
samples) and ``docs/profile/<body>.txt``.

    tools/profile/setup.sh            # once: py-spy into .venv-tools/ (idempotent)
    python tools/profile/profile_serve.py --out docs/profile [--native] [--target python-floor]

``--target`` profiles another process of ``kvgate bench peers`` in the same place (a
``python-floor*`` pass-through: ``loadtest/peers/targets.py``) instead of ``kvgate serve``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from loadtest.bench_gateway import PROFILE, client_session, large_body, small_body, timed_post
from loadtest.peers.overhead import SLOW_PROBES
from loadtest.peers.targets import open_target
from loadtest.simulator.fleet import SimFleet

PY_SPY = ROOT / ".venv-tools" / "bin" / "py-spy"
IDLE_LEAVES = ("epoll_pwait", "epoll_wait", "select", "poll", "ppoll")
"""With ``--native`` py-spy counts the event loop's wait in the kernel as running: samples
whose innermost frame is one of these are dropped (the default mode skips them itself)."""


def py_spy(pid: int, seconds: float, fmt: str, out: Path, rate: int, native: bool) -> subprocess.Popen[bytes]:
    cmd = [str(PY_SPY), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
           "--format", fmt, "--output", str(out)]
    # --native cannot sample without pausing the process (py-spy refuses --nonblocking then)
    return subprocess.Popen(cmd + (["--native"] if native else ["--nonblocking"]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


async def drive(url: str, body: bytes, seconds: float, concurrency: int) -> int:
    """Closed loop: ``concurrency`` workers posting ``body`` until ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await timed_post(session, url + "/v1/chat/completions", body)
            done += 1

    async with client_session(concurrency) as session:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (to/file.py)`` (lines merged)."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    short = "/".join(path.split("/")[-2:])
    return f"{name} ({short})" if short else name


def top_frames(collapsed: str, n: int) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """(samples, top self frames, top inclusive frames) from py-spy's collapsed stacks."""
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = [frame_name(f) for f in stack.split(";")[1:]]  # [0] is the process/thread
        if not frames or frames[-1].split(" (")[0] in IDLE_LEAVES:
            continue
        total += count
        self_c[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
    pct = 100.0 / max(total, 1)
    return (total, [(f, c * pct) for f, c in self_c.most_common(n)],
            [(f, c * pct) for f, c in incl.most_common(n)])


def report(name: str, requests: int, seconds: float, collapsed: str, n: int) -> str:
    total, selfs, incls = top_frames(collapsed, n)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    title = (f"# {name}: {requests} requests in {seconds:.0f} s ({requests / seconds:.0f}/s), "
             f"{total} non-idle samples, load average {load}")
    lines = [title, "", "## self (top frames)"]
    lines += [f"{p:6.2f}%  {f}" for f, p in selfs]
    lines += ["", "## inclusive"]
    lines += [f"{p:6.2f}%  {f}" for f, p in incls]
    return "\n".join(lines) + "\n"


def profile_body(pid: int, url: str, name: str, body: bytes, args: argparse.Namespace) -> str:
    raw = Path(tempfile.mkstemp(prefix=f"kvgate-profile-{name}-", suffix=".txt")[1])
    svg = args.out / f"{name}.svg"
    asyncio.run(drive(url, body, 2.0, args.concurrency))  # warm-up
    spies = [py_spy(pid, args.seconds, "flamegraph", svg, args.rate, args.native),
             py_spy(pid, args.seconds, "raw", raw, args.rate, args.native)]
    time.sleep(0.5)  # let both attach
    start = time.monotonic()
    requests = asyncio.run(drive(url, body, args.seconds, args.concurrency))
    elapsed = time.monotonic() - start
    for spy in spies:
        _, err = spy.communicate(timeout=args.seconds + 60)
        if spy.returncode != 0:
            raise RuntimeError(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-500:]}")
    text = report(name, requests, elapsed, raw.read_text(), args.top)
    raw.unlink()
    (args.out / f"{name}.txt").write_text(text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "profile")
    parser.add_argument("--seconds", type=float, default=20.0, help="sampling time per body")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kb", type=int, default=400)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--native", action="store_true", help="py-spy --native (C frames too)")
    parser.add_argument("--policy", default="cache-aware")
    parser.add_argument("--target", default="kvgate", help="kvgate, or a floor of loadtest/peers/targets.py")
    args = parser.parse_args(argv)
    if not PY_SPY.exists():
        subprocess.run([str(ROOT / "tools" / "profile" / "setup.sh")], check=True)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-native" if args.native else ""
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-profile-"))
    prefix = "" if args.target == "kvgate" else f"{args.target}-"
    target = f"kvgate-{args.policy}" if args.target == "kvgate" else args.target
    with SimFleet(1, profile=PROFILE, time_scale=1e6, seed=1, log_dir=log_dir) as fleet, \
            open_target(target, fleet.urls, log_dir, SLOW_PROBES) as (url, pid):  # slow probes: kvgate's only
        for name, body in ((f"{prefix}small{suffix}", small_body()), (f"{prefix}{args.kb}KB{suffix}",
                                                                     large_body(args.kb))):
            print(profile_body(pid, url, name, body, args))
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
