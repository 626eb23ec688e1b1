"""The application's programs as ONE SPMD program per bucket, for ``tp_degree`` ranks split ``moe_tp_degree x
moe_ep_degree`` (the layer's machinery, :mod:`nxd_moe.tracing`, applied to whole programs).

Each rank holds the whole model but its share of every MoE layer (``patch_model`` under
:func:`~nxd_moe.parallel_state.initialize_spmd_model_parallel`: NxD's ``SPMDRank`` a tensor, the collectives XLA ops
over replica groups). The ranks of a tensor-parallel group run the same sequences; the expert-parallel groups run
their own (data-parallel attention) and exchange tokens inside each MoE layer. Attention, embeddings and the LM head
run whole on every rank (NxDI shards them over ``tp_degree`` too: not done here -- the program computes the same
tokens, with more weight memory per rank).

:func:`check_programs` traces every rank's program of every bucket and phase, checks that all ranks traced the same
program, runs it on one XLA CPU device per rank, and compares each rank's tokens and cache with the single-device
application on that rank's sequences. :func:`export_programs` writes each program's HLO, parameter map and the
ranks' weight shards.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from nxd_moe import parallel_state
from nxd_moe.application.xla_programs import cache_as_inputs, program_inputs, program_modules
from nxd_moe.tracing.collectives import collective_summary
from nxd_moe.tracing.hlo import save_parameter_values
from nxd_moe.tracing.spmd_layout import SPMDLayout
from nxd_moe.tracing.spmd_program import compile_program, run_replicated, session, trace_rank
from nxd_moe.tracing.xla import materialize, xla_devices

if TYPE_CHECKING:
    from nxd_moe.application.application import CausalLMApplication

__all__ = ["check_programs", "export_programs", "layout_of", "rank_applications"]


def layout_of(config) -> SPMDLayout:
    """The SPMD layout of an :class:`~nxd_moe.application.ApplicationConfig`: the MoE's TP x EP split (with
    ``hybrid_sharding_config``, decode's own) over ``tp_degree`` ranks."""
    tp, ep = config.moe_tp_degree, config.moe_ep_degree
    copies = config.tp_degree // (tp * ep)
    hybrid = config.hybrid_sharding_config
    decode = {}
    if hybrid is not None:
        get = hybrid.get if isinstance(hybrid, dict) else lambda k, d=None: getattr(hybrid, k, d)
        tp, ep = get("moe_cte_tp_degree", tp), get("moe_cte_ep_degree", ep)
        decode = dict(moe_decode_tensor_model_parallel_size=get("moe_tkg_tp_degree"),
                      moe_decode_expert_model_parallel_size=get("moe_tkg_ep_degree"))
    return SPMDLayout(tp, ep, expert_data_parallel_size=copies, **decode)


def token_group(layout: SPMDLayout, rank: int) -> int:
    """Which sequences rank ``rank`` runs: its expert-parallel index within its MoE block (the ranks of a
    tensor-parallel group share them), blocks one after another."""
    rows = parallel_state.model_parallel_layout(layout.world_size, **layout._sizes())
    block = rank // layout.block_size
    return block * layout.expert_model_parallel_size + rows.index_in_groups("expert_model_parallel_groups")[rank]


def rank_applications(build: Callable[..., "CausalLMApplication"], layout: SPMDLayout,
                      full: "CausalLMApplication | None" = None
                      ) -> tuple["CausalLMApplication", list["CausalLMApplication"]]:
    """The single-device application ``build()`` and, per rank, ``build(cache_shapes=...)`` under the layout's
    SPMD state (its MoE layers that rank's shard; the cache shaped as the single-device one's, since a rank's MoE
    cannot run outside XLA to probe them). ``build`` must draw the same weights every call (a fixed seed, a
    checkpoint) and pass ``cache_shapes`` on to :class:`~nxd_moe.application.CausalLMApplication`. ``full``: the
    single-device application, if already built."""
    full = build() if full is None else full
    ranks = []
    for rank in range(layout.world_size):
        with layout.initialized(rank):
            ranks.append(build(cache_shapes=full.programs.cache.shapes))
    return full, ranks


_CACHE = "programs.cache."


def _tensors_by_path(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by module path (the names the parameter map uses; a patched model's ``state_dict``
    is refused on an expert-parallel rank)."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _to_devices(ranks: list["CausalLMApplication"], devices: list[str]) -> None:
    for app, device in zip(ranks, devices, strict=True):
        app.programs.to(torch.device(device))
        materialize(list(_tensors_by_path(app.programs).values()), device)


def _reset_cache(app: "CausalLMApplication", device: str | None = None) -> None:
    """Zero the cache as fresh device data (a program traced next reads it as an input, not as the lazy result of
    the previous trace)."""
    buffers = list(app.programs.cache.buffers())
    for buffer in buffers:
        buffer.data = torch.zeros(buffer.shape, dtype=buffer.dtype).to(buffer.device)
    if device is not None:
        materialize(buffers, device)


def _rank_inputs(full: "CausalLMApplication", layout: SPMDLayout, phase: str, bucket: int, rank: int,
                 seed: int) -> tuple[torch.Tensor, ...]:
    return program_inputs(full, phase, bucket, seed=seed + 1000 * token_group(layout, rank))(1)


def _trace_all(ranks, layout, devices, full, name, phase, bucket, seed):
    programs, inputs = [], []
    for rank, app in enumerate(ranks):
        _reset_cache(app, devices[rank])
        mine = _rank_inputs(full, layout, phase, bucket, rank, seed)
        on_device = [t.to(torch.device(devices[rank])) for t in mine]
        materialize(on_device, devices[rank])
        programs.append(trace_rank(program_modules(app)[name][0], on_device))
        inputs.append(mine)
    return programs, inputs


def check_programs(full: "CausalLMApplication", ranks: list["CausalLMApplication"], layout: SPMDLayout,
                   seed: int = 1) -> dict[str, dict[str, Any]]:
    """Per program: whether every rank traced the same program (and no host read), the compilations, and for each
    rank the largest difference of its outputs (tokens, done flags, cache) from the single-device application's on
    its sequences (``tokens_equal``: the tokens exactly), and the collectives the program makes."""
    devices = xla_devices(layout.world_size)
    _to_devices(ranks, devices)
    reports = {}
    with session(layout, devices):
        for name, (module, phase, bucket) in program_modules(full).items():
            programs, inputs = _trace_all(ranks, layout, devices, full, name, phase, bucket, seed)
            report: dict[str, Any] = {"host_sync": next((p.host_sync for p in programs if p.host_sync), None)}
            reports[name] = report
            if report["host_sync"]:
                continue
            report["identical_across_ranks"] = all(p.program_text == programs[0].program_text for p in programs)
            if not report["identical_across_ranks"]:
                continue
            report["compilations"] = compile_program(programs[0])
            outputs = run_replicated(programs[0].graph_hash, [p.arguments for p in programs], devices)
            tokens_equal, diffs = True, []
            for rank, out in enumerate(outputs):
                _reset_cache(full)
                with torch.no_grad():
                    expected = module(*inputs[rank])
                tokens_equal &= all(torch.equal(a, b) for a, b in zip(out[:2], expected[:2])
                                    if not a.is_floating_point())
                diffs.append(max(float((a.double() - b.double()).abs().max()) for a, b in zip(out, expected)))
            report.update(tokens_equal=tokens_equal, max_abs_diff=max(diffs),
                          collectives=collective_summary(programs[0].hlo_text))
    return reports


def export_programs(full: "CausalLMApplication", ranks: list["CausalLMApplication"], layout: SPMDLayout,
                    path: Path, signatures: dict[str, dict[str, Any]]) -> None:
    """Write every program's SPMD HLO (rank 0's trace: every rank runs it), its parameter map (the KV cache as
    inputs) and every rank's weight shard under ``path/<program>/``, and record them in ``signatures``. Run
    :func:`check_programs` first: this writes, it does not check."""
    devices = xla_devices(layout.world_size)
    with session(layout, devices):
        for name, (_, phase, bucket) in program_modules(full).items():
            programs, _ = _trace_all(ranks[:1], layout, devices, full, name, phase, bucket, 1)
            program = programs[0]
            if program.host_sync is not None:
                raise RuntimeError(f"{name}: rank 0's program reads a device value on the host: {program.host_sync}")
            out = path / name
            (out / "shards").mkdir(parents=True, exist_ok=True)
            (out / "model.hlo.txt").write_text(program.hlo_text)
            (out / "model.hlo_module.pb").write_bytes(program.hlo_proto())
            for rank, app in enumerate(ranks):  # weights and rank; the cache is an input (and donated by a run)
                module = program_modules(app)[name][0]
                torch.save({k: v.cpu() for k, v in _tensors_by_path(module).items() if not k.startswith(_CACHE)},
                           out / "shards" / f"rank{rank}.pt")
            save_parameter_values([dataclasses.replace(p) for p in program.parameters], program.arguments, out, None)
            cache_as_inputs(out)
            signatures[name].update({
                "hlo": {"text": f"{name}/model.hlo.txt", "proto": f"{name}/model.hlo_module.pb"},
                "spmd": {"world_size": layout.world_size, **layout.to_dict(),
                         "shards": [f"{name}/shards/rank{r}.pt" for r in range(len(ranks))],
                         "collectives": collective_summary(program.hlo_text)},
                "neuronx_cc": (f"neuronx-cc compile {name}/model.hlo_module.pb --framework XLA --target trn2 "
                               f"--lnc {full.config.logical_nc_config} --output {name}/model.neff"),
            })
