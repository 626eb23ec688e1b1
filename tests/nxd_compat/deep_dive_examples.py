"""The Python examples of AWS's MoE inference deep dive (``neuron-moe-inference-deep-dive.rst``, "Deep dive: Explore
Mixture of Experts (MoE) inference support for Neuron"), written against NxD's import names as the page writes
them, with only their sizes scaled to fit a laptop. Call them with the NxD front door installed.

Scaling: hidden and intermediate sizes divided so each layer stays small (7168 -> 56, 2048 -> 16, 2880 -> 48,
5120 -> 40, 8192 -> 64); expert counts, top-k, groups, block size, LNC, capacity factor and every flag are the
page's. World sizes of ``initialize_model_parallel`` are scaled in the torchrun tests (tests/nxd_compat/nxd_world.py).

Examples by the page's line number (the examples of the shipped copy in /work/shared/seeds/):

- 113 :func:`moe_layer`, 182 :func:`sp_router`, 197 :func:`group_limited_router`, 445 :func:`sp_router_2880`;
- 222 / 262 / 281 write ``hidden_act="swiglu"``, which NxD rejects too (``ExpertMLPsV2`` validates ``hidden_act``
  against ``ACT2FN``): :func:`swiglu_config` runs them as written (our error says what to write), and with that
  correction (GPT-OSS's SwiGLU);
- 325 / 847 ``initialize_model_parallel`` calls: under torchrun, tests/nxd_compat/nxd_world.py;
- 364 / 801 :func:`llama4_shared_experts_layer`;
- 466 is the page's pseudo-code of a naive HuggingFace loop (``combine_outputs`` is undefined): not an NxD example;
- 673 :func:`skip_dma_blockwise_config`, 711 :func:`dynamic_while_blockwise_config` (it sets both dynamic-while
  flags with "OR" between them; as written both are on, which our config refuses by name -- NxD's ``from_kwargs``
  accepts it and its kernel asserts at the first forward).
"""

from __future__ import annotations

H_7168, I_2048, H_2880, H_5120, I_8192 = 56, 16, 48, 40, 64


def moe_layer(hidden_size: int = H_7168, intermediate_size: int = I_2048):
    """Line 113: "Example: GPT-OSS MoE layer configuration" (sizes as the page writes them: 128 experts, top 8)."""
    from neuronx_distributed.modules.moe import MoE, routing
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
    from neuronx_distributed.modules.moe.moe_configs import BlockwiseMatmulConfig, RoutedExpertsMLPOpsConfig

    num_experts = 128
    top_k = 8
    router = routing.RouterTopK(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden_size,
    )
    routed_experts_config = RoutedExpertsMLPOpsConfig(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        hidden_act="silu",
        glu_mlp=True,
        capacity_factor=None,
        normalize_top_k_affinities=True,
    )
    blockwise_config = BlockwiseMatmulConfig.from_kwargs(
        block_size=512,
        logical_nc_config=2,
    )
    expert_mlps = ExpertMLPsV2(
        routed_experts_mlp_config=routed_experts_config,
        blockwise_matmul_config=blockwise_config,
        sequence_parallel_enabled=True,
    )
    moe_layer = MoE(
        router=router,
        expert_mlps=expert_mlps,
        sequence_parallel_enabled=True,
    )
    return moe_layer


def sp_router():
    """Line 182: standard top-k routing in sequence-parallel mode."""
    from neuronx_distributed.modules.moe import routing

    return routing.RouterTopK(
        num_experts=128,
        top_k=8,
        hidden_size=H_7168,
        act_fn="softmax",
        sequence_parallel_enabled=True,
    )


def group_limited_router():
    """Line 197: DeepSeek-V3-style group-limited routing."""
    from neuronx_distributed.modules.moe import routing

    return routing.GroupLimitedRouter(
        num_experts=256,
        top_k=8,
        hidden_size=H_7168,
        n_group=8,
        topk_group=2,
    )


def sp_router_2880():
    """Line 445: router configuration for sequence-parallel execution."""
    from neuronx_distributed.modules.moe import routing

    return routing.RouterTopK(
        num_experts=128,
        top_k=8,
        hidden_size=H_2880,
        sequence_parallel_enabled=True,
        act_fn="softmax",
    )


# The correction the swiglu examples need: GPT-OSS's SwiGLU, gate * sigmoid(1.702 * gate) * (up + 1), clamped.
GPT_OSS_SWIGLU = dict(hidden_act="sigmoid", glu_type="swiglu", hidden_act_scaling_factor=1.702,
                      hidden_act_bias=1.0, gate_clamp_upper_limit=7.0, up_clamp_lower_limit=-7.0,
                      up_clamp_upper_limit=7.0)


def swiglu_config(line: int, corrected: bool):
    """Lines 222, 262 and 281: their ``RoutedExpertsMLPOpsConfig``, as written (``hidden_act="swiglu"``) or with
    :data:`GPT_OSS_SWIGLU` instead."""
    from neuronx_distributed.modules.moe.moe_configs import RoutedExpertsMLPOpsConfig

    sizes = dict(hidden_size=H_2880, intermediate_size=H_2880) if line == 281 else dict(
        hidden_size=H_7168, intermediate_size=I_2048)
    activation = GPT_OSS_SWIGLU if corrected else dict(hidden_act="swiglu")
    return RoutedExpertsMLPOpsConfig(
        num_experts=128,
        top_k=8,
        **sizes,
        **activation,
        glu_mlp=True,
        capacity_factor=1.25 if line == 281 else None,
        normalize_top_k_affinities=True,
    )


def swiglu_expert_mlps(routed_experts_config):
    """Line 222's ``ExpertMLPsV2`` with its blockwise settings (block 512, LNC2, both DMA skips)."""
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
    from neuronx_distributed.modules.moe.moe_configs import BlockwiseMatmulConfig

    blockwise_config = BlockwiseMatmulConfig.from_kwargs(
        block_size=512,
        logical_nc_config=2,
        skip_dma_token=True,
        skip_dma_weight=True,
    )
    return ExpertMLPsV2(
        routed_experts_mlp_config=routed_experts_config,
        blockwise_matmul_config=blockwise_config,
        sequence_parallel_enabled=True,
    )


def llama4_shared_experts_layer():
    """Lines 364 / 801: Llama 4 Maverick's shared expert and the MoE layer with it (the page reuses ``router``
    and ``expert_mlps`` from line 113; here at this layer's hidden size)."""
    from neuronx_distributed.modules.moe import MoE
    from neuronx_distributed.modules.moe.shared_experts import SharedExperts

    base = moe_layer(hidden_size=H_5120, intermediate_size=I_2048)
    router, expert_mlps = base.router, base.expert_mlps
    shared_experts = SharedExperts(
        hidden_size=H_5120,
        intermediate_size=I_8192,
        num_shared_experts=1,
        hidden_act="silu",
        sequence_parallel_enabled=True,
        fused_gate_up_projection=True,
    )
    moe_layer_with_shared = MoE(
        router=router,
        expert_mlps=expert_mlps,
        shared_experts=shared_experts,
        sequence_parallel_enabled=True,
    )
    return moe_layer_with_shared


def skip_dma_blockwise_config():
    """Line 673."""
    from neuronx_distributed.modules.moe.moe_configs import BlockwiseMatmulConfig

    return BlockwiseMatmulConfig.from_kwargs(
        block_size=512,
        logical_nc_config=2,
        skip_dma_token=True,
        skip_dma_weight=True,
    )


def dynamic_while_blockwise_config(which: str | None = None):
    """Line 711, as written (``which=None``: both flags) or with one of the two alternatives (``"block"`` or
    ``"intermediate"``)."""
    from neuronx_distributed.modules.moe.moe_configs import BlockwiseMatmulConfig

    return BlockwiseMatmulConfig.from_kwargs(
        block_size=512,
        logical_nc_config=2,
        use_shard_on_block_dynamic_while=which in (None, "block"),
        use_shard_on_intermediate_dynamic_while=which in (None, "intermediate"),
    )
