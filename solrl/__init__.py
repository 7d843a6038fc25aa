"""solrl: RL post-training of diffusion models with two-stage rollouts."""

__version__ = "0.1.0"
