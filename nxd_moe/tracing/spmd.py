"""A parallel layout's SPMD program checked and exported: traced for every rank, compiled once, run on one XLA CPU
device per rank and compared with the single-device layer (:func:`check_spmd`); its HLO, each rank's shard and what
each HLO parameter is written for ``neuronx-cc`` and a runtime (:func:`export_spmd`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
import torch.nn as nn

from nxd_moe.tracing.collectives import collective_summary
from nxd_moe.tracing.hlo import ProgramParameter, hlo_op_histogram, save_parameter_values
from nxd_moe.tracing.inputs import local_inputs
from nxd_moe.tracing.spmd_layout import SPMDLayout
from nxd_moe.tracing.spmd_program import RankProgram, compile_program, run_replicated, session, trace_rank
from nxd_moe.tracing.tensors import describe_tensors
from nxd_moe.tracing.xla import device_of, fallback_counts, import_torch_xla, materialize, new_fallbacks


@dataclass
class SPMDReport:
    """:func:`check_spmd`'s findings over ``routings`` steps of the layout's ``world_size`` ranks.

    - ``graphs``: distinct graphs over the routings (1 = one static program);
    - ``identical_across_ranks``: every rank traced the same HLO, and the values its code put on the device
      (``shared`` parameters) are equal on every rank -- so rank 0's compiled program is every rank's;
    - ``compilations``: XLA compilations (1; 0 if this process compiled the program before);
    - ``transfers_during_trace`` (0), ``host_sync`` (None; else the error of an execution inside the trace),
      ``fallback_ops`` (operators ``torch_xla`` ran on the CPU: none);
    - ``max_abs_diff``: largest ``|rank output - single-device output|`` over ranks and routings, ``max_abs_ref``
      the largest ``|single-device output|``; they match when ``max_abs_diff <= atol * max(1, max_abs_ref)``
      (rounding scales with the outputs' size);
    - ``routing_ranks``: per routing, the EP ranks the block's pairs went to (routing 0: one rank);
    - ``parameters``: what each HLO parameter is (:class:`~nxd_moe.tracing.hlo.ProgramParameter`), ``hlo_text``:
      the program.
    """

    routings: int
    world_size: int
    graphs: int
    identical_across_ranks: bool
    compilations: int
    transfers_during_trace: int
    host_sync: str | None
    fallback_ops: list[str]
    max_abs_diff: float
    max_abs_ref: float
    atol: float
    routing_ranks: list[list[int]]
    parameters: list[ProgramParameter] = dataclasses.field(repr=False)
    hlo_text: str = dataclasses.field(repr=False)

    @property
    def static(self) -> bool:
        return (self.graphs == 1 and self.identical_across_ranks and self.compilations <= 1
                and self.transfers_during_trace == 0 and self.host_sync is None and not self.fallback_ops)

    @property
    def matches_single_device(self) -> bool:
        return self.max_abs_diff <= self.atol * max(1.0, self.max_abs_ref)

    @property
    def ok(self) -> bool:
        return self.static and self.matches_single_device

    @property
    def collectives(self) -> dict[str, dict]:
        return collective_summary(self.hlo_text)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("parameters",
                                                                                              "hlo_text")}
        out.update(static=self.static, matches_single_device=self.matches_single_device, ok=self.ok,
                   collectives=self.collectives)
        return out


def _ep_ranks(full: nn.Module, x: torch.Tensor, ep: int) -> list[int]:
    with torch.no_grad():
        index = full.router(x.reshape(-1, x.shape[-1]))[2]
    return sorted({int(e) // (full.router.num_experts // ep) for e in index.unique()})


def shared_values_equal(programs: Sequence[RankProgram]) -> bool:
    """Whether the values every rank's code put on the device (``shared`` parameters) are equal across
    ``programs``: only then is one rank's compiled program every rank's."""
    first = programs[0]
    for program in programs[1:]:
        for p, mine, theirs in zip(first.parameters, first.arguments, program.arguments, strict=True):
            if p.kind == "shared" and not torch.equal(mine.cpu(), theirs.cpu()):
                return False
    return True


def trace_world(ranks: Sequence[nn.Module], layout: SPMDLayout, world: Sequence[torch.Tensor], mode: str
                ) -> list[RankProgram]:
    """Every rank's program: rank ``r``'s layer (on its device, :func:`to_devices`) traced on its part of the
    world-wide inputs ``world`` (:meth:`~nxd_moe.tracing.spmd_layout.SPMDLayout.local`). Call inside
    :func:`~nxd_moe.tracing.spmd_program.session`."""
    programs = []
    for rank, module in enumerate(ranks):
        device = device_of(module)
        inputs = [t.to(torch.device(device)) for t in local_inputs(layout, world, rank, mode)]
        materialize(inputs, device)
        programs.append(trace_rank(module, inputs))
    return programs


def check_spmd(full: nn.Module, ranks: Sequence[nn.Module], layout: SPMDLayout,
               make_inputs: Callable[[int], Sequence[torch.Tensor]], mode: str, n: int = 3,
               atol: float = 1e-5) -> SPMDReport:
    """For ``i`` in ``range(n)``: trace every rank's layer (``ranks``, on their XLA devices from :func:`to_devices`)
    on its part of the world input ``make_inputs(i)``, compile rank 0's program, run it on every device with each
    rank's own arguments, and compare each rank's output with the single-device layer ``full`` (eager, CPU) on its
    MoE block's tokens. See :class:`SPMDReport`."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ValueError(f"n must be an int >= 2 (several routings, to see whether they share a graph), got {n!r}")
    torch_xla = import_torch_xla()
    devices = [device_of(m) for m in ranks]
    met = torch_xla.debug.metrics
    fallbacks = fallback_counts(met)
    hashes, routing_ranks, diffs, refs = set(), [], [], []
    identical, compilations, transfers, host_sync = True, 0, 0, None
    first: RankProgram | None = None
    ep = layout.moe_expert_parallel_size(mode)
    sharded = layout.sequence_parallel and mode == "prefill"
    with session(layout, devices):
        for i in range(n):
            world = tuple(make_inputs(i))
            expected = layout.per_block(full, world)
            routing_ranks.append(_ep_ranks(full, world[0], ep))
            programs = trace_world(ranks, layout, world, mode)
            transfers += sum(p.transfers_during_trace for p in programs)
            host_sync = host_sync or next((p.host_sync for p in programs if p.host_sync), None)
            if host_sync is not None:
                break
            identical &= all(p.program_text == programs[0].program_text for p in programs)
            identical &= shared_values_equal(programs)
            if not identical:
                break
            hashes.add(programs[0].graph_hash)
            compilations += compile_program(programs[0])
            outputs = run_replicated(programs[0].graph_hash, [p.arguments for p in programs], devices)
            diffs += [float((out[0].double() - layout.local(expected, rank, sharded).double()).abs().max())
                      for rank, out in enumerate(outputs)]
            refs.append(float(expected.abs().max()))
            first = first or programs[0]
    return SPMDReport(
        routings=n, world_size=layout.world_size, graphs=len(hashes), identical_across_ranks=identical,
        compilations=compilations, transfers_during_trace=transfers, host_sync=host_sync,
        fallback_ops=new_fallbacks(met, fallbacks), max_abs_diff=max(diffs, default=float("inf")),
        max_abs_ref=max(refs, default=0.0), atol=atol,
        routing_ranks=routing_ranks, parameters=[] if first is None else first.parameters,
        hlo_text="" if first is None else first.hlo_text)


def _sharding(parameter: ProgramParameter, whole: Mapping[str, torch.Size]) -> str:
    """How ``parameter`` of a rank's program relates to the whole layer (``whole``: its state dict's shapes)."""
    if parameter.kind in ("input", "rank"):
        return "per rank"
    full = whole.get(parameter.name)
    if parameter.kind == "shared" or full is None or tuple(full) == parameter.shape:
        return "replicated"
    split = [f"dim {d}: {s} of {f}" for d, (s, f) in enumerate(zip(parameter.shape, full)) if s != f]
    return "split " + ", ".join(split)


def export_spmd(ranks: Sequence[nn.Module], layout: SPMDLayout, example: Sequence[torch.Tensor], mode: str,
                out_dir: str | os.PathLike, whole: Mapping[str, torch.Size]) -> dict:
    """Trace rank 0's program on ``example`` (the block input) and write to ``out_dir``: ``model.hlo.txt`` /
    ``model.hlo_module.pb`` (the program every rank runs), ``shards/rank{r}.pt`` (rank ``r``'s state dict: its
    weights and its ``SPMDRank``), ``shared.pt`` (the values every rank passes for the ``shared`` parameters) and
    ``parameters.json`` (what each HLO parameter is and how it is sharded against ``whole``, the single-device
    layer's state-dict shapes: how to feed the compiled program on each rank). Returns the files and the parameter
    list. Run :func:`check_spmd` first: this writes, it does not check."""
    out_dir = Path(out_dir)
    (out_dir / "shards").mkdir(parents=True, exist_ok=True)
    with session(layout, [device_of(m) for m in ranks]):
        program = trace_world(ranks[:1], layout, example, mode)[0]
        if program.host_sync is not None:
            raise RuntimeError(f"rank 0's forward reads a device value on the host: {program.host_sync}")
        (out_dir / "model.hlo.txt").write_text(program.hlo_text)
        (out_dir / "model.hlo_module.pb").write_bytes(program.hlo_proto())
    for rank, module in enumerate(ranks):
        torch.save({k: v.cpu() for k, v in module.state_dict().items()}, out_dir / "shards" / f"rank{rank}.pt")
    mapped = [dataclasses.replace(p, sharding=_sharding(p, whole)) for p in program.parameters]
    save_parameter_values(mapped, program.arguments, out_dir, None)
    parameters = [p.to_dict() for p in mapped]
    return {
        "files": {"hlo_text": "model.hlo.txt", "hlo_proto": "model.hlo_module.pb", "parameters": "parameters.json",
                  "shared": "shared.pt", "shards": [f"shards/rank{r}.pt" for r in range(len(ranks))]},
        "hlo_instructions": sum(hlo_op_histogram(program.hlo_text).values()),
        "op_histogram": hlo_op_histogram(program.hlo_text),
        "inputs": describe_tensors([a for p, a in zip(program.parameters, program.arguments) if p.kind == "input"]),
        "parameters": parameters,
    }
