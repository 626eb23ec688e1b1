"""One rank of an NxD-style gloo world, started by torchrun through the front door (test_nxd_worlds.py)::

    torchrun --nproc-per-node N -m nxd_moe.nxd_compat tests/nxd_compat/nxd_world.py SUITE OUT_DIR

Every scenario is NxD / NxD Inference code: the deep dive's ``initialize_model_parallel`` calls (world sizes scaled:
the page's TP 8, EP 16 and TP 4 x EP 16 become TP N, EP N and TP 2 x EP 2) with the deep dive's MoE layer built
under them, NxDI's ``initialize_moe_module`` with MoE-only and hybrid sharding, NxD's ``parallel_state`` getters
and ``mappings``. Each layer is compared with the same layer on one process (the torch test harness's
``check_moe``; that layer is itself checked against the float64 reference by the single-process tests). Scenarios
and the result files are tests/parallel/parallel_worker.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "parallel")]

import deep_dive_examples as dd  # noqa: E402
import parallel_worker as pw  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from conftest import randomize_  # noqa: E402
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2  # noqa: E402
from neuronx_distributed.parallel_layers import layers, mappings, parallel_state  # noqa: E402
from neuronx_distributed_inference.modules.moe_v2 import initialize_moe_module  # noqa: E402

from nxd_moe.parallel.sharding import load_full_state_dict  # noqa: E402


def deep_dive_layout(tensor_model_parallel_size: int, expert_model_parallel_size: int, batch: int, seq: int):
    """The deep dive's MoE layer (line 113: 128 experts, top 8, 512-token blocks, sequence parallel) under
    ``initialize_model_parallel`` as the page calls it; prefill fills the blocks, then a decode."""
    def run():
        full = randomize_(dd.moe_layer(), seed=1).eval()  # built before the groups exist: one process's layer
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
        )
        par = load_full_state_dict(dd.moe_layer(), full.state_dict()).eval()
        assert par.expert_mlps.is_sharded
        assert pw.check_moe(full, par, batch, seq, seed=2).mode.value == "blockwise"
        assert pw.check_moe(full, par, 2, 1, seed=3).mode.value == "selective_loading"
    return run


def refuses_more_ranks_than_the_world():
    """The page's TP 8 in a smaller world: NxD clamps it to the world size silently; ours names the problem."""
    world = dist.get_world_size()
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=8, expert_model_parallel_size=1)
    except ValueError as e:
        assert f"tensor_model_parallel_size (8) must divide the world size ({world})" in str(e), e
    else:
        raise AssertionError("initialize_model_parallel(tensor_model_parallel_size=8) ran in a world of 2")


def nxd_parallel_state():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
    rank = dist.get_rank()
    mesh = parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, mesh_only=True)
    assert mesh.tp_groups == [[0, 1]] and mesh.ep_model_groups == [[0], [1]] and mesh.pp_groups == [[0], [1]]
    assert parallel_state.get_expert_model_parallel_group(as_list=True) == [[0, 1]]
    assert parallel_state.get_tensor_model_parallel_group(as_list=True) == [[0], [1]]
    assert parallel_state.get_world_group(as_list=True) == [[0, 1]]
    assert dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()) == [0, 1]
    assert (parallel_state.get_expert_model_parallel_rank(), parallel_state.get_tensor_model_parallel_size()) == (
        rank, 1)
    assert parallel_state.get_experts_for_expert_parallel_rank(rank, 8, 2) == list(range(4 * rank, 4 * rank + 4))
    assert layers.SPMDRank(world_size=2).get_rank().tolist() == [rank]
    assert parallel_state.rmsg("hi") == f"[rank {rank} tp 0 ep {rank}] hi"
    # An NxD-style group argument must be parallel_state's group of that role.
    experts_cfg = dd.moe_layer().expert_mlps.routed_experts_mlp_config
    ExpertMLPsV2(experts_cfg, expert_model_parallel_group=parallel_state.get_expert_model_parallel_group(),
                 tensor_model_parallel_group=parallel_state.get_tensor_model_parallel_group())
    try:
        ExpertMLPsV2(experts_cfg, tensor_model_parallel_group=parallel_state.get_world_group())
    except ValueError as e:
        assert "tensor_model_parallel_group holds ranks [0, 1], but this rank's moe prefill tensor group is" in str(e)
    else:
        raise AssertionError("a world group passed as the tensor-parallel group was accepted")


def nxd_moe_process_group():
    """NxD's MoE-only groups (NxDI's moe_tp / moe_ep, hybrid sharding): prefill EP 2, decode TP 2 of the world."""
    from neuronx_distributed.modules.moe import moe_process_group as mpg

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    mpg.init_tensor_expert_parallel_moe_process_groups(tkg_tp_degree=2, tkg_ep_degree=1, cte_tp_degree=1,
                                                       cte_ep_degree=2)
    ranks = dist.get_process_group_ranks
    assert ranks(mpg.get_moe_tp_ep_group(prefill=True)) == [rank] and ranks(mpg.get_moe_ep_group(True)) == [0, 1]
    assert ranks(mpg.get_moe_tp_ep_group(prefill=False)) == [0, 1] and ranks(mpg.get_moe_ep_group(False)) == [rank]
    mpg.destroy_moe_model_parallel()  # the groups belong to the layout: still there
    assert ranks(mpg.get_moe_ep_group(True)) == [0, 1]
    try:
        mpg.init_tensor_expert_parallel_moe_process_groups(2, 2, 1, 2)
    except ValueError as e:
        assert "must equal tensor_model_parallel_size * expert_model_parallel_size (2)" in str(e), e
    else:
        raise AssertionError("a TKG split of 4 ranks in a world of 2 was accepted")
    assert ranks(mpg.get_moe_ep_group(True)) == [0, 1]  # the groups before the bad call are kept


def nxd_mappings():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    mine = torch.full((2, 3), float(rank + 1))
    with torch.no_grad():
        gathered = mappings.gather_from_sequence_parallel_region(mine, sequence_dimension=0)
        assert gathered.tolist() == [[1.0] * 3] * 2 + [[2.0] * 3] * 2
        assert mappings.gather_from_tensor_model_parallel_region(mine).tolist() == [[1.0] * 3 + [2.0] * 3] * 2
        assert mappings.reduce_from_tensor_model_parallel_region(mine).tolist() == [[3.0] * 3] * 2
        assert torch.equal(mappings.copy_to_tensor_model_parallel_region(mine), mine)
        whole = torch.arange(8.0).view(4, 2)
        assert torch.equal(mappings.scatter_to_sequence_parallel_region(whole, 0), whole[2 * rank:2 * rank + 2])
        assert torch.equal(mappings.scatter_to_tensor_model_parallel_region(whole), whole[:, rank:rank + 1])
        summed = mappings.reduce_scatter_to_sequence_parallel_region(whole * (rank + 1), 0, dtype=torch.float64)
        assert torch.equal(summed, 3 * whole[2 * rank:2 * rank + 2]) and summed.dtype == torch.float32


def _nxdi_config(**neuron_config):
    return dict(num_local_experts=8, num_experts_per_tok=2, hidden_size=16, intermediate_size=8, hidden_act="silu",
                neuron_config=dict(torch_dtype="float32", blockwise_matmul_config=dict(block_size=4),
                                   **neuron_config))


def nxdi_layout(prefill: tuple[int, int], decode: tuple[int, int], **neuron_config):
    """NxDI's setup: global TP = the world (its ``initialize_model_parallel(tp_degree)``), the MoE split by
    ``moe_tp_degree`` x ``moe_ep_degree`` or a hybrid sharding config; each rank passes the same tokens."""
    def run():
        full = randomize_(initialize_moe_module(_nxdi_config()), seed=4)  # one process: no MoE split
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
        par = load_full_state_dict(initialize_moe_module(_nxdi_config(**neuron_config)), full.state_dict())
        layout = pw.parallel_state.get_parallel_layout()
        assert (layout.moe_prefill, layout.moe_decode) == (prefill, decode)
        assert pw.check_moe(full, par, 2, 8, seed=5).mode.value == "blockwise"
        assert pw.check_moe(full, par, 4, 1, seed=6).mode.value == "all_experts"
    return run


pw.SUITES["nxd_world2"] = {
    "deep_dive/tp2": deep_dive_layout(2, 1, 2, 32),
    "deep_dive/ep2": deep_dive_layout(1, 2, 2, 16),
    "deep_dive/tp8_in_a_world_of_2": refuses_more_ranks_than_the_world,
    "nxd/parallel_state": nxd_parallel_state,
    "nxd/moe_process_group": nxd_moe_process_group,
    "nxd/mappings": nxd_mappings,
    "nxdi/moe_ep2": nxdi_layout((1, 2), (1, 2), moe_tp_degree=1, moe_ep_degree=2),
    "nxdi/hybrid": nxdi_layout((1, 2), (2, 1), hybrid_sharding_config=dict(
        moe_cte_tp_degree=1, moe_cte_ep_degree=2, moe_tkg_tp_degree=2, moe_tkg_ep_degree=1)),
}
pw.SUITES["nxd_world4"] = {
    "deep_dive/tp4": deep_dive_layout(4, 1, 2, 32),
    "deep_dive/ep4": deep_dive_layout(1, 4, 1, 16),
    "deep_dive/tp2ep2": deep_dive_layout(2, 2, 2, 16),
}

if __name__ == "__main__":
    pw.main()
