"""`solrl bench serve --small`: one real run (Redis, loopback gRPC services, tritonclient), checked for its
files, structure and value ranges; and its refusals of bad options."""

from __future__ import annotations

import json

import pytest

from solrl.bench import run_bench


def test_serve_rejects_bad_options_before_measuring(tmp_path):
    with pytest.raises(ValueError, match="services must be one of"):
        run_bench("serve", tmp_path, small=True, services="docker")
    with pytest.raises(ValueError, match="explorers must be an int >= 1"):
        run_bench("serve", tmp_path, small=True, explorers=0)
    with pytest.raises(ValueError, match="epochs must be an int >= 1"):
        run_bench("serve", tmp_path, small=True, epochs=0)
    assert not (tmp_path / "serve.json").exists()


@pytest.mark.slow
def test_serve_small(tmp_path):
    r = run_bench("serve", tmp_path, small=True)
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved == json.loads(json.dumps(r)) and saved["bench"] == "serve" and "cpu" in saved["machine"]

    e, w, h = r["epoch_time"], r["reward_service"], r["hot_reload"]
    if "skipped" in e:
        pytest.skip(e["skipped"])  # no Redis: the other two parts were still measured and checked below
    assert e["services"] == "inproc" and e["explorers"] == 1 and e["epochs"] == 2
    assert len(e["services_epoch_s"]) == len(e["embedded_epoch_s"]) == 2
    assert all(t > 0 for t in e["services_epoch_s"] + e["embedded_epoch_s"])
    assert e["ratio"] == pytest.approx(e["services_median_s"] / e["embedded_median_s"]) and e["ratio"] > 0
    for side in ("embedded", "services"):
        assert 0 < e[f"{side}_rollout_median_s"] < e[f"{side}_median_s"]
        assert 0 < e[f"{side}_train_median_s"] < e[f"{side}_median_s"]
    # the first epoch samples the base model on both sides, with the same batches: the same rewards
    assert e["rewards_equal_first_epoch"] is True
    assert e["services_wall_s_incl_startup"] > sum(e["services_epoch_s"])

    assert w["in_process_images_per_s"] > 0 and w["batch"] == 8
    assert [row["concurrency"] for row in w["rows"]] == [1, 4, 16]
    for row in w["rows"]:
        assert row["errors"] == 0 and row["requests"] >= row["concurrency"]
        assert row["p99_ms"] >= row["p50_ms"] > 0
        assert row["images_per_s"] > 0
        assert row["ratio_vs_in_process"] == pytest.approx(row["images_per_s"] / w["in_process_images_per_s"])

    assert len(h["reload_s"]) == len(h["explore_s"]) == 2 and h["adapter_bytes"] > 0
    assert all(t > 0 for t in h["reload_s"] + h["explore_s"]) and h["ratio"] > 0

    md = (tmp_path / "serve.md").read_text()
    assert md.startswith("# solrl bench serve") and "shared" in md
    assert f"services / embedded: {e['ratio']:.2f}x" in md and "in-process distributed runner" in md
    assert all(f"\n| {c} | " in md for c in (1, 4, 16))  # one table row per concurrency
    assert f"Hot reload / one explore call: {h['ratio']:.3f}" in md
