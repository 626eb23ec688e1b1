"""NxD's ``parallel_state``, ``mappings`` and the not-served stand-ins of the front door
(``nxd_moe/nxd_compat/parallel_state.py``, ``mappings.py``, ``not_served.py``) in one process, argument by argument:
the gloo worlds of test_nxd_worlds.py run them for real on 2 and 4 ranks (seconds each); these cases pin what those
leave open -- NxD's positional orders, every group kind's rank lists, the mirrored private names, the messages word
for word. Found by mutation testing (benchmarks/mutation.py).

The layouts: an SPMD layout of 8 ranks (no torch.distributed) seen from rank 5 -- TP 2 x EP 2, the MoE split TP 4 x
EP 1 for prefill and TP 2 x EP 2 for decode -- where ``nxd_compat.parallel_state``'s ``dist`` answers rank 5 of a
world of 8. The mappings run their adapters' dimension and rank logic over a 2-rank group whose collectives are
stand-ins (rank 1's tensor is rank 0's plus 10; sums are over both): the real collectives are
tests/parallel's, and test_nxd_worlds.py runs these mappings on gloo.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from nxd_moe import parallel_state as ours
from nxd_moe.nxd_compat import mappings, not_served
from nxd_moe.nxd_compat import parallel_state as nxd_ps
from nxd_moe.nxd_compat.not_served import NotServed, NotServedError


@pytest.fixture
def fake_world(monkeypatch):
    """``nxd_compat.parallel_state``'s view of torch.distributed: rank 5 of an initialised world of 8."""
    monkeypatch.setattr(nxd_ps, "dist", SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda: 8, get_rank=lambda: 5,
        get_process_group_ranks=lambda group: group.ranks))


@pytest.fixture
def rank5(fake_world, monkeypatch):
    """NxD's ``initialize_model_parallel`` over an SPMD layout of 8 ranks (rank 5) instead of torch.distributed."""
    def spmd(tensor_model_parallel_size, expert_model_parallel_size):
        ours.initialize_spmd_model_parallel(
            8, tensor_model_parallel_size, expert_model_parallel_size, rank=5,
            moe_prefill_tensor_model_parallel_size=4, moe_prefill_expert_model_parallel_size=1,
            moe_decode_tensor_model_parallel_size=2, moe_decode_expert_model_parallel_size=2)

    monkeypatch.setattr(ours, "initialize_model_parallel", spmd)
    nxd_ps.initialize_model_parallel(2, 1, 1, 2)
    yield
    nxd_ps.destroy_token_shuffle_group()
    nxd_ps.destroy_model_parallel()


def _full(message: str) -> str:
    return "^" + re.escape(message) + "$"


# ----------------------------------------------------------------------------------------------------------
# initialize_model_parallel


def test_initialize_model_parallel_passes_nxds_positional_sizes(monkeypatch):
    calls = []
    monkeypatch.setattr(ours, "initialize_model_parallel", lambda *args: calls.append(args))
    # NxD: (tp, pp, cp, ep, skip_collective_init, lnc_size, mesh_only)
    assert nxd_ps.initialize_model_parallel(2, 1, 1, 4, True, 2, False) is None
    assert nxd_ps.initialize_model_parallel(expert_model_parallel_size=3) is None
    assert calls == [(2, 4), (1, 3)]
    assert nxd_ps._TENSOR_MODEL_PARALLEL_GROUP is None  # nothing initialised by the stand-in: nothing mirrored


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(pipeline_model_parallel_size=3), ValueError, "initialize_model_parallel: pipeline_model_parallel_size "
                                                       "must be 1, got 3 (nxd_moe has no pipeline parallelism)"),
    (dict(context_parallel_size=2), ValueError, "initialize_model_parallel: context_parallel_size must be 1, got 2 "
                                                "(nxd_moe has no context parallelism)"),
    (dict(pipeline_model_parallel_size=0), ValueError, "pipeline_model_parallel_size must be in [1, inf], got 0"),
    (dict(context_parallel_size=0), ValueError, "context_parallel_size must be in [1, inf], got 0"),
    (dict(context_parallel_size=1.0), TypeError, "context_parallel_size must be an int, got float 1.0"),
    (dict(skip_collective_init=1), TypeError, "skip_collective_init must be a bool, got int 1"),
    (dict(lnc_size=0), ValueError, "lnc_size must be in [1, 2], got 0"),
    (dict(lnc_size=3), ValueError, "lnc_size must be in [1, 2], got 3"),
    (dict(mesh_only=0), TypeError, "mesh_only must be a bool, got int 0"),
])
def test_initialize_model_parallel_refusals(kwargs, error, message):
    with pytest.raises(error, match=_full(message)):
        nxd_ps.initialize_model_parallel(**kwargs)


def test_initialize_model_parallel_accepts_nxds_other_settings(monkeypatch):
    calls = []
    monkeypatch.setattr(ours, "initialize_model_parallel", lambda *args: calls.append(args))
    nxd_ps.initialize_model_parallel(skip_collective_init=True, lnc_size=2)
    nxd_ps.initialize_model_parallel(lnc_size=1)
    assert calls == [(1, 1), (1, 1)]


@pytest.mark.parametrize("available,initialized", [(False, True), (True, False), (False, False)])
def test_mesh_only_needs_torch_distributed(monkeypatch, available, initialized):
    monkeypatch.setattr(nxd_ps, "dist", SimpleNamespace(is_available=lambda: available,
                                                        is_initialized=lambda: initialized))
    with pytest.raises(RuntimeError, match=_full(
            "initialize_model_parallel(mesh_only=True) needs torch.distributed for the world size: call "
            "torch.distributed.init_process_group first (torchrun sets its environment)")):
        nxd_ps.initialize_model_parallel(2, mesh_only=True)


def test_mesh_only_returns_every_kinds_rank_lists(fake_world):
    mesh = nxd_ps.initialize_model_parallel(2, 1, 1, 2, False, 1, True)
    assert mesh == nxd_ps.ParallelGroups(
        tp_groups=[[0, 1], [2, 3], [4, 5], [6, 7]], dp_groups=[[0, 2, 4, 6], [1, 3, 5, 7]],
        pp_groups=[[0], [1], [2], [3], [4], [5], [6], [7]], ep_model_groups=[[0, 2], [1, 3], [4, 6], [5, 7]],
        ep_data_groups=[[0, 4], [1, 5], [2, 6], [3, 7]], cp_groups=[[0], [1], [2], [3], [4], [5], [6], [7]])
    assert all(type(g) is list for kind in mesh for g in kind)  # lists, as NxD's meshes (not tuples)
    assert not ours.model_parallel_is_initialized()
    wide = nxd_ps.initialize_model_parallel(tensor_model_parallel_size=4, expert_model_parallel_size=2,
                                            mesh_only=True)
    assert wide.tp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]] and wide.ep_model_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]


# ----------------------------------------------------------------------------------------------------------
# the getters and NxD's private names


def test_group_getters_give_the_group_or_every_groups_ranks(rank5):
    assert nxd_ps.get_tensor_model_parallel_group(as_list=True) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert nxd_ps.get_expert_model_parallel_group(as_list=True) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert nxd_ps.get_data_parallel_group(as_list=True) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert nxd_ps.get_expert_data_parallel_group(as_list=True) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert nxd_ps.get_tensor_model_parallel_replica_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert nxd_ps.get_expert_data_parallel_replica_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for getter, ours_getter in ((nxd_ps.get_tensor_model_parallel_group, ours.get_tensor_model_parallel_group),
                                (nxd_ps.get_expert_model_parallel_group, ours.get_expert_model_parallel_group),
                                (nxd_ps.get_data_parallel_group, ours.get_data_parallel_group),
                                (nxd_ps.get_expert_data_parallel_group, ours.get_expert_data_parallel_group)):
        assert getter() is ours_getter() and getter(False) is ours_getter()
        assert getter.__name__ == getter.__qualname__ == ours_getter.__name__
        assert getter.__doc__ == (f"{ours_getter.__doc__} ``as_list=True``: every such group as a list of ranks "
                                  "(NxD's mesh).")
    assert nxd_ps.get_tensor_model_parallel_group().groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    with pytest.raises(TypeError, match=_full("as_list must be a bool, got int 1")):
        nxd_ps.get_data_parallel_group(1)
    assert nxd_ps.get_world_group(as_list=True) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert nxd_ps.get_world_group().groups == ((0, 1, 2, 3, 4, 5, 6, 7),)
    with pytest.raises(TypeError, match=_full("as_list must be a bool, got str 'yes'")):
        nxd_ps.get_world_group("yes")


def test_the_getter_factories(rank5):
    """The getters are made at import; their factories, called here, make them the same way."""
    def group():
        """This rank's group."""
        return "the group"

    getter = nxd_ps._group_getter(group, lambda: [[3, 1]])
    assert (getter(), getter(False), getter(True), getter(as_list=True)) == ("the group", "the group", [[3, 1]],
                                                                             [[3, 1]])
    assert getter.__name__ == getter.__qualname__ == "group"
    assert getter.__doc__ == "This rank's group. ``as_list=True``: every such group as a list of ranks (NxD's mesh)."
    with pytest.raises(TypeError, match=_full("as_list must be a bool, got NoneType None")):
        getter(None)
    assert nxd_ps._replica_groups("expert_data_parallel_groups")() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert nxd_ps._replica_groups("moe_decode_expert_groups")() == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_nxds_private_names_mirror_the_layout(rank5):
    assert nxd_ps._TENSOR_MODEL_PARALLEL_GROUP is ours.get_tensor_model_parallel_group()
    assert nxd_ps._EXPERT_MODEL_PARALLEL_GROUP is ours.get_expert_model_parallel_group()
    assert nxd_ps._DATA_PARALLEL_GROUP is ours.get_data_parallel_group()
    assert nxd_ps._EXP_DATA_PARALLEL_GROUP is ours.get_expert_data_parallel_group()
    assert nxd_ps._TENSOR_MODEL_PARALLEL_GROUP_SPMD == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert nxd_ps._EXPERT_MODEL_PARALLEL_GROUP_SPMD == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert nxd_ps._DATA_PARALLEL_GROUP_SPMD == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert nxd_ps._EXP_DATA_PARALLEL_GROUP_SPMD == [[0, 4], [1, 5], [2, 6], [3, 7]]
    nxd_ps.destroy_model_parallel()
    assert not ours.model_parallel_is_initialized()
    for name in nxd_ps._MIRRORED:
        assert getattr(nxd_ps, name) is None and getattr(nxd_ps, f"{name}_SPMD") is None


def test_token_shuffle_group(rank5):
    with pytest.raises(RuntimeError, match=_full(
            "the token-shuffle group is not initialized: call initialize_token_shuffle_group(1)")):
        nxd_ps.get_token_shuffle_group_size()
    with pytest.raises(ValueError, match=_full(
            "initialize_token_shuffle_group: token_shuffle_group_size must be 1, got 4 (token shuffling balances "
            "expert load in training, and nxd_moe is an inference layer)")):
        nxd_ps.initialize_token_shuffle_group(4)
    with pytest.raises(ValueError, match=_full("token_shuffle_group_size must be in [1, inf], got 0")):
        nxd_ps.initialize_token_shuffle_group(0)
    nxd_ps.initialize_token_shuffle_group()
    assert nxd_ps.get_token_shuffle_group_size() == 1
    assert nxd_ps._TOKEN_SHUFFLE_GROUP_SPMD == [[0], [1], [2], [3], [4], [5], [6], [7]]
    nxd_ps.destroy_token_shuffle_group()
    assert nxd_ps._TOKEN_SHUFFLE_GROUP_SIZE is None and nxd_ps._TOKEN_SHUFFLE_GROUP_SPMD is None


def test_token_shuffle_group_needs_a_layout():
    with pytest.raises(RuntimeError, match=_full(
            "initialize_token_shuffle_group needs initialize_model_parallel first (as in NxD)")):
        nxd_ps.initialize_token_shuffle_group(1)
    assert nxd_ps._TOKEN_SHUFFLE_GROUP_SIZE is None


def test_rmsg_and_the_experts_of_a_rank(rank5):
    assert nxd_ps.rmsg("hello") == "[rank 5 tp 1 ep 0] hello"  # rank 5's TP group is [4, 5], its EP group [5, 7]
    nxd_ps.destroy_model_parallel()
    assert nxd_ps.rmsg("hello") == "hello"
    assert nxd_ps.get_experts_for_expert_parallel_rank(2, 12, 3) == [8, 9, 10, 11]
    assert nxd_ps.get_experts_for_expert_parallel_rank(1, 4, 2, [[3, 0], [1, 2]]) == [1, 2]


def test_nxds_moe_process_groups(rank5, monkeypatch):
    assert nxd_ps.get_moe_tp_ep_group().groups == ((0, 1, 2, 3), (4, 5, 6, 7))  # prefill by default
    assert nxd_ps.get_moe_tp_ep_group(prefill=False).groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert nxd_ps.get_moe_ep_group().groups == tuple((r,) for r in range(8))
    assert nxd_ps.get_moe_ep_group(False).groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert nxd_ps.destroy_moe_model_parallel() is None and ours.model_parallel_is_initialized()
    calls = []
    monkeypatch.setattr(ours, "set_moe_model_parallel_sizes", lambda *args: calls.append(args))
    # NxD: (tkg_tp_degree, tkg_ep_degree, cte_tp_degree, cte_ep_degree); ours: (prefill, decode) as (tp, ep)
    nxd_ps.init_tensor_expert_parallel_moe_process_groups(1, 2, 3, 4)
    assert calls == [((3, 4), (1, 2))]


def test_check_group(rank5):
    nxd_ps.check_group("Owner", "some_group", None, "tensor_model_parallel_groups")  # None: nothing to check
    nxd_ps.check_group("Owner", "some_group", SimpleNamespace(ranks=[4, 5]), "tensor_model_parallel_groups")
    with pytest.raises(ValueError, match=_full(
            "Owner: some_group holds ranks [4, 5], but this rank's moe decode expert group is [5, 7]; nxd_moe runs "
            "the layer over parallel_state's groups (pass None, or initialize_model_parallel with the layout you "
            "want)")):
        nxd_ps.check_group("Owner", "some_group", SimpleNamespace(ranks=[4, 5]), "moe_decode_expert_groups")
    nxd_ps.destroy_model_parallel()
    with pytest.raises(RuntimeError, match=_full(
            "Owner: some_group was given, but nxd_moe.parallel_state is not initialized; nxd_moe modules take "
            "their groups from parallel_state.initialize_model_parallel")):
        nxd_ps.check_group("Owner", "some_group", SimpleNamespace(ranks=[4, 5]), "tensor_model_parallel_groups")


# ----------------------------------------------------------------------------------------------------------
# mappings


class _TwoRanks:
    """A 2-rank group (this process is rank 1) whose collectives are stand-ins; records each call's name."""

    def __init__(self):
        self.calls = []

    def gather(self, x, group, ledger, name):
        assert group is self
        ledger.add(name, x.numel())  # as the real collectives do
        self.calls.append((name, x.dtype))
        return torch.stack([x, x + 10])  # (G, ...): rank 0's, then this rank's (rank 0's plus 10)

    def reduce(self, x, group, ledger, name):
        assert group is self
        ledger.add(name, x.numel())
        self.calls.append((name, x.dtype))
        return 2 * x + 10

    def reduce_scatter(self, parts, group, ledger, name):
        assert group is self and parts.shape[0] == 2
        ledger.add(name, parts[0].numel())
        self.calls.append((name, parts.dtype))
        return (2 * parts + 10)[1]  # rank 1's part of the sum


@pytest.fixture
def two_ranks(monkeypatch):
    group = _TwoRanks()
    monkeypatch.setattr(mappings, "all_gather", group.gather)
    monkeypatch.setattr(mappings, "all_reduce", group.reduce)
    monkeypatch.setattr(mappings, "reduce_scatter", group.reduce_scatter)
    monkeypatch.setattr(mappings, "group_size", lambda g: 2 if g is group else pytest.fail("another group"))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda g=None: 1 if g is group else pytest.fail("no group"))
    return group


def test_gathers_concatenate_the_ranks_along_their_dimension(two_ranks):
    x = torch.arange(6.0).view(2, 3)
    g = mappings.gather_from_tensor_model_parallel_region(x, two_ranks)
    assert torch.equal(g, torch.cat([x, x + 10], dim=-1))
    g = mappings.gather_from_sequence_parallel_region(x, 1, False, two_ranks, True)
    assert torch.equal(g, torch.cat([x, x + 10], dim=1))
    g = mappings.gather_from_sequence_parallel_region(x, process_group=two_ranks)  # dimension 0 by default
    assert torch.equal(g, torch.cat([x, x + 10], dim=0))
    x3 = torch.arange(24.0).view(2, 3, 4)
    assert torch.equal(mappings.gather_from_sequence_parallel_region(x3, 1, process_group=two_ranks),
                       torch.cat([x3, x3 + 10], dim=1))
    assert [name for name, _ in two_ranks.calls] == ["gather_from_tensor_model_parallel_region"] + [
        "gather_from_sequence_parallel_region"] * 3
    for name, value in (("to_model_parallel", 1), ("tile_cc", None)):
        with pytest.raises(TypeError, match=_full(f"{name} must be a bool, got {type(value).__name__} {value!r}")):
            mappings.gather_from_sequence_parallel_region(x, 0, process_group=two_ranks, **{name: value})


def test_scatters_take_this_ranks_shard(two_ranks):
    x = torch.arange(24.0).view(4, 6)
    shard = mappings.scatter_to_tensor_model_parallel_region(x, two_ranks)
    assert torch.equal(shard, x[:, 3:]) and shard.is_contiguous()
    assert torch.equal(mappings.scatter_to_sequence_parallel_region(x, process_group=two_ranks), x[2:])
    assert torch.equal(mappings.scatter_to_sequence_parallel_region(x, 1, two_ranks), x[:, 3:])
    with pytest.raises(ValueError, match=_full(
            "mappings.scatter_to_sequence_parallel_region: dimension 0 of size 3 does not split into 2 ranks")):
        mappings.scatter_to_sequence_parallel_region(torch.ones(3, 2), 0, two_ranks)
    with pytest.raises(ValueError, match=_full(
            "mappings.scatter_to_tensor_model_parallel_region: dimension -1 of size 5 does not split into 2 ranks")):
        mappings.scatter_to_tensor_model_parallel_region(torch.ones(2, 5), two_ranks)


def test_reduces(two_ranks):
    x = torch.arange(8.0).view(4, 2)
    assert torch.equal(mappings.reduce_from_tensor_model_parallel_region(x, two_ranks), 2 * x + 10)
    out = mappings.reduce_scatter_to_sequence_parallel_region(x, 0, two_ranks, torch.float64)
    assert torch.equal(out, 2 * x[2:] + 10) and out.dtype == torch.float32
    out = mappings.reduce_scatter_to_sequence_parallel_region(x.half(), 1, process_group=two_ranks)
    assert torch.equal(out, (2 * x[:, 1:] + 10).half()) and out.dtype == torch.float16
    out = mappings.reduce_scatter_to_sequence_parallel_region(x, process_group=two_ranks)  # dimension 0
    assert torch.equal(out, 2 * x[2:] + 10)
    assert two_ranks.calls == [("reduce_from_tensor_model_parallel_region", torch.float32),
                               ("reduce_scatter_to_sequence_parallel_region", torch.float64),
                               ("reduce_scatter_to_sequence_parallel_region", torch.float16),
                               ("reduce_scatter_to_sequence_parallel_region", torch.float32)]
    with pytest.raises(ValueError, match=_full(
            "mappings.reduce_scatter_to_sequence_parallel_region: dimension 1 of size 3 does not split into 2 "
            "ranks")):
        mappings.reduce_scatter_to_sequence_parallel_region(torch.ones(2, 3), 1, two_ranks)


def test_copy_and_the_gradient_refusal(two_ranks):
    x = torch.ones(2, requires_grad=True)
    for call in (lambda t: mappings.copy_to_tensor_model_parallel_region(t, two_ranks),
                 lambda t: mappings.gather_from_tensor_model_parallel_region(t, two_ranks)):
        with torch.no_grad():
            call(x)  # no graph: served
    y = torch.ones(2)
    assert mappings.copy_to_tensor_model_parallel_region(y, two_ranks) is y
    with pytest.raises(RuntimeError, match=_full(
            "mappings.copy_to_tensor_model_parallel_region: nxd_moe's NxD mappings run the forward collective only "
            "(inference); call it under torch.no_grad() / torch.inference_mode() or on a tensor that needs no "
            "gradient")):
        mappings.copy_to_tensor_model_parallel_region(x, two_ranks)
    for name, call in (
            ("scatter_to_sequence_parallel_region", lambda t: mappings.scatter_to_sequence_parallel_region(t)),
            ("reduce_from_tensor_model_parallel_region", mappings.reduce_from_tensor_model_parallel_region),
            ("gather_from_tensor_model_parallel_region", mappings.gather_from_tensor_model_parallel_region),
            ("reduce_scatter_to_sequence_parallel_region", mappings.reduce_scatter_to_sequence_parallel_region)):
        with pytest.raises(RuntimeError, match=f"^mappings.{name}: nxd_moe's NxD mappings run the forward"):
            call(torch.ones(2, requires_grad=True))


def test_the_default_group_is_the_tensor_parallel_group(rank5, monkeypatch):
    seen = []
    monkeypatch.setattr(mappings, "all_reduce", lambda x, group, ledger, name: seen.append(group) or x)
    mappings.reduce_from_tensor_model_parallel_region(torch.ones(2))
    assert seen == [ours.get_tensor_model_parallel_group()]


def test_a_world_of_one_runs_the_real_collectives():
    import torch.distributed as dist

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, __import__("datetime").timedelta(seconds=30))
    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(mappings.scatter_to_sequence_parallel_region(x, 0, group), x)
    assert torch.equal(mappings.gather_from_sequence_parallel_region(x, 1, process_group=group), x)


# ----------------------------------------------------------------------------------------------------------
# not served


def test_not_served_stand_in():
    stub = NotServed("pkg.mod.Thing", "a reason")
    message = _full("pkg.mod.Thing is not served by nxd_moe's NxD front door (a reason); docs/nxd.md lists what is")
    for use in (lambda: stub(), lambda: stub(1, k=2), lambda: stub.attr, lambda: stub.__private,
                lambda: stub.trailing__, lambda: stub._is_coroutine_x):
        with pytest.raises(NotServedError, match=message):
            use()
    for name in ("__wrapped__", "__signature__", "_is_coroutine", "_is_coroutine_marker"):
        with pytest.raises(AttributeError, match=_full(name)):
            getattr(stub, name)
    assert repr(stub) == "<pkg.mod.Thing: not served (a reason)>"
    assert issubclass(NotServedError, NotImplementedError)


def test_not_served_builds_one_stand_in_per_name():
    stubs = not_served.not_served("pkg.mod", "another reason", "f", "G")
    assert list(stubs) == ["f", "G"]
    assert repr(stubs["G"]) == "<pkg.mod.G: not served (another reason)>"
    with pytest.raises(NotServedError, match=_full(
            "pkg.mod.f is not served by nxd_moe's NxD front door (another reason); docs/nxd.md lists what is")):
        stubs["f"]()
