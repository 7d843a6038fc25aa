"""`solrl bench doors` end to end (slow tier): the real perf_analyzer from .venv/perf (`make perf-env`; CI builds it)
against a reward service process, both protocols, and the result files it writes."""

from __future__ import annotations

import json

import pytest

from solrl.bench import run_bench

pytestmark = pytest.mark.slow


def test_perf_analyzer_sweeps_the_reward_door_over_both_protocols(tmp_path) -> None:
    r = run_bench("doors", tmp_path, small=True, doors=("reward",), tag="t")
    saved = json.loads((tmp_path / "doors-t.json").read_text())
    assert saved["bench"] == "doors-t" and saved["machine"]["cpu"] and "| reward | REST | 1 |" in \
        (tmp_path / "doors-t.md").read_text()
    rows = {(x["protocol"], x["concurrency"]): x for x in r["rows"]}
    assert set(rows) == {("grpc", 1), ("grpc", 4), ("http", 1), ("http", 4)}
    for x in rows.values():
        assert "error" not in x, x
        assert x["throughput"] > 0 and x["p99_us"] >= x["p50_us"] > 0 and x["server_us"] > 0
    # the REST door answers within a few ms of the server's own time (a kept-alive stall would add >= 40 ms)
    one = next(s for s in r["summary"] if s["concurrency"] == 1)
    assert one["rest_client_minus_server_ms"] < 20, one
    with pytest.raises(ValueError, match="unknown"):
        run_bench("doors", tmp_path, small=True, doors=("trainer",))
