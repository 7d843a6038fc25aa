"""Rollouts: sampling, scoring and selecting the seeds an epoch trains on, and what each rollout mode does.

  passes.py      generate(), explore(), regenerate() and the prompt cache: rollouts as pure functions (torch)
  workers.py     inference copies: the low-precision explorer's (and the services' regenerator's) denoiser
  strategies.py  the rollout strategies: one class per `rollout.mode`, `strategy(name)` (no torch: the config's
                 mode names and checks read it)
  candidates.py  the adaptive proxy's candidates: parse, label, check, device cost (no torch)

This file imports nothing, so the light modules load without torch.
"""
