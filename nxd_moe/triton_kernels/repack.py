"""Quantized expert weights rearranged, once, into the order the decode GEMMs' tensor-core operands take them.

Decode multiplies a few token rows by whole weight matrices, so the kernels swap the operands: the weight's
output columns are the MMA's rows (Hopper's ``wgmma`` needs 64 of them; the tokens are its 16 columns) and the
dequantized weight is its register operand -- no trip through shared memory after the dequantization. A thread
of that operand holds, for each 16-deep step along K, rows ``g`` and ``g + 8`` of its warp's 16 and the K pairs
``2t, 2t+1`` and ``2t+8, 2t+9`` (``g = lane // 4``, ``t = lane % 4``). The stored layouts put those values far
apart (MxFP4: one byte per K pair, ``t`` and ``t + 4`` four bytes apart; FP8 stored N-fastest: a column apart),
so a thread would load them a byte or two at a time. Rearranged here, a thread's values for 64 consecutive K of
its rows are 16 contiguous bytes: one 16-byte load, already in operand order.

**MxFP4** (``(E, K/2, N)`` packed, ``(E, K/32, N)`` E8M0): per pair of rows ``(n, n + 8)`` (``n % 16 < 8``) and
64-deep K chunk ``c``, 64 bytes: thread ``t``'s 16 at byte ``16 t``, as four 32-bit words ``j = 0..3`` (K step
``16 j`` of the chunk). Word ``j`` holds eight E2M1 codes -- rows ``n`` and ``n + 8`` at ``k = 64c + 16j + 2t +
{0, 1}`` and ``+ 8`` -- with each code's bits placed where the kernel's bit operations move them into bf16 fields
(:data:`MX_CODE_BITS`: four shifts and masks give the four register pairs of the operand). The chunk's four E8M0
scales (rows ``n``, ``n + 8`` of its two 32-deep groups) form one int32 next to it in a ``(E, N/2, K'/64)``
tensor. K is padded to a multiple of 64 with zero codes; ``N`` is a multiple of 32 (the format's block), so row
pairs never straddle the gate / up halves.

**FP8** (``(E, K, N)`` N-fastest): ``(E, N, K')`` bytes, K-fastest, each 64-deep chunk of a row ordered so that
thread ``t``'s 16 values (``k = 16j + 8h + 2t + b``) are contiguous; scales unchanged.

Repacked weights are a derived copy -- the stored tensors stay as they are, so every backend and the state dict see
the checkpoint's bytes -- made the first time a decode needs them and cached (:func:`repacked`) per stored tensor,
invalidated when that tensor is written (its version counter) and dropped when it is freed. The copy costs as much
GPU memory as the stored weights again (the stored layout is still what the prefill kernels read).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from nxd_moe.quantization.formats import QuantizationFormat, Shape
from nxd_moe.quantization.weight import QuantizedWeight
from nxd_moe.triton_kernels import in_compiled_graph_call

CHUNK = 64  # K values per thread run of the operand (4 threads x 16 values)
# Where each code's bits (sign, exponent high, exponent low, mantissa) sit in a 32-bit word, for the four
# register pairs the kernel extracts (rows n / n + 8, K pair t / t + 4) -- low 16-bit half; the high half (K + 1)
# is 16 bits up. Pair i = 0..2 comes out as (word << 3i) & 0x81C081C0, pair 3 from bits 10, 11, 13, 14.
MX_CODE_BITS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (11, 14, 13, 10))
# Kernel codes of the repacked formats (grouped_gemm.FORMAT_CODES has the stored ones).
REPACKED_CODES = {"mxfp4": 4, "fp8": 5, "fp8_block": 6}


class RepackedWeight(NamedTuple):
    """A projection's weights in the operand order of the swapped decode GEMMs (see the module docstring).

    ``format`` is the stored format (its name is what ``ExpertWeights.format`` reports); ``weight``/``scale`` the
    repacked tensors; ``shape`` the logical ``(E, K, N)``; ``code`` the kernels' FORMAT."""

    format: QuantizationFormat
    weight: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    shape: Shape
    code: int


def _padded(k: int) -> int:
    return -(-k // CHUNK) * CHUNK


def _by_experts(fn, *tensors, values_per_step: int = 1 << 24):
    """``fn`` over slices of a few experts at a time, results concatenated along the expert dim: the repack's
    integer temporaries stay a few hundred MB whatever the layer's size (DeepSeek-V3's experts are 22 GB in bf16)."""
    e = tensors[0].shape[0]
    per_expert = tensors[0][0].numel()
    step = max(1, values_per_step // max(per_expert, 1))
    parts = [fn(*(t[i:i + step] for t in tensors)) for i in range(0, e, step)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(column) for column in zip(*parts))
    return torch.cat(parts)


def repack_mxfp4(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight (E, K/2, N)`` uint8 (any strides), ``scale (E, K/32, N)`` uint8 -> ``(values (E, N/2, K') uint8,
    scales (E, N/2, K'/64) int32)``, ``K'`` = K rounded up to 64 (zero codes, scale bytes 127)."""
    if weight.shape[2] % 16:
        raise ValueError(f"repack_mxfp4: N must be a multiple of 16 (rows pair up as n, n + 8), got {weight.shape[2]}")
    return _by_experts(_repack_mxfp4, weight, scale)


def _repack_mxfp4(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e, half_k, n = weight.shape
    k = 2 * half_k
    kp = _padded(k)
    codes = torch.stack([weight & 0x0F, weight >> 4], dim=2).reshape(e, k, n)
    codes = torch.nn.functional.pad(codes, (0, 0, 0, kp - k))
    # k = 64c + 16j + 8 kh + 2t + b ; n = 16a + 8r + g
    codes = codes.reshape(e, kp // CHUNK, 4, 2, 4, 2, n // 16, 2, 8)  # e c j kh t b a r g
    codes = codes.permute(0, 6, 8, 1, 4, 2, 7, 3, 5).contiguous()  # e a g c t j r kh b
    word = torch.zeros(codes.shape[:6], dtype=torch.int64, device=weight.device)
    for r in range(2):
        for kh in range(2):
            places = MX_CODE_BITS[2 * r + kh]
            for b in range(2):
                code = codes[..., r, kh, b].to(torch.int64)
                for bit, place in zip((3, 2, 1, 0), places):
                    word |= ((code >> bit) & 1) << (place + 16 * b)
    values = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)
    values = values.reshape(e, n // 2, kp)  # (a, g) -> n/2 ; (c, t, j, byte) -> K'
    groups = torch.nn.functional.pad(scale.to(torch.int64), (0, 0, 0, kp // 32 - k // 32), value=127)
    groups = groups.reshape(e, kp // CHUNK, 2, n // 16, 2, 8).permute(0, 3, 5, 1, 2, 4)  # e a g c gi r
    words = sum(groups[..., gi, r] << (8 * (2 * gi + r)) for gi in range(2) for r in range(2))
    return values.contiguous(), words.reshape(e, n // 2, kp // CHUNK).to(torch.int32).contiguous()


def unpack_mxfp4(values: torch.Tensor, scales: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`repack_mxfp4`: the stored ``(weight (E, K/2, N), scale (E, K/32, N))`` (N-fastest)."""
    e, half_n, kp = values.shape
    n = 2 * half_n
    word = values.to(torch.int64).reshape(e, n // 16, 8, kp // CHUNK, 4, 4, 4)  # e a g c t j byte
    word = sum(word[..., i] << (8 * i) for i in range(4))  # e a g c t j
    codes = torch.zeros(*word.shape, 2, 2, 2, dtype=torch.int64, device=values.device)  # ... r kh b
    for r in range(2):
        for kh in range(2):
            for b in range(2):
                for bit, place in zip((3, 2, 1, 0), MX_CODE_BITS[2 * r + kh]):
                    codes[..., r, kh, b] |= ((word >> (place + 16 * b)) & 1) << bit
    codes = codes.permute(0, 3, 5, 7, 4, 8, 1, 6, 2).reshape(e, kp, n)[:, :k]  # e c j kh t b a r g
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    s = scales.to(torch.int64).reshape(e, n // 16, 8, kp // CHUNK)  # e a g c
    s = torch.stack([(s >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(e, n // 16, 8, kp // CHUNK, 2, 2)
    s = s.permute(0, 3, 4, 1, 5, 2).reshape(e, kp // 32, n)[:, :k // 32]  # e c gi a r g
    return packed, s.to(torch.uint8)


def repack_fp8(weight: torch.Tensor) -> torch.Tensor:
    """``weight (E, K, N)`` float8 -> ``(E, N, K')`` bytes (uint8), each 64-deep chunk of a row in operand order
    (K padded with zeros to a multiple of 64)."""
    return _by_experts(_repack_fp8, weight)


def _repack_fp8(weight: torch.Tensor) -> torch.Tensor:
    e, k, n = weight.shape
    kp = _padded(k)
    b = torch.nn.functional.pad(weight.view(torch.uint8).transpose(1, 2), (0, kp - k))  # (E, N, K')
    b = b.reshape(e, n, kp // CHUNK, 4, 2, 4, 2)  # k = 64c + 16j + 8h + 2t + b
    return b.permute(0, 1, 2, 5, 3, 4, 6).reshape(e, n, kp).contiguous()  # position 16t + 4j + 2h + b


def unpack_fp8(values: torch.Tensor, k: int, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """The inverse of :func:`repack_fp8`: ``(E, K, N)`` float8, N-fastest."""
    e, n, kp = values.shape
    b = values.reshape(e, n, kp // CHUNK, 4, 4, 2, 2).permute(0, 1, 2, 4, 5, 3, 6).reshape(e, n, kp)
    return b[:, :, :k].transpose(1, 2).contiguous().view(dtype)


def _build(weight: QuantizedWeight) -> RepackedWeight:
    name = weight.format.name
    if name == "mxfp4":
        values, scales = repack_mxfp4(weight.weight, weight.scale)
    else:
        values, scales = repack_fp8(weight.weight), weight.scale
    return RepackedWeight(weight.format, values, scales, weight.dtype, weight.shape, REPACKED_CODES[name])


# id(stored weight tensor) -> (weakref to it, version key, repacked copy)
_CACHE: dict[int, tuple[weakref.ref, tuple, RepackedWeight]] = {}


def _version(weight: QuantizedWeight) -> tuple:
    w, s = weight.weight, weight.scale
    return (w._version, s._version, w.data_ptr(), s.data_ptr(), tuple(w.stride()), weight.dtype)


def repacked(weight: QuantizedWeight) -> RepackedWeight | None:
    """``weight``'s repacked copy, built on first use and cached until the stored tensors are written or freed.

    None when it is not cached and the current stream is capturing a CUDA graph (building it there would record
    the repack into the graph, and redo it on every replay) or the call is an op of a ``torch.compile``'d graph
    (whose memory is the graph's, :func:`~nxd_moe.triton_kernels.compiled_graph_call`): the caller then reads the
    stored layout instead -- same result, slower decode. One eager decode call before capturing or compiling (as
    CUDA-graph warm-up does) builds it."""
    key = id(weight.weight)
    entry = _CACHE.get(key)
    version = _version(weight)
    if entry is not None and entry[0]() is weight.weight and entry[1] == version:
        return entry[2]
    if in_compiled_graph_call() or (weight.weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    built = _build(weight)
    if entry is None or entry[0]() is not weight.weight:
        weakref.finalize(weight.weight, _CACHE.pop, key, None)
    _CACHE[key] = (weakref.ref(weight.weight), version, built)
    return built
