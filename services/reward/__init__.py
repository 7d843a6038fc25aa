"""The reward service: solrl.reward.v1.Reward and the KServe v2 / Triton protocol over the core scorers."""
