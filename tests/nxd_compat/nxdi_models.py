"""NxD Inference's GPT-OSS and Llama 4 MoE layers as NxDI's model code builds them, and the transformers blocks to
compare them with: shared by test_nxdi_entry_point.py and tests/gpu/test_nxd_compat_gpu.py.

``gpt_oss_moe`` / ``llama4_moe`` do what NxDI's ``NeuronGptOssMoE`` and ``NeuronMoEDecoderLayer`` constructors do (set
their architecture's fields on ``neuron_config``, then call ``initialize_moe_module``), written here from those
sources; the configs are NxDI-shaped objects (``SimpleNamespace``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hf_helpers import HIDDEN, LAYERS, randomize_hf_
from transformers import GptOssConfig, Llama4TextConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

from nxd_moe.config import BlockwiseMatmulConfig, RouterConfig
from nxd_moe.hf import from_hf_moe_block
from nxd_moe.nxdi import NEURON_CONFIG_DEFAULTS

E, K, INTER = 8, 2, 24


def neuron_config(**overrides) -> SimpleNamespace:
    """An NxDI ``MoENeuronConfig``-shaped object: its defaults (fp32 here, for the parity checks), a small block."""
    fields = {**NEURON_CONFIG_DEFAULTS, "torch_dtype": torch.float32, "router_config": RouterConfig(),
              "blockwise_matmul_config": BlockwiseMatmulConfig.from_kwargs(block_size=4), "on_cpu": False,
              "is_hidden_dim_shuffled": False, "is_intermediate_dim_shuffled": False,
              "moe_fused_nki_kernel_enabled": None, "router_topk_nki_kernel_enabled": None,
              "expert_mlp_nki_kernel_enabled": None, "shared_mlp_nki_kernel_enabled": None,
              "rpl_reduce_dtype": None, **overrides}
    return SimpleNamespace(**fields)


def inference_config(hidden_act: str, top_k: int, hidden_size: int = HIDDEN, intermediate_size: int = INTER,
                     num_experts: int = E, **neuron_fields) -> SimpleNamespace:
    """An NxDI ``InferenceConfig``-shaped object for the MoE layers' fields."""
    return SimpleNamespace(num_local_experts=num_experts, num_experts_per_tok=top_k, hidden_size=hidden_size,
                           intermediate_size=intermediate_size, hidden_act=hidden_act, n_shared_experts=0,
                           neuron_config=neuron_config(**neuron_fields))


def gpt_oss_moe(config, rmsnorm=None, **backend):
    """NxDI's ``NeuronGptOssMoE.__init__``: GPT-OSS's fields on neuron_config, then initialize_moe_module (through
    the front door: install it first). ``backend``: nxd_moe's keyword, which NxDI's code does not pass."""
    from neuronx_distributed_inference.modules.moe_v2 import initialize_moe_module as nxdi_initialize_moe_module

    nc = config.neuron_config
    nc.router_config.act_fn = "softmax"
    nc.transpose_shared_experts_weights = False
    nc.early_expert_affinity_modulation = False
    nc.normalize_top_k_affinities = False
    nc.glu_type = "swiglu"
    nc.hidden_act_scaling_factor = 1.702
    nc.hidden_act_bias = 1
    nc.gate_clamp_upper_limit = 7.0
    nc.gate_clamp_lower_limit = None
    nc.up_clamp_upper_limit = 7.0
    nc.up_clamp_lower_limit = -7.0
    return nxdi_initialize_moe_module(config=config, rmsnorm=rmsnorm, init_tkg_module=not nc.on_cpu,
                                      router_bias=True, experts_bias=True, apply_act_fn_over_topk=True, **backend)


def llama4_moe(config, rmsnorm=None, **backend):
    """NxDI's ``NeuronMoEDecoderLayer.__init__`` (Llama 4), as :func:`gpt_oss_moe`."""
    from neuronx_distributed_inference.modules.moe_v2 import initialize_moe_module as nxdi_initialize_moe_module

    config.n_shared_experts = 1
    nc = config.neuron_config
    nc.router_config.dtype = torch.float32
    nc.router_config.act_fn = "sigmoid"
    nc.fused_shared_experts = False
    nc.transpose_shared_experts_weights = True
    nc.early_expert_affinity_modulation = True
    nc.normalize_top_k_affinities = False
    return nxdi_initialize_moe_module(config=config, rmsnorm=rmsnorm, init_tkg_module=True, **backend)


def rmsnorm(seed: int, hidden_size: int = HIDDEN) -> torch.nn.RMSNorm:
    """The decoder's post-attention RMSNorm NxDI hands the MoE (``rmsnorm=``), with a random scale."""
    norm = torch.nn.RMSNorm(hidden_size, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(hidden_size, generator=torch.Generator().manual_seed(seed)))
    return norm


def load_from_hf(moe, block, hf_config) -> None:
    """The block's weights into ``moe`` (through nxd_moe.hf's converter; Llama 4's shared expert stored transposed,
    as NxDI's ``transpose_shared_experts_weights`` asks)."""
    state = from_hf_moe_block(block, hf_config).state_dict()
    if moe.rmsnorm is not None:
        state.update({f"rmsnorm.{k}": v for k, v in moe.rmsnorm.state_dict().items()})
    shared = moe.shared_experts
    if shared is not None and shared.transpose_weights:
        state = {k: v.t() if k.startswith("shared_experts.") else v for k, v in state.items()}
    moe.load_state_dict(state)


def hf_output(block, x):
    """The block's output as ``(B, S, H)`` (both blocks return tuples; Llama 4 flattens the tokens)."""
    with torch.no_grad():
        out = block(x)
    return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)


def gpt_oss_block(seed: int = 0, hidden_size: int = HIDDEN, intermediate_size: int = INTER, num_experts: int = E):
    """``(config, GptOssMLP)`` with random weights; swiglu_limit 7.0, which NxDI hard-codes for GPT-OSS."""
    hf_config = GptOssConfig(hidden_size=hidden_size, intermediate_size=intermediate_size,
                             num_local_experts=num_experts, num_experts_per_tok=K, swiglu_limit=7.0, head_dim=16,
                             **LAYERS)
    return hf_config, randomize_hf_(GptOssMLP(hf_config), seed).eval()


def llama4_block(top_k: int, seed: int = 0, hidden_size: int = HIDDEN, intermediate_size: int = INTER,
                 num_experts: int = E):
    """``(config, Llama4TextMoe)`` with random weights."""
    hf_config = Llama4TextConfig(hidden_size=hidden_size, intermediate_size=intermediate_size,
                                 intermediate_size_mlp=2 * intermediate_size, num_local_experts=num_experts,
                                 num_experts_per_tok=top_k, head_dim=16, **LAYERS)
    return hf_config, randomize_hf_(Llama4TextMoe(hf_config), seed).eval()
