"""How many micro-batches an expert-parallel step's static all-to-all is split into.

Split into ``C`` micro-batches, a rank's owned rows travel in ``C`` exchanges each way, and all but the first
dispatch and the last combine run under the expert compute of another micro-batch
(:class:`~nxd_moe.parallel.all_to_all.StaticMicroBatches`): of the exchange's time ``X`` (its bytes over the link
rate), up to the compute's time ``F``, all but ``1 / C`` is hidden. What each extra micro-batch costs was
measured (two H200s, ``docs/parallel.md`` "Micro-batches"): its expert GEMMs read every held expert's weights
again (``W``: held bytes over the HBM rate) -- the layers we serve are read-bound at the token counts where the
exchange matters -- plus a fixed ``c`` of launches. So the rule picks the ``C`` in ``1 .. MAX_MICRO_BATCHES`` that
maximises ``min(X, F) * (1 - 1 / C) - (C - 1) * (W + c)``, and 1 on ties: it splits only where the exchange is
large against the held weights (many tokens per rank and a wide block), never on two GPUs for the measured layers.
"""

from __future__ import annotations

from nxd_moe.checks import check_int

# Measured on two H200s (benchmarks/parallel.py, benchmarks/results/parallel_micro_qwen3_ep2_h200x2.json): the
# NVLink all-to-all rate per GPU (bytes a rank sends over one 512 MiB all-to-all), the HBM copy rate and the bf16
# matmul rate, and the fixed cost of one more micro-batch beyond its weight reads.
LINK_GBPS = 286.0
HBM_GBPS = 4250.0
MATMUL_TFLOPS = 770.0
MICRO_BATCH_COST_US = 30.0
MAX_MICRO_BATCHES = 4


def exchange_us(rows: int, block_size: int, row_bytes: int, partial_row_bytes: int,
                link_GBps: float = LINK_GBPS) -> float:
    """Time one rank's static dispatch and combine put on the link: ``rows`` owned rows go to each of the other
    ``block_size - 1`` ranks in ``row_bytes`` (hidden, ids, weights) and come back as ``partial_row_bytes``."""
    return (block_size - 1) * rows * (row_bytes + partial_row_bytes) / (link_GBps * 1e3)


def micro_batch_count(configured: int | None, *, rows: int, block_size: int, row_bytes: int,
                      partial_row_bytes: int, weight_bytes: int, flops: float, overlappable: bool,
                      link_GBps: float = LINK_GBPS, hbm_GBps: float = HBM_GBPS, matmul_TFLOPs: float = MATMUL_TFLOPS,
                      cost_us: float = MICRO_BATCH_COST_US) -> int:
    """The micro-batches of one step: ``configured`` (``ExpertParallelConfig.micro_batches``) if given, at most
    ``rows``; else, where the exchange can run beside compute (``overlappable``: a static all-to-all over NCCL
    outside a trace), the rule of the module docstring for a rank holding ``weight_bytes`` of expert weights and
    computing ``flops`` per step; 1 elsewhere."""
    check_int("rows", rows, minimum=1)
    check_int("block_size", block_size, minimum=1)
    if configured is not None:
        check_int("ExpertParallelConfig.micro_batches", configured, minimum=1)
        return min(configured, rows)
    if not overlappable or block_size == 1:
        return 1
    hidden = min(exchange_us(rows, block_size, row_bytes, partial_row_bytes, link_GBps),
                 flops / (matmul_TFLOPs * 1e6))
    per_part = weight_bytes / (hbm_GBps * 1e3) + cost_us
    gain = {c: hidden * (1 - 1 / c) - (c - 1) * per_part for c in range(1, min(MAX_MICRO_BATCHES, rows) + 1)}
    return max(gain, key=lambda c: (gain[c], -c))
