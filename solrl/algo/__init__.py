"""The RL pieces: seed selection, advantages, DiffusionNFT and GRPO losses, old/EMA decay."""

from solrl.algo.advantages import compute_advantages, threshold_groups
from solrl.algo.ema import ema_decay, lerp_params_, old_decay
from solrl.algo.grpo import flow_grpo_loss, grpo_loss, mean_kl
from solrl.algo.nft import NFTConfig, nft_loss, timestep_count, timestep_indices
from solrl.algo.selection import SELECTION_MODES, kept_contrast, prompt_kendall_taus, select

__all__ = [
    "SELECTION_MODES",
    "NFTConfig",
    "compute_advantages",
    "ema_decay",
    "flow_grpo_loss",
    "grpo_loss",
    "kept_contrast",
    "lerp_params_",
    "mean_kl",
    "nft_loss",
    "old_decay",
    "prompt_kendall_taus",
    "select",
    "threshold_groups",
    "timestep_count",
    "timestep_indices",
]
