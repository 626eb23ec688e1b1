"""Our own cases for what NxD's MoE unit tests (``test/unit_test/modules/moe``, run unmodified by
``benchmarks/nxd_tests.py``, not committed) check, written against the names the front door serves:

- the block mapping with NxD's signature (NxD's ``test_get_blockwise_expert_and_token_mapping.py``): a worked
  example and random routings against a loop statement of the layout rule;
- the redundant-expert helpers (``test_moe_redundancy.py``): token ranges worked by hand, and every routed pair
  computed exactly once over the ranks of distributions with replicas;
- ``torch_neuronx.testing.assert_close`` (the comparison all of them make): the Neuron allclose rule;
- the MoE against transformers' blocks with the same weights (``test_impl_correctness.py``): Mixtral through NxD's
  ``ExpertMLPs`` with the top-k normalisation switched on after construction, as NxD's test does; S-BASE (Sinkhorn
  router, top 1) with capacity-factor drops against a float64 loop; Llama 4 with NxD's fused-decode state dict
  (``router.weight_T``, ``moe_fused_tkg.*``) and random routed experts (NxD's golden leaves them zero);
  ``SharedExperts`` against ``Llama4TextMLP``;
- the training and Neuron-kernel names the tests import: importable, a ``NotServedError`` when used; the
  ``parallel_state``, seeding, LNC, device-move and logger utilities; the ``xla`` process-group backend without
  torch_xla.

Tolerances: fp32 layers with outputs O(0.1-1) and sums over H <= 32, I <= 24: ``FP32_ATOL = 1e-5``
(tests/conftest.py), a 10x margin over their rounding. Each comparison has a negative control.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
from conftest import FP32_ATOL, assert_close, randn, randomize_
from hf_helpers import randomize_hf_

import nxd_moe
from nxd_moe.nxd_compat.not_served import NotServedError
from nxd_moe.nxd_compat.pytest_plugin import nxd_compat  # noqa: F401 -- the fixture

H, INTER = 16, 12


@pytest.fixture
def nxd(nxd_compat):  # noqa: F811
    import neuronx_distributed

    return neuronx_distributed


# ----------------------------------------------------------------------------------------------------------
# the block mapping (NxD's ExpertMLPs.get_blockwise_expert_and_token_mapping)


def _mapping(nxd, expert_index: torch.Tensor, num_experts: int, block_size: int, num_blocks: int,
             overrides: dict | None = None, **kwargs):
    from neuronx_distributed.modules.moe.expert_mlps import ExpertMLPs
    from neuronx_distributed.parallel_layers import parallel_state

    mask = torch.zeros(expert_index.shape[0], num_experts, dtype=torch.int64).scatter(1, expert_index, 1)
    args = dict(total_tokens=expert_index.shape[0], num_blocks=num_blocks, expert_mask=mask,
                expert_index=expert_index, block_size=block_size, device=mask.device, enable_spmd_rank=False,
                spmd_rank=None, tensor_parallel_group=parallel_state.get_world_group())
    return ExpertMLPs.get_blockwise_expert_and_token_mapping(**{**args, **kwargs, **(overrides or {})})


def test_block_mapping_worked_example(nxd):
    # 5 tokens, top 2 of 3 experts, blocks of 2. Expert 0 gets tokens 0, 1, 3, 4 (two full blocks), expert 1 gets
    # 1, 2, 3 and expert 2 gets 0, 2, 4 (two blocks each, the second half empty). NxD's worst-case count:
    # ceil((5*2 - 2) / 2) + 2 = 6 blocks.
    index = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    block_to_expert, position_to_id = _mapping(nxd, index, 3, 2, 6)
    assert block_to_expert.tolist() == [0, 0, 1, 1, 2, 2] and block_to_expert.dtype == torch.int64
    assert position_to_id.tolist() == [0, 1, 3, 4, 1, 2, 3, -1, 0, 2, 4, -1]
    # A block nobody needs maps to the last expert, all padding; NxD's ways of computing it change nothing.
    block_to_expert, position_to_id = _mapping(nxd, index, 3, 2, 7, optimized_block_to_token_mapping=False,
                                               parallelize_token_to_block_mapping=True, pad_num_blocks_to_even=True)
    assert block_to_expert.tolist() == [0, 0, 1, 1, 2, 2, 2] and position_to_id[-2:].tolist() == [-1, -1]
    with pytest.raises(ValueError, match=r"expert_mask must be \(total_tokens, E\) = \(4, E\)"):
        _mapping(nxd, index, 3, 2, 6, total_tokens=4)



@pytest.mark.parametrize("argument", ["total_tokens", "num_blocks", "block_size"])
@pytest.mark.parametrize("value", [0, -2])
def test_block_mapping_refuses_counts_below_one(nxd, argument, value):
    index = torch.tensor([[0, 2], [1, 0], [2, 1]])
    with pytest.raises(ValueError, match=rf"^{argument} must be in \[1, inf\], got {value}$"):
        _mapping(nxd, index, 3, 2, 6, overrides={argument: value})


def test_block_mapping_checks_expert_index_and_takes_any_integer_dtype(nxd):
    index = torch.tensor([[0, 2], [1, 0], [2, 1]])
    with pytest.raises(ValueError, match=r"expert_index must be \(total_tokens, k\) = \(3, k\), got \(6,\)"):
        _mapping(nxd, index, 3, 2, 6, overrides={"expert_index": index.flatten()})
    with pytest.raises(ValueError, match=r"expert_index must be \(total_tokens, k\) = \(3, k\), got \(2, 2\)"):
        _mapping(nxd, index, 3, 2, 6, overrides={"expert_index": index[:2]})
    # NxD's routers return int64, its kernels' index paths int32: the mapping is the same, in int64
    expected = _mapping(nxd, index, 3, 2, 6)
    block_to_expert, position_to_id = _mapping(nxd, index.to(torch.int32), 3, 2, 6)
    assert block_to_expert.dtype == position_to_id.dtype == torch.int64
    assert torch.equal(block_to_expert, expected[0]) and torch.equal(position_to_id, expected[1])

def _layout(expert_index: torch.Tensor, num_experts: int, block_size: int, num_blocks: int):
    """The rule in words: each expert in turn takes ``ceil(n / B)`` blocks for its ``n`` tokens, in token order,
    padded with -1; blocks left over belong to the last expert."""
    blocks, slots = [], []
    for e in range(num_experts):
        tokens = [t for t in range(expert_index.shape[0]) if e in expert_index[t].tolist()]
        count = math.ceil(len(tokens) / block_size)
        blocks += [e] * count
        slots += tokens + [-1] * (count * block_size - len(tokens))
    blocks += [num_experts - 1] * (num_blocks - len(blocks))
    return blocks, slots + [-1] * (num_blocks * block_size - len(slots))


@pytest.mark.parametrize("seed", range(4))
def test_block_mapping_random_routings(nxd, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens, experts, k, block = 11, 5, 2, 3
    index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    num_blocks = math.ceil((tokens * k - (experts - 1)) / block) + experts - 1
    block_to_expert, position_to_id = _mapping(nxd, index, experts, block, num_blocks)
    assert (block_to_expert.tolist(), position_to_id.tolist()) == _layout(index, experts, block, num_blocks)


# ----------------------------------------------------------------------------------------------------------
# redundant experts (NxD's ExpertMLPs.allocate_token_blocks / generate_local_expert_mask_with_redundancy)


def test_allocate_token_blocks_by_hand(nxd):
    from neuronx_distributed.modules.moe.expert_mlps import ExpertMLPs

    # EP 3: expert 0 on every rank, expert 1 on ranks 1 and 2. Ten tokens: expert 0's copies take 3, 3 and 3 + the
    # remainder 1; expert 1's take 5 and 5; rank 0 holds no expert 1 (an empty range, end = start - 1).
    start, end = ExpertMLPs.allocate_token_blocks(torch.tensor([[1, 0], [1, 1], [1, 1]]), 10)
    assert start.tolist() == [[0, 0], [3, 0], [6, 5]] and end.tolist() == [[2, -1], [5, 4], [9, 9]]
    assert start.dtype == end.dtype == torch.int32


@pytest.mark.parametrize("distribution", [
    [[0, 1], [2, 3]],  # no redundancy
    [[0, 1, 2], [0, 3, 2]],  # experts 0 and 2 on both ranks
    [[3, 0, 3], [1, 2, 3]],  # rank 0 holds expert 3 twice: it computes it once
])
def test_redundancy_masks_compute_each_pair_once(nxd, distribution):
    from neuronx_distributed.modules.moe.expert_mlps import ExpertMLPs

    experts, tokens = 4, 13
    gen = torch.Generator().manual_seed(len(distribution[0]))
    mask = (torch.rand(tokens, experts, generator=gen) < 0.5).to(torch.float32)
    degree = torch.tensor([[ranks.count(e) for e in range(experts)] for ranks in distribution])
    start, end = ExpertMLPs.allocate_token_blocks(degree, tokens)
    helper = ExpertMLPs.__new__(ExpertMLPs)  # NxD's test calls them on an instance built without __init__
    computed = torch.zeros(tokens, experts)
    for rank, local in enumerate(distribution):
        local_index = torch.tensor([local])
        kept = helper.generate_local_expert_mask_with_redundancy(mask[:, local], local_index, start, end, experts,
                                                                 torch.tensor([rank]))
        for slot, e in enumerate(local):
            rows = kept[:, slot].nonzero().flatten()
            assert all(start[rank, e] <= t <= end[rank, e] for t in rows.tolist())
            computed[:, e] += kept[:, slot]
    assert torch.equal(computed, mask)


def test_redundancy_helpers_refuse_bad_input_and_keep_nxds_dtypes(nxd):
    from neuronx_distributed.modules.moe.expert_mlps import ExpertMLPs

    degree = torch.tensor([[1, 0], [1, 1]])
    start, end = ExpertMLPs.allocate_token_blocks(degree, 0)  # no token: every range empty
    assert (end - start).eq(-1).all()
    with pytest.raises(ValueError, match=r"^tokens_per_expert must be in \[0, inf\], got -1$"):
        ExpertMLPs.allocate_token_blocks(degree, -1)
    # slot 0 holds expert 1, slot 1 nothing (-1), slot 2 expert 0
    holders = torch.tensor([[False, False, True], [True, False, False]])
    local_id = ExpertMLPs.generate_local_expert_id_no_local_redundancy(holders, torch.device("cpu"))
    assert local_id.tolist() == [1, -1, 0] and local_id.dtype == torch.int32
    helper = ExpertMLPs.__new__(ExpertMLPs)
    start, end = ExpertMLPs.allocate_token_blocks(degree, 6)
    for bad in (torch.ones(6, 3), torch.ones(6)):  # two local experts: (T, 2)
        with pytest.raises(ValueError, match=rf"local_expert_mask must be \(T, L\) with L = 2 local experts, "
                                             rf"got {re.escape(str(tuple(bad.shape)))}"):
            helper.generate_local_expert_mask_with_redundancy(bad, torch.tensor([[0, 1]]), start, end, 2, 1)


# ----------------------------------------------------------------------------------------------------------
# torch_neuronx.testing.assert_close


def test_neuron_assert_close_rule(nxd_compat):  # noqa: F811
    from torch_neuronx.testing import assert_close as neuron_close

    expected = torch.tensor([100.0, 1e-3])
    near = torch.tensor([100.0, 0.5])  # off by 500x at the small element, within rtol * max|expected|
    neuron_close(near, expected, rtol=0.01, atol=0.0)
    with pytest.raises(AssertionError):  # the per-element rule (torch.testing's) refuses it
        torch.testing.assert_close(near, expected, rtol=0.01, atol=0.0)
    with pytest.raises(AssertionError, match="Mismatched elements: 1 / 2"):
        neuron_close(torch.tensor([100.0, 1.5]), expected, rtol=0.01, atol=0.0)
    ones = torch.ones(3)
    neuron_close(ones + 1e-5, ones)  # float32 defaults: atol 1e-5 + rtol 1.3e-6 * 1
    with pytest.raises(AssertionError):
        neuron_close(ones + 2e-5, ones)
    with pytest.raises(AssertionError, match="dtypes differ"):
        neuron_close(ones.double(), ones)
    with pytest.raises(AssertionError, match="shapes differ"):
        neuron_close(ones, torch.ones(4))
    with pytest.raises(ValueError, match="give both rtol and atol"):
        neuron_close(ones, ones, rtol=0.1)
    infinite = torch.tensor([float("inf"), 1.0])
    neuron_close(infinite, infinite.clone())
    with pytest.raises(AssertionError):
        neuron_close(-infinite, infinite)
    nan = torch.tensor([float("nan")])
    neuron_close(nan, nan, equal_nan=True)
    with pytest.raises(AssertionError):
        neuron_close(nan, nan)


# ----------------------------------------------------------------------------------------------------------
# the MoE against transformers' blocks (NxD's test_impl_correctness.py)


def _mixtral(num_experts: int, top_k: int):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=num_experts,
                           num_experts_per_tok=top_k)
    config._experts_implementation = "eager"
    return randomize_hf_(MixtralSparseMoeBlock(config), seed=num_experts + top_k).eval()


def _nxd_mixtral(nxd, hf, num_experts: int, top_k: int, capacity_factor):
    """NxD's test's Mixtral layer: ExpertMLPs with normalisation off, switched on after construction."""
    from neuronx_distributed.modules.moe import MoE, RouterTopK
    from neuronx_distributed.modules.moe.expert_mlps import ExpertMLPs

    router = RouterTopK(num_experts=num_experts, top_k=top_k, hidden_size=H, act_fn="softmax")
    experts = ExpertMLPs(num_experts=num_experts, top_k=top_k, hidden_size=H, intermediate_size=INTER,
                         hidden_act="silu", glu_mlp=True, capacity_factor=capacity_factor, block_size=4)
    moe = MoE(router, experts, return_router_logits=True).eval()
    sd = hf.state_dict()  # transformers: gate_up (E, 2I, H) = [gate; up], down (E, H, I); NxD: (E, H, 2I), (E, I, H)
    moe.load_state_dict({"router.linear_router.weight": sd["gate.weight"],
                         "expert_mlps.mlp_op.gate_up_proj.weight": sd["experts.gate_up_proj"].transpose(1, 2),
                         "expert_mlps.mlp_op.down_proj.weight": sd["experts.down_proj"].transpose(1, 2)})
    return moe


@pytest.mark.parametrize("num_experts,top_k,capacity_factor,shape", [
    (4, 2, None, (2, 9, H)),  # blockwise prefill
    (4, 2, None, (3, 1, H)),  # decode
    (8, 4, 8 / 4 - 1e-6, (1, 10, H)),  # capacity factor just under dropless: nothing dropped
    (2, 1, None, (1, 7, H)),  # top 1: normalised weight 1
])
def test_mixtral_through_nxds_expert_mlps(nxd, num_experts, top_k, capacity_factor, shape):
    hf = _mixtral(num_experts, top_k)
    moe = _nxd_mixtral(nxd, hf, num_experts, top_k, capacity_factor)
    x = randn(*shape, seed=1)
    with torch.no_grad():
        unnormalised = moe(x)[0]
        moe.expert_mlps.routed_experts_mlp_config.normalize_top_k_affinities = True  # NxD's test's workaround
        out, logits = moe(x)
        expected = hf(x)
    assert_close(out, expected, FP32_ATOL)
    assert_close(logits, x.reshape(-1, H) @ hf.gate.weight.T, FP32_ATOL)
    assert (unnormalised - expected).abs().max() > 100 * FP32_ATOL  # control: the assignment took effect


def test_expert_config_assignments(nxd):
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
    from neuronx_distributed.modules.moe.moe_configs import BlockwiseMatmulConfig, RoutedExpertsMLPOpsConfig

    config = RoutedExpertsMLPOpsConfig(num_experts=4, hidden_size=H, intermediate_size=INTER, top_k=2,
                                       hidden_act="silu", glu_mlp=True, early_expert_affinity_modulation=True)
    # NxD's test passes the experts' early_expert_affinity_modulation to the blockwise config too (NxD drops it).
    experts = ExpertMLPsV2(config, BlockwiseMatmulConfig.from_kwargs(block_size=4,
                                                                      early_expert_affinity_modulation=True))
    with pytest.raises(ValueError, match="was given early_expert_affinity_modulation=False, a setting of the routed "
                                         "experts, but RoutedExpertsMLPOpsConfig.early_expert_affinity_modulation "
                                         "is True"):
        ExpertMLPsV2(config, BlockwiseMatmulConfig.from_kwargs(early_expert_affinity_modulation=False))
    with pytest.raises(TypeError, match="unknown key"):
        BlockwiseMatmulConfig.from_kwargs(blok_size=4)
    held = experts.routed_experts_mlp_config
    held.capacity_factor = 10.0  # >= E / k: dropless, as at construction
    assert held.capacity_factor is None and config.capacity_factor is None
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        held.capacity_factor = 0.0
    with pytest.raises(AttributeError, match="hidden_act cannot be assigned once the module is built"):
        held.hidden_act = "gelu"


def _sbase_reference(x, router_weight, gate_up, down, glu: bool, capacity: int):
    """S-BASE in eval, float64: each token's top expert by logit, weighted by sigmoid(logit); an expert keeps its
    first ``capacity`` tokens (token order) and drops the rest (zero output)."""
    x, logits = x.double(), x.double() @ router_weight.double().t()
    out = torch.zeros_like(x)
    taken = [0] * router_weight.shape[0]
    for t in range(x.shape[0]):
        e = int(logits[t].argmax())
        taken[e] += 1
        if taken[e] > capacity:
            continue
        h = x[t] @ gate_up[e].double()
        h = torch.nn.functional.silu(h[:INTER]) * h[INTER:] if glu else torch.nn.functional.silu(h)
        out[t] = torch.sigmoid(logits[t, e]) * (h @ down[e].double())
    return out


@pytest.mark.parametrize("glu", [True, False])
def test_sbase_with_capacity_drops(nxd, glu):
    from neuronx_distributed.modules.moe import MoE, RouterSinkhorn
    from neuronx_distributed.modules.moe.expert_mlps import ExpertMLPs

    experts, tokens, capacity_factor = 4, 16, 1.0  # capacity ceil(16 * 1 / 4) = 4 tokens per expert
    router = RouterSinkhorn(num_experts=experts, top_k=1, hidden_size=H)
    mlps = ExpertMLPs(experts, 1, H, INTER, "silu", glu, capacity_factor)
    moe = randomize_(MoE(router, mlps, return_expert_index=True), seed=3).eval()
    x = randn(tokens, H, seed=4)
    with torch.no_grad():
        out, index = moe(x.reshape(1, tokens, H))
    op = moe.expert_mlps.mlp_op
    first = op.gate_up_proj.weight if glu else op.up_proj.weight
    expected = _sbase_reference(x, moe.router.linear_router.weight, first, op.down_proj.weight, glu, 4)
    assert torch.bincount(index.flatten(), minlength=experts).max() > 4  # some expert is over capacity
    assert_close(out.reshape(tokens, H), expected, FP32_ATOL)
    kept_all = _sbase_reference(x, moe.router.linear_router.weight, first, op.down_proj.weight, glu, tokens)
    assert (out.reshape(tokens, H).double() - kept_all).abs().max() > 100 * FP32_ATOL  # control: drops happened


def _llama4(top_k: int = 1):
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe, Llama4TextRMSNorm

    config = Llama4TextConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=4, num_experts_per_tok=top_k)
    moe = randomize_hf_(Llama4TextMoe(config), seed=5).eval()  # transformers makes gate_up_proj zeros
    norm = Llama4TextRMSNorm(H, eps=config.rms_norm_eps)
    norm.weight.data = 1 + 0.1 * randn(H, seed=6)
    return moe, norm


def _nxd_llama4(nxd):
    from neuronx_distributed.modules.moe import MoE, RouterTopK
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
    from neuronx_distributed.modules.moe.moe_configs import MoEFusedTKGConfig, RoutedExpertsMLPOpsConfig
    from neuronx_distributed.modules.moe.shared_experts import SharedExperts

    router = RouterTopK(num_experts=4, top_k=1, hidden_size=H, act_fn="sigmoid", store_transposed_weights=True)
    experts = ExpertMLPsV2(RoutedExpertsMLPOpsConfig(num_experts=4, hidden_size=H, intermediate_size=INTER, top_k=1,
                                                     hidden_act="silu", glu_mlp=True,
                                                     early_expert_affinity_modulation=True))
    shared = SharedExperts(H, INTER, 1, "silu")
    rmsnorm = torch.nn.RMSNorm(H, eps=1e-5)
    return MoE(router, experts, shared, rmsnorm, init_tkg_module=True,
               tkg_config=MoEFusedTKGConfig(quantized=False, moe_fused_kernel_enabled=True)).eval()


def _nxd_llama4_state_dict(hf, norm) -> dict:
    """NxD's layout of a Llama 4 MoE with its fused decode module: every tensor of the router, experts, shared
    expert and norm again under ``moe_fused_tkg.``, and the router weight transposed (``weight_T``)."""
    sd = hf.state_dict()
    own = {"rmsnorm.weight": norm.weight, "router.linear_router.weight": sd["router.weight"],
           "router.weight_T": sd["router.weight"].T,
           "expert_mlps.mlp_op.gate_up_proj.weight": sd["experts.gate_up_proj"],
           "expert_mlps.mlp_op.down_proj.weight": sd["experts.down_proj"],
           **{f"shared_experts.{p}.weight": sd[f"shared_expert.{p}.weight"] for p in ("gate_proj", "up_proj",
                                                                                         "down_proj")}}
    fused = {f"moe_fused_tkg.{k.replace('rmsnorm.', 'post_attention_layernorm.')}": v for k, v in own.items()}
    return {k: v.detach().clone() for k, v in {**own, **fused}.items()}


def test_llama4_with_nxds_fused_decode_state_dict(nxd):
    hf, norm = _llama4()
    moe = _nxd_llama4(nxd)
    state = _nxd_llama4_state_dict(hf, norm)
    loaded = moe.load_state_dict(state)  # strict: every key is consumed, the copies checked and dropped
    assert not loaded.missing_keys and not loaded.unexpected_keys
    for shape in ((2, 5, H), (4, 1, H)):  # prefill, decode
        x = randn(*shape, seed=7)
        with torch.no_grad():
            out = moe(x)[0]
            expected = hf(norm(x))[0].reshape(shape)
        assert_close(out, expected, FP32_ATOL)
    with torch.no_grad():  # control: NxD's golden's setting (the affinity scaling the output) is another function
        moe.expert_mlps.routed_experts_mlp_config.early_expert_affinity_modulation = False
        assert (moe(x)[0] - expected).abs().max() > 100 * FP32_ATOL
    with pytest.raises(NotServedError, match="MoE.moe_fused_tkg .NxD's MoEFusedTKG. is not served"):
        moe.moe_fused_tkg._can_use_nki_kernel("moe_fused", x)
    bad = dict(state)
    bad["moe_fused_tkg.expert_mlps.mlp_op.down_proj.weight"] = bad["expert_mlps.mlp_op.down_proj.weight"] + 1
    with pytest.raises(ValueError, match="'moe_fused_tkg.expert_mlps.mlp_op.down_proj.weight' must hold the same"):
        _nxd_llama4(nxd).load_state_dict(bad)
    doubled = state["router.weight_T"] * 2
    bad = dict(state, **{"router.weight_T": doubled, "moe_fused_tkg.router.weight_T": doubled})
    with pytest.raises(ValueError, match="RouterTopK: state dict entry 'router.weight_T' must hold the same values"):
        _nxd_llama4(nxd).load_state_dict(bad)


@pytest.mark.parametrize("fused,num_shared", [(False, 1), (True, 2), (False, 3)])
def test_shared_experts_against_llama4_mlp(nxd, fused, num_shared):
    from types import SimpleNamespace

    from neuronx_distributed.modules.moe.shared_experts import SharedExperts
    from transformers.models.llama4.modeling_llama4 import Llama4TextMLP

    config = SimpleNamespace(hidden_size=H, intermediate_size=6, hidden_act="silu")
    golden = randomize_hf_(Llama4TextMLP(config, 6 * num_shared), seed=num_shared).eval()
    ours = SharedExperts(hidden_size=H, intermediate_size=6, num_shared_experts=num_shared,
                         fused_gate_up_projection=fused, hidden_act="silu").eval()
    if fused:  # assigned the way NxD's test does
        ours.gate_up_proj.weight.data = torch.cat((golden.gate_proj.weight, golden.up_proj.weight))
    else:
        ours.gate_proj.weight, ours.up_proj.weight = golden.gate_proj.weight, golden.up_proj.weight
    ours.down_proj.weight = golden.down_proj.weight
    x = randn(1, 5, H, seed=8)
    with torch.no_grad():
        assert_close(ours(x, 5), golden(x), FP32_ATOL)
        assert (ours(x, 5) - 1.01 * golden(x)).abs().max() > 10 * FP32_ATOL  # control: a 1 % error is refused


# ----------------------------------------------------------------------------------------------------------
# names the tests import: training and Neuron-kernel ones (not served), utilities (served)

NOT_SERVED = [
    ("neuronx_distributed.modules.moe", "load_balancing_loss_func", "training only"),
    ("neuronx_distributed.modules.moe.token_shuffling", "token_shuffle", "training only"),
    ("neuronx_distributed.modules.moe.moe_config_validator", "MoeConfigValidator", "training only"),
    ("neuronx_distributed.optimizer", "NeuronZero1Optimizer", "training only"),
    ("neuronx_distributed.trainer.optimizer", "NxDOptimizer", "training only"),
    ("neuronx_distributed.quantization.quantize", "convert", "module-swapping quantization"),
    ("neuronx_distributed.modules.moe.blockwise", "can_use_blockwise_matmul_nki", "Neuron kernel plumbing"),
    ("neuronx_distributed.modules.moe.blockwise", "ExpertAffinityScaleMode", "Neuron kernel plumbing"),
    ("neuronx_distributed.modules.moe.moe_fused_tkg", "MoEFusedTKG", "Neuron kernel plumbing"),
    ("neuronx_distributed.modules.moe.moe_fused_tkg_mx", "MoEFusedTKGMX", "Neuron kernel plumbing"),
    ("neuronx_distributed.modules.moe.expert_mlps_v2", "can_use_find_index_kernel", "Neuron kernel plumbing"),
]


@pytest.mark.parametrize("module,name,why", NOT_SERVED)
def test_not_served_names_import_and_say_why_when_used(nxd, module, name, why):
    import importlib

    stub = getattr(importlib.import_module(module), name)
    for use in (lambda: stub(1, key=2), lambda: stub.POST_SCALE, lambda: stub._private_method):
        with pytest.raises(NotServedError, match=f"{name} is not served .*{why}"):
            use()
    assert not hasattr(stub, "__wrapped__")  # introspection sees an ordinary object
    with mock.patch(f"{module}.{name}") as patched:  # NxD's tests patch kernel entry points
        patched.return_value = 3
        assert getattr(importlib.import_module(module), name)() == 3


def test_served_blockwise_enums_and_expert_mlps_helpers(nxd):
    from neuronx_distributed.modules.moe.blockwise import BlockShardStrategy, LogicalNCConfig, SkipMode
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2

    assert BlockShardStrategy is nxd_moe.config.BlockShardStrategy and SkipMode(True, False).skip_token
    assert LogicalNCConfig(2) == 2
    with pytest.raises(NotServedError, match="ExpertMLPsV2.use_index_calc_kernel is not served"):
        ExpertMLPsV2.use_index_calc_kernel(object(), 1024)


def test_parallel_state_token_shuffle_and_nxds_private_names(nxd):
    from neuronx_distributed.parallel_layers import parallel_state

    # NxD's test helpers save and restore these by name; without a layout they are None.
    for name in ("_TENSOR_MODEL_PARALLEL_GROUP", "_EXPERT_MODEL_PARALLEL_GROUP_SPMD", "_TOKEN_SHUFFLE_GROUP_SIZE",
                 "_PIPELINE_GLOBAL_RANKS", "_KV_SHARED_GROUP", "PP_GROUP_PG_GLOO"):
        assert name in vars(parallel_state) and getattr(parallel_state, name) is None
    with pytest.raises(ValueError, match="token_shuffle_group_size must be 1, got 2"):
        parallel_state.initialize_token_shuffle_group(2)
    with pytest.raises(RuntimeError, match="needs initialize_model_parallel first"):
        parallel_state.initialize_token_shuffle_group(1)
    with pytest.raises(RuntimeError, match="not initialized: call initialize_token_shuffle_group"):
        parallel_state.get_token_shuffle_group_size()


def test_utilities(nxd, monkeypatch):
    import logging

    from neuronx_distributed.parallel_layers import random
    from neuronx_distributed.utils.logger import get_logger
    from neuronx_distributed.utils.model_utils import LogicalNCConfig, get_platform_lnc, move_model_to_device

    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert get_platform_lnc() is LogicalNCConfig.LNC_1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert get_platform_lnc() is LogicalNCConfig.LNC_2
    random.model_parallel_xla_manual_seed(5)
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))
    layer = torch.nn.Linear(2, 2)
    weight = layer.weight
    assert move_model_to_device(layer, torch.device("cpu")) is None and layer.weight is weight
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        move_model_to_device(weight, "cpu")
    monkeypatch.setenv("NXD_LOG_LEVEL", "warning")
    logger = get_logger()
    assert logger.name == "neuronx_distributed[0]" and logger.level == logging.WARNING
    monkeypatch.setenv("NXD_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="NXD_LOG_LEVEL must be one of"):
        get_logger()


@pytest.mark.skipif(__import__("importlib").util.find_spec("torch_xla") is not None,
                    reason="with torch_xla installed, its own xla backend serves")
def test_xla_process_group_backend_without_torch_xla(tmp_path):
    """NxD's tests create their world with backend="xla"; without torch_xla the front door serves it as gloo. A
    fresh process: a registered backend stays registered."""
    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from nxd_moe import nxd_compat
        nxd_compat.install()
        dist.init_process_group(backend="xla", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        from neuronx_distributed.parallel_layers import parallel_state
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        parallel_state.initialize_token_shuffle_group(token_shuffle_group_size=1)
        assert parallel_state.get_token_shuffle_group_size() == 1
        assert parallel_state._TENSOR_MODEL_PARALLEL_GROUP is parallel_state.get_tensor_model_parallel_group()
        assert parallel_state._EXPERT_MODEL_PARALLEL_GROUP_SPMD == [[0]]
        t = torch.ones(2)
        dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
        parallel_state.destroy_model_parallel()
        assert parallel_state._TENSOR_MODEL_PARALLEL_GROUP is None
        print(dist.get_backend(), t.tolist())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["xla", "[1.0,", "1.0]"]
