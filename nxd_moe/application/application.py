"""An MoE causal LM as an application: NxD Inference's ``compile`` / ``load`` / ``generate``, on nxd_moe's layer.

:class:`CausalLMApplication` wraps a transformers ``...ForCausalLM`` of a family nxd_moe serves (its sparse-MoE blocks
patched to nxd_moe's :class:`~nxd_moe.MoE`), the KV cache it owns and the programs of every bucket
(:mod:`~nxd_moe.application.programs`), and runs generation with no host in the token loop
(:mod:`~nxd_moe.application.generation`). Build one from a local checkpoint (:meth:`~CausalLMApplication.
from_pretrained`), a shipped architecture with random weights (:meth:`~CausalLMApplication.from_model_config`) or a
model in memory; ``compile(path)`` writes what a deployment needs (:mod:`~nxd_moe.application.artifacts`) and
``load(path)`` readies the programs (on CUDA: every bucket captured as a CUDA graph).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from nxd_moe import parallel_state
from nxd_moe.application.artifacts import check_compiled, read_model, write_compiled
from nxd_moe.application.attention import use_decode_attention
from nxd_moe.application.config import ApplicationConfig
from nxd_moe.application.fused_projections import share_projection_storage
from nxd_moe.application.generation import GenerationOutput, generate_tokens, prompts_of
from nxd_moe.application.programs import CausalLMPrograms, decoder_of
from nxd_moe.application.runner import ProgramRunner
from nxd_moe.application.sampling import prepare_sampling_params
from nxd_moe.models.decoder_step import replace_polar_rotary_embeddings
from nxd_moe.moe import MoE

__all__ = ["CausalLMApplication"]


def _served_model_type(model: nn.Module) -> str:
    from nxd_moe.hf.configs import SUPPORTED_MODEL_TYPES  # the hf extra (transformers): imported where needed

    model_type = getattr(model.config.get_text_config(), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not an MoE family nxd_moe serves (a dense model has no MoE "
                         f"layer to run); served: {list(SUPPORTED_MODEL_TYPES)}")
    return model_type


def _to_dtype_keeping_routers(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` in ``dtype``, except the routers of layers already patched to nxd_moe's ``MoE``, which keep their
    own dtype (float32, as NxD runs them): cast with the rest, a patched model's routers would route in bf16 and lose
    the layer's fused one-launch decode, which takes a float32 router only."""
    kept = [(p, p.data) for m in model.modules() if isinstance(m, MoE) for p in m.router.parameters()]
    model = model.to(dtype)
    for parameter, data in kept:
        parameter.data = data
    return model


class CausalLMApplication:
    """A transformers MoE causal LM ``model`` run as an NxD Inference application under ``config``.

    ``model`` is converted to ``config.torch_dtype`` and, unless already patched, patched
    (:func:`nxd_moe.hf.patch_model`) with ``backend`` (None: triton on CUDA, else torch) and the routed experts'
    quantization ``config`` names. ``cuda_graphs`` (default: on a CUDA device) captures each bucket's steps;
    ``compile_token_generation`` (default: with CUDA graphs) compiles the token-generation step with Inductor
    first. ``checkpoint``: the directory the weights came from (recorded by ``compile``, read back by ``load``).
    ``cache_shapes``: the KV cache's per-layer shapes, when they cannot be probed (an SPMD rank's build).
    ``decode_attention`` (default: on a CUDA device) runs an SDPA model's one-token attention on nxd_moe's split-key
    kernel (:mod:`nxd_moe.application.attention`; the model's attention implementation is switched in place).
    ``rebuild(**kwargs)``: builds this application again from its source (set by the ``from_...`` constructors);
    ``compile`` of an SPMD program (``tp_degree`` > 1) builds each rank's with it.

    Expert parallelism: with ``moe_ep_degree`` > 1 and a ``torch.distributed`` world of ``moe_tp_degree x
    moe_ep_degree`` processes, each rank keeps its experts, runs the rest of the model whole on its own sequences
    (data-parallel attention) and steps in lockstep with the others.
    """

    def __init__(self, model: nn.Module, config: ApplicationConfig, *, backend: str | None = None,
                 cuda_graphs: bool | None = None, compile_token_generation: bool | None = None,
                 checkpoint: str | os.PathLike | None = None, cache_shapes: list | None = None,
                 rebuild: Callable[..., "CausalLMApplication"] | None = None, decode_attention: bool | None = None):
        if not isinstance(config, ApplicationConfig):
            raise TypeError(f"config must be an ApplicationConfig, got {type(config).__name__}")
        self.model_type = _served_model_type(model)
        self.config = config
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        self.group = self._expert_parallel_group(config)
        model = _to_dtype_keeping_routers(model, config.torch_dtype).eval()
        from nxd_moe.models.patch import patch_model
        if getattr(model, "nxd_moe_patched", None) is None:
            patch_model(model, backend=backend, quantization=config.quantization)
        # Llama 4's torch.polar has no XLA lowering (a host round trip per step): the same values from cos / sin
        replace_polar_rotary_embeddings(model)
        self.model = model
        sampling = config.on_device_sampling_config
        self.sampling = sampling is not None and sampling.do_sample
        self.programs = CausalLMPrograms(model, config.batch_size, config.max_length,
                                         sampling.global_topk if sampling is not None else 256, cache_shapes)
        device = self.programs.cache.keys_0.device
        cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        compile_token_generation = cuda_graphs if compile_token_generation is None else compile_token_generation
        if device.type == "cuda" if decode_attention is None else decode_attention:
            use_decode_attention(model)
        if compile_token_generation:  # the compiled token step runs the projections of one input as one GEMM
            ids = torch.zeros(1, 1, dtype=torch.long, device=device)
            share_projection_storage(model, lambda: decoder_of(model)(input_ids=ids, use_cache=False))
        self.runner = ProgramRunner(self.programs, config, sampling=self.sampling, cuda_graphs=cuda_graphs,
                                    compile_token_generation=compile_token_generation)
        self.is_loaded = False
        self.last_timings: dict = {}
        self.rebuild = rebuild

    @staticmethod
    def _expert_parallel_group(config: ApplicationConfig):
        """The process group of an expert-parallel run (None on one process), after initialising
        :mod:`nxd_moe.parallel_state` with the config's MoE split if nobody has."""
        moe_ranks = config.moe_tp_degree * config.moe_ep_degree
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        if dist.get_world_size() != moe_ranks:
            raise ValueError(f"a torch.distributed world of {dist.get_world_size()} processes; the config's MoE "
                             f"split moe_tp_degree x moe_ep_degree is {config.moe_tp_degree} x "
                             f"{config.moe_ep_degree} = {moe_ranks}: run one process per MoE rank")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=config.moe_tp_degree,
                                                     expert_model_parallel_size=config.moe_ep_degree)
        layout = parallel_state.get_parallel_layout()
        if layout.moe_decode != (config.moe_tp_degree, config.moe_ep_degree):
            raise ValueError(f"nxd_moe.parallel_state splits the MoE as (tp, ep) = {layout.moe_decode}, the config "
                             f"as ({config.moe_tp_degree}, {config.moe_ep_degree}): initialise it to the config's "
                             "split, or leave it to the application")
        return dist.group.WORLD

    # ------------------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, config: ApplicationConfig, *,
                        device: torch.device | str = "cpu", **kwargs: Any) -> "CausalLMApplication":
        """The application of the local transformers checkpoint directory ``path`` (safetensors only)."""
        from nxd_moe.models.generate import load_checkpoint_model
        model = load_checkpoint_model(path, config.torch_dtype, torch.device(device))
        rebuild = functools.partial(cls.from_pretrained, path, config)
        return cls(model, config, checkpoint=path, rebuild=rebuild, **kwargs)

    @classmethod
    def from_model_config(cls, model_config: str | os.PathLike, config: ApplicationConfig, *,
                          num_layers: int | None = None, scale: int = 1, seed: int = 0,
                          device: torch.device | str = "cpu", **kwargs: Any) -> "CausalLMApplication":
        """A shipped architecture (``"qwen3-30b-a3b"`` or a YAML path) with random weights drawn from ``seed``
        (:func:`nxd_moe.models.hf_models.build_hf_model`): ``num_layers`` MoE layers (default the architecture's),
        widths divided by ``scale``."""
        from nxd_moe.models.hf_models import build_hf_model
        model = build_hf_model(model_config, num_layers=num_layers, scale=scale, dtype=config.torch_dtype,
                               device=device, seed=seed)
        rebuild = functools.partial(cls.from_model_config, model_config, config, num_layers=num_layers, scale=scale,
                                    seed=seed)
        return cls(model, config, rebuild=rebuild, **kwargs)

    @classmethod
    def from_compiled(cls, path: str | os.PathLike, *, device: torch.device | str = "cpu", load: bool = True,
                      **kwargs: Any) -> "CausalLMApplication":
        """The application a ``compile(path)`` wrote (:func:`~nxd_moe.application.artifacts.read_model`), loaded
        unless ``load`` is False."""
        model, config, checkpoint = read_model(Path(path), device)
        rebuild = functools.partial(cls.from_compiled, path, load=False)
        app = cls(model, config, checkpoint=checkpoint, rebuild=rebuild, **kwargs)
        if load:
            app.load(path)
        return app

    # ------------------------------------------------------------------------------------------------------
    # compile / load

    def compile(self, path: str | os.PathLike, *, xla: bool | None = None) -> dict:
        """Write the compiled application to ``path`` and return its manifest (see
        :func:`nxd_moe.application.artifacts.write_compiled`): the configs, and per bucket and phase the traced
        program (HLO for ``neuronx-cc`` when the model is on the CPU and ``torch_xla`` is installed) -- then load
        it (on CUDA: capture every bucket's CUDA graphs)."""
        manifest = write_compiled(self, Path(path), xla=xla)
        self.load(path)
        return manifest

    def load(self, path: str | os.PathLike | None = None) -> None:
        """Ready the programs of every bucket (on CUDA, capture them as CUDA graphs now, so no ``generate`` call
        captures); ``path``, if given, must be a directory ``compile`` wrote for this model."""
        if path is not None:
            check_compiled(self, Path(path))
        if self.runner.cuda_graphs and not self.config.skip_warmup:
            self.runner.capture_all()
        self.is_loaded = True

    # ------------------------------------------------------------------------------------------------------
    # generate

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int | None = None, max_length: int | None = None, do_sample: bool | None = None,
                 top_k: int | Sequence[int] | None = None, top_p: float | Sequence[float] | None = None,
                 temperature: float | Sequence[float] | None = None,
                 eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                 read_every: int = 16, on_tokens: Callable[[torch.Tensor], None] | None = None,
                 progress: bool = False) -> GenerationOutput:
        """Generate from ``input_ids (B, W)`` (``B <= batch_size``; left or right padded, ``attention_mask`` says
        where) and return a :class:`~nxd_moe.application.generation.GenerationOutput`.

        ``max_new_tokens`` (else ``max_length - W``, as transformers counts; else the config's ``max_new_tokens``,
        else what the cache has room for). ``do_sample`` (default: the config's on-device sampling) with per-call
        ``top_k`` / ``top_p`` / ``temperature`` (a number or one per sequence; used when the sampling config is
        ``dynamic``, else the config's). ``eos_token_id`` (default the model's ``generation_config``; None or []:
        no EOS), ``pad_token_id`` (default the model's, else the first EOS, else 0). ``read_every``: the host reads
        the tokens every this many steps (``on_tokens`` gets each block, for streaming); ``progress``: a progress
        bar.
        """
        prompts = prompts_of(input_ids, attention_mask)
        width = input_ids.shape[1]
        config = self.config
        if max_new_tokens is None and max_length is not None:
            max_new_tokens = max_length - width
            if max_new_tokens < 1:
                raise ValueError(f"max_length ({max_length}) leaves no room for new tokens after the input's "
                                 f"{width} positions")
        if max_new_tokens is None:
            max_new_tokens = config.max_new_tokens or config.max_length - max(p.numel() for p in prompts)
        do_sample = self.sampling if do_sample is None else do_sample
        if do_sample and not self.sampling:
            raise ValueError("do_sample=True, but the application's programs take the argmax: build it with "
                             "on_device_sampling_config=SamplingConfig(do_sample=True, ...)")
        params = None
        if self.sampling:
            sc = config.on_device_sampling_config
            if not do_sample:
                top_k, top_p, temperature = 1, 1.0, 1.0  # greedy through the sampling program: keep the argmax
            elif not sc.dynamic or top_k is None and top_p is None and temperature is None:
                top_k, top_p, temperature = sc.top_k, sc.top_p, sc.temperature
            else:
                top_k = sc.top_k if top_k is None else top_k
                top_p = sc.top_p if top_p is None else top_p
                temperature = sc.temperature if temperature is None else temperature
            params = prepare_sampling_params(len(prompts), top_k, top_p, temperature)
        eos = self._eos_ids(eos_token_id)
        if pad_token_id is None:
            pad_token_id = getattr(self._generation_config(), "pad_token_id", None)
            pad_token_id = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        tokens, lengths, timings = generate_tokens(
            self.runner, prompts, width, max_new_tokens=max_new_tokens, eos_token_ids=eos,
            pad_token_id=int(pad_token_id), sampling_params=params, read_every=read_every, on_tokens=on_tokens,
            progress=progress, group=self.group)
        self.last_timings = timings
        sequences = torch.cat([input_ids.cpu().long(), tokens], dim=1)
        return GenerationOutput(sequences, tokens, lengths, timings)

    def _generation_config(self):
        return getattr(self.model, "generation_config", None)

    def _eos_ids(self, eos_token_id) -> list[int]:
        if eos_token_id is None:
            eos_token_id = getattr(self._generation_config(), "eos_token_id", None)
        if eos_token_id is None:
            return []
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        vocab = self.programs.text_config.vocab_size
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
                raise ValueError(f"eos_token_id must be token ids in [0, {vocab}), got {eos_token_id!r}")
        return ids

    def reset(self) -> None:
        """NxDI's ``reset``: nothing to do -- every ``generate`` starts from its own prompts (the cache positions a
        prompt does not write are masked)."""
