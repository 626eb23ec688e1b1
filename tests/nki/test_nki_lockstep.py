"""LNC2 cores run in lockstep (nxd_moe.nki_kernels.lnc.Lockstep): the cores take turns one instruction at a time,
whatever the host's thread timing, so a kernel that relies on both cores progressing together -- as nki-library's
core/max kernels do -- gets the hardware's result every time; barriers and sendrecv still synchronise; a core waiting
for something that cannot come fails at once with a named error."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from nxd_moe.nki_kernels import CoreDivergenceError, HardwareLimitError, compat, simulate
from nxd_moe.nki_kernels import isa as nisa
from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.lnc import Lockstep

ROWS, COLS = 256, 64
# Long enough that free-running core threads always interleave the wrong way: the delayed core's zeroing lands after
# its peer wrote its half (on hardware, and in lockstep, both cores zero before either writes).
HOST_DELAY_S = 0.05


def zero_then_write_halves(x, delayed_core=None, liveness=False):
    """nki-library's ``folded_load_store_dst_kernel`` pattern: both cores zero the whole shared output (a memset tile
    DMA'd over it), then each copies its half of ``x`` in, with no barrier in between. ``delayed_core`` sleeps on the
    host before zeroing: a preempted thread or a GC pause, which must not change what the kernel computes."""
    core = nl.program_id(0)
    out = nl.ndarray((ROWS, COLS), nl.float32, buffer=nl.shared_hbm, name="out")
    zero = nl.ndarray((128, COLS), nl.float32, buffer=nl.sbuf)
    if core == delayed_core:
        time.sleep(HOST_DELAY_S)
    nisa.memset(zero, 0.0)
    for i in range(ROWS // 128):
        nisa.dma_copy(dst=out[nl.ds(i * 128, 128), :], src=zero)
    half = ROWS // 2
    mine = nl.ndarray((half, COLS), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine, src=x[nl.ds(core * half, half), :])
    nisa.dma_copy(dst=out[nl.ds(core * half, half), :], src=mine)
    return out


@pytest.mark.parametrize("delayed_core", [None, 0, 1])
def test_shared_output_zeroed_by_both_cores_then_written_by_halves(delayed_core):
    x = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    for _ in range(3):
        out = simulate(zero_then_write_halves, lnc=2)(x, delayed_core).outputs
        # Every row was written by one core after both zeroed: the output is x itself.
        np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("delayed_core", [0, 1])
def test_the_same_race_through_the_nki_front_door(delayed_core):
    """The same kernel launched as nki-library's harness launches it (compat: liveness memory model, aliased
    inputs)."""
    x = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32)
    run = compat.run(zero_then_write_halves, x, delayed_core, lnc=2)
    np.testing.assert_array_equal(run.outputs, x)


def test_cores_take_turns_one_instruction_each():
    """Python before an instruction runs in that instruction's turn, so the log shows the schedule: core 0's k-th
    instruction, core 1's k-th, core 0's (k+1)-th, ...; a core that finished drops out. An instruction built from
    another (``activation_reduce`` calls ``activation``) is one turn."""
    log = []

    def kernel(counts):
        core = nl.program_id(0)
        t = nl.ndarray((4, 8), nl.float32)
        total = nl.ndarray((4, 1), nl.float32)
        for k in range(counts[core]):
            log.append((core, k))
            if core == 0:
                nisa.activation_reduce(t, nl.copy, t, nl.add, total)
            else:
                nisa.memset(t, float(k))
        log.append((core, "end"))

    simulate(kernel, lnc=2)((3, 5))
    assert log == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, "end"), (1, 3), (1, 4), (1, "end")]


def test_a_genuine_race_resolves_the_same_way_every_time():
    """Both cores write their id into the same shared row at the same instruction (a real race on hardware). In
    lockstep core 1's k-th instruction follows core 0's, so core 1's value stays -- under any host delays."""
    rng = random.Random(0)

    def kernel(x, delays):
        core = nl.program_id(0)
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm, name="out")
        t = nl.ndarray((1, 4), nl.float32)
        for k in range(4):
            time.sleep(delays[core][k])
            nisa.memset(t, float(10 * k + core))
            nisa.dma_copy(dst=out, src=t)
        return out

    for _ in range(6):
        delays = [[rng.choice([0.0, 0.0, 0.01]) for _ in range(4)] for _ in range(2)]
        out = simulate(kernel, lnc=2)(np.zeros(1, np.float32), delays).outputs
        np.testing.assert_array_equal(out, 31.0)


def test_barrier_waits_for_a_core_that_is_many_instructions_behind():
    """Core 0 reaches the barrier at once, core 1 after 50 more instructions; afterwards each reads the row the other
    wrote before the barrier; then several sendrecv rounds on one pipe."""

    def kernel(x):
        core = nl.program_id(0)
        out = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm, name="rows")
        mine = nl.ndarray((1, 8), nl.float32)
        nisa.memset(mine, 0.0)
        for _ in range(50 if core == 1 else 0):
            nisa.tensor_scalar(mine, mine, nl.add, 1.0)
        nisa.dma_copy(dst=out[core:core + 1, :], src=mine)
        nisa.core_barrier(out, (0, 1))
        theirs = nl.ndarray((1, 8), nl.float32)
        nisa.dma_copy(dst=theirs, src=out[1 - core:2 - core, :])
        received = nl.ndarray((1, 8), nl.float32)
        for _ in range(3):  # swap the tiles three times: each core ends with the other's
            nisa.sendrecv(src=theirs, dst=received, send_to_rank=1 - core, recv_from_rank=1 - core, pipe_id=0)
            nisa.tensor_copy(theirs, received)
        result = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm, name="result")
        nisa.dma_copy(dst=result[core:core + 1, :], src=theirs)
        return result

    run = simulate(kernel, lnc=2)(np.zeros(1, np.float32))
    # After the barrier core 0 holds core 1's 50 and core 1 core 0's 0; three swaps leave them exchanged.
    np.testing.assert_array_equal(run.outputs, np.array([[0.0] * 8, [50.0] * 8], np.float32))
    assert [core.barriers for core in run.cores] == [1, 1]


def test_the_cores_leave_a_barrier_together():
    """Core 1 reaches the barrier 10 instructions after core 0; they leave it together, so core 1's first instruction
    after it (writing 7 into a shared cell) runs before core 0's second (reading the cell) -- not 10 instructions
    later, as it would if core 0 were still counted 10 behind."""

    def kernel(cell):
        core = nl.program_id(0)
        t = nl.ndarray((1, 1), nl.float32)
        nisa.memset(t, 7.0)
        for _ in range(10 if core == 1 else 0):
            nisa.memset(t, 7.0)
        nisa.core_barrier(cell, (0, 1))
        if core == 1:
            nisa.dma_copy(dst=cell, src=t)
        else:
            nisa.memset(t, 0.0)
        seen = nl.ndarray((1, 1), nl.float32)
        nisa.dma_copy(dst=seen, src=cell)
        out = nl.ndarray((2, 1), nl.float32, buffer=nl.shared_hbm, name="out")
        nisa.dma_copy(dst=out[core:core + 1, :], src=seen)
        return out

    out = simulate(kernel, lnc=2)(np.full((1, 1), -1.0, np.float32)).outputs
    np.testing.assert_array_equal(out, [[7.0], [7.0]])


def test_a_barrier_the_peer_never_reaches_is_a_named_error_at_once():
    def kernel(x):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nisa.core_barrier(out, (0, 1))
        if nl.program_id(0) == 0:
            nisa.core_barrier(out, (0, 1))
        return out

    start = time.perf_counter()
    with pytest.raises(CoreDivergenceError, match=r"core 0, at its instruction 2, waits at core barrier #2 .*"
                                                  r"core 1 finished; the cores took different control paths"):
        simulate(kernel, lnc=2)(np.zeros(1, np.float32))
    assert time.perf_counter() - start < 2.0


def test_every_core_blocked_is_a_named_deadlock():
    """The scheduler on its own: two cores each waiting for something only the other could give."""
    lockstep = Lockstep(2)
    errors: list[BaseException | None] = [None, None]

    def core(pid: int) -> None:
        try:
            lockstep.begin(pid)
            lockstep.step(pid)
            lockstep.block(pid, lambda: False, f"semaphore {pid}")
        except CoreDivergenceError as e:
            errors[pid] = e
        finally:
            lockstep.finish(pid, errors[pid] is not None)

    threads = [threading.Thread(target=core, args=(pid,)) for pid in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)
    assert "core 0, at its instruction 1, waits at semaphore 0" in str(errors[0])
    assert "core 1, at its instruction 1, waits at semaphore 1" in str(errors[0])
    assert "every core is blocked (deadlock)" in str(errors[0]) and "deadlock" in str(errors[1])


def test_a_failing_core_stops_its_peer_at_the_next_instruction():
    issued = [0, 0]

    def kernel(x):
        core = nl.program_id(0)
        t = nl.ndarray((1, 1), nl.float32)
        for _ in range(100_000):
            issued[core] += 1
            nisa.memset(t, 0.0)
            if core == 1:
                nl.ndarray((129, 1), nl.float32)

    with pytest.raises(HardwareLimitError, match="pmax"):
        simulate(kernel, lnc=2)(np.zeros(1, np.float32))
    assert issued == [2, 1]


def test_one_core_runs_on_the_calling_thread():
    seen = []

    def kernel(x):
        seen.append(threading.get_ident())
        t = nl.ndarray((1, 1), nl.float32)
        nisa.memset(t, 0.0)

    simulate(kernel)(np.zeros(1, np.float32))
    assert seen == [threading.get_ident()]
