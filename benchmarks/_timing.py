"""Interleaved wall-clock timing for noisy machines.

Why interleave: on a shared VM the available CPU drifts over seconds (other processes, frequency changes).
Timing contender A for a minute and then contender B for a minute turns that drift into a fake speedup.
Here every *repetition* runs every contender once, and the starting contender rotates between repetitions,
so slow periods hit all contenders about equally and no contender always runs right after the same other one
(cache state, allocator state). Medians and p10/p90 are then taken per contender.

Short calls (decode) are timed in batches of ``calls_per_sample`` back-to-back calls so that one sample is
at least ``min_sample_s`` long; timer resolution and per-sample jitter then stay small relative to the
sample. Each contender gets its own batch size (calibrated during warm-up), and the reported numbers are
always per call.
"""

from __future__ import annotations

import gc
import math
import os
import resource
import time
from typing import Any, Callable, Mapping

Contender = Callable[[], Any]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]) of a non-empty list, like numpy's default."""
    if not values:
        raise ValueError("percentile of an empty list")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(samples_s: list[float]) -> dict[str, float | int]:
    """Per-call seconds -> milliseconds summary: median, p10, p90, min, number of samples."""
    ms = [s * 1e3 for s in samples_s]
    return {
        "median_ms": percentile(ms, 50),
        "p10_ms": percentile(ms, 10),
        "p90_ms": percentile(ms, 90),
        "min_ms": min(ms),
        "samples": len(ms),
    }


def _time_batch(fn: Contender, calls: int) -> float:
    """Seconds per call, averaged over ``calls`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _measure_batch(fn: Contender, calls: int) -> tuple[float, float, float]:
    """``(wall s, minor page faults, kernel CPU s)`` per call over ``calls`` back-to-back calls.

    Page faults and system time are process-wide (all threads); they are recorded because on CPU a forward
    that allocates large fresh temporaries pays the kernel for zeroing new pages, which shows up here and
    not in a profiler's op times.
    """
    before = resource.getrusage(resource.RUSAGE_SELF)
    wall = _time_batch(fn, calls)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return wall, (after.ru_minflt - before.ru_minflt) / calls, (after.ru_stime - before.ru_stime) / calls


def warm_up_and_calibrate(contenders: Mapping[str, Contender], warmup: int, min_sample_s: float,
                          max_calls_per_sample: int = 64) -> dict[str, int]:
    """Run each contender ``warmup`` times (at least once) and pick its calls-per-sample.

    Warm-up calls are interleaved too, and the calibration uses the fastest warm-up call, so a hiccup
    during warm-up cannot inflate the batch size.
    """
    fastest = {name: math.inf for name in contenders}
    for _ in range(max(1, warmup)):
        for name, fn in contenders.items():
            fastest[name] = min(fastest[name], _time_batch(fn, 1))
    return {name: max(1, min(max_calls_per_sample, math.ceil(min_sample_s / max(t, 1e-9))))
            for name, t in fastest.items()}


def time_interleaved(
    contenders: Mapping[str, Contender],
    repeats: int,
    warmup: int = 2,
    min_sample_s: float = 0.02,
) -> dict[str, dict[str, float | int]]:
    """Time every contender ``repeats`` times, interleaved with a rotating start.

    Returns ``{name: summarize(...) | {"calls_per_sample": n, "minor_page_faults_per_call": median,
    "kernel_cpu_ms_per_call": median}}``. The garbage collector is paused while timing (a collection in the
    middle of one contender's sample would be charged to it alone).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(contenders)
    calls = warm_up_and_calibrate(contenders, warmup, min_sample_s)
    samples: dict[str, list[float]] = {name: [] for name in names}
    faults: dict[str, list[float]] = {name: [] for name in names}
    sys_s: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for rep in range(repeats):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                wall, minflt, stime = _measure_batch(contenders[name], calls[name])
                samples[name].append(wall)
                faults[name].append(minflt)
                sys_s[name].append(stime)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: {**summarize(samples[name]), "calls_per_sample": calls[name],
                   "minor_page_faults_per_call": percentile(faults[name], 50),
                   "kernel_cpu_ms_per_call": percentile(sys_s[name], 50) * 1e3} for name in names}


# ------------------------------------------------------------------------------------------------------
# Other processes' CPU use: the noise source on a shared VM, measured rather than guessed.
# ------------------------------------------------------------------------------------------------------

def _system_busy_s() -> float | None:
    """CPU-seconds all processes have been busy since boot (``/proc/stat``), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait is busy.
    ticks = [int(v) for v in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class OtherCpuMeter:
    """Average number of cores other processes kept busy between ``start()`` and ``stop()``.

    System-wide busy time minus this process's own CPU time, over wall time. Coarse (clock ticks), but it
    tells a contended measurement from a clean one, which the load average (a 1-minute decaying mean that
    includes our own threads) cannot.
    """

    def start(self) -> "OtherCpuMeter":
        self._busy, self._own, self._wall = _system_busy_s(), _own_cpu_s(), time.perf_counter()
        return self

    def stop(self) -> float | None:
        busy = _system_busy_s()
        if busy is None or self._busy is None:
            return None
        wall = time.perf_counter() - self._wall
        other = (busy - self._busy) - (_own_cpu_s() - self._own)
        return max(0.0, other / wall) if wall > 0 else None


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.3, window_s: float = 0.5) -> dict[str, float | None]:
    """Sleep in ``window_s`` steps until other processes use less than ``threshold_cores`` (or give up after
    ``max_wait_s``). Returns how long it waited and the last measured load of other processes."""
    waited, other = 0.0, None
    while True:
        meter = OtherCpuMeter().start()
        time.sleep(window_s)
        other = meter.stop()
        waited += window_s
        if other is None or other < threshold_cores or waited >= max_wait_s:
            return {"waited_s": round(waited, 1), "other_cpu_cores_before": other}
