"""nxd_moe's expert algorithms behind transformers' experts interface.

transformers 5 runs every experts module decorated with ``use_experts_implementation`` (Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V3, GPT-OSS, ...) through a function it looks up by name in ``ExpertsInterface`` on every call:
``fn(module, hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``, the weighted sum over
``k`` of each token's experts. The router, shared experts and reshapes stay in the model's block. ``import
nxd_moe.hf`` registers three names:

- ``"nxd_moe"``: the triton backend for CUDA tensors when Triton imports (fp32 / bf16 / fp16), the torch backend
  otherwise -- there, wherever ``grouped_mm`` takes the dtype (a CPU), with the ``T*k`` pairs sorted by expert at
  every ``T``, transformers' own algorithm (:meth:`~nxd_moe.experts.backends.TorchBackend.pairs_cheapest`: NxD's
  Trainium rules pad to 512-row blocks and compute all experts at decode, which eager matmuls pay in full);
- ``"nxd_moe_torch"``, ``"nxd_moe_triton"``: that backend always, with its own mode rules (the torch backend's
  are NxD's).

The function reads the module's own weight tensors on every call (views, never copies: ``is_transposed=False``
weights are used through a transposed view), so switching costs no memory. The algorithm comes from ``T`` alone
(the function cannot tell decode from prefill; a decode step of ``B`` sequences is ``T = B``):
:meth:`~nxd_moe.experts.backends.ExpertsBackend.select_mode_from_tokens`. What a module needs -- layout flags,
activation, gate -- is derived once (:class:`ExpertsLayout`, kept on the module; no tensors) and anything this
package cannot compute exactly is refused with :class:`UnsupportedExpertsError`: transformers has no hook to refuse
it when the implementation is set, so :func:`check_experts_support` does it for a whole model
(:func:`set_experts_implementation` calls it first), and otherwise the first call does.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from nxd_moe.activations import ACT2FN
from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.backends import ExpertsBackend, TorchBackend, get_backend
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.mode import ExpertsMode
from nxd_moe.experts.pairs import experts_forward_pairs
from nxd_moe.moe_configs import DEFAULT_SELECTIVE_LOADING_THRESHOLD, BlockwiseMatmulConfig, GLUType

# NxD's defaults: blockwise from T*k >= 512 assignments, selective loading while T*k < E.
BLOCKWISE_MATMUL_CONFIG = BlockwiseMatmulConfig()
_LAYOUT = "_nxd_moe_experts_layout"
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class UnsupportedExpertsError(ValueError):
    """An experts module (or model) that nxd_moe's experts implementations cannot compute exactly."""


@dataclass(frozen=True)
class ExpertsLayout:
    """A transformers experts module in nxd_moe's terms: which projection comes first (``"gate_up_proj"``, or
    ``"up_proj"`` without a gate), whether the weights are stored ``(E, H, 2I)`` / ``(E, I, H)`` already
    (``transposed``), biases, the expert count and the activation (GLU / GPT-OSS's clamped SwiGLU, interleaved
    gate/up columns included)."""

    first_proj: str
    transposed: bool
    has_bias: bool
    num_experts: int
    activation: ExpertActivation
    # A transformers release without the ``_is_expert_parallel`` flag (5.17 has none): ids >= E are sentinels always.
    sentinels_always: bool = False
    # ``arange(E)`` per device: every expert is local (the routing of pairs takes a global -> local table).
    local_slots: dict = field(default_factory=dict, compare=False, repr=False)

    def weights(self, module: nn.Module) -> ExpertWeights:
        """The module's weights in NxD's layout: its own tensors, or transposed views of them."""
        first, down = getattr(module, self.first_proj), module.down_proj
        if not self.transposed:
            first, down = first.transpose(1, 2), down.transpose(1, 2)
        if not self.has_bias:
            return ExpertWeights(first, down, None, None, self.activation)
        return ExpertWeights(first, down, getattr(module, self.first_proj + "_bias"), module.down_proj_bias,
                             self.activation)

    def local_slot(self, device: torch.device) -> torch.Tensor:
        slot = self.local_slots.get(device)
        if slot is None:
            slot = self.local_slots[device] = torch.arange(self.num_experts, device=device)
        return slot


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` dispatches through transformers' experts interface: its class is decorated with
    ``use_experts_implementation``, which gives the class a ``_apply_gate`` and the instance its layout flags (of
    which every transformers 5 release sets ``is_transposed``; later flags are read with the decorator's
    defaults where absent)."""
    return callable(getattr(type(module), "_apply_gate", None)) and hasattr(module, "is_transposed")


def experts_layout(module: nn.Module, where: str | None = None) -> ExpertsLayout:
    """The :class:`ExpertsLayout` of a decorated experts module, or :class:`UnsupportedExpertsError` naming what
    cannot be served (``where``: the module's path, for the message)."""
    name = f"{where} ({type(module).__name__})" if where else type(module).__name__

    def refuse(what: str):
        raise UnsupportedExpertsError(f"nxd_moe experts implementation: {name}: {what}")

    if not is_experts_module(module):
        refuse("not an experts module of transformers' experts interface (a class decorated with "
               "use_experts_implementation)")
    if getattr(module, "has_post_expert_norm", False):
        refuse("has_post_expert_norm=True (a norm after each expert) is not supported; use "
               "experts_implementation='eager' or 'grouped_mm'")
    has_gate, has_bias = getattr(module, "has_gate", True), bool(getattr(module, "has_bias", False))
    first_proj = "gate_up_proj" if has_gate else "up_proj"
    first, down = getattr(module, first_proj, None), getattr(module, "down_proj", None)
    for proj, tensor in ((first_proj, first), ("down_proj", down)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 or tensor.dtype not in _WEIGHT_DTYPES:
            refuse(f"{proj} must be a 3-D tensor of {[str(d) for d in _WEIGHT_DTYPES]}, got "
                   f"{tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}"
                   f"{' ' + str(tensor.dtype) if isinstance(tensor, torch.Tensor) else ''} (quantized experts "
                   "are not served)")
    transposed = bool(module.is_transposed)
    (experts, hidden, width), (down_experts, inter, down_hidden) = (
        (first.shape, down.shape) if transposed else
        ((first.shape[0], first.shape[2], first.shape[1]), (down.shape[0], down.shape[2], down.shape[1])))
    num_experts = getattr(module, "num_experts", None)
    glu_width = 2 * inter if has_gate else inter
    if num_experts != experts or down_experts != experts or down_hidden != hidden or width != glu_width:
        layout = "(E, H, W) / (E, I, H)" if transposed else "(E, W, H) / (E, H, I)"
        refuse(f"with is_transposed={transposed}, {first_proj} {tuple(first.shape)} and down_proj "
               f"{tuple(down.shape)} must be {layout} with E = num_experts ({num_experts}) and W = "
               f"{'2I' if has_gate else 'I'}")
    if has_bias:
        for bias_name, size in ((first_proj + "_bias", width), ("down_proj_bias", hidden)):
            bias = getattr(module, bias_name, None)
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (experts, size):
                refuse(f"has_bias=True needs {bias_name} of shape ({experts}, {size}), got "
                       f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else bias!r}")
    activation = _activation(module, has_gate, inter, refuse)
    return ExpertsLayout(first_proj, transposed, has_bias, experts, activation,
                         sentinels_always=not hasattr(module, "_is_expert_parallel"))


def _activation(module: nn.Module, has_gate: bool, inter: int, refuse) -> ExpertActivation:
    """The module's activation between the projections: ``act_fn`` (no gate), the default ``_apply_gate``
    (``act_fn(gate) * up`` on ``[gate | up]`` halves) or GPT-OSS's clamped SwiGLU on interleaved columns. The gate
    function decides the column order (early transformers 5 releases have no ``is_concatenated`` flag); a flag
    that contradicts it is refused."""
    if not has_gate:
        return ExpertActivation(_activation_name(module, refuse), False, GLUType.GLU, intermediate_size=inter)
    if "_apply_gate" in module.__dict__:
        refuse("_apply_gate is overridden on the instance; only the class's default gate or GPT-OSS's is known")
    gate = getattr(type(module), "_apply_gate", None)
    concatenated = getattr(module, "is_concatenated", None)
    if gate is _loaded("transformers.integrations.moe", "_default_apply_gate"):
        if concatenated is False:
            refuse("is_concatenated=False (interleaved gate/up) but the default _apply_gate splits [gate | up] "
                   "halves: which layout the weights hold is ambiguous")
        return ExpertActivation(_activation_name(module, refuse), True, GLUType.GLU, intermediate_size=inter)
    if gate is _loaded("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts", "_apply_gate"):
        if concatenated is True:
            refuse("GPT-OSS's _apply_gate reads interleaved gate/up columns but is_concatenated=True")
        alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
        if not isinstance(alpha, (int, float)) or not (limit is None or isinstance(limit, (int, float))):
            refuse(f"GPT-OSS's gate needs a number alpha and a number (or None) limit, got alpha={alpha!r}, "
                   f"limit={limit!r}")
        # HF clamps the gate from above only and the up projection on both sides.
        clamps = {} if limit is None else dict(gate_upper=float(limit), up_lower=-float(limit),
                                               up_upper=float(limit))
        return ExpertActivation("sigmoid", True, GLUType.SWIGLU, scaling_factor=float(alpha), act_bias=1.0,
                                intermediate_size=inter, gate_up_interleaved=True, **clamps)
    refuse(f"its _apply_gate (from {getattr(gate, '__module__', None)}) is not one nxd_moe computes: supported are "
           "transformers' default (act_fn(gate) * up) and GPT-OSS's clamped SwiGLU")


def _loaded(module_name: str, *path: str):
    """``module_name.path`` if that transformers module is loaded, else None (then no module of a model can hold
    it). Looked up, not imported: a first call inside ``torch.compile`` derives its layout in the traced code."""
    found = sys.modules.get(module_name)
    for name in path:
        found = getattr(found, name, None)
    return found


def _activation_name(module: nn.Module, refuse) -> str:
    act_fn = getattr(module, "act_fn", None)
    # Exact classes (a subclass may compute something else) and functions.
    names = {**{fn: name for name, fn in ACT2FN.items()}, nn.SiLU: "silu", nn.ReLU: "relu", nn.Sigmoid: "sigmoid",
             nn.Tanh: "tanh"}
    for cls_name, name in (("SiLUActivation", "silu"), ("GELUActivation", "gelu")):  # GELU: erf, in C or Python
        cls = _loaded("transformers.activations", cls_name)
        if cls is not None:
            names[cls] = name
    name = names.get(type(act_fn) if isinstance(act_fn, nn.Module) else act_fn)
    if name is None and isinstance(act_fn, nn.GELU) and act_fn.approximate == "none":
        name = "gelu"
    if name is None and isinstance(act_fn, nn.LeakyReLU) and act_fn.negative_slope == 0.01:
        name = "leaky_relu"  # the slope F.leaky_relu and the triton kernels use
    if name is None:
        refuse(f"act_fn {act_fn!r} is not supported; supported: {sorted(ACT2FN)} (transformers' SiLU, GELU (erf), "
               "ReLU, Sigmoid, Tanh and LeakyReLU(0.01) modules, or those torch functions)")
    return name


def _layout_of(module: nn.Module) -> ExpertsLayout:
    layout = getattr(module, _LAYOUT, None)
    if layout is None:
        layout = experts_layout(module)
        if not torch.compiler.is_compiling():  # a traced first call derives it again at no runtime cost
            setattr(module, _LAYOUT, layout)
    return layout


# The torch backend exists up front: a first call inside torch.compile then imports nothing.
_BACKENDS: dict[str, ExpertsBackend] = {"torch": TorchBackend()}
_AUTOMATIC: dict[tuple[str, torch.dtype], ExpertsBackend] = {}


def _backend(name: str) -> ExpertsBackend:
    """One instance per backend name, shared by every layer (a backend caches launch choices per shape)."""
    backend = _BACKENDS.get(name)
    if backend is None:
        backend = _BACKENDS[name] = get_backend(name)
    return backend


def _automatic_backend(hidden_states: torch.Tensor) -> ExpertsBackend:
    """``"nxd_moe"``'s choice: triton for CUDA tensors of a dtype it computes, when Triton imports; else torch."""
    key = (hidden_states.device.type, hidden_states.dtype)
    backend = _AUTOMATIC.get(key)
    if backend is None:
        name = "torch"
        if key[0] == "cuda" and importlib.util.find_spec("triton") is not None:
            from nxd_moe.triton_kernels.backend import SUPPORTED_DTYPES

            name = "triton" if key[1] in SUPPORTED_DTYPES else "torch"
        backend = _AUTOMATIC[key] = _backend(name)
    return backend


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, backend: str | ExpertsBackend | None = None,
                    blockwise_matmul_config: BlockwiseMatmulConfig = BLOCKWISE_MATMUL_CONFIG) -> torch.Tensor:
    """transformers' experts function on nxd_moe: ``hidden_states (T, H)``, ``top_k_index (T, k)`` (ids ``>=
    num_experts`` are expert-parallel sentinels -- when ``module._is_expert_parallel``, or always on a transformers
    release without that flag -- and contribute nothing),
    ``top_k_weights (T, k)`` (final weights, summed in fp32 or better) -> ``(T, H)`` in ``hidden_states.dtype``.

    ``backend``: an :class:`~nxd_moe.experts.backends.ExpertsBackend` or its name; None picks by device (see the
    module docstring). To register another configuration, e.g. ``ExpertsInterface.register("mine",
    functools.partial(experts_forward, backend=TritonBackend(one_launch=False)))``.
    """
    layout = _layout_of(module)
    automatic = backend is None
    if automatic:
        backend = _automatic_backend(hidden_states)
    elif isinstance(backend, str):
        backend = _backend(backend)
    weights = layout.weights(module)
    num_tokens, top_k = top_k_index.shape
    if (hidden_states.dim() != 2 or hidden_states.shape[0] != num_tokens
            or hidden_states.shape[1] != weights.gate_up_proj.shape[1] or top_k_weights.shape != top_k_index.shape):
        raise ValueError(f"nxd_moe experts implementation: hidden_states must be (T, H) with H = "
                         f"{weights.gate_up_proj.shape[1]} and top_k_index, top_k_weights (T, k); got "
                         f"{tuple(hidden_states.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}")
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    dtype = weights.gate_up_proj.dtype
    x = hidden_states if hidden_states.dtype == dtype else hidden_states.to(dtype)
    pair_expert = top_k_index
    if layout.sentinels_always or module._is_expert_parallel:
        pair_expert = torch.where(top_k_index < layout.num_experts, top_k_index, -1)
    dims = (*weights.gate_up_proj.shape[1:], *weights.down_proj.shape[1:])
    if automatic and isinstance(backend, TorchBackend) and backend.pairs_cheapest(x.device, dtype, dims):
        mode = ExpertsMode.SELECTIVE_LOADING  # transformers' own algorithm on a CPU / GPU, at every T (see there)
    else:
        mode = backend.select_mode_from_tokens(num_tokens, top_k, layout.num_experts,
                                               blockwise_matmul_config.block_size, DEFAULT_SELECTIVE_LOADING_THRESHOLD)
    run = experts_forward_pairs(backend, x, pair_expert, top_k_weights, weights, layout.local_slot(x.device), mode,
                                blockwise_matmul_config)
    return run.output.to(hidden_states.dtype)


def nxd_moe_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """``experts_implementation="nxd_moe"``: :func:`experts_forward` with the backend picked by device."""
    return experts_forward(self, hidden_states, top_k_index, top_k_weights)


def nxd_moe_torch_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """``experts_implementation="nxd_moe_torch"``: :func:`experts_forward` on the torch backend."""
    return experts_forward(self, hidden_states, top_k_index, top_k_weights, "torch")


def nxd_moe_triton_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """``experts_implementation="nxd_moe_triton"``: :func:`experts_forward` on the triton backend."""
    return experts_forward(self, hidden_states, top_k_index, top_k_weights, "triton")


IMPLEMENTATIONS = {
    "nxd_moe": nxd_moe_experts_forward,
    "nxd_moe_torch": nxd_moe_torch_experts_forward,
    "nxd_moe_triton": nxd_moe_triton_experts_forward,
}


def register_experts_implementations() -> None:
    """Add :data:`IMPLEMENTATIONS` to transformers' ``ExpertsInterface`` (class-wide: every model sees them).
    Calling it again changes nothing."""
    from transformers.integrations.moe import ExpertsInterface

    for name, fn in IMPLEMENTATIONS.items():
        ExpertsInterface.register(name, fn)


# Model types with MoE blocks whose experts have one hard-coded forward (not decorated in transformers 5).
_UNDECORATED = {"llama4": "Llama 4", "llama4_text": "Llama 4", "dbrx": "DBRX"}


def check_experts_support(model: nn.Module) -> list[str]:
    """Derive every experts module's layout now (kept on the module) and return their paths; raise
    :class:`UnsupportedExpertsError` naming the first module nxd_moe cannot serve, or the model when none of its
    modules goes through transformers' experts interface (Llama 4 and DBRX: their experts are not decorated, so
    ``experts_implementation`` does not reach them)."""
    served = []
    for path, module in model.named_modules():
        if is_experts_module(module):
            setattr(module, _LAYOUT, experts_layout(module, path))
            served.append(path)
    if not served:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        family = _UNDECORATED.get(model_type)
        why = (f"{family}'s experts are not decorated with use_experts_implementation in transformers 5, so "
               "experts_implementation does not reach them" if family else
               "it has no experts module decorated with transformers' use_experts_implementation")
        raise UnsupportedExpertsError(f"nxd_moe experts implementation: {type(model).__name__}: {why}; swap its "
                                      "MoE blocks for nxd_moe layers instead (nxd_moe.hf.patch_model)")
    return served


def set_experts_implementation(model: nn.Module, implementation: str = "nxd_moe") -> list[str]:
    """``model.set_experts_implementation(implementation)`` after :func:`check_experts_support` (transformers
    itself accepts any registered name for any model); returns the paths of the experts modules now served."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {sorted(IMPLEMENTATIONS)}, got {implementation!r}")
    register_experts_implementations()
    served = check_experts_support(model)
    model.set_experts_implementation(implementation)
    return served
