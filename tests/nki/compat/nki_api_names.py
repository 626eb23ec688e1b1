"""The inventory of the public NKI API this simulator serves, per module, for ``test_compat_api_names.py`` and the
table in docs/nki.md.

Source: the NKI API reference of Neuron 2.32 -- the public modules ``nki``, ``nki.isa``, ``nki.language`` and
``nki.collectives`` as listed in aws-neuron-sdk's ``nki/api/*.rst`` and their API stubs ``nki/api/nki/**/__init__.py``
(every public name, in the reference's order, and the methods of its ``NkiTensor``) -- plus the names of the other
``nki.*`` modules that nki-library (d2ad3a5) imports: its harness (``test/utils/simulation_setup.py``,
``kernel_tracer.py``) and kernels (``nki.typing``, ``nki.isa.constants``, ``nki.dtype``, ``nki.compiler.frontend``,
``nl.tensor`` / ``nl.bool`` / ``nl.par_dim``).

Status of a name: ``SIM`` runs on the simulator; ``TRN3`` is a NeuronCore-v4 (Trn3) instruction -- the simulated
target is Trn2 -- and raises ``Trn3OnlyError`` when called; ``MULTI_RANK`` is a collective between ranks, which the
one-logical-core simulator does not model, and raises ``CollectivesNotSimulatedError`` when called.
"""

from __future__ import annotations

SIM, TRN3, MULTI_RANK = "sim", "trn3", "multi_rank"

DOCUMENTED: dict[str, tuple[str, ...]] = {
    "nki": ("jit", "simulate"),
    "nki.isa": (
        "tensor_engine", "vector_engine", "scalar_engine", "gpsimd_engine", "unknown_engine", "engine", "reduce_cmd",
        "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version", "dma_engine", "NkiInstruction", "NkiValidationError",
        "VirtualRegister", "get_nc_sub_version", "get_nc_version", "dma_copy", "tensor_copy", "memset",
        "tensor_copy_predicated", "nc_matmul", "nc_matmul_mx", "nc_transpose", "dma_transpose", "tensor_tensor",
        "tensor_scalar", "tensor_reduce", "tensor_partition_reduce", "tensor_scalar_cumulative", "activation",
        "activation_reduce", "activate2", "iota", "affine_select", "local_gather", "nc_n_gather", "bn_stats",
        "bn_aggr", "tensor_tensor_scan", "nc_stream_shuffle", "rng", "dropout", "set_rng_seed", "rand_set_state",
        "rand_get_state", "rand2", "exponential", "reciprocal", "max8", "sequence_bounds", "scalar_tensor_tensor",
        "tensor_scalar_reduce", "core_barrier", "dma_compute", "quantize_mx", "range_select", "select_reduce",
        "sendrecv", "register_alloc", "register_move", "register_load", "register_store", "nc_find_index8",
        "nc_match_replace8", "nonzero_with_count", "topk",
    ),
    "nki.language": (
        "DType", "bool_", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32", "bfloat16",
        "tfloat32", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e5m2_x4", "float8_e4m3fn_x4",
        "float8_e8m0fnu", "float4_e2m1fn_x4", "sbuf", "psum", "hbm", "private_hbm", "shared_hbm", "tile_size",
        "average", "prelu", "bypass", "MemoryRegion", "NKIObject", "NkiTensor", "is_hbm", "is_on_chip", "is_psum",
        "is_sbuf", "add", "subtract", "multiply", "divide", "maximum", "minimum", "abs_max", "abs_min", "abs",
        "square", "power", "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "bitwise_and",
        "bitwise_or", "bitwise_xor", "invert", "left_shift", "right_shift", "logical_and", "logical_or",
        "logical_xor", "logical_not", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu",
        "gelu_apprx_sigmoid", "gelu_apprx_tanh", "gelu_dx", "gelu_apprx_sigmoid_dx", "silu", "silu_dx", "softplus",
        "mish", "erf", "erf_dx", "reciprocal", "copy", "sin", "cos", "tan", "arctan", "ceil", "floor", "trunc",
        "negative", "sign", "fmod", "mod", "sum", "max", "min", "mean", "prod", "var", "all", "softmax", "rms_norm",
        "where", "dropout", "ones", "full", "zeros_like", "empty_like", "random_seed", "expand_dims",
        "broadcast_to", "transpose", "matmul", "no_reorder", "load_transpose2d", "gather_flattened", "ds",
        "affine_range", "sequential_range", "static_range", "dynamic_range", "fori_loop", "while_loop", "ndarray",
        "zeros", "load", "store", "program_id", "num_programs", "program_ndim", "shared_constant",
        "shared_identity_matrix", "device_print", "rand",
    ),
    "nki.collectives": (
        "ReplicaGroup", "all_reduce", "all_gather", "all_gather_v", "reduce_scatter", "all_to_all", "all_to_all_v",
        "collective_permute", "collective_permute_implicit", "collective_permute_implicit_reduce",
        "collective_permute_implicit_current_processing_rank_id", "rank_id",
    ),
}

# The methods and attributes of the reference's nl.NkiTensor class (its view operations).
TENSOR_METHODS = (
    "is_contiguous", "get_pattern", "is_indirect", "permute", "broadcast", "expand_dim", "squeeze_dim", "reshape_dim",
    "flatten_dims", "reshape", "rearrange", "slice", "select", "vector_select", "ap", "view", "indirect", "shape",
    "strides", "offset", "name", "dtype", "buffer", "ndim", "size",
)

# Names outside the reference that nki-library's harness and kernels use.
USED_BY_NKI_LIBRARY: dict[str, tuple[str, ...]] = {
    "nki": ("cpu_simulate", "simulate_kernel"),
    "nki.language": ("tensor", "bool", "par_dim"),
    "nki.isa.constants": ("oob_mode", "dge_mode", "engine", "nc_version", "reduce_cmd", "matmul_perf_mode",
                          "dma_engine"),
    "nki.typing": ("tensor", "mutable_tensor"),
    "nki.dtype": ("bfloat16", "float16", "float32", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "int8", "int32",
                  "uint8"),
    "nki.compiler.frontend": ("ParserFrontend", "NKIFrontend"),
}

TRN3_ONLY = ("nc_matmul_mx", "quantize_mx", "activate2", "exponential", "rand2", "NkiTensor.indirect")
MULTI_RANK_ONLY = tuple(n for n in DOCUMENTED["nki.collectives"] if n not in ("ReplicaGroup", "rank_id"))


def status(module: str, name: str) -> str:
    if module in ("nki.isa", "nki.language") and name in TRN3_ONLY:
        return TRN3
    if module == "nki.collectives" and name in MULTI_RANK_ONLY:
        return MULTI_RANK
    return SIM


def inventory() -> list[tuple[str, str, str]]:
    """``(module, name, status)`` for every listed name."""
    rows = []
    for table in (DOCUMENTED, {"nki.language": tuple(f"NkiTensor.{m}" for m in TENSOR_METHODS)},
                  USED_BY_NKI_LIBRARY):
        for module, names in table.items():
            rows += [(module, name, status(module, name)) for name in names]
    return rows
