"""The memory model: what each role's process holds on its GPU, piece by piece, and whether the trainer fits without
gradient checkpointing (train.gradient_checkpointing=auto asks it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from solrl.config import RunConfig
from solrl.deploy.facts import REWARD_MODELS, WAN_ARCHITECTURES, Component, ModelFacts, _facts
from solrl.deploy.recipe import Recipe, recipe_from_config
from solrl.hardware import GPUS, REFERENCE_GPU, USABLE_HBM

GB = 1e9
# Activations (models, not measured: no GPU here). Training, per token x width x block: 34 bytes (BF16 with flash
# attention, Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2 without
# the s^2 attention term); with gradient checkpointing (diffusers' per-block `gradient_checkpointing`) each block
# keeps only its BF16 input (2 bytes) and one block's 34 bytes live again during its recompute. Sampling: 16 bytes
# per token x width, the live tensors of one block under no_grad. VAE decode: about 1 KiB per decoded pixel of a
# decode batch (the decoder's last up block at full resolution: 128 channels x 4 live BF16 tensors).
ACTIVATION_BYTES_TRAIN = 34
CHECKPOINT_BYTES = 2
ACTIVATION_BYTES_SAMPLE = 16
VAE_DECODE_BYTES = 1024
# Per parameter of one LoRA adapter, in the trainer (solrl/engine/update.py, solrl/adapters/lora.py): three FP32 adapters
# (the trainable "default", the sampling "old" policy DiffusionNFT's loss compares with, the evaluation "ema"), the
# FP32 gradient and AdamW's two FP32 moments. The reference policy (kl_beta) is the base with adapters disabled: no
# copy. With more than one rank DDP adds its FP32 gradient buckets and NCCL its buffers (about half a GB per rank:
# NCCL_BUFFSIZE 4 MiB x channels x peers, plus the communicator's own).
TRAINER_LORA_BYTES = {"LoRA adapters: trainable, old, EMA (FP32)": 12, "LoRA gradients (FP32)": 4,
                      "AdamW moments (FP32)": 8}
DDP_BUCKET_BYTES, NCCL_GB = 4, 0.5
# The quantized serving copy Transformer Engine caches per layer: NVFP4 = 4-bit values + an E4M3 scale per 16 + one
# FP32 tensor scale; FP8 = 1 byte + one FP32 scale (the layout of TE's and torchao's tensors; the test counts them).
QUANT_BYTES = {"fp4": (0.5625, 4), "fp8": (1.0, 4)}
ROLES = ("explorer", "regenerator", "trainer", "reward")


def reward_components(reward: str) -> tuple[Component, ...]:
    """The neural scorers of a reward spec ('hpsv2', 'pickscore:1.0+ocr:0.5'); rule-based ones hold no weights."""
    names = [part.split(":")[0].strip() for part in reward.split("+")]
    return tuple(REWARD_MODELS[n] for n in names if n in REWARD_MODELS)


@dataclass(frozen=True)
class MemoryModel:
    """What each role's process holds on its GPU, in GB (1e9 bytes), piece by piece (`parts`).

    explorer (a quantizing backend: Transformer Engine's nvfp4 / fp8): the denoiser in BF16 (the selected layers'
    BF16 weights live inside te.Linear, the others as they are), TE's cached quantized copy of the selected layers,
    the LoRA targets' BF16 originals it re-merges every push from (one target at a time in FP32: the push's
    workspace), in place, no second copy; a BF16 explorer serves the LoRA unmerged like the regenerator.
    regenerator: one BF16 denoiser shared by every adapter version, the LoRA unmerged in FP32 (two versions
    during a push). trainer: the frozen BF16 denoiser, the LoRA states (TRAINER_LORA_BYTES), DDP and NCCL buffers
    with more than one rank, and the training micro-batch's activations, with or without gradient checkpointing.
    Each of the three holds the text encoders and VAE on its GPU (the prompt cache keeps embeddings on the CPU:
    `prompt_mb` a prompt); reward: its scorers' weights. Activations: the module constants above."""

    denoiser: float               # BF16, every expert
    explorer_weights: dict[str, float]   # the explorer's own pieces beyond the BF16 denoiser
    components: dict[str, float]  # text encoders and VAE
    reward: dict[str, float]
    lora: float                   # one adapter in FP32
    sample_activations: float     # one sampling micro-batch (x2 under CFG)
    decode_activations: float     # one VAE decode batch
    train_per_sample: float       # training activations of one row, without checkpointing
    train_per_sample_checkpointed: float
    train_micro_batch: int
    train_passes: int             # forward-equivalents per trained row (recomputation adds one)
    colocated_explorer: float     # what the explorer adds to a process that already holds the BF16 denoiser
    prompt_mb: float = 0.0        # one prompt's text embeddings (host memory, in the prompt cache)
    checkpointing: bool = False

    def checkpointed(self) -> MemoryModel:
        return dataclasses.replace(self, checkpointing=True)

    @property
    def train_activations(self) -> float:
        per = self.train_per_sample_checkpointed if self.checkpointing else self.train_per_sample
        return self.train_micro_batch * per

    @property
    def train_time_factor(self) -> float:
        """Training time with checkpointing over without: every trainable forward runs again in the backward."""
        return (self.train_passes + 1) / self.train_passes if self.checkpointing else 1.0

    def _trainer_states(self, ranks: int) -> dict[str, float]:
        out = {k: self.lora * b / 4 for k, b in TRAINER_LORA_BYTES.items()}
        if ranks > 1:
            out["DDP gradient buckets + NCCL buffers"] = self.lora * DDP_BUCKET_BYTES / 4 + NCCL_GB
        return out

    def parts(self, role: str, ranks: int = 1) -> dict[str, float]:
        """GB by piece of one process of `role` (colocated: one process holding every role, as the paper runs)."""
        activations = "activations (sampling micro-batch, or a VAE decode batch)"
        sampling = {activations: max(self.sample_activations, self.decode_activations)}
        train = {f"training activations (micro-batch {self.train_micro_batch}, "
                 f"{'with' if self.checkpointing else 'no'} gradient checkpointing)": self.train_activations}
        base = {"denoiser BF16": self.denoiser}
        if role == "explorer":
            return {**base, **self.explorer_weights, **self.components, **sampling}
        if role == "regenerator":
            return {**base, "LoRA (FP32, unmerged; two versions during a push)": 2 * self.lora, **self.components,
                    **sampling}
        if role == "trainer":
            return {**base, **self._trainer_states(ranks), **self.components, **train}
        if role == "reward":
            return dict(self.reward)
        if role == "colocated":
            # one process: one BF16 denoiser for every role; the stages run one after another
            peak = max(self.sample_activations, self.decode_activations, self.train_activations)
            return {**base, "explorer's quantized layers and merged targets": self.colocated_explorer,
                    **self._trainer_states(ranks), **self.components, **self.reward, "activations (largest stage)": peak}
        raise ValueError(f"unknown role {role!r}")

    def role(self, role: str, ranks: int = 1) -> float:
        return sum(self.parts(role, ranks).values())

    def max_train_micro_batch(self, hbm_gb: float, colocated: bool) -> int:
        """The largest train.micro_batch whose activations fit beside the trainer's (or every role's) weights."""
        fixed = dataclasses.replace(self, train_micro_batch=0).role("colocated" if colocated else "trainer")
        if colocated:
            fixed -= max(self.sample_activations, self.decode_activations)
        per = dataclasses.replace(self, train_micro_batch=1).train_activations
        return max(0, int((hbm_gb * USABLE_HBM - fixed) // per))


def memory_model(facts: ModelFacts, recipe: Recipe) -> MemoryModel:
    """The memory model of a recipe (without gradient checkpointing; `MemoryModel.checkpointed()` turns it on)."""
    fwd = facts.forward
    explorer: dict[str, float] = {}
    colocated = 0.0
    if recipe.explorer_needed and recipe.explore_format in QUANT_BYTES:
        per, per_tensor = QUANT_BYTES[recipe.explore_format]
        cache = (facts.quantized_params * per + facts.quantized_layers * per_tensor) / GB
        fmt = recipe.explore_format.upper().replace("FP4", "NVFP4")
        explorer = {f"TE's cached {fmt} copy of the {facts.quantized_layers} quantized layers": cache,
                    "LoRA targets' BF16 originals (to re-merge)": facts.target_params * 2 / GB,
                    "push: one target merged in FP32": facts.largest_target * 8 / GB}
        # colocated, the shared base holds the targets' originals; the explorer's own: te.Linear's BF16 weights, the
        # merged copies of the targets it does not quantize, TE's cache
        colocated = (facts.quantized_params + facts.target_params - facts.quantized_target_params) * 2 / GB + cache
    elif recipe.explorer_needed:
        explorer = {"LoRA (FP32, unmerged; two versions during a push)": 2 * facts.lora_params * 4 / GB}
    from solrl.models.diffusers_t2i import DiffusersT2I
    from solrl.models.wan import WanModel

    decode_batch = WanModel.decode_batch if facts.name in WAN_ARCHITECTURES else DiffusersT2I.decode_batch
    return MemoryModel(
        denoiser=facts.params * 2 / GB, explorer_weights=explorer,
        components={c.name: c.gb for c in facts.components},
        reward={c.name: c.gb for c in reward_components(recipe.reward)},
        lora=facts.lora_params * 4 / GB,
        sample_activations=recipe.rollout_micro_batch * recipe.cfg_mult * fwd.tokens * fwd.width
        * ACTIVATION_BYTES_SAMPLE / GB,
        decode_activations=min(decode_batch, recipe.rollout_micro_batch) * facts.resolution ** 2 * VAE_DECODE_BYTES
        / GB,
        train_per_sample=fwd.tokens * fwd.width * fwd.blocks * ACTIVATION_BYTES_TRAIN / GB,
        train_per_sample_checkpointed=fwd.tokens * fwd.width * (fwd.blocks * CHECKPOINT_BYTES
                                                                + ACTIVATION_BYTES_TRAIN) / GB,
        train_micro_batch=recipe.train_micro_batch, train_passes=recipe.train_passes, colocated_explorer=colocated,
        prompt_mb=facts.prompt_bytes / 1e6)


def trainer_fits_without_checkpointing(cfg: RunConfig, hbm_gb: float, ranks: int = 1) -> bool:
    """Whether the trainer's process of `cfg`, as MemoryModel counts it, fits a GPU of `hbm_gb` (USABLE_HBM of it)
    without gradient checkpointing, with `ranks` data-parallel ranks: train.gradient_checkpointing=auto's answer
    (solrl.engine.update.use_gradient_checkpointing). PlanError for a model the planner has no architecture for."""
    recipe, pc = recipe_from_config(cfg, "-", dataclasses.replace(GPUS[REFERENCE_GPU], hbm_gb=hbm_gb))
    return memory_model(_facts(cfg, pc), recipe).role("trainer", ranks) <= hbm_gb * USABLE_HBM
