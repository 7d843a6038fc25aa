"""The memory budget and the doors under sustained load, on a reward service process of its own (issue 58; slow
tier): a burst of 64 gzip bodies of 1.5 MB at once, and a soak of mixed valid and invalid requests at
concurrency 16 (services/doors.py: `burst`, `soak`)."""

from __future__ import annotations

import json
import os

import pytest

from services.doors import burst, soak

pytestmark = pytest.mark.slow


def test_a_burst_of_64_gzip_bodies_stays_within_the_budget_and_a_valid_request_follows() -> None:
    r = burst(64, 3 << 19)
    print(json.dumps(r, indent=1))
    assert set(r["statuses"]) <= {"413", "503"} and sum(r["statuses"].values()) == 64, r["statuses"]
    assert r["growth_mb"] <= 512, f"peak {r['peak_mb']:.0f} MB, {r['growth_mb']:.0f} MB over {r['baseline_mb']:.0f}"
    assert r["valid_after_status"] == 200 and r["valid_after_s"] < 1.0


def test_a_soak_of_mixed_requests_keeps_memory_flat_and_every_answer_right() -> None:
    r = soak(float(os.environ.get("SOLRL_SOAK_S", "45")), 16, warmup_s=10)
    print(json.dumps({k: v for k, v in r.items() if k != "rss_curve_mb"}, indent=1))
    assert r["alive"], "the service died"
    assert r["unexpected"] == 0, r["problems"]
    assert r["duplicate_ids"] == 0
    assert all(k["sent"] > 0 for k in r["tally"].values()), r["tally"]
    assert r["rss_growth_after_warmup"] <= 0.05, r["rss_curve_mb"]
