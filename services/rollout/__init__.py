"""What the two rollout roles (explorer, regenerator) share, above the plumbing in services/common (import the
modules directly).

hot_swap          HotSwapModel: the one served copy of the denoiser, adapter pushes applied in place
adapter_endpoint  its front door: PUT /v1/adapter, the LoadAdapter RPCs, the fetch from the trainer
plane             RolloutPlane (the served model's lifecycle and info), scorers, request checks, sampler defaults
shell             start-up (model, options, run settings) and the serve loop with the stream consumer
consumers         StreamWorker: a work-queue consumer; each role's handler is its own (services/<role>/consumer.py)
"""
