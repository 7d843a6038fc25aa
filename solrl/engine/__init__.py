"""The training engine: the session, the two loops that run it, and what they are built from.

  session.py        the session (everything built from a config) and one epoch of the two-stage loop
  loop.py           the embedded loop: `train()`, a run in one process (ranks > 0 of a torchrun launch follow)
  queue_loop.py     the queue-driven loop: the same epochs with rollouts from the services (`run_distributed`)
  run.py            the run skeleton both loops share: resume, records, evaluation and checkpoint cadence
  update.py         the DiffusionNFT / FlowGRPO update
  data_parallel.py  torch data parallelism of the update (torchrun ranks)
  proxy.py          the adaptive proxy: calibration and the controller
  evaluate.py       held-out evaluation
  checkpoint.py     checkpoints

The rollout modes are strategies (solrl/rollout/strategies.py), the proxy's candidates are in
solrl/rollout/candidates.py: both sit below the engine, where the config and the planner can read them too.
"""
