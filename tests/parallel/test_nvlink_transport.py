"""The static all-to-all straight over NVLink (nxd_moe/parallel/nvlink.py, nxd_moe/triton_kernels/peer_put.py) on a
CPU: the put kernel in Triton's interpreter writing into every "peer's" buffer through raw addresses, against the
all-to-all's definition; an exchange's order (barrier, put, barrier) with a recording handle; where it gives way to
NCCL's all-to-all; the config's refusals. On two GPUs the `nccl2` suite runs it for real."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import INTERPRETED

from nxd_moe.config import ExpertParallelConfig
from nxd_moe.parallel import nvlink
from nxd_moe.parallel.collectives import CommLedger, PendingExchange

# CPU buffers behind raw addresses: the interpreter's (on a GPU, the nccl2 suite runs the kernel for real)
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="the put kernel on CPU buffers: Triton's interpreter")


def all_to_all_by_definition(sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rank ``p`` receives, in rank order, the ``n`` rows every rank ``q`` addressed to it (rows ``[p n, (p+1) n)``
    of ``q``'s send buffer)."""
    m = len(sends)
    n = sends[0].shape[0] // m
    return [torch.cat([sends[q][p * n:(p + 1) * n] for q in range(m)]) for p in range(m)]


@needs_interpreter
@pytest.mark.parametrize("ranks,rows,row_bytes", [(2, 3, 8), (3, 2, 12), (4, 1, 4)])
def test_the_put_kernel_writes_the_all_to_all_layout_into_every_peer(ranks, rows, row_bytes):
    pytest.importorskip("triton")
    from nxd_moe.triton_kernels.peer_put import put_to_peers

    gen = torch.Generator().manual_seed(ranks * 10 + rows)
    sends = [torch.randint(0, 256, (ranks * rows, row_bytes), generator=gen, dtype=torch.uint8)
             for _ in range(ranks)]
    buffers = [torch.full((ranks * rows, row_bytes), 7, dtype=torch.uint8) for _ in range(ranks)]
    peers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    for me in range(ranks):
        put_to_peers(sends[me].view(torch.int32).reshape(-1), peers, me)
    for got, expected in zip(buffers, all_to_all_by_definition(sends)):
        assert torch.equal(got, expected)


class RecordingHandle:
    """A symmetric-memory handle over plain CPU buffers, one per rank, recording its barriers."""

    def __init__(self, buffers: list[torch.Tensor], rank: int, log: list):
        self.buffer_ptrs = [b.data_ptr() for b in buffers]
        self.rank, self.log = rank, log

    def barrier(self, channel: int = 0) -> None:
        self.log.append((self.rank, "barrier", channel))


@needs_interpreter
def test_an_exchange_is_a_barrier_one_put_and_a_barrier_and_returns_the_received_rows(monkeypatch):
    """Two "ranks" in one process: each exchange waits at channel 0 (the peers have read their buffers), writes,
    and waits at channel 1 (every peer's rows have landed); what comes back is the rank's buffer viewed in the
    sender's dtype and shape -- bf16 rows of 2 words each here -- equal to the all-to-all's definition."""
    pytest.importorskip("triton")
    import torch.distributed._symmetric_memory as symm_mem

    ranks, rows = 2, 3
    buffers = [torch.zeros(ranks * rows, 8, dtype=torch.uint8) for _ in range(ranks)]
    log, made, asked = [], iter(range(ranks)), []
    group = FakeGroup(group_name="block")

    def empty(*shape, dtype, device):
        asked.append(("empty", shape, dtype, device))
        return buffers[next(made)]

    def rendezvous(buffer, group):
        asked.append(("rendezvous", group))
        return RecordingHandle(buffers, next(i for i, b in enumerate(buffers) if b is buffer), log)

    monkeypatch.setattr(symm_mem, "empty", empty, raising=False)
    monkeypatch.setattr(symm_mem, "rendezvous", rendezvous, raising=False)
    cpu = torch.device("cpu")
    exchanges = [nvlink.PeerExchange(group, ranks * rows, 8, cpu) for _ in range(ranks)]
    assert asked == [("empty", (ranks * rows, 8), torch.uint8, cpu), ("rendezvous", group)] * ranks
    for exchange in exchanges:  # every rank's buffer address, as int64 on the rank's device
        assert exchange.peer_ptrs.dtype == torch.int64 and exchange.peer_ptrs.device == cpu
        assert exchange.peer_ptrs.tolist() == [b.data_ptr() for b in buffers]
    sends = [torch.randn(ranks * rows, 4, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
             for r in range(ranks)]
    for r in range(ranks):
        exchanges[r](sends[r])
    assert log == [(0, "barrier", 0), (0, "barrier", 1), (1, "barrier", 0), (1, "barrier", 1)]
    for r, expected in enumerate(all_to_all_by_definition(sends)):
        assert torch.equal(buffers[r].view(torch.bfloat16).view(ranks * rows, 4), expected)


class FakeGroup(SimpleNamespace):
    pass


def recorded_fallback(monkeypatch) -> list:
    """NCCL's all-to-all replaced by a recorder of exactly what it is handed."""
    calls = []
    monkeypatch.setattr(nvlink, "start_all_to_all", lambda x, group, ledger, step: calls.append(
        (x, group, ledger, step)) or PendingExchange(x))
    return calls


def test_where_nvlink_cannot_run_the_exchange_is_nccls(monkeypatch):
    """Off CUDA (this CPU), rows that are not whole 4-byte words, a group of one: NCCL's all-to-all, with the same
    arguments; nothing is allocated."""
    calls = recorded_fallback(monkeypatch)
    monkeypatch.setattr(nvlink, "group_size", lambda group: group.size)
    monkeypatch.setattr(nvlink, "PeerExchange", lambda *a: pytest.fail("no buffer may be made"))
    ledger = CommLedger()
    x = torch.zeros(4, 2, dtype=torch.float32)
    group = FakeGroup(size=2, group_name="g")
    assert nvlink.start_nvlink_all_to_all(x, group, ledger, "dispatch").wait() is x
    assert len(calls) == 1 and calls[0][0] is x and calls[0][1] is group and calls[0][2] is ledger
    assert calls[0][3] == "dispatch"
    assert not nvlink.usable(x, FakeGroup(size=2, group_name="g"))  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as if on a GPU
    assert nvlink.usable(x, FakeGroup(size=2, group_name="g"))  # the control: this one could
    assert not nvlink.usable(torch.zeros(4, 3, dtype=torch.bfloat16), FakeGroup(size=2, group_name="g"))  # 6 B rows
    assert not nvlink.usable(x, FakeGroup(size=1, group_name="g"))
    assert not nvlink.usable(x[:0], FakeGroup(size=2, group_name="g"))


def test_a_shape_first_met_in_a_capture_or_without_peer_access_takes_nccl_and_a_kept_one_does_not(monkeypatch):
    calls = recorded_fallback(monkeypatch)
    group = FakeGroup(group_name="block")
    monkeypatch.setattr(nvlink, "usable", lambda x, g: g is group)
    monkeypatch.setattr(nvlink, "group_size", lambda g: 3 if g is group else pytest.fail("another group"))
    monkeypatch.setattr(nvlink, "_exchanges", {})
    made, sent = [], []

    class Exchange:
        def __init__(self, g, num_rows, row_bytes, device):
            made.append((g, num_rows, row_bytes, device))
            self.buffer = torch.arange(num_rows * row_bytes, dtype=torch.uint8).view(num_rows, row_bytes)

        def __call__(self, send):
            sent.append(send)
            return self.buffer

    monkeypatch.setattr(nvlink, "PeerExchange", Exchange)
    x = torch.zeros(6, 3, dtype=torch.float32)  # 12-byte rows, 2 to each of 3 ranks
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    access = []
    monkeypatch.setattr(nvlink, "peer_access", lambda g, device: access.append((g, device)) or False)
    ledger = CommLedger()
    nvlink.start_nvlink_all_to_all(x, group, ledger, "dispatch")  # in a capture: NCCL, no buffer, no question
    assert [c[0] for c in calls] == [x] and calls[0][1:] == (group, ledger, "dispatch") and made == access == []
    capturing[0] = False
    nvlink.start_nvlink_all_to_all(x, group, ledger, "dispatch")  # no peer access: NCCL
    assert len(calls) == 2 and calls[1][1:] == (group, ledger, "dispatch") and made == []
    assert access == [(group, x.device)]
    monkeypatch.setattr(nvlink, "peer_access", lambda g, device: g is group)
    got = nvlink.start_nvlink_all_to_all(x, group, ledger, "combine").wait()
    assert made == [(group, 6, 12, x.device)] and len(calls) == 2 and sent == [x]
    # the buffer in the sender's dtype and shape; the bytes the other ranks sent counted: 2 of 3 parts of 72
    assert got.dtype == torch.float32 and got.shape == (6, 3)
    assert torch.equal(got.view(torch.uint8), torch.arange(72, dtype=torch.uint8).view(6, 12))
    assert ledger.steps == {"combine": 48} and type(ledger.steps["combine"]) is int
    capturing[0] = True  # kept: a capture now records the NVLink exchange
    nvlink.start_nvlink_all_to_all(x, group, ledger, "combine")
    assert len(made) == 1 and len(calls) == 2 and ledger.steps == {"combine": 96}
    # other shapes get their own buffers (rows, row bytes), the same shape on another device too
    capturing[0] = False
    nvlink.start_nvlink_all_to_all(torch.zeros(3, 3), group, ledger, "combine")
    nvlink.start_nvlink_all_to_all(torch.zeros(6, 2), group, ledger, "combine")
    nvlink.start_nvlink_all_to_all(torch.zeros(6, 3, device="meta"), group, ledger, "combine")
    assert [m[1:3] for m in made] == [(6, 12), (3, 12), (6, 8), (6, 12)] and made[3][3] == torch.device("meta")
    with pytest.raises(ValueError, match="all_to_all: 4 rows do not split into 3 equal parts"):
        nvlink.start_nvlink_all_to_all(torch.zeros(4, 5), group, ledger, "combine")


class FakeDevice(SimpleNamespace):
    pass


@pytest.mark.parametrize("places,access,expected", [
    ([("h", "u0", 0), ("h", "u1", 1)], {(0, 1), (1, 0)}, True),  # one host, each reaches the other
    ([("h", "u0", 0), ("k", "u1", 0)], {(0, 0)}, False),  # two hosts
    ([("h", "u0", 0), ("h", "u1", 1)], {(1, 0)}, False),  # rank 0's GPU cannot reach rank 1's
    ([("h", "u0", 0), ("h", "u0", 0)], set(), True),  # the same GPU twice: nothing to reach
])
def test_peer_access_is_one_answer_for_every_rank_and_kept_per_group(monkeypatch, places, access, expected):
    """Rank 0's view: the ranks' hosts and GPUs gathered, this rank's verdict (same host, and it reaches every other
    GPU), every rank's verdict gathered and all required; asked once per group."""
    monkeypatch.setattr(nvlink, "_peer_access", {})
    group = FakeGroup(group_name="block")
    gathered = []

    def all_gather_object(out, obj, group):
        gathered.append((obj, group))
        out[:] = places if len(gathered) % 2 else [obj, True]  # rank 1 agrees with whatever rank 0 says

    monkeypatch.setattr(nvlink, "dist", SimpleNamespace(all_gather_object=all_gather_object))
    monkeypatch.setattr(nvlink, "group_size", lambda g: 2 if g.group_name in ("block", "another")
                        else pytest.fail("an unknown group"))
    device = torch.device("cuda", places[0][2])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: FakeDevice(uuid=places[0][1]) if d == device
                        else pytest.fail(f"asked about {d}"))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) in access)
    monkeypatch.setattr("socket.gethostname", lambda: places[0][0])
    assert nvlink.peer_access(group, device) is expected
    assert gathered[0] == ((places[0][0], places[0][1], places[0][2]), group)
    assert gathered[1][0] is expected and gathered[1][1] is group  # this rank's verdict (the other says True)
    assert nvlink.peer_access(group, device) is expected and len(gathered) == 2  # kept
    nvlink.peer_access(FakeGroup(group_name="another"), device)  # another group is asked on its own
    assert len(gathered) == 4 and set(nvlink._peer_access) == {"block", "another"}


def test_one_rank_without_access_makes_every_rank_take_nccl(monkeypatch):
    monkeypatch.setattr(nvlink, "_peer_access", {})
    group = FakeGroup(group_name="block")
    calls = []

    def all_gather_object(out, obj, group):
        calls.append(obj)
        out[:] = [("h", "u0", 0), ("h", "u1", 1)] if len(calls) == 1 else [obj, False]

    monkeypatch.setattr(nvlink, "dist", SimpleNamespace(all_gather_object=all_gather_object))
    monkeypatch.setattr(nvlink, "group_size", lambda g: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: FakeDevice(uuid="u0"))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setattr("socket.gethostname", lambda: "h")
    assert nvlink.peer_access(group, torch.device("cuda", 0)) is False
    assert calls[1] is True  # this rank could; the other could not


@pytest.mark.parametrize("kwargs,message", [
    (dict(transport="nvl"), r"ExpertParallelConfig.transport must be one of \['nccl', 'nvlink'\], got 'nvl'"),
    (dict(dispatch="all_gather", transport="nvlink"), "transport='nvlink' needs dispatch='all_to_all_v' with "
                                                      "all_to_all_splits='static', got dispatch='all_gather'"),
    (dict(dispatch="all_to_all_v", all_to_all_splits="exact", transport="nvlink"), "all_to_all_splits='exact'"),
    (dict(dispatch="all_to_all_v", transport="nvlink", micro_batches=2), "runs one batch .* micro_batches=2"),
])
def test_the_config_refuses_a_transport_it_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpertParallelConfig(**kwargs)


def test_the_config_takes_nvlink_for_a_static_all_to_all():
    assert ExpertParallelConfig().transport == "nccl"
    assert ExpertParallelConfig("all_to_all_v", transport="nvlink", micro_batches=1).transport == "nvlink"
