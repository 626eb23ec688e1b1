"""NxD Inference's application for MoE causal LMs, on nxd_moe's layer: config, compile, load, generate.

See docs/application.md. The pieces: :mod:`~nxd_moe.application.config` (NxDI's fields), :mod:`~.kv_cache`,
:mod:`~.sampling`, :mod:`~.programs` (context encoding and token generation), :mod:`~.runner` (state on the device,
CUDA graphs), :mod:`~.generation` (the loop), :mod:`~.artifacts` (what ``compile`` writes), :mod:`~.application`.
"""

from nxd_moe.application.application import CausalLMApplication
from nxd_moe.application.config import ApplicationConfig, NxDIFieldWarning
from nxd_moe.application.generation import GenerationOutput
from nxd_moe.application.sampling import SamplingConfig, prepare_sampling_params

__all__ = ["ApplicationConfig", "CausalLMApplication", "GenerationOutput", "NxDIFieldWarning", "SamplingConfig",
           "prepare_sampling_params"]
