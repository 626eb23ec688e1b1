"""The micro-batch rule of expert parallelism (nxd_moe/parallel/overlap.py) and the settings that choose it: the
exchange time by its definition, the count that maximises the time hidden minus the cost of the parts (checked
against a brute-force loop over the stated formula), forced counts, and where the rule may not split at all."""

from __future__ import annotations

import pytest
import torch
from conftest import make_config

from nxd_moe import ExpertMLPsV2, parallel_state
from nxd_moe.config import BlockwiseMatmulConfig, ExpertParallelConfig
from nxd_moe.parallel import ExpertParallel, overlap
from nxd_moe.parallel.overlap import exchange_us, micro_batch_count

# DeepSeek-V3-sized rows: 7168 bf16 hidden, top-8 int32 ids and fp32 weights out, bf16 partials back.
ROW, PARTIAL = 7168 * 2 + 8 * 8, 7168 * 2


def test_exchange_time_is_the_bytes_to_the_other_ranks_over_the_link():
    # 3 other ranks x 100 rows x (1000 + 500) bytes = 450,000 bytes; at 150 GB/s (150,000 bytes per us): 3 us
    assert exchange_us(100, 4, 1000, 500, link_GBps=150.0) == pytest.approx(3.0)
    assert exchange_us(100, 1, 1000, 500) == 0.0  # one rank: nothing leaves it
    assert exchange_us(100, 2, ROW, PARTIAL) == pytest.approx(100 * (ROW + PARTIAL) / (overlap.LINK_GBPS * 1e3))


def _best_by_loop(hidden_us: float, rows: int, per_part_us: float) -> int:
    best, best_gain = 1, 0.0
    for c in range(2, min(overlap.MAX_MICRO_BATCHES, rows) + 1):
        gain = hidden_us - hidden_us / c - (c - 1) * per_part_us
        if gain > best_gain:
            best, best_gain = c, gain
    return best


# (weight bytes a rank holds, flops per owned row): Qwen3-30B-A3B's 64 experts of an EP2 rank, top-8 at
# H 2048 / I 768; a small-expert layer with a wide block.
QWEN3_EP2 = (64 * 3 * 2048 * 768 * 2, 2.0 * 8 * 3 * 2048 * 768)
SMALL = (8 * 3 * 2048 * 768 * 2, 2.0 * 8 * 3 * 2048 * 768)


@pytest.mark.parametrize("rows,block", [(1, 2), (3, 2), (64, 2), (2048, 2), (2048, 4), (8192, 2), (8192, 8),
                                        (100_000, 8)])
@pytest.mark.parametrize("layer", [QWEN3_EP2, SMALL])
@pytest.mark.parametrize("cost_us", [5.0, 30.0, 300.0])
def test_the_rule_maximises_the_hidden_time_minus_the_parts_cost(rows, block, layer, cost_us):
    weight_bytes, flops_per_row = layer
    x = exchange_us(rows, block, ROW, PARTIAL)
    f = rows * flops_per_row / (overlap.MATMUL_TFLOPS * 1e6)
    w = weight_bytes / (overlap.HBM_GBPS * 1e3)
    got = micro_batch_count(None, rows=rows, block_size=block, row_bytes=ROW, partial_row_bytes=PARTIAL,
                            weight_bytes=weight_bytes, flops=rows * flops_per_row, overlappable=True,
                            cost_us=cost_us)
    assert got == _best_by_loop(min(x, f), rows, w + cost_us), (x, f, w, got)
    assert 1 <= got <= min(rows, overlap.MAX_MICRO_BATCHES)


def test_the_rule_keeps_the_measured_layers_whole_and_splits_a_wide_exchange_of_light_experts():
    """Two H200s measured a second micro-batch to cost a re-read of the held weights: Qwen3-30B-A3B EP2 prefill
    of 8192 tokens per rank ran 1.921 ms in one batch and 1.967 in two (its 236 us exchange cannot hide 142 us of
    weights plus launches per part) -- the rule keeps one. Eight ranks of 8 such experts each with 8192 rows
    each: x = 7 * 8192 * (4160 + 4096) B / 286 GB/s = 1653 us, F = 803 us, W = 18 us -> hidden 803 * (1 - 1/C)
    - (C - 1) * 48 us: 4 parts."""
    qwen3 = dict(rows=8192, block_size=2, row_bytes=2048 * 2 + 64, partial_row_bytes=2048 * 2,
                 weight_bytes=QWEN3_EP2[0], flops=8192 * QWEN3_EP2[1], overlappable=True)
    assert micro_batch_count(None, **qwen3) == 1
    assert micro_batch_count(None, **(qwen3 | dict(weight_bytes=0, cost_us=0.0))) == 4  # free parts: as many as can be
    wide = qwen3 | dict(block_size=8, weight_bytes=SMALL[0])
    assert micro_batch_count(None, **wide) == 4
    assert micro_batch_count(None, **(wide | dict(rows=8, flops=8 * SMALL[1]))) == 1  # decode: nothing to hide
    # the compute bounds what hides: an exchange far longer than the compute hides only the compute
    assert micro_batch_count(None, **(wide | dict(flops=0.0))) == 1
    # a tie between one and two parts keeps one: hidden / 2 == per part exactly (100 us hidden, 50 us a part)
    assert micro_batch_count(None, rows=100, block_size=2, row_bytes=1000, partial_row_bytes=0, weight_bytes=0,
                             flops=1e12, overlappable=True, link_GBps=1.0, cost_us=50.0) == 1


def test_where_nothing_overlaps_the_rule_keeps_one_batch_and_a_forced_count_is_kept():
    big = dict(rows=8192, row_bytes=ROW, partial_row_bytes=PARTIAL, weight_bytes=0, flops=1e15)
    assert micro_batch_count(None, block_size=8, overlappable=True, **big) == 4  # the control: this one splits
    assert micro_batch_count(None, block_size=8, overlappable=False, **big) == 1
    assert micro_batch_count(None, block_size=1, overlappable=True, **big) == 1
    assert micro_batch_count(3, block_size=2, overlappable=False, **big) == 3  # forced: kept anywhere
    assert micro_batch_count(1, block_size=8, overlappable=True, **big) == 1
    assert micro_batch_count(7, block_size=2, overlappable=True, **(big | dict(rows=5))) == 5  # never more than rows


@pytest.mark.parametrize("kwargs,message", [
    (dict(configured=0), r"ExpertParallelConfig.micro_batches must be in \[1, inf\], got 0"),
    (dict(configured=2.0), r"ExpertParallelConfig.micro_batches"),
    (dict(rows=0), r"rows must be in \[1, inf\], got 0"),
    (dict(block_size=0), r"block_size must be in \[1, inf\], got 0"),
])
def test_bad_counts_are_named(kwargs, message):
    args = dict(configured=None, rows=4, block_size=2, row_bytes=8, partial_row_bytes=8, weight_bytes=0, flops=1.0,
                overlappable=True) | kwargs
    with pytest.raises((ValueError, TypeError), match=message):
        micro_batch_count(args.pop("configured"), **args)


@pytest.mark.parametrize("kwargs,message", [
    (dict(dispatch="all_gather", micro_batches=2), "needs dispatch='all_to_all_v' with all_to_all_splits='static', "
                                                  "got dispatch='all_gather', all_to_all_splits='static'"),
    (dict(dispatch="all_to_all_v", all_to_all_splits="exact", micro_batches=3),
     "got dispatch='all_to_all_v', all_to_all_splits='exact'"),
    (dict(dispatch="all_to_all_v", micro_batches=0),
     r"ExpertParallelConfig.micro_batches must be in \[1, inf\], got 0"),
    (dict(dispatch="all_to_all_v", micro_batches=True), "ExpertParallelConfig.micro_batches"),
])
def test_the_config_refuses_micro_batches_it_cannot_run(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ExpertParallelConfig(**kwargs)


def test_the_config_keeps_one_batch_for_any_dispatch_and_the_default_is_the_rule():
    assert ExpertParallelConfig().micro_batches is None
    assert ExpertParallelConfig("all_gather", micro_batches=1).micro_batches == 1
    assert ExpertParallelConfig("all_to_all_v", all_to_all_splits="exact", micro_batches=1).micro_batches == 1
    assert ExpertParallelConfig("all_to_all_v", micro_batches=4).micro_batches == 4


@pytest.fixture
def ep2():
    parallel_state.initialize_spmd_model_parallel(2, 1, 2, rank=0)
    yield
    parallel_state.destroy_model_parallel()


def _layer(config: ExpertParallelConfig, hidden: int = 64) -> ExpertParallel:
    cfg = make_config(num_experts=4, hidden_size=hidden, intermediate_size=8, top_k=2)
    return ExpertParallel(ExpertMLPsV2(cfg, BlockwiseMatmulConfig(block_size=4), expert_parallel_config=config))


def test_the_layer_asks_the_rule_with_its_rows_and_row_bytes(ep2, monkeypatch):
    """The layer's question to the rule: the rows it owns (a shared-token layout's chunk), its block, the bytes of
    a row out (hidden in the input dtype, top-k int32 ids and fp32 weights) and back (hidden); overlappable only on
    CUDA outside an SPMD program -- this CPU SPMD layer may not split by the rule, but a forced count is kept."""
    asked = []
    monkeypatch.setattr("nxd_moe.parallel.expert_parallel.micro_batch_count",
                        lambda configured, **kw: asked.append((configured, kw)) or 7)
    layer = _layer(ExpertParallelConfig("all_to_all_v", micro_batches=3))
    x = torch.zeros(10, 64, dtype=torch.bfloat16)
    assert layer.micro_batch_count(x, 2, layer.token_layout(2, 5, False)) == 7
    # the held shard: 2 of 4 experts, (2, 64, 16) gate/up and (2, 8, 64) down in float32
    assert asked == [(3, dict(rows=10, block_size=2, row_bytes=64 * 2 + 2 * 8, partial_row_bytes=128,
                              weight_bytes=(2 * 64 * 16 + 2 * 8 * 64) * 4, flops=2.0 * 10 * 2 * 3 * 64 * 8,
                              overlappable=False))]
    asked.clear()
    for other in (ExpertParallelConfig("all_gather"), ExpertParallelConfig("all_to_all_v", all_to_all_splits="exact")):
        monkeypatch.setattr(parallel_state, "is_spmd", lambda: False)
        assert _layer(other).micro_batch_count(x, 2, layer.token_layout(2, 5, False)) == 1
    assert asked == []  # nothing to split: the rule is not asked


def test_each_rate_given_is_the_one_used():
    """The link, HBM and matmul rates and the cost passed in decide, not the measured defaults: each case sits a
    hair away from the one-or-two boundary, so a rate read off by one part in a thousand (or the default's) flips
    it."""
    common = dict(rows=100, block_size=2, row_bytes=1000, partial_row_bytes=0, overlappable=True)
    # the link: x = 100 * 1000 B / 1 GB/s = 100 us -> hidden 100 (flops ample), a part costs 40: two parts
    assert micro_batch_count(None, weight_bytes=0, flops=1e15, link_GBps=1.0, cost_us=40.0, **common) == 2
    # the matmul rate: hidden = 2e12 flop / (1 TFLOP/s) = 2,000,000 us (the link far slower), a part costs
    # hidden / 2 - 0.25 us: two parts by a hair (a rate 1e-6 lower would give one)
    hidden_us = 2_000_000.0
    assert micro_batch_count(None, weight_bytes=0, flops=hidden_us * 1e6, link_GBps=1e-6, matmul_TFLOPs=1.0,
                             cost_us=hidden_us / 2 - 0.25, **common) == 2
    # the HBM rate: hidden 2000 us, a part's weights 1,000,500 B at 1 GB/s = 1000.5 us: 1000 - 1000.5 < 0 -> one
    # part (a rate 0.1 % higher would make the part cost 999.5 us and give two)
    assert micro_batch_count(None, weight_bytes=1_000_500, flops=2000 * 1e6, link_GBps=1e-6, matmul_TFLOPs=1.0,
                             hbm_GBps=1.0, cost_us=0.0, **common) == 1
    assert micro_batch_count(None, weight_bytes=999_500, flops=2000 * 1e6, link_GBps=1e-6, matmul_TFLOPs=1.0,
                             hbm_GBps=1.0, cost_us=0.0, **common) == 2
