"""Run configuration: the schema (nested dataclasses, `validate()`, JSON; schema.py), `--set a.b=v` overrides parsed
against each field's declared type (overrides.py), and presets, functions returning a `RunConfig` by name, with a
run's config resolved from a preset or a config file plus overrides (presets.py). The names callers use are here."""

from solrl.config.overrides import apply_overrides
from solrl.config.presets import (
    DEFAULT_PRESET,
    PRESETS,
    get_preset,
    register_preset,
    resolve,
    resolve_run,
    with_flow_grpo,
)
from solrl.config.schema import (
    ALGOS,
    MODEL_NAMES,
    MODES,
    REWARD_FRAMES,
    SELECTIONS,
    SOLVERS,
    VIDEO_MODELS,
    ConfigError,
    EvalConfig,
    GuardConfig,
    LoraConfig,
    ModelConfig,
    MonitorConfig,
    PromptsConfig,
    ProxyConfig,
    RolloutConfig,
    RunConfig,
    SamplerConfig,
    TrainConfig,
)

__all__ = [
    "ALGOS", "DEFAULT_PRESET", "MODEL_NAMES", "MODES", "PRESETS", "REWARD_FRAMES", "SELECTIONS", "SOLVERS",
    "VIDEO_MODELS", "ConfigError", "EvalConfig", "GuardConfig", "LoraConfig", "ModelConfig", "MonitorConfig",
    "PromptsConfig", "ProxyConfig",
    "RolloutConfig", "RunConfig", "SamplerConfig", "TrainConfig", "apply_overrides", "get_preset", "register_preset",
    "resolve", "resolve_run", "with_flow_grpo",
]
