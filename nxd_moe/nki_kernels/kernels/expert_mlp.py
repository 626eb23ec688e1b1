"""One expert's MLP on chip, ``down(act(gate_up(x)))`` for up to ``B`` tokens whose rows are already in SBUF.

Layouts (partition dimension first; ``t`` hidden tiles, ``a`` intermediate tiles, ``j`` token tiles of 128):

- ``x   (128, NT, Hin)``       token-major rows, as gathered from HBM
- ``x_T (128, nHt, B)``        hidden-major: the *moving* operand of gate/up (tokens stream through the array)
- ``w_gu (128, nHt, G, Ic)``   the expert's gate/up weights, hidden on partitions (``G`` = 2 gate+up, 1 up only)
- ``h   (128, nIt, B)``        activations, intermediate on partitions: the *stationary* operand of down
- ``w_d (128, nIt, Hout)``     the expert's down weights, intermediate on partitions

Gate/up: ``psum (Isz, <=512 tokens) += w_gu[t].T @ x_T[t]`` over hidden tiles (contraction over H).
Down: ``psum (Tsz, <=512 of H) += h[a, tokens].T @ w_d[a]`` over intermediate tiles; the result is already
token-major, so no transpose is needed before the output scatter. This is the tiling of the NKI library's
``compute_one_block`` (reference section 1.4).

A :class:`MlpShard` says which hidden columns a core contracts over and produces, and which intermediate columns it
owns: the whole expert on one core, half of H (shard-on-H) or half of I (shard-on-I) with LNC2.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.moe_configs import GLUType
from nxd_moe.nki_kernels import isa as nisa
from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.hardware import PMAX, HardwareLimitError
from nxd_moe.nki_kernels.kernels.tiling import tiles
from nxd_moe.nki_kernels.tensor import NkiTensor
from nxd_moe.quantization.formats import QuantizationFormat, Shape, get_format

TOKEN_CHUNK = nl.tile_size.gemm_moving_fmax  # tokens per gate/up matmul (moving free size)
HIDDEN_CHUNK = nl.tile_size.psum_fmax  # hidden columns per down-projection matmul (one PSUM bank of fp32)
# SBUF bytes per partition one expert's weights may take; beyond it they stream through in intermediate chunks.
WEIGHT_SBUF_BUDGET = 96 * 1024


class ExpertAffinityScaleMode(enum.IntEnum):
    """Where the router affinity multiplies: the expert's output or its input (NKI's values; its NO_SCALE and
    PRE_SCALE_DELAYED are not implemented)."""

    POST_SCALE = 1
    PRE_SCALE = 2


@dataclass(frozen=True)
class MlpShard:
    """What one core computes of an expert MLP.

    ``hidden``: H. ``intermediate``: I as stored (the weights' last dim). ``h_in``: hidden columns contracted in
    gate/up; ``h_out``: hidden columns the down projection produces; ``i_range``: intermediate columns (within the
    first ``intermediate_size_actual``). ``glu``: gate and up projections (else up only).
    """

    hidden: int
    intermediate: int
    h_in: tuple[int, int]
    h_out: tuple[int, int]
    i_range: tuple[int, int]
    glu: bool

    @property
    def projections(self) -> int:
        return 2 if self.glu else 1

    @property
    def h_in_tiles(self) -> list[tuple[int, int]]:
        return tiles(*self.h_in, PMAX)

    @property
    def i_tiles(self) -> list[tuple[int, int]]:
        return tiles(*self.i_range, PMAX)

    @property
    def h_out_width(self) -> int:
        return self.h_out[1] - self.h_out[0]


@dataclass(frozen=True)
class QuantizedHbm:
    """An expert weight stored quantized in HBM: ``data (E, K / v, N)`` and ``scale`` as
    :mod:`nxd_moe.quantization.formats` lays them out, standing for the logical weight of ``shape`` in ``dtype``
    (the kernels' ``(E, H, G, I)`` gate/up or ``(E, I, H)`` down). :func:`load_weights` DMAs the stored bytes and
    dequantizes on chip."""

    data: NkiTensor
    scale: NkiTensor
    format: QuantizationFormat
    shape: tuple[int, ...]
    dtype: object

    @property
    def name(self) -> str:
        return self.data.name


def quantized_inputs(gate_up_proj_weight, down_proj_weight, gate_up_proj_scale, down_proj_scale, weight_format,
                     dtype, glu: bool):
    """The kernels' weight inputs as :class:`QuantizedHbm` when ``weight_format`` is quantized (NxD's
    ``gate_up_proj_scale`` / ``down_proj_scale`` arguments), else unchanged. Stored gate/up is ``(E, H/v, G*I)``."""
    fmt = get_format(weight_format, "weight_format")
    if not fmt.quantized:
        return gate_up_proj_weight, down_proj_weight
    for t, name in ((gate_up_proj_weight, "gate_up_proj_weight"), (down_proj_weight, "down_proj_weight"),
                    (gate_up_proj_scale, "gate_up_proj_scale"), (down_proj_scale, "down_proj_scale")):
        array_shape(t, name, 3)
    experts, packed_h, width = gate_up_proj_weight.shape
    hidden, projections = packed_h * fmt.values_per_byte, 2 if glu else 1
    inter = width // projections
    if gate_up_proj_weight.dtype.itemsize != 1 or down_proj_weight.dtype.itemsize != 1:
        raise TypeError(f"format {fmt.name!r}: gate_up_proj_weight / down_proj_weight must be stored 1-byte arrays, "
                        f"got {gate_up_proj_weight.dtype} / {down_proj_weight.dtype}")
    for data, scale, name, shape in (
            (gate_up_proj_weight, gate_up_proj_scale, "gate_up_proj", (experts, hidden, width)),
            (down_proj_weight, down_proj_scale, "down_proj", (experts, inter, hidden))):
        fmt.check_shape(Shape(*shape), name)
        expected = (fmt.weight_shape(Shape(*shape)), fmt.scale_shape(Shape(*shape)))
        if (data.shape, scale.shape) != expected:
            raise ValueError(f"{name}_weight / {name}_scale must be {expected[0]} / {expected[1]} for format "
                             f"{fmt.name!r}, got {data.shape} / {scale.shape}")
    return (QuantizedHbm(gate_up_proj_weight, gate_up_proj_scale, fmt, (experts, hidden, projections, inter), dtype),
            QuantizedHbm(down_proj_weight, down_proj_scale, fmt, (experts, inter, hidden), dtype))


def array_shape(t, name: str, dims: int) -> tuple[int, ...]:
    """The shape of kernel input ``t``, checked: an array (an HBM tensor inside the kernel) of ``dims`` dimensions."""
    if isinstance(t, QuantizedHbm) and len(t.shape) == dims:
        return t.shape
    if not isinstance(t, NkiTensor):
        raise TypeError(f"{name} must be an array (an HBM tensor inside the kernel), got {type(t).__name__}")
    if len(t.shape) != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {t.shape}")
    return t.shape


def check_expert_weights(gate_up_proj_weight, down_proj_weight, hidden: int,
                         activation: ExpertActivation) -> tuple[int, int, int]:
    """``(E, G, I)`` of a kernel's expert weights, checked against NKI's contract for hidden size ``hidden``:
    ``gate_up_proj_weight (E, H, G, I)`` with ``G`` 2 for a GLU MLP and 1 otherwise, ``down_proj_weight (E, I, H)``,
    and ``activation`` an :class:`~nxd_moe.experts.activation.ExpertActivation`."""
    if not isinstance(activation, ExpertActivation):
        raise TypeError(f"activation must be an ExpertActivation, got {type(activation).__name__}")
    experts, h, num_proj, inter = array_shape(gate_up_proj_weight, "gate_up_proj_weight", 4)
    if h != hidden or num_proj != (2 if activation.glu_mlp else 1):
        raise ValueError(f"gate_up_proj_weight must be (E, H={hidden}, {2 if activation.glu_mlp else 1}, I), got "
                         f"{gate_up_proj_weight.shape}")
    if down_proj_weight.shape != (experts, inter, hidden):
        raise ValueError(f"down_proj_weight must be (E, I, H) = {(experts, inter, hidden)}, got "
                         f"{down_proj_weight.shape}")
    return experts, num_proj, inter


def computed_intermediate(activation: ExpertActivation, intermediate: int) -> int:
    """How many of the ``intermediate`` columns stored the kernels compute: the first ``intermediate_size_actual``
    (all of them when it is unset; the rest is checkpoint padding)."""
    actual = activation.intermediate_size_actual
    return intermediate if actual is None else min(actual, intermediate)


def weight_chunks(shard: MlpShard, itemsize: int, budget: int | None = None) -> list[tuple[int, int]]:
    """The core's intermediate columns in pieces whose weights fit ``budget`` bytes per partition (default
    :data:`WEIGHT_SBUF_BUDGET`).

    One piece when the core's whole share fits: the weights stay resident, and weight skipping can reuse them for
    the next block. Otherwise 128-aligned pieces, loaded one after the other for every block (the NKI library's
    chunked path for large ``I``); nothing stays resident, so weight skipping has nothing to reuse.
    """
    per_column = len(shard.h_in_tiles) * shard.projections * itemsize  # gate/up: one column in each hidden tile
    per_tile = shard.h_out_width * itemsize  # down: one row of H per partition for every 128 columns

    def cost(width: int) -> int:
        return width * per_column + -(-width // PMAX) * per_tile

    budget = WEIGHT_SBUF_BUDGET if budget is None else budget
    i0, i1 = shard.i_range
    if cost(i1 - i0) <= budget:
        return [(i0, i1)]
    width = PMAX
    while cost(width + PMAX) <= budget:
        width += PMAX
    return tiles(i0, i1, width)


def allocate_weights(shard: MlpShard, dtype) -> tuple:
    """The SBUF buffers the expert's weights (or its largest chunk of them) are loaded into, allocated once: when
    the whole share fits they persist across blocks and weight skipping reuses them."""
    c0, c1 = weight_chunks(shard, dtype.itemsize)[0]
    w_gu = nl.ndarray((PMAX, len(shard.h_in_tiles), shard.projections, c1 - c0), dtype, name="gate_up_weights_sb")
    w_d = nl.ndarray((PMAX, -(-(c1 - c0) // PMAX), shard.h_out_width), dtype, name="down_weights_sb")
    return w_gu, w_d


def load_weights(w_gu, w_d, gate_up_proj_weight, down_proj_weight, expert, shard: MlpShard, oob_mode: str) -> None:
    """DMA expert ``expert``'s slice (``shard.i_range`` columns) into the buffers: one transfer per hidden tile of
    gate/up, one per intermediate tile of down. ``expert`` is an int (static) or an int32 ``(1, 1)`` tensor (a
    runtime ``scalar_offset``); an out-of-range runtime expert with ``oob_mode.skip`` skips the loads and leaves the
    buffers as they were. Quantized weights (:class:`QuantizedHbm`) move as stored, scales included, and are
    dequantized into the same buffers."""
    if isinstance(gate_up_proj_weight, QuantizedHbm):
        _load_quantized_weights(w_gu, w_d, gate_up_proj_weight, down_proj_weight, expert, shard, oob_mode)
        return
    num_proj, inter = shard.projections, shard.intermediate
    i0, i1 = shard.i_range
    for t, (h0, h1) in enumerate(shard.h_in_tiles):
        src = _expert_ap(gate_up_proj_weight, [[num_proj * inter, h1 - h0], [inter, num_proj], [1, i1 - i0]],
                         h0 * num_proj * inter + i0, expert)
        nisa.dma_copy(w_gu[:h1 - h0, t, :, :i1 - i0], src, oob_mode=oob_mode)
    o0, o1 = shard.h_out
    for a, (a0, a1) in enumerate(shard.i_tiles):
        src = _expert_ap(down_proj_weight, [[shard.hidden, a1 - a0], [1, o1 - o0]], a0 * shard.hidden + o0, expert)
        nisa.dma_copy(w_d[:a1 - a0, a], src, oob_mode=oob_mode)


def _load_quantized_weights(w_gu, w_d, gate_up: QuantizedHbm, down: QuantizedHbm, expert, shard: MlpShard,
                            oob_mode: str) -> None:
    """:func:`load_weights` for stored formats: per tile one DMA of the packed rows, one of their scale rows (per
    channel scales: once per projection, shared by every tile), then :func:`nisa.dequantize` into the buffer."""
    i0, i1 = shard.i_range
    for g in range(shard.projections):
        col0 = g * shard.intermediate + i0
        scale = _load_scale_rows(gate_up, 0, shard.hidden, col0, i1 - i0, expert, oob_mode)
        for t, (h0, h1) in enumerate(shard.h_in_tiles):
            _load_tile(w_gu[:h1 - h0, t, g, :i1 - i0], gate_up, h0, h1 - h0, col0, i1 - i0, expert, oob_mode, scale)
    o0, o1 = shard.h_out
    scale = _load_scale_rows(down, 0, shard.intermediate, o0, o1 - o0, expert, oob_mode)
    for a, (a0, a1) in enumerate(shard.i_tiles):
        _load_tile(w_d[:a1 - a0, a], down, a0, a1 - a0, o0, o1 - o0, expert, oob_mode, scale)


def _load_scale_rows(q: QuantizedHbm, row0: int, rows: int, col0: int, cols: int, expert, oob_mode: str,
                     per_channel_only: bool = True):
    """The scales of weight rows ``[row0, row0 + rows)`` and columns ``[col0, col0 + cols)`` in SBUF; None for
    block formats when ``per_channel_only`` (those load their scale rows with each tile)."""
    fmt = q.format
    if per_channel_only and fmt.block_k is not None:
        return None
    for what, start, size, block in (("row", row0, rows, fmt.block_k), ("column", col0, cols, fmt.block_n)):
        if block is not None and (start % block or size % block):
            raise HardwareLimitError(f"{q.name}: a tile's {what}s [{start}, {start + size}) must align with format "
                                     f"{fmt.name!r}'s blocks of {block} (choose sizes / shardings that keep them "
                                     "aligned)")
    width = q.scale.shape[2]
    srow0, srows = (0, 1) if fmt.block_k is None else (row0 // fmt.block_k, rows // fmt.block_k)
    scale = nl.ndarray((srows, cols // fmt.block_n), q.scale.dtype, name=f"{q.scale.name}_sb")
    nisa.dma_copy(scale, _expert_ap(q.scale, [[width, srows], [1, cols // fmt.block_n]],
                                    srow0 * width + col0 // fmt.block_n, expert), oob_mode=oob_mode)
    return scale


def _load_tile(dst, q: QuantizedHbm, row0: int, rows: int, col0: int, cols: int, expert, oob_mode: str,
               scale) -> None:
    if scale is None:
        scale = _load_scale_rows(q, row0, rows, col0, cols, expert, oob_mode, per_channel_only=False)
    per_byte, width = q.format.values_per_byte, q.data.shape[2]
    staged = nl.ndarray((rows // per_byte, cols), q.data.dtype, name=f"{q.data.name}_stored_sb")
    nisa.dma_copy(staged, _expert_ap(q.data, [[width, rows // per_byte], [1, cols]], row0 // per_byte * width + col0,
                                     expert), oob_mode=oob_mode)
    nisa.dequantize(dst, staged, scale, q.format)


def load_gate_up_bias(gate_and_up_proj_bias, expert, shard: MlpShard, dtype):
    """``(128, nIt, G)``: the expert's gate/up bias with intermediate on partitions (one value per partition)."""
    bias = nl.ndarray((PMAX, len(shard.i_tiles), shard.projections), dtype, name="gate_up_bias_sb")
    for a, (a0, a1) in enumerate(shard.i_tiles):
        for g in range(shard.projections):
            src = _expert_ap(gate_and_up_proj_bias, [[1, a1 - a0], [1, 1]], g * shard.intermediate + a0, expert)
            nisa.dma_copy(bias[:a1 - a0, a, g:g + 1], src)
    return bias


def load_down_bias(down_proj_bias, expert, shard: MlpShard, dtype, partitions: int = PMAX):
    """``(partitions, Hout)``: the expert's down bias on every partition (a stride-0 DMA broadcast)."""
    o0, o1 = shard.h_out
    bias = nl.ndarray((partitions, o1 - o0), dtype, name="down_bias_sb")
    nisa.dma_copy(bias, _expert_ap(down_proj_bias, [[0, partitions], [1, o1 - o0]], o0, expert))
    return bias


def _expert_ap(tensor, pattern, offset: int, expert):
    """An access pattern into expert ``expert``'s slice of ``tensor`` (experts on dim 0)."""
    if isinstance(expert, int):
        stride = 1
        for n in tensor.shape[1:]:
            stride *= n
        return tensor.ap(pattern, offset=offset + expert * stride)
    return tensor.ap(pattern, offset=offset, scalar_offset=expert, indirect_dim=0)


def transpose_tokens(x, num_tokens: int, shard: MlpShard, dtype):
    """``x (128, NT, Hin)`` token-major -> ``x_T (128, nHt, B)`` hidden-major, on the Tensor Engine: 128x128 pieces
    into one PSUM bank (up to 512 tokens), then one copy per bank back to SBUF."""
    h_tiles = shard.h_in_tiles
    chunks = tiles(0, num_tokens, TOKEN_CHUNK)
    x_t = nl.ndarray((PMAX, len(h_tiles), num_tokens), dtype, name="hidden_T_sb")
    for t in nl.affine_range(len(h_tiles)):
        h0, h1 = h_tiles[t]
        for c in nl.affine_range(len(chunks)):
            c0, c1 = chunks[c]
            ps = nl.ndarray((h1 - h0, c1 - c0), nl.float32, buffer=nl.psum, name="transpose_psum")
            x0, x1 = h0 - shard.h_in[0], h1 - shard.h_in[0]
            for j0, j1 in tiles(c0, c1, PMAX):
                nisa.nc_transpose(ps[:, j0 - c0:j1 - c0], x[:j1 - j0, j0 // PMAX, x0:x1])
            nisa.tensor_copy(x_t[:h1 - h0, t, c0:c1], ps)
    return x_t


def gate_up_activation(x_t, w_gu, num_tokens: int, shard: MlpShard, activation: ExpertActivation, bias, dtype,
                       sum_across_cores: bool = False):
    """``h (128, nIt, B) = act(x @ W_gu + b)`` in the compute dtype, with GLU / SwiGLU, scaling, clamps and
    ``hidden_act_bias`` as :class:`~nxd_moe.experts.activation.ExpertActivation` defines them.

    ``sum_across_cores``: each core contracted only its hidden columns, so the fp32 partial sums are exchanged with
    ``sendrecv`` and added (the all-reduce of shard-on-H) before anything non-linear.
    """
    act = nl.ACTIVATION_FUNCTIONS[activation.hidden_act]
    i_tiles, chunks = shard.i_tiles, tiles(0, num_tokens, TOKEN_CHUNK)
    h = nl.ndarray((PMAX, len(i_tiles), num_tokens), dtype, name="intermediate_sb")
    for a in nl.affine_range(len(i_tiles)):
        a0, a1 = i_tiles[a]
        isz = a1 - a0
        col = a0 - shard.i_range[0]
        for c in nl.affine_range(len(chunks)):
            c0, c1 = chunks[c]
            projected = []
            for g in range(shard.projections):
                ps = nl.ndarray((isz, c1 - c0), nl.float32, buffer=nl.psum, name="gate_up_psum")
                for t, (h0, h1) in enumerate(shard.h_in_tiles):
                    nisa.nc_matmul(ps, w_gu[:h1 - h0, t, g, col:col + isz], x_t[:h1 - h0, t, c0:c1])
                if sum_across_cores:
                    ps = _sum_with_peer(ps, pipe_id=g)
                projected.append(ps)
            g_bias = None if bias is None else [bias[:isz, a, g:g + 1] for g in range(shard.projections)]
            out = h[:isz, a, c0:c1]
            if shard.glu:
                _glu(out, projected[0], projected[1], activation, act, g_bias)
            else:
                nisa.activation(out, act, projected[0], bias=None if g_bias is None else g_bias[0])
    return h


def _sum_with_peer(partial, pipe_id: int):
    """All-reduce of an fp32 PSUM partial between the two cores: evacuate, exchange, add."""
    mine = nl.ndarray(partial.shape, nl.float32, name="partial_sb")
    theirs = nl.ndarray(partial.shape, nl.float32, name="peer_partial_sb")
    nisa.tensor_copy(mine, partial)
    peer = 1 - nl.program_id(0)
    nisa.sendrecv(src=mine, dst=theirs, send_to_rank=peer, recv_from_rank=peer, pipe_id=pipe_id)
    nisa.tensor_tensor(mine, mine, theirs, nl.add)
    return mine


def _glu(out, gate, up, activation: ExpertActivation, act, bias) -> None:
    shape = gate.shape
    gate = _affine_clamp(gate, None if bias is None else bias[0], 0.0, activation.gate_lower, activation.gate_upper,
                         "gate_sb")
    up = _affine_clamp(up, None if bias is None else bias[1], activation.act_bias, activation.up_lower,
                       activation.up_upper, "up_sb")
    gated = nl.ndarray(shape, nl.float32, name="activated_sb")
    nisa.activation(gated, act, gate, scale=activation.scaling_factor)
    if activation.glu_type is GLUType.SWIGLU:
        nisa.tensor_tensor(gated, gated, gate, nl.multiply)
    nisa.tensor_tensor(out, gated, up, nl.multiply)


def _affine_clamp(src, bias, shift: float, lower: float | None, upper: float | None, name: str):
    """``clamp(src + bias) + shift`` in fp32 SBUF, two operations per ``tensor_scalar`` (``src`` itself if none)."""
    steps = []
    if bias is not None:
        steps.append((nl.add, bias))
    if lower is not None:
        steps.append((nl.maximum, lower))
    if upper is not None:
        steps.append((nl.minimum, upper))
    if shift != 0.0:
        steps.append((nl.add, shift))
    if not steps:
        return src
    dst = nl.ndarray(src.shape, nl.float32, name=name)
    current = src
    for i in range(0, len(steps), 2):
        (op0, operand0), *rest = steps[i:i + 2]
        op1, operand1 = rest[0] if rest else (None, None)
        nisa.tensor_scalar(dst, current, op0, operand0, op1=op1, operand1=operand1)
        current = dst
    return dst


def down_projection(h, w_d, token0: int, num_tokens: int, col0: int, col1: int, shard: MlpShard):
    """``psum (num_tokens, col1-col0) = h[:, tokens].T @ w_d[:, cols]`` summed over intermediate tiles: one PSUM
    bank of the token-major output (``num_tokens <= 128``, ``col1 - col0 <= 512``)."""
    ps = nl.ndarray((num_tokens, col1 - col0), nl.float32, buffer=nl.psum, name="down_psum")
    for a, (a0, a1) in enumerate(shard.i_tiles):
        nisa.nc_matmul(ps, h[:a1 - a0, a, token0:token0 + num_tokens], w_d[:a1 - a0, a, col0:col1])
    return ps
