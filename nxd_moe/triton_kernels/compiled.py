"""The triton backend under ``torch.compile``: each step of the backend seam as one opaque custom op.

Under ``torch.compile`` (Dynamo tracing, see :meth:`~nxd_moe.triton_kernels.backend.TritonBackend`'s seam methods)
the backend does not launch its kernels itself: it calls one op of the ``nxd_moe`` library per seam step --
``triton_routing``, ``triton_local_routing``, ``triton_block_mapping``, ``triton_experts`` (the four algorithms),
``triton_router_top_k`` and ``triton_moe_decode`` (the one-launch decode of a whole layer) -- whose implementation
is the eager backend method, run when the compiled graph runs, and whose fake implementation gives the output shapes
at trace time.

Why opaque ops rather than letting Dynamo capture each ``kernel[grid](...)`` as a user-defined Triton kernel
(``torch._higher_order_ops.triton_kernel_wrap``, torch 2.11 and 2.13 alike):

- the launch helpers are Python that Dynamo cannot trace: launch configurations looked up by GPU name
  (``torch.cuda.get_device_name``, JSON tables), TMA descriptors built only for 16-byte aligned weights
  (``data_ptr()``), the one-launch decode's launch plans keyed on pointer alignment and the current stream, and its
  direct relaunch of the compiled kernel (``CompiledKernel.run``);
- the one-launch decode keeps state across launches by design: its counters are zeroed by the last program of
  the previous launch. Functionalization has no such notion: a kernel argument it sees written (and every argument,
  when its TTIR analysis fails: "assuming every input is mutated") is cloned before the launch unless Inductor
  proves the write can stay in place;
- Triton's interpreter (CPU) cannot be compiled into a graph; an op runs it like any other implementation.

An op keeps what CUDA-graph capture needs: its kernels are launched on the current stream with no host sync, so
``mode="reduce-overhead"`` (Inductor's CUDA-graph trees) records them inside the compiled graph, and replays serve
any routing as with :func:`nxd_moe.graphs.capture`. Inside an op no device tensor outlives the call
(:func:`~nxd_moe.triton_kernels.compiled_graph_call`). Everything around the ops (the router in torch, shared
experts, norms, masking) is compiled by Inductor as usual.

Non-tensor arguments are static: Python scalars and strings in the op schema, one integer per backend instance
(:func:`register`; the ops look its options and launch-configuration cache up), and the weights' storage formats
and activation as scalars (:func:`weights_arguments`, rebuilt by :func:`weights_from_arguments`).
"""

from __future__ import annotations

import functools
import itertools
import weakref

import torch

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.mlp import ExpertWeights, ExpertWeightsLayout
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.experts.token_mapping import BlockMapping
from nxd_moe.layer_parts import RouterParts, SharedParts
from nxd_moe.moe_configs import GLUType
from nxd_moe.quantization.activations import ActivationQuantization
from nxd_moe.quantization.formats import FORMATS
from nxd_moe.quantization.weight import WeightLayout
from nxd_moe.triton_kernels import compiled_graph_call
from nxd_moe.triton_kernels.routing_metadata import TileLayout, max_tiles

# ----------------------------------------------------------------------------------------------------------------
# backends by handle

_BACKENDS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def register(backend) -> int:
    """A new handle for ``backend`` (a ``TritonBackend``), by which the ops find it while it lives."""
    handle = next(_HANDLES)
    _BACKENDS[handle] = backend
    return handle


def _backend(handle: int):
    backend = _BACKENDS.get(handle)
    if backend is None:
        raise RuntimeError(f"nxd_moe triton op: backend handle {handle} belongs to no living TritonBackend (a compiled "
                           f"graph outlived the layer it was compiled from)")
    return backend


# ----------------------------------------------------------------------------------------------------------------
# weights as op arguments

# ExpertActivation's fields in the op schema (tests check that this names every field).
ACTIVATION_FIELDS = (("hidden_act", "str"), ("glu_mlp", "bool"), ("glu_type", "str"), ("scaling_factor", "float"),
                     ("act_bias", "float"), ("gate_lower", "float?"), ("gate_upper", "float?"), ("up_lower", "float?"),
                     ("up_upper", "float?"), ("intermediate_size", "int?"), ("intermediate_size_actual", "int?"),
                     ("gate_up_interleaved", "bool"))
_WEIGHTS_FIELDS = (["Tensor[] weights", "str gate_up_format", "ScalarType? gate_up_dtype", "str down_format",
                    "ScalarType? down_dtype", "bool has_gate_up_bias", "bool has_down_bias"]
                   + [f"{kind} {name}" for name, kind in ACTIVATION_FIELDS]
                   + ["bool w8a8", "int? activation_group_size"])
_WEIGHTS_SCHEMA = ", ".join(_WEIGHTS_FIELDS)


def _field(value, kind: str):
    if value is None:
        return None
    if kind.startswith("float"):
        return float(value)
    return value.value if isinstance(value, GLUType) else value


def _projection_arguments(layout: WeightLayout) -> tuple:
    return ("bf16", None) if layout.format is None else (layout.format.name, layout.dtype)


def weights_arguments(weights: ExpertWeights) -> tuple:
    """``weights`` as the tail of an op's arguments: its stored tensors (:meth:`ExpertWeights.flatten`), then the
    tensor-free rest as schema scalars. Traced by Dynamo: attribute reads only."""
    tensors, layout = weights.flatten()
    activation = layout.activation
    quantization = layout.activation_quantization
    return (tensors, *_projection_arguments(layout.gate_up_proj), *_projection_arguments(layout.down_proj),
            layout.has_gate_up_bias, layout.has_down_bias,
            *(_field(getattr(activation, name), kind) for name, kind in ACTIVATION_FIELDS),
            quantization is not None, None if quantization is None else quantization.group_size)


def _projection(name: str, dtype) -> WeightLayout:
    return WeightLayout(None, None, 1) if name == "bf16" else WeightLayout(FORMATS[name], dtype, 2)


@functools.lru_cache(maxsize=None)
def _layout(gate_up_format: str, gate_up_dtype, down_format: str, down_dtype, has_gate_up_bias: bool,
            has_down_bias: bool, *rest) -> ExpertWeightsLayout:
    *fields, w8a8, group_size = rest
    activation = dict(zip((name for name, _ in ACTIVATION_FIELDS), fields))
    activation["glu_type"] = GLUType(activation["glu_type"])
    return ExpertWeightsLayout(_projection(gate_up_format, gate_up_dtype), _projection(down_format, down_dtype),
                               has_gate_up_bias, has_down_bias, ExpertActivation(**activation),
                               ActivationQuantization(group_size) if w8a8 else None)


def weights_from_arguments(tensors, *statics) -> ExpertWeights:
    """The inverse of :func:`weights_arguments` (its static part rebuilt once per distinct value)."""
    return _layout(*statics).rebuild(tensors)


def _split_weights(args: tuple) -> tuple[tuple, ExpertWeights]:
    """An op's ``args`` without their weights tail, and the weights."""
    return args[:-len(_WEIGHTS_FIELDS)], weights_from_arguments(*args[-len(_WEIGHTS_FIELDS):])


def _op(name: str, schema: str, impl, fake):
    """Registers the ``nxd_moe::name`` custom op (exact strides: the kernels take the views they are given) and
    returns ``torch.ops.nxd_moe.name``, which is what the traced code calls."""
    op = torch.library.custom_op(f"nxd_moe::{name}", impl, mutates_args=(), schema=schema,
                                 tags=(torch.Tag.needs_exact_strides,))
    op.register_fake(fake)
    return getattr(torch.ops.nxd_moe, name)


def _in_graph(fn):
    """``fn`` with its launches marked as a compiled graph's (:func:`~nxd_moe.triton_kernels.compiled_graph_call`)."""
    @functools.wraps(fn)
    def wrapped(*args):
        with compiled_graph_call():
            return fn(*args)
    return wrapped


# ----------------------------------------------------------------------------------------------------------------
# routing: TritonBackend.build_routing


def _routing_impl(handle, expert_affinities, expert_index, padding_mask, num_experts, normalize):
    routing = _backend(handle).build_routing(expert_affinities, expert_index, num_experts, normalize, False,
                                             padding_mask)
    return routing.expert_mask, routing.affinities


def _routing_fake(handle, expert_affinities, expert_index, padding_mask, num_experts, normalize):
    shape = (expert_index.shape[0], num_experts)
    return expert_affinities.new_empty(shape, dtype=torch.bool), expert_affinities.new_empty(shape)


_routing_op = _op("triton_routing", "(int backend, Tensor expert_affinities, Tensor expert_index, "
                  "Tensor? padding_mask, int num_experts, bool normalize) -> (Tensor, Tensor)",
                  _in_graph(_routing_impl), _routing_fake)


def build_routing(backend, expert_affinities, expert_index, num_experts: int, normalize: bool, prescale: bool,
                  padding_mask) -> Routing:
    mask, affinities = _routing_op(backend.handle, expert_affinities, expert_index, padding_mask, num_experts,
                                   normalize)
    return Routing(expert_index, mask, affinities, prescale, padding_mask is not None)


# ----------------------------------------------------------------------------------------------------------------
# a module's pairs as a routing over its experts: TritonBackend.build_local_routing


def _local_routing_impl(handle, pair_expert, pair_weight, local_slot, num_local):
    routing = _backend(handle).build_local_routing(pair_expert, pair_weight, local_slot, num_local, False)
    return routing.expert_index, routing.expert_mask, routing.affinities


def _local_routing_fake(handle, pair_expert, pair_weight, local_slot, num_local):
    rows, top_k = pair_expert.shape
    return (pair_expert.new_empty((rows, min(top_k, num_local)), dtype=torch.int64),
            pair_expert.new_empty((rows, num_local), dtype=torch.bool), pair_weight.new_empty((rows, num_local)))


_local_routing_op = _op("triton_local_routing", "(int backend, Tensor pair_expert, Tensor pair_weight, "
                        "Tensor local_slot, int num_local) -> (Tensor, Tensor, Tensor)", _in_graph(_local_routing_impl),
                        _local_routing_fake)


def build_local_routing(backend, pair_expert, pair_weight, local_slot, num_local: int, prescale: bool) -> Routing:
    index, mask, affinities = _local_routing_op(backend.handle, pair_expert, pair_weight, local_slot, num_local)
    return Routing(index, mask, affinities, prescale, has_padding=True)


# ----------------------------------------------------------------------------------------------------------------
# block mapping: TritonBackend.block_mapping


def _mapping_impl(*args):
    (handle, expert_index, expert_mask, affinities, block_size, num_blocks), weights = _split_weights(args)
    routing = Routing(expert_index, expert_mask, affinities, False)
    mapping = _backend(handle).block_mapping(routing, weights, block_size, num_blocks, True)
    return [*mapping[:5], *mapping.tiles[:4]]


def _mapping_fake(*args):
    (handle, expert_index, expert_mask, affinities, block_size, num_blocks), weights = _split_weights(args)
    num_tokens, top_k = expert_index.shape
    num_experts = expert_mask.shape[1]
    block_m = _backend(handle)._config(affinities, weights, top_k)["block_m"]
    tiles = max_tiles(num_tokens * top_k, num_experts, block_m)
    i64, i32 = dict(dtype=torch.int64), dict(dtype=torch.int32)
    empty = expert_index.new_empty
    return [empty(num_blocks, **i64), empty(num_blocks * block_size, **i64), empty(num_blocks, **i32),
            empty((num_tokens, top_k), **i64), empty(num_experts, **i64),
            empty(tiles * block_m, **i64), empty(tiles, **i32), empty(1, **i32), empty((num_tokens, top_k), **i64)]


_mapping_op = _op("triton_block_mapping", "(int backend, Tensor expert_index, Tensor expert_mask, Tensor affinities, "
                  f"int block_size, int num_blocks, {_WEIGHTS_SCHEMA}) -> Tensor[]", _in_graph(_mapping_impl),
                  _mapping_fake)


def _mapping(tensors, block_size: int) -> BlockMapping:
    """A :class:`BlockMapping` with its tiles from the nine tensors ``_mapping_op`` returns."""
    row_token, tile_expert, num_tiles, pair_row = tensors[5:]
    tiles = TileLayout(row_token, tile_expert, num_tiles, pair_row, row_token.shape[0] // tile_expert.shape[0])
    return BlockMapping(*tensors[:5], block_size, tiles)


def block_mapping(backend, routing: Routing, weights: ExpertWeights, block_size: int, num_blocks: int) -> BlockMapping:
    tensors = _mapping_op(backend.handle, routing.expert_index, routing.expert_mask, routing.affinities, block_size,
                          num_blocks, *weights_arguments(weights))
    return _mapping(tensors, block_size)


# ----------------------------------------------------------------------------------------------------------------
# the four algorithms: TritonBackend.blockwise / capacity_factor / selective_loading / all_experts


def _experts_impl(*args):
    (handle, mode, x, expert_index, expert_mask, affinities, prescale, has_padding, addend, mapping, block_size,
     capacity), weights = _split_weights(args)
    backend = _backend(handle)
    routing = Routing(expert_index, expert_mask, affinities, prescale, has_padding)
    if mode == "blockwise":
        return [backend.blockwise(x, routing, _mapping(mapping, block_size), weights, None, addend)]
    if mode == "capacity_factor":
        return list(backend.capacity_factor(x, routing, capacity, weights, addend))
    return [getattr(backend, mode)(x, routing, weights, addend)]


def _experts_fake(*args):
    (handle, mode, x, *_), weights = _split_weights(args)
    out = x.new_empty((x.shape[0], weights.down_proj.shape[2]))
    return [out, x.new_empty((), dtype=torch.int64)] if mode == "capacity_factor" else [out]


_experts_op = _op("triton_experts", "(int backend, str mode, Tensor hidden_states, Tensor expert_index, "
                  "Tensor expert_mask, Tensor affinities, bool prescale, bool has_padding, Tensor? addend, "
                  f"Tensor[] mapping, int block_size, int capacity, {_WEIGHTS_SCHEMA}) -> Tensor[]",
                  _in_graph(_experts_impl), _experts_fake)


def experts(backend, mode: str, hidden_states, routing: Routing, weights: ExpertWeights, addend,
            mapping: BlockMapping | None = None, capacity: int = 0) -> list[torch.Tensor]:
    """``[output (T, H)]``, and for ``capacity_factor`` the dropped count after it."""
    mapping_tensors = [] if mapping is None else [*mapping[:5], *mapping.tiles[:4]]
    return _experts_op(backend.handle, mode, hidden_states, routing.expert_index, routing.expert_mask,
                       routing.affinities, routing.prescale, routing.has_padding, addend, mapping_tensors,
                       0 if mapping is None else mapping.block_size, capacity, *weights_arguments(weights))


# ----------------------------------------------------------------------------------------------------------------
# the fused router: TritonBackend.fused_router


def _router_impl(handle, hidden_states, weight, bias, top_k, sigmoid, act_over_topk):
    return _backend(handle).router_top_k(hidden_states, weight, bias, top_k, sigmoid, act_over_topk)


def _router_fake(handle, hidden_states, weight, bias, top_k, sigmoid, act_over_topk):
    logits = hidden_states.new_empty((hidden_states.shape[0], weight.shape[0]), dtype=torch.float32)
    return logits, torch.empty_like(logits), logits.new_empty((hidden_states.shape[0], top_k), dtype=torch.int64)


_router_op = _op("triton_router_top_k", "(int backend, Tensor hidden_states, Tensor weight, Tensor? bias, int top_k, "
                 "bool sigmoid, bool act_over_topk) -> (Tensor, Tensor, Tensor)", _in_graph(_router_impl),
                 _router_fake)


def router_top_k(backend, hidden_states, weight, bias, top_k: int, sigmoid: bool, act_over_topk: bool):
    return _router_op(backend.handle, hidden_states, weight, bias, top_k, sigmoid, act_over_topk)


# ----------------------------------------------------------------------------------------------------------------
# a whole decode layer in one launch: TritonBackend.fused_decode


def _decode_impl(*args):
    (handle, x, router_weight, router_bias, top_k, sigmoid, act_over_topk, normalize, padding_mask, prescale,
     shared_gate, shared_up, shared_down, shared_act), weights = _split_weights(args)
    router = RouterParts(router_weight, router_bias, top_k, sigmoid, act_over_topk, normalize, padding_mask)
    shared = None if shared_gate is None else SharedParts(shared_gate, shared_up, shared_down, shared_act)
    return _backend(handle).moe_decode(x, router, weights, prescale, shared)


def _decode_fake(*args):
    (handle, x, router_weight, router_bias, top_k, *_), _ = _split_weights(args)
    num_tokens = x.shape[0]
    return (torch.empty_like(x), x.new_empty((num_tokens, router_weight.shape[0]), dtype=torch.float32),
            x.new_empty((num_tokens, top_k), dtype=torch.int64))


_decode_op = _op("triton_moe_decode", "(int backend, Tensor hidden_states, Tensor router_weight, Tensor? router_bias, "
                 "int top_k, bool sigmoid, bool act_over_topk, bool normalize, Tensor? padding_mask, bool prescale, "
                 f"Tensor? shared_gate, Tensor? shared_up, Tensor? shared_down, str shared_act, {_WEIGHTS_SCHEMA}) "
                 "-> (Tensor, Tensor, Tensor)", _in_graph(_decode_impl), _decode_fake)


def moe_decode(backend, hidden_states, router: RouterParts, weights: ExpertWeights, prescale: bool,
               shared: SharedParts | None):
    if shared is None:
        shared = SharedParts(None, None, None, "")
    return _decode_op(backend.handle, hidden_states, router.weight, router.bias, router.top_k, router.sigmoid,
                      router.act_over_topk, router.normalize, router.padding, prescale, *shared,
                      *weights_arguments(weights))
