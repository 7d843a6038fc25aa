"""The shapes bed's run presets (`shapes-*`): the four modes and FlowGRPO on the bundled model, sized for two CPU cores.

`solrl.config.PRESETS` holds each as a "solrl.shapes.presets:function" entry, imported when the preset is built.
"""

from __future__ import annotations

from solrl.config import EvalConfig, LoraConfig, RolloutConfig, RunConfig, TrainConfig, with_flow_grpo
from solrl.precision import PrecisionConfig


def _shapes_base(name: str, mode: str) -> RunConfig:
    """The shapes world, sized so `make demo` trains in a few minutes on two CPU cores: 8 prompts x
    16 explored seeds -> 8 kept (the reference: 48 x 96 -> 24).

    The trainer departs from the reference's one optimizer step per epoch at lr 3e-4, because a 15-epoch run
    of that takes 15 small steps: it takes one step per prompt group (optimizer_steps_per_epoch=0: 8 per
    epoch) at lr 1e-3. With every sample trained at all 10 rollout timesteps this raised the held-out exact
    reward +0.078 in 15 epochs on the bundled base, against +0.024 with one step per epoch at 3e-4 and fraction
    0.4, and +0.022 with 4 steps (docs/notes/shapes.md). 12 epochs.

    The NFT guidance strength is 0.5 (the reference: 1.0, and 0.1 for its OCR and multi-reward runs): the implicit
    positive policy beta * v + (1 - beta) * v_old then moves half as far as v, so the loss pulls v twice as far
    towards the better half of a group. Three run seeds each, on one H200 (benchmarks/results/nft_beta_gpu.md)
    and on two CPU cores, it ended 12 epochs at 0.825 / 0.813 against 1.0's 0.799 / 0.807 on the same seeds (0.3
    and 0.2 on the H200: 0.827, 0.828).

    No KL term (train.kl_beta=0; the reference: 1e-4): on this bed kl_beta x KL stays below 1e-6 of the loss
    (benchmarks/results/profile.md), so the reference forward, a fifth of a training step's passes, bought nothing;
    the held-out gain without it is measured over four run seeds in benchmarks/results/kl_beta_cpu.md.

    Half the rollout timesteps trained per sample (train.timestep_fraction=0.5, each sample its own random 5 of
    the 10; the reference: 0.6 for SD3.5, 0.4 for FLUX.1) in one forward of 40 rows per prompt-group step
    (train.micro_batch=40): the train phase, half of an epoch, costs half, and the held-out gain over four paired
    run seeds stays within the interval of all 10 (benchmarks/results/timestep_fraction_cpu.md). Held-out
    evaluation every 6 epochs (before, half way, after).

    The explorer is the emulated NVFP4 one on every machine. Where the CPU has BF16 instructions, the real-kernel
    `bf16-cpu` explorer's forward costs 0.55-0.68x the FP32 one (benchmarks/results/rollout-bf16cpu*.md), but the
    demo's learning with it falls short of its goal (three run seeds on a Xeon with AMX: +0.058 and 1.24x exact match
    at epoch 12 against the emulation's +0.066 and 1.39x; benchmarks/results/demo_explorer_bf16cpu.md), so it is a
    choice, portable across machines:
    `--set rollout.explore_precision.backend=bf16-cpu --set rollout.explore_precision.fallback=nvfp4-emu`."""
    cfg = RunConfig(name=name, seed=0, epochs=12, threads=0)
    cfg.lora = LoraConfig(rank=16, alpha=32.0)
    cfg.rollout = RolloutConfig(
        mode=mode, prompts_per_epoch=8, pool=16, kept=8, explore_steps=6, steps=10, micro_batch=128,
        explore_precision=PrecisionConfig(backend="nvfp4-emu"), precision=PrecisionConfig(backend="bf16"),
    )
    cfg.train = TrainConfig(lr=1e-3, micro_batch=40, timestep_fraction=0.5, weight_decay=1e-4,
                            optimizer_steps_per_epoch=0, beta=0.5, kl_beta=0.0)
    cfg.eval = EvalConfig(every=6, steps=(10,), prompts=48, seeds_per_prompt=2, reward="shapes")
    return cfg


def shapes_sol_rl() -> RunConfig:
    return _shapes_base("shapes-sol-rl", "sol_rl")


def shapes_diffusion_nft() -> RunConfig:
    cfg = _shapes_base("shapes-diffusion-nft", "diffusion_nft")
    cfg.rollout.pool = cfg.rollout.kept
    return cfg


def shapes_naive_scaling() -> RunConfig:
    return _shapes_base("shapes-naive-scaling", "naive_scaling")


def shapes_naive_quant() -> RunConfig:
    return _shapes_base("shapes-naive-quant", "naive_quant")


def shapes_flow_grpo() -> RunConfig:
    """One stage: k seeds per prompt sampled with the SDE in BF16 and trained on (pool = kept), the shapes
    trainer settings of `_shapes_base` otherwise."""
    return with_flow_grpo(shapes_diffusion_nft(), "shapes-flow-grpo")


def shapes_sol_flow_grpo() -> RunConfig:
    """Two stages: the low-precision explorer ranks 16 seeds per prompt with the ODE as shapes-sol-rl does; the 8
    kept are regenerated in BF16 with the SDE, and those trajectories and log-probs are trained on."""
    return with_flow_grpo(shapes_sol_rl(), "shapes-sol-flow-grpo")


