"""The engines' pseudo random number generators: ``rng`` (32 random bits per element), ``dropout`` (Vector
Engine), ``set_rng_seed`` (the Vector Engine's seed), ``rand_set_state`` / ``rand_get_state`` (GpSimd's per-lane
XORWOW states, 6 uint32 words per partition on Trn2).

Every lane (partition) of an engine runs Marsaglia's XORWOW; the Vector Engine's lanes are seeded from one 32-bit
seed by splitmix32. Sequences are deterministic per launch and core (default seed 0), so simulated kernels are
reproducible; they are not the hardware's bit streams, which NKI does not document.
"""

from __future__ import annotations

import numpy as np

from nxd_moe.nki_kernels.dtypes import float32, int8, int16, int32, is_integer, uint8, uint16, uint32
from nxd_moe.nki_kernels.hardware import Buffer, HardwareLimitError
from nxd_moe.nki_kernels.instruction_support import (
    account,
    as_f32,
    check_reaches,
    check_same_shape,
    chosen_engine,
    computes,
    scalar_operand,
    store_result,
    tile_operand,
)
from nxd_moe.nki_kernels.isa_constants import engine
from nxd_moe.nki_kernels.machine import current_core, instruction

LANES = 128
XORWOW_WORDS = 6  # x, y, z, w, v and the Weyl counter d
_WEYL = np.uint32(362437)
_INTEGER_DTYPES = (int8, int16, int32, uint8, uint16, uint32)


def _splitmix32(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint32(0x9E3779B9)).astype(np.uint32)
    x = ((x ^ (x >> np.uint32(16))) * np.uint32(0x85EBCA6B)).astype(np.uint32)
    x = ((x ^ (x >> np.uint32(13))) * np.uint32(0xC2B2AE35)).astype(np.uint32)
    return (x ^ (x >> np.uint32(16))).astype(np.uint32)


def seeded_states(seed: int) -> np.ndarray:
    """``(128, 6)`` uint32 XORWOW lane states from one 32-bit seed (a nonzero xorshift state in every lane)."""
    counter = np.uint32(seed) + np.arange(LANES * XORWOW_WORDS, dtype=np.uint32)
    with np.errstate(over="ignore"):
        states = _splitmix32(counter.astype(np.uint32)).reshape(LANES, XORWOW_WORDS)
    states[:, 0] |= np.uint32(1)
    return states


def _states(engine_name: str) -> np.ndarray:
    registers = current_core().accumulators.setdefault(f"prng:{engine_name}", {})
    if "state" not in registers:
        registers["state"] = seeded_states(0)
    return registers["state"]


def xorwow(states: np.ndarray, count: int) -> np.ndarray:
    """``count`` 32-bit outputs per lane, advancing ``states (P, 6)`` in place; ``(P, count)`` uint32."""
    out = np.empty((states.shape[0], count), np.uint32)
    x, y, z, w, v, d = (states[:, i].copy() for i in range(XORWOW_WORDS))
    with np.errstate(over="ignore"):
        for i in range(count):
            t = x ^ (x >> np.uint32(2))
            x, y, z, w = y, z, w, v
            v = (v ^ (v << np.uint32(4))) ^ (t ^ (t << np.uint32(1)))
            d = d + _WEYL
            out[:, i] = v + d
    states[:] = np.stack([x, y, z, w, v, d], axis=1)
    return out


def random_bits(engine_name: str, partitions: int, count: int) -> np.ndarray:
    states = _states(engine_name)
    lanes = states[:partitions]
    bits = xorwow(lanes, count)
    states[:partitions] = lanes
    return bits


@instruction
def rng(dst, engine=engine.vector, name=None) -> None:
    """32 random bits per element of ``dst`` (an integer tile), keeping the low bits its dtype holds; Vector
    Engine, or GpSimd (then ``dst`` must be in SBUF)."""
    label = "rng"
    dst = tile_operand(dst, "dst", label)
    on = chosen_engine(engine, "vector", ("vector", "gpsimd"), label)
    check_reaches(on, label, dst)
    if dst.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{label}: dst must be an integer type (int8/16/32, uint8/16/32), got {dst.dtype}")
    if dst.alloc.has_data:
        bits = random_bits(on, dst.partitions, dst.free_size)
        store_result(dst, bits.astype(np.dtype(f"u{dst.dtype.itemsize}")).view(dst.dtype))
    account(on, label, dst)


@instruction
def dropout(dst, data, prob, name=None) -> None:
    """Vector Engine: each element of ``data`` is replaced by 0 with probability ``prob`` (a number or a ``(P, 1)``
    tile), otherwise kept (no rescaling); ``dst`` has ``data``'s dtype; integer data needs an fp32 ``prob``."""
    label = "dropout"
    dst, data = tile_operand(dst, "dst", label), tile_operand(data, "data", label)
    check_same_shape(label, dst, "dst", data, "data")
    if dst.dtype != data.dtype:
        raise TypeError(f"{label}: dst must have data's dtype {data.dtype}, got {dst.dtype}")
    prob = scalar_operand(prob, data, label, "prob")
    if is_integer(data.dtype) and hasattr(prob, "dtype") and prob.dtype != float32:
        raise TypeError(f"{label}: with integer data, prob must be float32, got {prob.dtype}")
    if computes(dst, data, prob):
        uniform = random_bits("vector", data.partitions, data.free_size).astype(np.float64) / 2.0**32
        drop = uniform < np.asarray(as_f32(prob), np.float64)
        values = data.data.reshape(data.partitions, data.free_size)
        store_result(dst, np.where(drop, np.zeros((), data.dtype), values))
    account("vector", label, data, dst)


@instruction
def set_rng_seed(src_seeds, name=None) -> None:
    """Seed the Vector Engine's generator from a ``(1, 1)`` 32-bit tile in SBUF or PSUM."""
    label = "set_rng_seed"
    src = tile_operand(src_seeds, "src_seeds", label)
    if src.shape[0] != 1 or src.free_size != 1 or src.dtype.itemsize != 4:
        raise HardwareLimitError(f"{label}: src_seeds must be a (1, 1) 32-bit tensor, got {src.shape} {src.dtype}")
    if src.alloc.has_data:
        seed = int(src.data.reshape(-1).view(np.uint32)[0]) if src.dtype.kind != "f" else \
            int(np.float32(src.data.reshape(-1)[0]).view(np.uint32))
        current_core().accumulators.setdefault("prng:vector", {})["state"] = seeded_states(seed)
    account("vector", label, src)


def _state_tile(t, role: str, label: str, on: str):
    if on != "gpsimd":
        raise HardwareLimitError(f"{label}: on NeuronCore-v3 (Trn2) only the GpSimd Engine has per-lane PRNG states; "
                                 "engine=vector is NeuronCore-v4 (Trn3)")
    t = tile_operand(t, role, label, (Buffer.SBUF,))
    if t.dtype != uint32 or t.free_size != XORWOW_WORDS:
        raise HardwareLimitError(f"{label}: {role} must be uint32 with {XORWOW_WORDS} XORWOW words per partition, "
                                 f"got {t.shape} {t.dtype}")
    return t


@instruction
def rand_set_state(src_seeds, engine=engine.gpsimd, name=None) -> None:
    """Load GpSimd's per-lane XORWOW states from ``src_seeds (P, 6)`` uint32 in SBUF (lane p from partition p)."""
    label = "rand_set_state"
    src = _state_tile(src_seeds, "src_seeds", label, chosen_engine(engine, "gpsimd", ("vector", "gpsimd"), label))
    if src.alloc.has_data:
        states = _states("gpsimd")
        states[:src.partitions] = src.data.reshape(src.partitions, XORWOW_WORDS).astype(np.uint32)
    account("gpsimd", label, src)


@instruction
def rand_get_state(dst, engine=engine.gpsimd, name=None) -> None:
    """Store GpSimd's per-lane XORWOW states into ``dst (P, 6)`` uint32 in SBUF."""
    label = "rand_get_state"
    dst = _state_tile(dst, "dst", label, chosen_engine(engine, "gpsimd", ("vector", "gpsimd"), label))
    if dst.alloc.has_data:
        store_result(dst, _states("gpsimd")[:dst.partitions])
    account("gpsimd", label, dst)
