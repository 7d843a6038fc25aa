"""solrl: RL post-training of diffusion models with two-stage rollouts."""

import logging as _logging

# torchao logs a warning for each CUDA-only extension it cannot load on a CPU machine, and torch's
# pytree logs a deprecation note on torchao's enums; neither concerns solrl's users.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)
# diffusers' torchao quantizer cannot import torchao's old tensor types; solrl does not use that path.
_logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").setLevel(_logging.ERROR)

__version__ = "0.1.0"
