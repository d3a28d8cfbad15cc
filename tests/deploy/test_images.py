"""The two images of deploy/Dockerfile and who runs which.

The gateway image (the default target) is built from the serving packages alone: the
wheel its build stage makes, built here from exactly the files that stage copies, holds
gateway, policies, prefix_index and replicas, and no load-test harness or simulator. The
``sim`` target adds loadtest/. In the manifests, the gateway and the drain sidecar run the
gateway image and the simulated replicas the sim image (whose preStop runs ``kvgate
drain``, which it holds too). No container runtime is needed (CI has none).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.deploy.k8s import DEPLOY, ROOT, TARGETS, Doc, build, containers

SERVING = {"gateway", "policies", "prefix_index", "replicas"}
GATEWAY_IMAGE, SIM_IMAGE = "ghcr.io/kvgate/kvgate", "ghcr.io/kvgate/kvgate-sim"


def stages() -> dict[str, tuple[str, list[str]]]:
    """Stage name -> (what it is FROM, the sources of its COPY lines without --from)."""
    out: dict[str, tuple[str, list[str]]] = {}
    current = ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if m := re.match(r"FROM (\S+) AS (\S+)$", line):
            current = m.group(2)
            out[current] = (m.group(1), [])
        elif line.startswith("COPY ") and "--from=" not in line:
            out[current][1].extend(line.split()[1:-1])
    return out


def copied(stage: str) -> set[str]:
    """Everything a stage has copied, its parents' included."""
    parent, sources = stages()[stage]
    return set(sources) | (copied(parent) if parent in stages() else set())


def test_stages_copy_what_each_image_is() -> None:
    names = list(stages())
    assert names[-1] == "gateway"  # `docker build` without --target: the gateway image
    assert copied("build") == {"pyproject.toml", "README.md", *SERVING}
    assert copied("build-sim") == copied("build") | {"loadtest"}
    text = (DEPLOY / "Dockerfile").read_text()
    gateway = text[text.index("FROM runtime AS gateway"):]
    sim = text[text.index("FROM runtime AS sim"):text.index("FROM runtime AS gateway")]
    assert "COPY --from=build /wheels" in gateway and "--from=build-sim" not in gateway
    assert "COPY --from=build-sim /wheels" in sim and '"serve"' in gateway and '"sim"' in sim


def test_gateway_wheel_holds_the_serving_packages_only(tmp_path: Path) -> None:
    """Build the wheel from what the gateway's build stage copies, as the image does."""
    src = tmp_path / "src"
    src.mkdir()
    for name in copied("build"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--wheel-dir", str(tmp_path / "wheels"), str(src)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "wheels").glob("kvgate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.startswith("kvgate-")} == SERVING
    assert "replicas/sglang_profiles/kimi-k2.6-tp8-dflash.toml" in names  # package data kept


def _runs(container: Doc) -> str:
    return " ".join([*container.get("command", []), *container.get("args", []),
                     *container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])])


@pytest.mark.parametrize("target", TARGETS)
def test_each_container_runs_an_image_that_has_its_command(target: str) -> None:
    seen: set[str] = set()
    for name, c, _pod in containers(build(target)):
        image = c["image"].rsplit(":", 1)[0]
        runs = _runs(c)
        if c.get("args", [""])[0] == "sim":
            assert image == SIM_IMAGE, name
        elif c.get("args", [""])[0] == "serve" or "kvgate drain" in runs:
            assert image in (GATEWAY_IMAGE, SIM_IMAGE), name
            assert image == GATEWAY_IMAGE or "kvgate drain" in runs, name
        seen.add(image)
    assert GATEWAY_IMAGE in seen
    assert (SIM_IMAGE in seen) == (target in ("overlays/sim-cpu", "overlays/two-models"))  # simulated
