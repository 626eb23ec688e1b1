"""The application's settings, in NxD Inference's field names: :class:`ApplicationConfig`.

An NxDI script describes its deployment with ``MoENeuronConfig(**fields)``. :class:`ApplicationConfig` takes the
same keyword fields. Three kinds of field:

- **served** (:data:`SERVED`): batch and sequence sizes, dtype, buckets, on-device sampling, the MoE's TP / EP split,
  its blockwise-matmul and router configs, expert-weight quantization -- they decide what the programs are;
- **ignored** (:data:`IGNORED`): how a Neuron device runs the same function (NKI kernel toggles, compiler tiling,
  attention layouts, LNC, ...). Accepted; one warning names every one given a value other than NxDI's default
  (at its default a field changes nothing, so ignoring it is exact);
- **refused** (:data:`REFUSED`): features that would change what is computed and that nxd_moe does not serve
  (speculative decoding, LoRA, paged or quantized KV caches, chunked prefill, ...): a value other than the default
  is an error naming the field.

A field that is none of these is an error in ``ApplicationConfig`` (a misspelling must not pass silently); NxDI's
front door (``neuronx_distributed_inference.models.config``) only warns, as NxDI does, so scripts written for a newer
NxDI keep running.
"""

from __future__ import annotations

import enum
import math
import warnings
from typing import Any, Mapping

import torch

from nxd_moe.application.sampling import SamplingConfig
from nxd_moe.checks import check_bool, check_int, to_torch_dtype
from nxd_moe.moe_configs import BlockwiseMatmulConfig, RouterConfig
from nxd_moe.quantization.nxd_fields import format_of_nxd_fields

__all__ = ["IGNORED", "REFUSED", "SERVED", "ApplicationConfig", "NxDIFieldWarning", "autobucket"]


class NxDIFieldWarning(UserWarning):
    """An NxD Inference field given a value nxd_moe does not act on (see :data:`IGNORED`)."""


# Served fields and what they mean here (docs/application.md has the table).
SERVED = frozenset({
    "batch_size", "ctx_batch_size", "tkg_batch_size", "max_batch_size", "kv_cache_batch_size", "padding_side",
    "seq_len", "max_context_length", "max_new_tokens", "max_length", "torch_dtype", "on_device_sampling_config",
    "enable_bucketing", "buckets", "context_encoding_buckets", "token_generation_buckets", "tp_degree",
    "moe_tp_degree", "moe_ep_degree", "ep_degree", "world_size", "hybrid_sharding_config",
    "blockwise_matmul_config", "router_config", "capacity_factor", "quantized", "quantized_checkpoints_path",
    "quantization_type", "quantization_dtype", "quantization_block_size", "save_sharded_checkpoint", "skip_warmup",
    "logical_nc_config", "on_cpu",
})

# NxDI fields that choose how a Neuron device computes, not what: accepted, warned about when not at NxDI's default.
IGNORED: dict[str, Any] = {
    # sizes NxDI derives for its own tracing
    "n_active_tokens": None, "n_positions": None, "bucket_n_active_tokens": False, "token_generation_batches": None,
    "kv_cache_padding_size": 0,
    # parallel layouts of the attention and the compiled program (the function is the same)
    "cp_degree": 1, "mlp_cp_degree": 1, "attention_dp_degree": 1, "pp_degree": 1, "sequence_parallel_enabled": False,
    "shared_experts_sequence_parallel_enabled": False, "vocab_parallel": False, "start_rank_id": 0,
    "local_ranks_size": None, "skip_sharding": False, "enable_ve_data_parallel": False,
    "weight_gather_seq_len_threshold": 32768, "ep_dispatch_cc_option": "AR_AG", "switch_cc": False,
    "is_continuous_batching": False, "async_mode": False, "apply_seq_ids_mask": False,
    # Neuron kernels and compiler settings
    "fused_qkv": False, "flash_decoding_enabled": False, "attn_kernel_enabled": None,
    "strided_context_parallel_kernel_enabled": False, "qkv_kernel_enabled": False, "qkv_nki_kernel_enabled": False,
    "qkv_cte_nki_kernel_fuse_rope": False, "qkv_kernel_nbsd_layout": False, "mlp_kernel_enabled": False,
    "mlp_tkg_nki_kernel_enabled": False, "fused_rmsnorm_skip_gamma": False, "mlp_kernel_fuse_residual_add": False,
    "qkv_kernel_fuse_residual_add": False, "quantized_mlp_kernel_enabled": False, "out_proj_kernel_enabled": False,
    "attn_tkg_nki_kernel_enabled": False, "attn_tkg_builtin_kernel_enabled": False,
    "attn_block_tkg_nki_kernel_enabled": False, "attn_block_tkg_nki_kernel_cache_update": False,
    "attn_block_tkg_nki_kernel_cascaded_attention": False, "attn_block_tkg_nki_kernel_use_online_softmax": True,
    "attn_block_tkg_nki_kernel_disable_gpsimd_sb2sb": False, "attn_block_cte_nki_kernel_enabled": False,
    "rmsnorm_quantize_kernel_enabled": False, "quantize_clamp_bound": math.inf, "moe_fused_nki_kernel_enabled": None,
    "router_topk_nki_kernel_enabled": None, "expert_mlp_nki_kernel_enabled": None,
    "shared_mlp_nki_kernel_enabled": None, "use_index_calc_kernel": False, "disable_argmax_kernel": False,
    "disable_kv_cache_tiling": False, "k_cache_transposed": False, "lm_head_pad": False,
    "lm_head_pad_alignment_size": 1, "cc_pipeline_tiling_factor": 2, "seq_len_threshold_for_cc_tiling": 16384,
    "target": None, "enable_spill_reload_dge": False, "weights_to_skip_layout_optimization": None,
    "dma_order_config": None, "scratchpad_page_size": None, "enable_output_completion_notifications": False,
    "disable_numeric_cc_token": False, "layer_boundary_markers": False, "enable_cte_modular_flow": False,
    "attn_cls": "NeuronLlamaAttention", "cast_type": "config", "rpl_reduce_dtype": None,
    "quantization_block_axis": None, "quantization_scale_dtype": "f32", "modules_to_not_convert": None,
    "draft_model_modules_to_not_convert": None, "logical_neuron_cores": None, "overrides_torch_dtype": None,
    # architecture flags NxDI's model code sets from the checkpoint; here the checkpoint's transformers config decides
    "glu_mlp": True, "glu_type": "glu", "hidden_act_scaling_factor": 1.0, "hidden_act_bias": 0.0,
    "gate_clamp_upper_limit": None, "gate_clamp_lower_limit": None, "up_clamp_upper_limit": None,
    "up_clamp_lower_limit": None, "early_expert_affinity_modulation": False,
    "disable_normalize_top_k_affinities": False, "fused_shared_experts": False,
    "transpose_shared_experts_weights": False, "moe_mask_padded_tokens": False, "return_expert_index": False,
    "return_router_logits": False, "qk_layernorm": False, "pre_rope_rmsnorm": False, "padded_hidden_size": None,
    "padded_intermediate_size": None, "is_full_model_shuffled": False,
    # routers' flat keywords (router_config covers them)
    "router_act_fn": None, "router_dtype": None,
}

_SPECULATION = "speculative decoding is not served by nxd_moe's application"
# NxDI features that change what is computed and are not served: a non-default value is an error.
REFUSED: dict[str, tuple[Any, str]] = {
    "speculation_length": (0, _SPECULATION), "spec_batch_size": (None, _SPECULATION),
    "enable_fused_speculation": (False, _SPECULATION), "enable_eagle_speculation": (False, _SPECULATION),
    "eagle_rolling_buffer_kernel_enabled": (False, _SPECULATION), "is_eagle3": (False, _SPECULATION),
    "is_eagle_draft": (False, _SPECULATION), "enable_eagle_draft_input_norm": (False, _SPECULATION),
    "token_tree_config": (None, _SPECULATION), "is_medusa": (False, _SPECULATION),
    "medusa_speculation_length": (0, _SPECULATION), "num_medusa_heads": (0, _SPECULATION),
    "medusa_tree": (None, _SPECULATION),
    "lora_config": (None, "LoRA adapters are not served"),
    "is_block_kv_layout": (False, "the paged (block) KV cache is not served: the cache is one line per sequence"),
    "pa_num_blocks": (None, "the paged (block) KV cache is not served"),
    "pa_block_size": (None, "the paged (block) KV cache is not served"),
    "is_prefix_caching": (False, "prefix caching is not served"),
    "prefix_buckets": (None, "prefix caching is not served"),
    "chunked_prefill_config": (None, "chunked prefill is not served"),
    "windowed_context_encoding_size": (None, "windowed context encoding is not served"),
    "kv_cache_quant": (False, "a quantized KV cache is not served (the cache is in torch_dtype)"),
    "kv_quant_config": (None, "a quantized KV cache is not served (the cache is in torch_dtype)"),
    "tensor_capture_config": (None, "tensor capture is not served"),
    "tensor_replacement_config": (None, "tensor replacement is not served"),
    "attention_dtype": (None, "an attention dtype other than torch_dtype is not served"),
    "activation_quantization_type": (None, "activation quantization is not served by the application (the layer's "
                                           "W8A8 is: nxd_moe.build_moe(..., activation_quantization='fp8'))"),
    "is_mxfp4_compute": (False, "Trn3's shuffled MXFP4 compute layout is not served (mxfp4 weights are, with "
                                "quantization_dtype='f4e2m1fn_x4')"),
    "allow_input_truncation": (False, "input truncation is not served: a prompt longer than the largest context "
                                      "bucket is an error"),
    "output_logits": (False, "returning every step's logits is not served: the programs return sampled tokens"),
}


def autobucket(smallest: int, largest: int) -> list[int]:
    """NxDI's automatic buckets: powers of two from ``smallest`` up, then ``largest`` itself."""
    buckets, b = [], smallest
    while b < largest:
        buckets.append(b)
        b *= 2
    return buckets + [largest]


def _check_buckets(name: str, buckets: Any, largest: int, largest_name: str) -> list[int]:
    if not isinstance(buckets, (list, tuple)) or not buckets:
        raise TypeError(f"{name} must be a non-empty list of ints, got {buckets!r}")
    out = sorted({check_int(f"{name}[{i}]", b, minimum=1) for i, b in enumerate(buckets)})
    if out[-1] > largest:
        raise ValueError(f"{name}: bucket {out[-1]} exceeds {largest_name} ({largest})")
    return out


class ApplicationConfig:
    """NxD Inference's ``(MoE)NeuronConfig`` fields that decide the application's programs (module docstring).

    Sizes: ``batch_size`` sequences per ``generate`` (the programs' batch; fewer are padded), ``ctx_batch_size``
    sequences per context-encoding program (default ``batch_size``; smaller runs the prompts in groups),
    ``seq_len`` positions per cache line, ``max_context_length`` the longest prompt (default ``seq_len``),
    ``max_length`` prompt + generated tokens (default ``seq_len``). Buckets: with ``enable_bucketing`` the context
    buckets default to powers of two from 128 to ``max_context_length`` and the token generation buckets from 128
    to ``max_length``; without it one bucket each (``max_context_length``, ``max_length``). Parallelism:
    ``tp_degree`` ranks (NxDI's world size), the MoE split as ``moe_tp_degree x moe_ep_degree`` (their product is
    ``tp_degree`` when both are given; ``hybrid_sharding_config`` splits prefill and decode differently).
    """

    def __init__(self, *, strict: bool = True, **fields: Any):
        unknown = sorted(k for k in fields if k not in SERVED and k not in IGNORED and k not in REFUSED)
        if unknown and strict:
            raise TypeError(f"ApplicationConfig: unknown field(s) {unknown} (not NxD Inference NeuronConfig / "
                            "MoENeuronConfig fields known to nxd_moe)")
        if unknown:
            warnings.warn(f"NeuronConfig: unexpected keyword arguments {unknown} are not NxD Inference fields known "
                          "to nxd_moe; ignored", NxDIFieldWarning, stacklevel=3)
        for name, (default, why) in REFUSED.items():
            if name in fields and fields[name] != default and not (default is None and not fields[name]):
                raise ValueError(f"{name}={fields[name]!r}: {why} (nxd_moe serves NxD Inference's MoE generation "
                                 "without it)")
        ignored = {k: v for k, v in fields.items() if k in IGNORED and not _same(v, IGNORED[k])}
        if ignored:
            warnings.warn("NxD Inference fields that choose how a Neuron device runs the model are ignored (the "
                          f"function computed is the same): {', '.join(f'{k}={v!r}' for k, v in ignored.items())}",
                          NxDIFieldWarning, stacklevel=3)
        self.ignored_fields = ignored
        self.unknown_fields = {k: fields[k] for k in unknown}
        for name in IGNORED:  # every NxDI attribute a script may read exists
            setattr(self, name, fields.get(name, IGNORED[name]))
        for name, (default, _) in REFUSED.items():
            setattr(self, name, fields.get(name, default))
        self._serve(fields)

    # ------------------------------------------------------------------------------------------------------
    def _serve(self, f: dict[str, Any]) -> None:
        self.batch_size = check_int("batch_size", f.get("batch_size", 1), minimum=1)
        for name in ("ctx_batch_size", "tkg_batch_size", "max_batch_size", "kv_cache_batch_size"):
            setattr(self, name, check_int(name, f.get(name, self.batch_size), minimum=1))
        if self.ctx_batch_size > self.batch_size or self.batch_size % self.ctx_batch_size:
            raise ValueError(f"ctx_batch_size ({self.ctx_batch_size}) must divide batch_size ({self.batch_size})")
        for name in ("tkg_batch_size", "kv_cache_batch_size"):
            if getattr(self, name) != self.batch_size:
                raise ValueError(f"{name} ({getattr(self, name)}) must equal batch_size ({self.batch_size}): every "
                                 "sequence of a batch generates in one token-generation program")
        self.padding_side = f.get("padding_side", "right")
        if self.padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {self.padding_side!r}")
        self.seq_len = check_int("seq_len", f.get("seq_len", 128), minimum=2)
        self.max_context_length = check_int("max_context_length", f.get("max_context_length", self.seq_len),
                                            minimum=1, maximum=self.seq_len)
        self.max_length = check_int("max_length", f.get("max_length", self.seq_len), minimum=2,
                                    maximum=self.seq_len)
        if self.max_context_length > self.max_length:
            raise ValueError(f"max_context_length ({self.max_context_length}) must be <= max_length "
                             f"({self.max_length})")
        self.max_new_tokens = f.get("max_new_tokens", (self.seq_len - self.max_context_length) or None)
        if self.max_new_tokens is not None:
            check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        self.torch_dtype = to_torch_dtype(f.get("torch_dtype", torch.bfloat16), "torch_dtype")
        sampling = f.get("on_device_sampling_config")
        if isinstance(sampling, Mapping):
            sampling = SamplingConfig(**{k: v for k, v in sampling.items() if k in SamplingConfig.__dataclass_fields__})
        elif sampling is not None and not isinstance(sampling, SamplingConfig):
            sampling = SamplingConfig(**{k: getattr(sampling, k) for k in SamplingConfig.__dataclass_fields__
                                         if hasattr(sampling, k)})
        self.on_device_sampling_config = sampling
        self.enable_bucketing = check_bool("enable_bucketing", f.get("enable_bucketing", False))
        self.buckets = f.get("buckets", [self.seq_len])
        cte, tkg = f.get("context_encoding_buckets"), f.get("token_generation_buckets")
        if cte is None:
            cte = autobucket(min(128, self.max_context_length), self.max_context_length) if self.enable_bucketing \
                else [self.max_context_length]
        if tkg is None:
            tkg = autobucket(min(128, self.max_length), self.max_length) if self.enable_bucketing \
                else [self.max_length]
        self.context_encoding_buckets = _check_buckets("context_encoding_buckets", cte, self.max_context_length,
                                                       "max_context_length")
        self.token_generation_buckets = _check_buckets("token_generation_buckets", tkg, self.max_length,
                                                       "max_length")
        if self.token_generation_buckets[-1] < self.max_length:
            self.token_generation_buckets.append(self.max_length)  # every position the cache holds is reachable
        self.tp_degree = check_int("tp_degree", f.get("tp_degree", 1), minimum=1)
        self.moe_tp_degree = check_int("moe_tp_degree", f.get("moe_tp_degree", 1), minimum=1)
        self.moe_ep_degree = check_int("moe_ep_degree", f.get("moe_ep_degree", 1), minimum=1)
        self.ep_degree = check_int("ep_degree", f.get("ep_degree", 1), minimum=1)
        self.world_size = check_int("world_size", f.get("world_size", self.tp_degree * self.ep_degree), minimum=1)
        moe = self.moe_tp_degree * self.moe_ep_degree
        if moe > 1 and self.tp_degree % moe:
            raise ValueError(f"moe_tp_degree x moe_ep_degree ({self.moe_tp_degree} x {self.moe_ep_degree}) must "
                             f"divide tp_degree ({self.tp_degree})")
        self.hybrid_sharding_config = f.get("hybrid_sharding_config")
        bmc = f.get("blockwise_matmul_config")
        if isinstance(bmc, Mapping) or bmc is None:
            bmc = BlockwiseMatmulConfig.from_kwargs(**(bmc or {}))
        elif not isinstance(bmc, BlockwiseMatmulConfig):
            raise TypeError("blockwise_matmul_config must be a BlockwiseMatmulConfig or a dict, got "
                            f"{type(bmc).__name__}")
        self.blockwise_matmul_config = bmc
        router = f.get("router_config")
        if isinstance(router, Mapping):
            router = RouterConfig(**router)
        elif router is None:
            router = RouterConfig.from_kwargs(**{k: f[k] for k in ("router_act_fn", "router_dtype")
                                                 if f.get(k) is not None})
        elif not isinstance(router, RouterConfig):
            raise TypeError(f"router_config must be a RouterConfig or a dict, got {type(router).__name__}")
        self.router_config = router
        if f.get("capacity_factor") is not None:
            raise ValueError(f"capacity_factor={f['capacity_factor']!r}: the application runs the experts dropless, "
                             "as NxD Inference's MoE models do; leave it None")
        self.capacity_factor = None
        self.quantized = check_bool("quantized", f.get("quantized", False))
        self.quantized_checkpoints_path = f.get("quantized_checkpoints_path")
        self.quantization_type = f.get("quantization_type", "per_tensor_symmetric")
        self.quantization_dtype = f.get("quantization_dtype", "int8")
        self.quantization_block_size = f.get("quantization_block_size")
        self.quantization = self._routed_quantization()
        self.save_sharded_checkpoint = check_bool("save_sharded_checkpoint", f.get("save_sharded_checkpoint", False))
        self.skip_warmup = check_bool("skip_warmup", f.get("skip_warmup", False))
        self.logical_nc_config = check_int("logical_nc_config", f.get("logical_nc_config", 1), minimum=1, maximum=2)
        self.on_cpu = check_bool("on_cpu", f.get("on_cpu", False))

    def _routed_quantization(self) -> str | None:
        """The routed experts' weight format NxDI's quantization fields name (None: the model's dtype)."""
        name = format_of_nxd_fields(self.quantized, self.quantization_type, self.quantization_dtype,
                                    self.quantization_block_size)
        return None if name == "bf16" else name

    # ------------------------------------------------------------------------------------------------------
    def context_bucket(self, prompt_length: int) -> int:
        """The smallest context-encoding bucket that holds ``prompt_length`` tokens."""
        for b in self.context_encoding_buckets:
            if b >= prompt_length:
                return b
        raise ValueError(f"prompt of {prompt_length} tokens is longer than the largest context-encoding bucket "
                         f"({self.context_encoding_buckets[-1]}, max_context_length {self.max_context_length})")

    def generation_bucket(self, length: int) -> int:
        """The smallest token-generation bucket that holds ``length`` positions."""
        for b in self.token_generation_buckets:
            if b >= length:
                return b
        raise ValueError(f"{length} positions exceed the largest token-generation bucket "
                         f"({self.token_generation_buckets[-1]}, max_length {self.max_length})")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (NxDI's ``neuron_config`` section of ``neuron_config.json``)."""
        out: dict[str, Any] = {}
        for key, value in vars(self).items():
            if key in ("ignored_fields", "unknown_fields", "quantization"):
                continue
            out[key] = _jsonable(value)
        return out


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # tensors, objects without a total equality
        return a is b


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return {k: _jsonable(getattr(value, k)) for k in value.__dataclass_fields__}
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in vars(value).items() if not k.startswith("_")}
    return value
