"""`solrl plan`: the analytic FLOPs, the calibration against the paper's table, placement sanity, emitted
layouts and the errors on bad input."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from solrl import hardware
from solrl.cli.app import main
from solrl.deploy import facts, fit, flops, placement, recipe, report, timing
from solrl.deploy.layouts import emit
from tests.deploy.test_deploy import k8s_copy

ROOT = Path(__file__).resolve().parents[2]
REAL = ("sana1.5-1.6b", "sd3.5-large", "flux1-dev")


def _plan(model: str, gpu: str = "b200", gpus: int = 8, sets: list[str] | None = None, **kw) -> placement.Plan:
    cfg, preset = recipe.resolve_config(model, None, sets or [])
    return placement.make_plan(cfg, preset, gpu, gpus, **kw)


# ------------------------------------------------------------------ FLOPs

def test_sd3_forward_by_hand():
    """A tiny MMDiT config, counted by hand: D = 2 x 4 = 8, 2 layers, patch 2, 4 latent channels, 4 image and
    3 text tokens, text width 6, pooled width 5."""
    c = {"num_attention_heads": 2, "attention_head_dim": 4, "num_layers": 2, "patch_size": 2, "in_channels": 4,
         "out_channels": 4, "joint_attention_dim": 6, "pooled_projection_dim": 5}
    f = flops.sd3_forward(c, image_tokens=4, text_tokens=3)
    per_sample = 256 * 8 + 64 + 5 * 8 + 64 + 2 * 6 * 64 + 6 * 64 + 2 * 64 + 2 * 64       # 3624
    per_text = 6 * 8 + 12 * 64 + 3 * 64                                                   # 1008
    per_image = 2 * 12 * 64 + 8 * 2 * 2 * 4                                               # 1664
    assert f.linear_macs == per_sample + 3 * per_text + 4 * per_image == 13304
    assert f.conv_macs == 4 * 4 * 2 * 2 * 8 == 512
    assert f.attention_macs == 2 * 2 * 7 * 7 * 8 == 1568
    assert f.flops == 2 * (13304 + 512 + 1568)


def test_real_forwards_match_layer_hooks_and_known_totals():
    """The analytic Linear and Conv2d MACs equal what forward hooks count on the meta-device model, for all
    three real models; SD3.5-L's total is the hand-derived 2 x 15.01 T MACs (attention 3.42 T) at the reference's
    text length (CLIP 77 + T5 128 tokens); FLUX.1's 15.81 TFLOPs at T5 128 tokens (21.50 at the pipeline's 512)."""
    for name in REAL:
        mf = facts.model_facts(name, _precision_key("nvfp4-emu"), (), 32)
        assert (mf.forward.linear_macs, mf.forward.conv_macs) == mf.measured_macs, name
    sd3 = flops.denoiser_forward("sd3.5-large")
    d, x, t = 2432, 4096, 77 + 128
    assert sd3.attention_macs == 38 * 2 * (x + t) ** 2 * d
    assert sd3.linear_macs == 11_594_561_634_304
    assert sd3.flops / 1e12 == pytest.approx(30.03, abs=0.01)
    assert flops.denoiser_forward("flux1-dev").flops / 1e12 == pytest.approx(15.81, abs=0.01)
    assert flops.denoiser_forward("sana1.5-1.6b").flops / 1e12 == pytest.approx(2.967, abs=0.001)


def test_shapes_forward_is_measured():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    mf = facts.model_facts("shapes", _precision_key("nvfp4-emu"), (), 16)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        facts.denoiser("shapes").run()   # the bundled UNet's forward that the facts were counted on
    # torch's counter sees the Linear and convolution work (not the CPU attention kernel)
    assert counter.get_total_flops() == 2 * (mf.forward.linear_macs + mf.forward.conv_macs)
    assert mf.forward.attention_macs > 0 and 0.2 < mf.quantized_share < 0.3


def _precision_key(backend: str) -> str:
    import dataclasses
    import json

    from solrl.precision import PrecisionConfig

    return json.dumps(dataclasses.asdict(PrecisionConfig(backend=backend)), sort_keys=True)


# ------------------------------------------------------------------ calibration

def test_calibration_reproduces_the_paper_table_within_the_reported_error():
    cal, rows = fit.fit_calibration()
    stored = timing.CALIBRATION
    assert cal.eta_rollout == pytest.approx(stored.eta_rollout, rel=1e-3)
    assert cal.eta_train == pytest.approx(stored.eta_train, rel=1e-3)
    assert cal.image_s == pytest.approx(stored.image_s, rel=1e-3)
    assert len(rows) == 12
    errors = [abs(r["error"]) for r in rows]
    # benchmarks/results/plan.md: RMS 10.0%, largest 17.6% (SD3.5-L's naive rollout)
    assert max(errors) < 0.18
    assert (sum(e * e for e in errors) / 12) ** 0.5 < 0.11
    # the colocated plan of a paper preset is the calibrated cell itself
    p = _plan("sd3.5-large")
    cell = next(r for r in rows if r["model"] == "sd3.5-large" and r["cell"] == "two-stage end to end")
    assert p.colocated.epoch_s == pytest.approx(cell["predicted_s"], rel=1e-3)


# ------------------------------------------------------------------ placement

def test_more_gpus_are_never_slower():
    cfg, preset = recipe.resolve_config("sana1.5-1.6b", None, [])
    times = [placement.make_plan(cfg, preset, "b200", n).best.epoch_s for n in range(1, 41)]
    assert all(b <= a + 1e-9 for a, b in zip(times, times[1:]))
    dis = [placement.make_plan(cfg, preset, "b200", n, layout="disaggregated").best.epoch_s for n in range(4, 41)]
    assert all(b <= a + 1e-9 for a, b in zip(dis, dis[1:]))


def test_b200_plans_colocate_and_beat_the_shipped_split():
    for name in REAL:
        p = _plan(name)
        assert p.best.kind == "colocated" and p.best.fits
        d = p.disaggregated
        assert d.explorers + d.regenerators + d.trainer_ranks + d.reward + d.unused == 8
        shipped = _plan(name, layout="disaggregated", explorers=4, regenerators=2, trainer_ranks=1).best
        assert shipped.epoch_s > d.epoch_s > p.best.epoch_s
        # the trainer alone on one GPU: the stage takes all its one-GPU time
        assert shipped.stage_s["train"] == pytest.approx(p.stage_one_gpu_s["train"])


def test_recipe_costs_follow_the_config():
    flops_only = timing.Calibration(eta_rollout=0.3, eta_train=0.3, image_s=0.0)
    base = _plan("sd3.5-large", cal=flops_only)
    guided = _plan("sd3.5-large", sets=["sampler.guidance=4.5"], cal=flops_only)
    for stage in ("explore", "regenerate"):   # CFG doubles the sampling forwards, not training
        assert guided.stage_one_gpu_s[stage] == pytest.approx(2 * base.stage_one_gpu_s[stage])
    assert guided.stage_one_gpu_s["train"] == base.stage_one_gpu_s["train"]
    no_kl = _plan("sd3.5-large", sets=["train.kl_beta=0"], cal=flops_only)
    assert no_kl.stage_one_gpu_s["train"] == pytest.approx(0.8 * base.stage_one_gpu_s["train"])
    naive = _plan("sd3.5-large", sets=["rollout.mode=naive_scaling"])
    assert "explore" not in naive.stage_one_gpu_s and naive.disaggregated.explorers == 0
    assert any("distilled" in n for n in _plan("flux1-dev").notes)


def test_fp4_explorer_on_hopper_is_planned_in_fp8():
    b200, h200 = _plan("sana1.5-1.6b"), _plan("sana1.5-1.6b", gpu="h200")
    assert b200.recipe.explore_format == "fp4" and h200.recipe.explore_format == "fp8"
    assert any("no FP4 kernels" in n and "backend=fp8" in n for n in h200.notes)
    assert h200.best.epoch_s > b200.best.epoch_s


# ------------------------------------------------------------------ bad input

def test_the_format_costs_are_the_hardware_table_s_peak_ratios():
    """One hardware table: each format's cost relative to BF16 is BF16's dense peak over the format's on every GPU
    that has kernels for it (within 0.1%: Hopper's FP8 peak is 2.001x its BF16); the proxy and the benchmarks' cost
    axis read the same numbers."""
    from solrl.hardware import FORMAT_COST, format_cost, forward_cost

    for kind, gpu in hardware.GPUS.items():
        for fmt, peak in gpu.tflops.items():
            if peak is None:
                assert format_cost(fmt, kind) is None
            else:
                assert gpu.tflops["bf16"] / peak == pytest.approx(FORMAT_COST[fmt], rel=1e-3), (kind, fmt)
    assert forward_cost("nvfp4", 0.5) == pytest.approx(0.5 + 0.5 * 0.25) and forward_cost("nvfp4", 1.0, "h100") is None


def test_unknown_gpu_kind():
    with pytest.raises(recipe.PlanError, match="unknown GPU kind 'a100'; allowed: b200, h100, h200"):
        _plan("sana1.5-1.6b", gpu="a100")


def test_more_trainer_ranks_than_samples():
    with pytest.raises(recipe.PlanError, match="1153 trainer ranks, but an optimizer step can hold as few as 1152 samples"):
        _plan("sana1.5-1.6b", gpus=2000, trainer_ranks=1153)
    with pytest.raises(recipe.PlanError, match="as few as 2 samples"):
        _plan("sana1.5-1.6b", sets=["rollout.prompts_per_epoch=1", "rollout.kept=2"], trainer_ranks=3)


def test_trainer_ranks_follow_the_trainer_s_rule_not_the_epoch_s_samples():
    """shapes-sol-rl takes one optimizer step per prompt group: with 4 kept of 8 prompts an epoch holds 32
    samples but each step 4, and the trainer (ddp.check_ranks) refuses a 5th rank. The plan caps ranks the same
    way (one function, ddp.max_ranks), says so, and prices training per step: ceil(4 / g) samples each."""
    from solrl.config import ConfigError
    from solrl.engine import data_parallel as ddp

    sets = ["rollout.kept=4"]
    cfg, _ = recipe.resolve_config(None, "shapes-sol-rl", sets)
    assert ddp.max_ranks(cfg) == 4 and cfg.rollout.prompts_per_epoch * cfg.rollout.kept == 32
    p = _plan("shapes", gpus=16, sets=sets)
    assert p.recipe.step_samples == (4,) * 8 and p.recipe.max_trainer_ranks == 4
    assert p.colocated.trainer_ranks == 4 and p.disaggregated.trainer_ranks == 4   # was 16 and 4 with the epoch's 32
    for layout in (p.colocated, p.disaggregated):
        ddp.check_ranks(cfg, layout.trainer_ranks)   # what the plan places, the trainer accepts
    with pytest.raises(ConfigError, match="WORLD_SIZE=5"):
        ddp.check_ranks(cfg, 5)
    with pytest.raises(recipe.PlanError, match=r"5 trainer ranks, but an optimizer step can hold as few as 4 samples "
                                          r"\(rollout.prompts_per_epoch=8 prompts over train.optimizer_steps_per_epoch=0 "
                                          r"\(8 steps\) x rollout.kept=4\)"):
        _plan("shapes", gpus=16, sets=sets, trainer_ranks=5)
    train = p.stage_one_gpu_s["train"]
    assert p.colocated.stage_s["train"] == pytest.approx(train / 4)
    three = _plan("shapes", gpus=16, sets=sets, layout="disaggregated", trainer_ranks=3).best
    assert three.stage_s["train"] == pytest.approx(train / 2)   # ceil(4 / 3) = 2 of every step's 4 samples
    text = report.format_plan(p)
    assert "trainer    at most 4 data-parallel ranks" in text and "the trainer uses 4 of the 16 GPUs" in text


def test_plans_that_do_not_fit_in_memory(monkeypatch):
    """SD3.5-L's trainer (micro-batch 4 at 1024 px) fits an H100 only with gradient checkpointing: the plan turns it
    on there, prices the recomputation and says why; on a B200 it stays off. A split where a role cannot fit is
    refused naming each role and by how much."""
    h100, b200 = _plan("sd3.5-large", gpu="h100"), _plan("sd3.5-large")
    usable = 80 * hardware.USABLE_HBM
    assert h100.best.fits and h100.gradient_checkpointing and not b200.gradient_checkpointing
    assert h100.memory.role("trainer") > usable > h100.memory.checkpointed().role("trainer")
    assert any("gradient checkpointing on: without it the trainer's GPU needs" in n for n in h100.notes)
    # every trainable forward runs again in the backward: 6 forward-equivalents a row instead of 5
    assert h100.colocated.stage_s["train"] == pytest.approx(h100.stage_one_gpu_s["train"] / 8 * 6 / 5)
    assert report.plan_dict(h100)["gradient_checkpointing"] is True
    monkeypatch.setitem(hardware.GPUS, "small", hardware.Gpu("small", {"bf16": 100.0, "fp8": 200.0, "fp4": None}, 40.0))
    with pytest.raises(recipe.PlanError, match=r"flux1-dev does not fit on one small \(40 GB, 38 usable\) in any layout, "
                                          r"even with gradient checkpointing: .*disaggregated: explorer 48 GB, 10 GB over"
                                          r", trainer 41 GB, 3 GB over. Try --set train.micro_batch=6 and a smaller "
                                          r"rollout.micro_batch"):
        _plan("flux1-dev", gpu="small", layout="disaggregated")
    monkeypatch.setitem(hardware.GPUS, "tiny", hardware.Gpu("tiny", {"bf16": 100.0, "fp8": None, "fp4": None}, 24.0))
    with pytest.raises(recipe.PlanError, match="BF16 weights and text encoders alone take 34 GB"):
        _plan("flux1-dev", gpu="tiny")


def test_other_bad_input():
    with pytest.raises(recipe.PlanError, match="unknown model"):
        recipe.resolve_config("sdxl", None, [])
    with pytest.raises(recipe.PlanError, match="at least 1"):
        _plan("sana1.5-1.6b", gpus=0)
    with pytest.raises(recipe.PlanError, match="disaggregated layout needs at least 4 GPUs"):
        _plan("sana1.5-1.6b", gpus=3, layout="disaggregated")
    with pytest.raises(recipe.PlanError, match="no explore stage"):
        _plan("sana1.5-1.6b", sets=["rollout.mode=naive_scaling"], explorers=2)
    with pytest.raises(recipe.PlanError, match="compose or kustomize"):
        emit(_plan("sana1.5-1.6b"), "helm")
    for kind in ("compose", "kustomize"):   # the services run the two-stage mode only
        with pytest.raises(recipe.PlanError, match="rollout.mode='naive_scaling': the services .* run rollout.mode='sol_rl'"):
            emit(_plan("sana1.5-1.6b", layout="disaggregated", sets=["rollout.mode=naive_scaling"]), kind)


# ------------------------------------------------------------------ emitted layouts and the command

def test_emit_compose_and_kustomize(tmp_path):
    """The emitted files give every role of the plan's layout its GPUs: compose (a whole file) and a kustomize
    Component built on top of overlays/b200 in place of its own plan component."""
    p = _plan("sd3.5-large", layout="disaggregated")
    x = p.best
    services = yaml.safe_load(emit(p, "compose", ["rollout.pool=48"]))["services"]

    def ids(svc):
        return [g for d in svc["deploy"]["resources"]["reservations"]["devices"] for g in d["device_ids"]]

    explorers = [n for n in services if n.startswith("explorer-")]
    regenerators = [n for n in services if n.startswith("regenerator-")]
    assert (len(explorers), len(regenerators)) == (x.explorers, x.regenerators)
    flat = [g for n in explorers + regenerators + ["trainer", "reward"] for g in ids(services[n])]
    assert sorted(flat, key=int) == [str(i) for i in range(8)]   # each GPU to one container
    trainer = services["trainer"]
    assert len(ids(trainer)) == int(trainer["environment"]["PET_NPROC_PER_NODE"]) == x.trainer_ranks
    assert trainer["entrypoint"][0] == "torchrun"
    assert trainer["environment"]["SOLRL_EXPLORER_ADDRS"] == ",".join(f"{n}:8011" for n in explorers)
    colo = yaml.safe_load(emit(_plan("sd3.5-large"), "compose"))["services"]
    assert ids(colo["trainer"]) == [str(i) for i in range(8)] and ids(colo["explorer-3"]) == ["3"]
    with pytest.raises(recipe.PlanError, match="colocated layout has no overlay.*time-slicing"):
        emit(_plan("sd3.5-large"), "kustomize")
    frag = emit(p, "kustomize")
    doc = yaml.safe_load(frag)
    assert doc["kind"] == "Component"
    assert {r["name"]: r["count"] for r in doc["replicas"]} == {"explorer": x.explorers, "regenerator": x.regenerators}
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the component is not built into the overlay")
    tree = k8s_copy(tmp_path)
    (tree / "overlays" / "b200" / "plan" / "kustomization.yaml").write_text(frag)
    out = subprocess.run([kubectl, "kustomize", str(tree / "overlays" / "b200")], capture_output=True, text=True,
                         check=True).stdout
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out)}
    assert docs[("Deployment", "explorer")]["spec"]["replicas"] == x.explorers
    (c,) = docs[("Job", "trainer")]["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == x.trainer_ranks
    assert {e["name"]: e.get("value") for e in c["env"]}["PET_NPROC_PER_NODE"] == str(x.trainer_ranks)


def test_cli(tmp_path, capsys):
    assert main(["plan", "--model", "sana1.5-1.6b", "--gpu", "a100"]) == 2
    assert "unknown GPU kind 'a100'" in capsys.readouterr().err
    assert main(["plan", "--model", "sana1.5-1.6b", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "best: colocated on 8 GPUs" in out and "explore" in out
    assert main(["plan", "--calibrate", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "plan.md").read_text()
    assert "| sd3.5-large | naive rollout | 451 |" in md and (tmp_path / "plan.json").exists()


PLAN_RESULTS = sorted((ROOT / "benchmarks" / "results").glob("plan_*_*.md"))


@pytest.mark.parametrize("path", PLAN_RESULTS, ids=lambda p: p.stem)
def test_committed_plans_are_what_solrl_plan_prints(path, capsys):
    """benchmarks/results/plan_<preset>_<gpu>.md (the plans docs/deploy.md quotes) equal their command's output,
    and each places every role of its two-stage preset on 8 GPUs of its kind."""
    import re
    import shlex

    text = path.read_text()
    command = shlex.split(re.match(r"# `(solrl plan [^`]+)`", text).group(1))
    assert main(command[1:]) == 0
    out = capsys.readouterr().out
    assert text.split("```text\n", 1)[1].split("```", 1)[0] == out, f"{path.name}: rerun its command"
    assert "best: " in out and "explorer " in out and "trainer " in out and "reward " in out


def test_the_real_presets_fit_8_gpus_of_each_kind():
    """SD3.5-Large and FLUX.1-dev's two-stage presets fit 8x H100 (80 GB) and 8x B200 in a colocated and a
    disaggregated layout; where the trainer would not fit without gradient checkpointing the plan turns it on."""
    for model in ("sd3.5-large", "flux1-dev"):
        for gpu in ("h100", "b200"):
            p = _plan(model, gpu=gpu)
            usable = hardware.GPUS[gpu].hbm_gb * hardware.USABLE_HBM
            for x in (p.colocated, p.disaggregated):
                assert x is not None and x.fits and not x.over_gb
                roles = p.role_memory(x)
                assert all(sum(parts.values()) <= usable for parts in roles.values())
                m = p.memory.checkpointed() if x.gradient_checkpointing else p.memory
                if x.gradient_checkpointing:   # on only where it is needed
                    role = "colocated" if x.kind == "colocated" else "trainer"
                    assert dataclasses.replace(m, checkpointing=False).role(role, x.trainer_ranks) > usable
            assert p.gradient_checkpointing == (gpu == "h100")   # the B200s hold both trainers without it
            # the hopper / b200 overlays' plan component for this preset (was refused on H100: "does not fit")
            dis = _plan(model, gpu=gpu, layout="disaggregated")
            doc = yaml.safe_load(emit(dis, "kustomize", ["rollout.explore_precision.backend=fp8"]))
            assert {r["name"]: r["count"] for r in doc["replicas"]} == {"explorer": dis.best.explorers,
                                                                         "regenerator": dis.best.regenerators}
