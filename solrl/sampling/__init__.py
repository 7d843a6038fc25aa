"""Sigmas, seed -> noise, flow ODE/SDE steps and the sampling loop (model-agnostic)."""

from solrl.sampling.noise import SeedNoise, noise_for_seeds
from solrl.sampling.sampler import SOLVERS, SampleResult, Solver, VelocityFn, cfg_velocity, sample
from solrl.sampling.schedule import flow_sigmas
from solrl.sampling.steps import DPMHistory, SDEStep, dpm2_step, euler_step, sde_step_with_logprob

__all__ = [
    "SOLVERS",
    "SeedNoise",
    "DPMHistory",
    "SDEStep",
    "SampleResult",
    "Solver",
    "VelocityFn",
    "cfg_velocity",
    "dpm2_step",
    "euler_step",
    "flow_sigmas",
    "noise_for_seeds",
    "sample",
    "sde_step_with_logprob",
]
