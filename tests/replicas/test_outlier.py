"""The outlier detector (replicas/outlier.py), pure: virtual time, no I/O."""
from __future__ import annotations

from prefix_index.base import ReplicaId
from replicas.config import OutlierConfig
from replicas.outlier import OutlierDetector

A, B, C, D = (ReplicaId(f"http://r{i}") for i in range(4))
FLEET = (A, B, C, D)


def test_failure_rate_ejects_an_outlier_not_a_fleet_wide_failure() -> None:
    det = OutlierDetector(OutlierConfig(consecutive_failures=100))
    now = 0.0
    reasons: list[str | None] = []
    for i in range(40):  # every replica fails every other request alike: nobody is an outlier
        now += 0.1
        for rid in FLEET:
            reasons.append(det.record(rid, i % 2 == 0, now, FLEET))
    assert reasons.count(None) == len(reasons)
    for i in range(60):  # now A alone fails 3 of 4
        now += 0.1
        for rid in FLEET:
            ok = (i % 4 == 0) if rid == A else True
            got = det.record(rid, ok, now, FLEET)
            if got is not None:
                assert (rid, got) == (A, "failure_rate")
                reasons.append(got)
    assert reasons.count("failure_rate") == 1 and det.is_ejected(A, now)
    assert not det.is_ejected(A, now + 30.0)
    assert det.expire(now + 30.0) == [A]


def test_ejection_time_grows_and_is_capped() -> None:
    det = OutlierDetector(OutlierConfig(consecutive_failures=2, base_ejection_s=30, max_ejection_s=70))
    now = 0.0
    lengths = []
    for _ in range(4):
        while det.record(A, False, now, FLEET) is None:
            now += 0.01
        until = det.ejected_until(A)
        assert until is not None
        lengths.append(round(until - now))
        now = until
        det.expire(now)
    assert lengths == [30, 60, 70, 70]
    det.record(A, True, now, FLEET)  # a success resets the streak: one failure does not eject
    assert det.record(A, False, now, FLEET) is None


def test_cap_and_never_the_last_replica() -> None:
    det = OutlierDetector(OutlierConfig(consecutive_failures=1, max_ejection_percent=50))
    assert det.record(A, False, 0.0, FLEET) == "consecutive"
    assert det.record(B, False, 0.0, FLEET) == "consecutive"
    assert det.record(C, False, 0.0, FLEET) is None  # 2 of 4 already out
    lone = OutlierDetector(OutlierConfig(consecutive_failures=1, max_ejection_percent=100))
    assert lone.record(A, False, 0.0, (A, B)) == "consecutive"
    assert lone.record(B, False, 0.0, (A, B)) is None  # B is the last one routable
    assert not lone.suspect(B, 0.0, (A, B))


def test_suspect_is_lifted_by_an_answering_probe_and_disabled_config() -> None:
    det = OutlierDetector(OutlierConfig())
    assert det.suspect(A, 0.0, FLEET) and det.is_ejected(A, 1.0)
    assert det.probe_answered(A) and not det.is_ejected(A, 1.0)
    assert not det.probe_answered(A)
    off = OutlierDetector(OutlierConfig(enabled=False, consecutive_failures=1))
    assert off.record(A, False, 0.0, FLEET) is None and not off.suspect(A, 0.0, FLEET)
