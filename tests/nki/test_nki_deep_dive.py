"""The deep dive's worked examples, reproduced by the kernels' counts ("Advanced optimizations in the BWMM
algorithm" and "Padding overhead analysis" in ``shared/seeds/neuron-moe-inference-deep-dive.rst``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from nki_helpers import make_case, max_all_close

from nxd_moe import BlockwiseMatmulConfig
from nxd_moe.experts.token_mapping import num_blocks

SMALL = {"hidden": 128, "intermediate": 128}


def hidden_rows(call) -> int:
    return call.run(numerics=False).accounting.traffic("hidden_states", "hbm->sbuf").rows


def test_token_skipping_loads_three_rows_of_t0_t2_t5_pad():
    """6 tokens routed [E0, E1, E0, E2, E1, E0], block size 4: block 0 is [T0, T2, T5, -1]; with token skipping it
    loads 3 rows instead of 4 (the deep dive's "~25% reduction in memory bandwidth")."""
    case = make_case(torch.tensor([[0], [1], [0], [2], [1], [0]]), num_experts=3, block_size=4, **SMALL)
    assert case.mapping.token_position_to_id[:4].tolist() == [0, 2, 5, -1]
    first_block = {"token_position_to_id": case.mapping.token_position_to_id[:4], "block_to_expert":
                   case.mapping.block_to_expert[:1], "conditions": case.mapping.conditions[:1]}
    rows = {}
    for skip in (False, True):
        call = case.call(BlockwiseMatmulConfig(block_size=4, skip_dma_token=skip))
        whole = hidden_rows(call)
        one = case.mapping._replace(**first_block)
        call_one = dataclasses.replace(case, mapping=one).call(BlockwiseMatmulConfig(block_size=4, skip_dma_token=skip))
        rows[skip] = (hidden_rows(call_one), whole)
        max_all_close(case.output(call.run().outputs), case.golden())
    assert rows[True] == (3, 6)  # real tokens only: 3 in block 0, all 6 tokens over the 3 blocks
    assert rows[False] == (4, 12)  # every slot: padding slots read the zero row T
    assert 1 - rows[True][0] / rows[False][0] == 0.25


def test_weight_skipping_loads_three_experts_for_e0_e0_e1_e2_e2():
    """Blocks [E0, E0, E1, E2, E2]: with weight skipping E0 and E2 are reused for their second block."""
    index = torch.tensor([0] * 8 + [1] * 4 + [2] * 8).view(-1, 1)
    case = make_case(index, num_experts=3, block_size=4, blocks=5, **SMALL)
    assert case.mapping.block_to_expert.tolist() == [0, 0, 1, 2, 2]
    expert_bytes = 128 * 2 * 128 * 2
    loaded = {}
    for skip in (False, True):
        call = case.call(BlockwiseMatmulConfig(block_size=4, skip_dma_weight=skip))
        run = call.run()
        max_all_close(case.output(run.outputs), case.golden())
        loaded[skip] = run.accounting.dma_bytes("gate_up_proj_weight") // expert_bytes
    assert loaded == {False: 5, True: 3}


def test_dynamic_loop_computes_six_of_ten_blocks():
    """10 blocks provisioned, 6 hold real tokens: the dynamic loop computes 6 -- 40% fewer FLOPs."""
    tokens, block = 36, 4
    assert num_blocks(tokens, 1, 2, block) == 10
    index = torch.tensor([0, 1] * (tokens // 2)).view(-1, 1)
    padding_mask = torch.arange(tokens) < 24  # 12 tokens per expert are real: 3 blocks each
    case = make_case(index, num_experts=2, block_size=block, padding_mask=padding_mask, **SMALL)
    assert case.mapping.conditions.tolist() == [1] * 6 + [0] * 4
    static = case.call(BlockwiseMatmulConfig(block_size=block)).run()
    per_block = 6 * block * 128 * 128
    assert static.accounting.matmul_flops == 10 * per_block
    for lnc, flags in ((1, {"use_shard_on_intermediate_dynamic_while": True}),
                       (2, {"use_shard_on_block_dynamic_while": True, "block_sharding_strategy": "PING_PONG"})):
        config = BlockwiseMatmulConfig(block_size=block, logical_nc_config=lnc, num_static_blocks=0, **flags)
        run = case.call(config).run()
        max_all_close(case.output(run.outputs), case.golden())
        assert run.accounting.matmul_flops == 6 * per_block
        assert 1 - run.accounting.matmul_flops / static.accounting.matmul_flops == 0.4
        assert run.accounting.dynamic_iterations == 6  # both cores run 3 iterations of 2 blocks on PING_PONG
        assert np.all(case.output(run.outputs)[24:] == 0)  # padded tokens get zero rows


def test_fifteen_blocks_for_1000_tokens_8_experts_top2_block256():
    """N = ceil(2000 / 256) + 7 = 15 provisioned; with balanced routing 8 are needed (padding overhead 87.5%,
    algorithmic 2.4%): the static kernel computes 15 blocks, the dynamic one 8."""
    tokens, experts, top_k, block = 1000, 8, 2, 256
    assert num_blocks(tokens, top_k, experts, block) == 15
    index = (torch.arange(tokens * top_k) % experts).view(tokens, top_k)
    case = make_case(index, num_experts=experts, block_size=block, **SMALL)
    active = int(case.mapping.conditions.sum())
    assert active == 8
    assert (15 * block - active * block) / (active * block) == 0.875
    assert round((active * block - tokens * top_k) / (tokens * top_k), 3) == 0.024
    per_block = 6 * block * 128 * 128
    static = case.call(BlockwiseMatmulConfig(block_size=block)).run(numerics=False)
    assert static.accounting.matmul_flops == 15 * per_block
    dynamic = case.call(BlockwiseMatmulConfig(block_size=block, use_shard_on_intermediate_dynamic_while=True,
                                              num_static_blocks=0)).run(numerics=False)
    assert dynamic.accounting.matmul_flops == 8 * per_block
