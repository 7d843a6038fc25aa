"""Deployment: the planner (`solrl plan`), the layout emitter (`solrl plan --emit`) and the local supervisor (`solrl up`).

The planner is a cost model of one training epoch and the GPU placement that makes it shortest, a module a concern:

  recipe.py      the GPU by kind, one epoch's recipe from a RunConfig, the run config to plan; `PlanError`
  flops.py       one denoiser forward's multiply-accumulates (analytic, per architecture)
  facts.py       model facts: work per forward, the quantized share, parameter counts of every piece
  timing.py      stage times: the calibrated efficiencies and each stage's work on one GPU
  memory.py      the memory model, role by role
  placement.py   colocated and disaggregated layouts, and the plan (`make_plan`)
  report.py      the plan as JSON and as text
  fit.py         the paper-table fit (`solrl plan --calibrate`) and its report
  layouts.py     a plan's layout as compose / kustomize files
  up.py          `solrl up`: the four roles as local processes

GPU peaks and format costs come from the one hardware table, solrl/hardware.py. How the planner counts:

Work comes from the model and the recipe; time from the GPU's peak throughput per format and three
efficiencies calibrated against the paper's timing table (docs/method.md, 8x B200).

- One denoiser forward (one sample): analytic multiply-accumulates (MACs) of every Linear, every
  convolution and the attention products, from the model's diffusers config (solrl/models/architectures.py)
  at its reference resolution and text length (`denoiser_forward`; the formulas sit beside each family).
  The bundled shapes UNet is measured instead on one real forward: layer hooks for its Linear and
  convolution MACs (torch's FlopCounterMode agrees, tests/deploy/test_plan.py) and the attention calls' shapes for
  the attention products (which FlopCounterMode does not see in the CPU attention kernel). The share
  that a low-precision explorer quantizes follows the run's precision policy on the model's own layer-skip
  rules (solrl.precision: the same selection `solrl models quantized` reports); attention products and
  unquantized layers stay BF16.
- The recipe (solrl.config: preset + overrides): explored seeds x explore steps in the explorer's format,
  regenerated seeds x full steps in BF16 (x2 under classifier-free guidance), and per kept sample
  `timestep_count(steps, timestep_fraction)` training timesteps of 5 forward-equivalents each (the trainable
  forward, its backward counted as 2, the old adapter's forward and the reference forward; 4 with
  kl_beta = 0), as solrl/bench/curve.py prices an epoch.
- Time of a stage on one GPU = compute FLOPs / (peak of its format x efficiency) + images x a per-image
  overhead (VAE decode, hand-off and scoring, proportional to pixels). The efficiencies (one for sampling,
  one for training) and the per-image overhead are fitted by least squares on the relative error of the
  paper's twelve cells (`fit_calibration`), and `CALIBRATION` holds the result.
- Placements: colocated (every role time-shares every GPU, as the paper: the stages run one after another,
  each over all N GPUs) or disaggregated (explorers, regenerators and trainer ranks on their own GPUs,
  plus one GPU for the reward service, as docker-compose.yml and k8s/overlays/b200 ship it). Explore and
  regenerate jobs are whole prompts, so a sampling stage on g GPUs takes ceil(prompts / g) prompts' time;
  the trainer splits every optimizer step's samples among its ranks (solrl/engine/data_parallel.py), so training on g ranks
  takes the sum over steps of ceil(step samples / g) samples' time, and at most the fewest samples of any
  step can be ranks (`ddp.max_ranks`, the rule the trainer enforces). Disaggregated, the regenerators take
  each prompt as soon as it is explored (the queue streams them), so the rollout takes the slower of the two
  stages plus one prompt of the other; training needs the whole batch (advantages use the batch's std) and comes after.
- Memory per GPU, role by role, as each process holds it (`MemoryModel`): the BF16 denoiser (one copy per
  process: the regenerator's adapter versions share it), the explorer's Transformer Engine cache of its quantized
  layers and the LoRA targets' BF16 originals it re-merges from, the trainer's three FP32 adapters (trainable, old,
  EMA), gradients, AdamW moments and DDP / NCCL buffers, the text encoders and VAE on every model role's GPU, the
  reward's scorer; weights and states are exact parameter counts (tests/deploy/test_plan_memory.py holds them against the
  real objects). Activations are a model (the constants' comment gives the source): training per token x width x
  block, with and without gradient checkpointing; the plan turns checkpointing on where the trainer (or the
  colocated process) would not fit without it (`Layout.gradient_checkpointing`, the plan's `gradient_checkpointing`)
  and prices the recomputation (one more forward a trained row). A layout that does not fit names each role and by
  how much.

Not modelled: the sync (merging the LoRA and re-quantizing reads the weights once: well under a second),
network transfer and data-parallel communication time (a stage spread over g GPUs is g times faster, up to
its granularity), the LoRA layers' own FLOPs (about 1-3% of a forward at rank 32), eval (reported
amortized, outside the epoch), FSDP (each trainer rank holds the whole base model; DDP over the LoRA).
"""
