"""Every blockwise kernel x DMA skip mode x LNC variant against the float64 golden in bf16 (nki-library's
tolerance: rtol 2e-2 on the global range), with its DMA bytes and FLOPs equal to the analytic expectation, and the
counting run equal to the numeric one.

The problem (:func:`nki_helpers.skewed_expert_index`): T=300, k=2, E=4, H=I=256, B=256 -> 2 hidden, 2 intermediate
and 2 token tiles per block; ``block_to_expert = [0, 0, 1, 2, 3, 3]``, 5 active blocks, the last one padding.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from nki_helpers import make_case, max_all_close, real_rows, skewed_expert_index, weight_loads

from nxd_moe import BlockwiseMatmulConfig
from nxd_moe.experts.token_mapping import num_static_blocks
from nxd_moe.nki_kernels.kernels import expert_mlp

KERNELS = {
    "shard_on_H": {},
    "shard_on_I_static": {"use_shard_on_intermediate_dynamic_while": True},
    "shard_on_I_dynamic": {"use_shard_on_intermediate_dynamic_while": True},
    "block_HI_LO": {"use_block_parallel": True, "block_sharding_strategy": "HI_LO"},
    "block_PING_PONG": {"use_block_parallel": True, "block_sharding_strategy": "PING_PONG"},
    "block_HI_LO_dynamic": {"use_shard_on_block_dynamic_while": True, "block_sharding_strategy": "HI_LO"},
    "block_PING_PONG_dynamic": {"use_shard_on_block_dynamic_while": True, "block_sharding_strategy": "PING_PONG"},
}
SKIPS = {"none": (False, False), "token": (True, False), "weight": (False, True), "token_weight": (True, True)}
BLOCK = 256
HIDDEN = INTER = 256
BF16_BYTES = 2


@pytest.fixture(scope="module")
def case():
    return make_case(skewed_expert_index(), num_experts=4, block_size=BLOCK, hidden=HIDDEN, intermediate=INTER)


@pytest.fixture(scope="module")
def golden(case):
    return case.golden()


def kernel_call(case, kernel: str, skip: tuple[bool, bool], lnc: int):
    config = BlockwiseMatmulConfig(block_size=BLOCK, logical_nc_config=lnc, skip_dma_token=skip[0],
                                   skip_dma_weight=skip[1], **KERNELS[kernel])
    call = case.call(config)
    if kernel == "shard_on_I_static":
        args = {k: v for k, v in call.args.items() if k not in ("conditions", "num_static_block")}
        call = dataclasses.replace(call, name="bwmm_shard_on_I", args=args)
    return call


def computed_blocks(case, kernel: str, lnc: int) -> list[list[int]]:
    """The blocks each core computes, in order, from the kernels' documented loop structure."""
    n = case.mapping.num_blocks
    conditions = case.mapping.conditions.tolist()
    active = sum(conditions)
    static = num_static_blocks(case.tokens, case.expert_index.shape[1], BLOCK)
    if kernel in ("shard_on_H", "shard_on_I_static"):
        return [list(range(n))] * lnc
    if kernel == "shard_on_I_dynamic":
        return [list(range(max(static, active)))] * lnc
    per_core = n // lnc
    cores = []
    for core in range(lnc):
        if "PING_PONG" in kernel:
            own = [core + lnc * j for j in range(per_core)]
            flags = conditions[0::lnc][:per_core]
        else:
            own = [core * per_core + j for j in range(per_core)]
            flags = conditions[:per_core]
        iterations = per_core
        if kernel.endswith("dynamic"):
            iterations = max(-(-static // lnc), sum(flags))
        cores.append(own[:iterations])
    return cores


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("skip", list(SKIPS), ids=list(SKIPS))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_blockwise_kernel(case, golden, kernel, skip, lnc):
    skip_token, skip_weight = SKIPS[skip]
    call = kernel_call(case, kernel, SKIPS[skip], lnc)
    run = call.run()
    max_all_close(case.output(run.outputs), golden, msg=f"{call.name} lnc={lnc} skip={skip}")

    blocks = computed_blocks(case, kernel, lnc)
    sharded_h = kernel == "shard_on_H" and lnc == 2
    sharded_i = kernel.startswith("shard_on_I") and lnc == 2
    h_core = HIDDEN // 2 if sharded_h else HIDDEN
    block_to_expert = case.mapping.block_to_expert.tolist()
    accounting = run.accounting

    rows = sum(real_rows(case.mapping, core) if skip_token else BLOCK * len(core) for core in blocks)
    assert accounting.dma_bytes("hidden_states", "hbm->sbuf") == rows * h_core * BF16_BYTES

    loads = sum(weight_loads([block_to_expert[b] for b in core]) if skip_weight else len(core) for core in blocks)
    gate_up_bytes = HIDDEN * 2 * INTER * BF16_BYTES // (2 if sharded_h or sharded_i else 1)
    assert accounting.dma_bytes("gate_up_proj_weight", "hbm->sbuf") == loads * gate_up_bytes
    assert accounting.dma_bytes("down_proj_weight", "hbm->sbuf") == loads * gate_up_bytes // 2

    per_block_flops = 6 * BLOCK * HIDDEN * INTER
    assert accounting.matmul_flops == sum(len(core) for core in blocks) * per_block_flops // (
        2 if sharded_h or sharded_i else 1)

    assert call.run(numerics=False).accounting == accounting, "a counting run must count exactly what a full run does"


def test_weight_skipping_counts_differ_between_strategies(case):
    """The expectations above are not vacuous: PING_PONG splits expert 0's two blocks between the cores, so weight
    skipping saves nothing there, while HI_LO keeps them on one core."""
    loads = {}
    for kernel in ("block_PING_PONG", "block_HI_LO"):
        run = kernel_call(case, kernel, (False, True), 2).run(numerics=False)
        loads[kernel] = run.accounting.dma_bytes("gate_up_proj_weight")
    per_load = HIDDEN * 2 * INTER * BF16_BYTES
    assert loads == {"block_PING_PONG": 6 * per_load, "block_HI_LO": 4 * per_load}


def test_golden_check_catches_one_lost_token(case, golden):
    """Negative control: a correct output with one token's row lost must fail the comparison."""
    run = kernel_call(case, "shard_on_H", (True, True), 1).run()
    out = case.output(run.outputs).astype(np.float32)
    max_all_close(out, golden)
    broken = out.copy()
    broken[int(np.abs(golden).max(axis=1).argmax())] = 0.0
    with pytest.raises(AssertionError):
        max_all_close(broken, golden)


def test_wrong_expert_mapping_fails_the_golden(case, golden):
    """Negative control: the same kernel with two experts' weights swapped is far outside the tolerance."""
    call = kernel_call(case, "shard_on_H", (False, False), 1)
    w = call.args["gate_up_proj_weight"].copy()
    w[[0, 1]] = w[[1, 0]]
    run = dataclasses.replace(call, args={**call.args, "gate_up_proj_weight": w}).run()
    with pytest.raises(AssertionError):
        max_all_close(case.output(run.outputs), golden)


@given(tokens=st.integers(1, 40), experts=st.integers(2, 6), top_k=st.integers(1, 2),
       block=st.sampled_from([4, 8, 16]), padded=st.integers(0, 10), seed=st.integers(0, 2**16))
def test_counts_follow_the_mapping_for_any_routing(tokens, experts, top_k, block, padded, seed):
    """Any routing (with padded tokens): the dynamic loop computes exactly the active blocks, token skipping loads
    exactly their real rows, weight skipping loads once per change of expert along them."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    mask = torch.arange(tokens) >= min(padded, tokens)
    case = make_case(index, num_experts=experts, block_size=block, hidden=128, intermediate=128, padding_mask=mask,
                     seed=seed)
    config = BlockwiseMatmulConfig(block_size=block, skip_dma_token=True, skip_dma_weight=True,
                                   use_shard_on_intermediate_dynamic_while=True, num_static_blocks=0)
    accounting = case.call(config).run(numerics=False).accounting
    active = list(range(int(case.mapping.conditions.sum())))
    assert active == [b for b, c in enumerate(case.mapping.conditions.tolist()) if c]  # a prefix
    assert real_rows(case.mapping, active) == int(mask.sum()) * top_k  # dropless: every real pair has a slot
    assert accounting.dma_bytes("hidden_states", "hbm->sbuf") == real_rows(case.mapping, active) * 128 * BF16_BYTES
    experts_of = case.mapping.block_to_expert.tolist()
    assert accounting.dma_bytes("gate_up_proj_weight") == weight_loads([experts_of[b] for b in active]) * (
        128 * 2 * 128 * BF16_BYTES)
    assert accounting.matmul_flops == len(active) * 6 * block * 128 * 128


@pytest.fixture(scope="module")
def wide_case():
    return make_case(skewed_expert_index(), num_experts=4, block_size=BLOCK, hidden=HIDDEN, intermediate=512)


@pytest.mark.parametrize("kernel, lnc", [("shard_on_H", 1), ("shard_on_H", 2), ("shard_on_I_dynamic", 2),
                                         ("block_PING_PONG_dynamic", 2), ("block_HI_LO", 1)])
def test_weights_stream_in_chunks_when_they_do_not_fit(wide_case, kernel, lnc, monkeypatch):
    """An expert share larger than the SBUF weight budget is loaded in 128-column pieces for every block: same
    result, same FLOPs, less SBUF -- and weight skipping has nothing resident to reuse."""
    resident = kernel_call(wide_case, kernel, (True, True), lnc).run(numerics=False).accounting
    monkeypatch.setattr(expert_mlp, "WEIGHT_SBUF_BUDGET", 1024)
    call = kernel_call(wide_case, kernel, (True, True), lnc)
    run = call.run()
    max_all_close(wide_case.output(run.outputs), wide_case.golden(), msg=f"{call.name} lnc={lnc}")
    accounting = run.accounting
    assert accounting.matmul_flops == resident.matmul_flops
    assert accounting.sbuf_high_water < resident.sbuf_high_water
    blocks = computed_blocks(wide_case, kernel, lnc)
    share = HIDDEN * 2 * 512 * BF16_BYTES // (2 if lnc == 2 and kernel in ("shard_on_H", "shard_on_I_dynamic") else 1)
    experts_of = wide_case.mapping.block_to_expert.tolist()
    reused = sum(weight_loads([experts_of[b] for b in core]) for core in blocks)
    assert resident.dma_bytes("gate_up_proj_weight") == reused * share
    assert accounting.dma_bytes("gate_up_proj_weight") == sum(len(core) for core in blocks) * share
    assert call.run(numerics=False).accounting == accounting
