"""The live run dashboard in a real headless browser (Debian's chromium driven by Playwright): `solrl dashboard
RUN_DIR` serves the page while an embedded training writes the directory, and the page follows the run."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from solrl.config import apply_overrides, get_preset
from solrl.dashboard import run_state

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("SOLRL_TEST_ARTIFACTS", ROOT / "test-artifacts"))  # git-ignored
TINY = ["epochs=3", "eval.every=1", "tensorboard=false", "rollout.prompts_per_epoch=2", "rollout.pool=6",
        "rollout.kept=4", "eval.prompts=2", "eval.seeds_per_prompt=2", "lora.rank=4", "lora.alpha=8",
        "train.micro_batch=8", "threads=1", "name=dash-test",
        # the reward-hacking monitors: a reference reward the run does not train on, and a diversity floor no
        # evaluation meets (an RMS distance of 252 of 255 between seeds), so every evaluation after training alarms
        'monitor.reference_rewards=["jpeg_compressibility"]', "monitor.diversity_min=0.99",
        # a guard, whose shares the monitors' chart draws beside them
        "guard.gate=flat"]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("SOLRL_REQUIRE_DEPLOY_TOOLS"):
            pytest.fail("chromium is required here (.ci/run installs it)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    return path


def test_the_page_follows_a_running_training(tmp_path) -> None:
    from playwright.sync_api import sync_playwright

    from solrl.engine.loop import train

    browser_path = chromium()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    server = subprocess.Popen([sys.executable, "-m", "solrl.cli", "dashboard", str(run_dir), "--port", "0"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = server.stdout.readline()
        url = re.search(r"(http://\S+/dashboard)", line).group(1)
        assert httpx.get(url.replace("/dashboard", "/dashboard/api/grid?epoch=0")).status_code == 404  # not yet
        cfg = apply_overrides(get_preset("shapes-sol-rl"), TINY).validate()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                train(cfg, run_dir, progress=False, log=lambda *_: None)
            except BaseException as exc:  # surfaced below
                failed.append(exc)

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(url + "?poll=200")
            page.wait_for_function("document.getElementById('status').dataset.epoch === '0'", timeout=30_000)
            trainer = threading.Thread(target=run)
            trainer.start()
            seen = set()
            deadline = time.monotonic() + 600   # the run's own pace: a busy 2-core machine can take minutes
            while time.monotonic() < deadline:   # the epochs as the page shows them while the run goes
                seen.add(page.evaluate("document.getElementById('status').dataset.epoch"))
                if "3" in seen or failed:
                    break
                page.wait_for_timeout(100)
            trainer.join(600)
            assert not failed, failed
            assert {"1", "2", "3"} & seen and "3" in seen, seen   # it updated without a reload
            page.wait_for_function("document.querySelector('#chart-reward polyline[data-series=\"eval.mean_reward\"]')"
                                   "?.dataset.points === '4'", timeout=30_000)
            recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            points = page.evaluate("Object.fromEntries([...document.querySelectorAll('#chart-reward polyline')]"
                                   ".map(e => [e.dataset.series, Number(e.dataset.points)]))")
            assert points == {"explore.reward_mean": 3, "rollout.reward_mean": 3, "eval.mean_reward": 4}
            assert len(recs) == 4
            last_eval = json.loads((run_dir / "eval" / "epoch_0003" / "eval.json").read_text())["mean_reward"]
            assert page.inner_text("#grid-title") == f"Latest evaluation: epoch 3, held-out reward {last_eval:.4f}"
            page.wait_for_function("document.getElementById('grid-img').complete && "
                                   "document.getElementById('grid-img').naturalWidth > 0", timeout=30_000)
            assert page.evaluate("document.getElementById('grid-img').dataset.epoch") == "3"
            assert json.loads(page.inner_text("#config"))["name"] == "dash-test"
            legend = page.inner_text("#legend-loss")
            assert f"loss {recs[-1]['train.loss']:.4f}" in legend
            assert page.locator("#chart-stages polyline").count() >= 3  # explore, regenerate, train, eval, sync
            monitors = page.evaluate("Object.fromEntries([...document.querySelectorAll('#chart-monitor polyline')]"
                                     ".map(e => [e.dataset.series, Number(e.dataset.points)]))")
            assert monitors == {"eval.flat_share": 4, "eval.duplicate_share": 4, "eval.diversity": 4,
                                "rollout.flat_share": 3, "eval.ref_drift.jpeg_compressibility": 3,
                                "guard.failed_share": 3, "guard.demoted_share": 3}
            assert f"reference jpeg_compressibility drift {recs[-1]['eval.ref_drift.jpeg_compressibility']:.4f}" in \
                page.inner_text("#legend-monitor")
            assert [r["monitor.alarms"] for r in recs[1:]] == [1, 1, 1]
            assert page.evaluate("document.getElementById('alarms').dataset.alarms") == "3"
            assert page.inner_text("#alarms") == "alarms at epochs 1, 2, 3"
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)  # kept for a person to look at
            assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
            browser.close()
    finally:
        server.terminate()
        server.wait(10)


def test_run_state_reads_a_run_in_progress_and_drops_nan(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"name": "x", "epochs": 2}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"epoch": 0, "eval.mean_reward": 0.5}) + "\n"
                                           + json.dumps({"epoch": 1, "proxy_kendall_tau": math.nan}) + "\n"
                                           + '{"epoch": 2, "rollout.rew')  # a line still being written
    state = run_state(tmp_path)
    assert [r["epoch"] for r in state["records"]] == [0, 1] and state["records"][1]["proxy_kendall_tau"] is None
    assert json.loads(json.dumps(state, allow_nan=False)) == state and state["evals"] == []
