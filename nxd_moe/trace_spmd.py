"""Parallel layouts as ONE SPMD program: the parallel MoE traced under ``torch_xla`` for every rank at once.

Trainium runs a model over many NeuronCores with one compiled program that every core runs (SPMD): the rank is a
tensor input (:class:`~nxd_moe.parallel_state.SPMDRank`), the weights are the rank's shard (same shapes on every
rank), and the collectives are XLA ops over the layout's replica groups. This module builds that program for a
layout (:class:`SPMDLayout`: TP, EP, TP x EP, sequence-parallel prefill, hybrid prefill/decode sharding) and checks
it on ``torch_xla``'s CPU client with one device per rank:

- :func:`build_rank_layers` builds the layer once per rank under
  :func:`~nxd_moe.parallel_state.initialize_spmd_model_parallel`, each loading its shard of the single-device
  layer's state;
- :func:`trace_rank` traces one rank's forward lazily (an execution would be a host sync inside the layer: it is
  refused), and names each HLO parameter: an input, a weight of the rank's shard, the rank, or a value every rank
  shares;
- :func:`run_replicated` runs ONE compiled executable on every device, each with its rank's arguments, from one
  thread per device (XLA's CPU collectives meet in a rendezvous keyed by the executable, so the ranks must run the
  same one: ``xmp.spawn`` compiles one per device, and its all-reduce never meets);
- :func:`check_spmd` does it for several routings and compares every rank's output with the single-device layer;
  :func:`export_spmd` writes the HLO, the per-rank shards and what each HLO parameter is; ``nxd-moe trace --tp
  --ep`` runs both (:func:`trace`).

``torch_xla`` is imported by the functions that need it. The CPU client must have at least ``world_size`` devices
(``CPU_NUM_DEVICES``, read when the XLA runtime starts): :func:`xla_devices` sets it if the runtime has not started.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn

from nxd_moe import parallel_state
from nxd_moe.parallel.sharding import load_full_state_dict
from nxd_moe.quantization.formats import describe_weights
from nxd_moe.trace import (
    _describe,
    _fallback_counts,
    _new_fallbacks,
    _tensors,
    _transfers,
    ProgramParameter,
    hlo_op_histogram,
    hlo_parameters,
    import_torch_xla,
    module_tensor_names,
    save_parameter_values,
)

COLLECTIVES = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce")


@dataclass(frozen=True)
class SPMDLayout:
    """A parallel layout: NxD's TP / EP sizes, sequence-parallel prefill, the MoE's own split for decode (hybrid
    sharding; default the same as prefill), and ``expert_data_parallel_size`` copies of the ``TP * EP``-rank MoE
    block (NxD's expert-data-parallel replicas, each with its own tokens): ``world_size = TP * EP * copies``."""

    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    moe_decode_tensor_model_parallel_size: int | None = None
    moe_decode_expert_model_parallel_size: int | None = None
    expert_data_parallel_size: int = 1

    @property
    def block_size(self) -> int:
        return self.tensor_model_parallel_size * self.expert_model_parallel_size

    @property
    def world_size(self) -> int:
        return self.block_size * self.expert_data_parallel_size

    def _sizes(self) -> dict:
        return dict(tensor_model_parallel_size=self.tensor_model_parallel_size,
                    expert_model_parallel_size=self.expert_model_parallel_size,
                    moe_decode_tensor_model_parallel_size=self.moe_decode_tensor_model_parallel_size,
                    moe_decode_expert_model_parallel_size=self.moe_decode_expert_model_parallel_size)

    def check(self, num_experts: int, tokens: int, mode: str) -> parallel_state.ParallelLayout:
        """The rank lists, after the checks that must fail before anything is traced: sizes that do not divide the
        world or the experts, and a sequence-parallel prefill whose tokens do not split over TP (``ValueError``
        naming the argument)."""
        layout = parallel_state.model_parallel_layout(self.world_size, num_experts=num_experts, **self._sizes())
        if self.sequence_parallel and mode == "prefill" and tokens % self.tensor_model_parallel_size:
            raise ValueError(f"sequence parallelism splits the prefill tokens ({tokens}) over the "
                             f"tensor-parallel size ({self.tensor_model_parallel_size}): tokens must be divisible "
                             "by it")
        return layout

    @contextlib.contextmanager
    def initialized(self, rank: int = 0) -> Iterator[None]:
        """:mod:`nxd_moe.parallel_state` set to this layout's SPMD program, building ``rank``'s shard."""
        parallel_state.initialize_spmd_model_parallel(self.world_size, rank=rank, **self._sizes())
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()

    def local(self, world: torch.Tensor, rank: int, sharded: bool) -> torch.Tensor:
        """Rank ``rank``'s part of a world-wide ``(copies * D * B, S, ...)`` tensor: each MoE block's ``D`` token
        groups (the dense layers' TP groups; see :class:`~nxd_moe.parallel.TokenLayout`) of ``B`` rows, blocks one
        after another. The rank gets its group's rows, and with ``sharded`` (sequence-parallel prefill) its
        ``S / TP`` positions of them."""
        tp, groups = self.tensor_model_parallel_size, self.expert_model_parallel_size
        layout = parallel_state.model_parallel_layout(self.world_size, **self._sizes())
        group = rank // self.block_size * groups + layout.index_in_groups("expert_model_parallel_groups")[rank]
        position = layout.index_in_groups("tensor_model_parallel_groups")[rank]
        batch = world.shape[0] // (groups * self.expert_data_parallel_size)
        mine = world[group * batch:(group + 1) * batch]
        if not sharded:
            return mine
        width = world.shape[1] // tp
        return mine[:, position * width:(position + 1) * width]

    def per_block(self, layer: Callable[..., Any], world: Sequence[torch.Tensor]) -> torch.Tensor:
        """``layer`` (the single-device layer) applied to each MoE block's tokens of the world-wide inputs on its
        own -- what the block computes -- and the outputs stacked as the inputs are."""
        rows = world[0].shape[0] // self.expert_data_parallel_size
        with torch.no_grad():
            return torch.cat([layer(*(t[b * rows:(b + 1) * rows] for t in world))[0]
                              for b in range(self.expert_data_parallel_size)])

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, **self._sizes(), "sequence_parallel": self.sequence_parallel,
                "expert_data_parallel_size": self.expert_data_parallel_size}


def build_rank_layers(build: Callable[..., nn.Module], layout: SPMDLayout) -> tuple[nn.Module, list[nn.Module]]:
    """The single-device layer ``build(model_parallel=False)`` and, per rank, ``build()`` under the layout's SPMD
    state with that rank's shard of the single-device layer's weights loaded. ``build`` must draw the same
    replicated weights every call (a fixed seed)."""
    full = build(model_parallel=False)
    state = full.state_dict()
    ranks = []
    for rank in range(layout.world_size):
        with layout.initialized(rank):
            ranks.append(load_full_state_dict(build(), state))
    return full, ranks


# ----------------------------------------------------------------------------------------------------------
# devices


def xla_devices(world_size: int) -> list[str]:
    """The first ``world_size`` XLA devices. On the CPU client (``PJRT_DEVICE=CPU``) their number is
    ``CPU_NUM_DEVICES``, read once when the runtime starts: set here if it has not started, else a clear
    error if it has too few."""
    torch_xla = import_torch_xla()
    if not torch_xla._XLAC._xla_runtime_is_initialized() and os.environ.get("PJRT_DEVICE") == "CPU":
        current = int(os.environ.get("CPU_NUM_DEVICES", "1"))
        os.environ["CPU_NUM_DEVICES"] = str(max(current, world_size))
    import torch_xla.core.xla_model as xm

    devices = xm.get_xla_supported_devices()
    if len(devices) < world_size:
        raise RuntimeError(f"the SPMD program has {world_size} ranks but torch_xla has {len(devices)} device(s); "
                           f"start the process with CPU_NUM_DEVICES={world_size} (PJRT_DEVICE=CPU)")
    return devices[:world_size]


@contextlib.contextmanager
def replicated(devices: Sequence[str]) -> Iterator[None]:
    """Inside the block, ``torch_xla`` compiles programs as one replica of ``devices`` (replica ``r`` on
    ``devices[r]``), so their collectives span them. Set directly: ``xm.set_replication`` insists on every device
    of the runtime, and the runtime may have more than the program's ranks."""
    torch_xla = import_torch_xla()
    import torch_xla.core.xla_model as xm

    torch_xla._XLAC._xla_set_replication_devices(xm.xla_real_devices(list(devices)))
    try:
        yield
    finally:
        torch_xla._XLAC._xla_set_replication_devices([])


@contextlib.contextmanager
def session(layout: SPMDLayout, devices: Sequence[str]) -> Iterator[None]:
    """What tracing and compiling a layout's program needs: its SPMD state in :mod:`nxd_moe.parallel_state` (the
    groups the forward reads) and ``torch_xla`` replicating over its ``devices``."""
    with layout.initialized(), replicated(devices):
        yield


def device_of(module: nn.Module) -> str:
    return str(next(iter(module.state_dict().values())).device)


def _materialize(tensors: Sequence[torch.Tensor], device: str) -> None:
    torch_xla = import_torch_xla()
    torch_xla._XLAC._xla_sync_multi(list(tensors), [device], True)


def to_devices(ranks: Sequence[nn.Module], devices: Sequence[str]) -> list[nn.Module]:
    """Rank ``r``'s layer moved to ``devices[r]`` (in place) and its weights materialized there."""
    for module, device in zip(ranks, devices, strict=True):
        module.to(torch.device(device))
        _materialize(list(module.state_dict().values()), device)
    return list(ranks)


# ----------------------------------------------------------------------------------------------------------
# one rank's program


@dataclass
class RankProgram:
    """One rank's traced forward, not yet run: its HLO, graph hash, the device tensors it takes in HLO parameter
    order (``arguments``), what each is (``parameters``), its lazy ``outputs``, and what happened while tracing
    (device-to-host transfers, and a host sync's error: the layer is then not one graph)."""

    hlo_text: str
    graph_hash: bytes
    arguments: list[torch.Tensor]
    parameters: list[ProgramParameter]
    outputs: list[torch.Tensor]
    transfers_during_trace: int
    host_sync: str | None = None

    @property
    def program_text(self) -> str:
        """The HLO without its module name (a counter that differs between traces of the same program)."""
        return self.hlo_text.split("\n", 1)[1] if self.hlo_text.startswith("HloModule") else self.hlo_text

    def hlo_proto(self) -> bytes:
        return import_torch_xla()._XLAC._get_xla_tensors_hlo_proto(self.outputs)


def trace_rank(module: nn.Module, inputs: Sequence[torch.Tensor | None]) -> RankProgram:
    """Trace ``module(*inputs)`` (module and inputs on the rank's XLA device) without running it. Executions are
    refused while tracing: a host read of a computed value inside the layer ends the trace with ``host_sync``
    set (running it on one device would wait forever for the other ranks' collectives)."""
    torch_xla = import_torch_xla()
    met = torch_xla.debug.metrics
    transfers = _transfers(met)
    host_sync = None
    device, default = str(inputs[0].device), torch_xla._XLAC._xla_get_default_device()
    # Collectives chain through the default device's token: start a fresh chain on the rank's own device, so the
    # program holds this forward only (never an earlier trace that was run without a sync).
    before = module_tensor_names(module)  # a buffer the forward updates in place is named by its old value
    torch_xla._XLAC._xla_set_default_device(device)
    torch_xla._XLAC._set_all_reduce_token(device, None)
    torch_xla._XLAC._set_allow_execution(False)
    try:
        with torch.no_grad():
            outputs = _tensors(module(*inputs))
    except RuntimeError as e:
        if "Unexpected execution" not in str(e):
            raise
        host_sync, outputs = str(e).splitlines()[0], []
    finally:
        torch_xla._XLAC._set_allow_execution(True)
        torch_xla._XLAC._set_all_reduce_token(device, None)
        torch_xla._XLAC._xla_set_default_device(default)
    transfers = _transfers(met) - transfers
    if host_sync is not None:
        return RankProgram("", b"", [], [], [], transfers, host_sync)
    parameters, values = hlo_parameters(module, inputs, outputs, before)
    _restore_updated_buffers(module, before, parameters, values)
    return RankProgram(torch_xla._XLAC._get_xla_tensors_hlo(outputs), torch_xla._XLAC._get_graph_hash(outputs),
                       values, parameters, outputs, transfers)


def _restore_updated_buffers(module: nn.Module, before: dict[int, tuple[str, str]],
                             parameters: Sequence[ProgramParameter], values: Sequence[torch.Tensor]) -> None:
    """Give every buffer the traced forward updated in place (an application's KV cache) its value from before
    the trace back. The updated value is an unexecuted graph holding the program's collectives: a later sync on
    this one device would run it alone and wait forever for the other ranks."""
    now = {path: tensor_id for tensor_id, (_, path) in module_tensor_names(module).items()}
    old_values = {p.name: v for p, v in zip(parameters, values)}
    for tensor_id, (_, path) in before.items():
        if now.get(path, tensor_id) == tensor_id:
            continue
        if path not in old_values:
            raise RuntimeError(f"{path}: the forward overwrote this buffer without reading it; the trace cannot "
                               "give it its old value back")
        owner_path, _, name = path.rpartition(".")
        # A new tensor in the module, not new data in the old one: the program's outputs may be that tensor.
        module.get_submodule(owner_path).register_buffer(
            name, old_values[path], persistent=name not in module.get_submodule(owner_path)._non_persistent_buffers_set)


def compile_program(program: RankProgram) -> int:
    """Compile ``program`` (cached by its graph hash; the replication set by :func:`replicated` makes it one
    replica of the world) and return the number of new compilations (0 when the hash was compiled before)."""
    torch_xla = import_torch_xla()
    met = torch_xla.debug.metrics
    before = met.counter_value("UncachedCompile") or 0
    torch_xla._XLAC._xla_warm_up_cache(program.outputs, [])
    return (met.counter_value("UncachedCompile") or 0) - before


def run_replicated(graph_hash: bytes, arguments: Sequence[Sequence[torch.Tensor]], devices: Sequence[str]
                   ) -> list[list[torch.Tensor]]:
    """Run the compiled program ``graph_hash`` on every device at once, device ``r`` with ``arguments[r]`` (its
    device tensors in HLO parameter order); returns each rank's outputs on the CPU. One thread per device, released
    together: XLA's CPU collectives wait for every rank of the same executable."""
    torch_xla = import_torch_xla()
    results: list[Any] = [None] * len(devices)
    barrier = threading.Barrier(len(devices))

    def run(rank: int) -> None:
        try:
            torch_xla._XLAC._xla_set_default_device(devices[rank])
            _materialize(arguments[rank], devices[rank])
            barrier.wait()
            results[rank] = [t.cpu() for t in torch_xla._XLAC._run_cached_graph(graph_hash, list(arguments[rank]))]
        except BaseException as e:  # reported by the caller's thread
            barrier.abort()
            results[rank] = e

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(devices))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rank, result in enumerate(results):
        if isinstance(result, BaseException) and not isinstance(result, threading.BrokenBarrierError):
            raise RuntimeError(f"rank {rank} failed running the SPMD program: {result}") from result
    return results


# ----------------------------------------------------------------------------------------------------------
# what the program communicates

_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%\S+ = (\([^()]*\)|\S+) (" + "|".join(COLLECTIVES) + r")\((.*?)\),"
                         r".*?replica_groups=(\{(?:\{[\d,]*\},?)*\})", re.MULTILINE)
_SHAPE = re.compile(r"([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _shape_bytes(text: str) -> int:
    """Bytes of the arrays in an HLO shape or operand list, scalars left out: the only scalars a collective carries
    are the ordering tokens ``torch_xla`` threads through its all-reduces."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if not dims:
            continue
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _BYTES[dtype]
    return total


def collective_summary(hlo_text: str) -> dict[str, dict]:
    """Per collective opcode in the HLO: ``count``, the distinct ``replica_groups`` and ``bytes_per_rank`` -- what one
    rank receives under the usual algorithms (:mod:`nxd_moe.parallel.collectives`' rule): all-gather ``(G-1)/G`` of
    its result, reduce-scatter ``G-1`` times its result, all-reduce ``2 (G-1)/G`` of its operand, all-to-all
    ``(G-1)/G`` of its operand (``G`` the group size)."""
    out: dict[str, dict] = {}
    for result, op, operands, groups_text in _COLLECTIVE.findall(hlo_text):
        groups = [[int(r) for r in g.split(",") if r] for g in re.findall(r"\{([\d,]*)\}", groups_text[1:-1])]
        size = len(groups[0])
        moved = {"all-gather": _shape_bytes(result) * (size - 1) // size,
                 "reduce-scatter": _shape_bytes(result) * (size - 1),
                 "all-reduce": 2 * _shape_bytes(operands) * (size - 1) // size,
                 "all-to-all": _shape_bytes(operands) * (size - 1) // size}[op]
        entry = out.setdefault(op, {"count": 0, "replica_groups": [], "bytes_per_rank": 0})
        entry["count"] += 1
        entry["bytes_per_rank"] += moved
        if groups not in entry["replica_groups"]:
            entry["replica_groups"].append(groups)
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------------------------------------
# inputs


def one_rank_token(full: nn.Module, experts: Sequence[int]) -> torch.Tensor:
    """``(H,)``: a hidden state the router sends to experts among ``experts`` (one EP rank's) only. The direction is
    the least-squares solution of ``router logits = +m`` on the first ``k`` of them and ``-m`` elsewhere; its length
    starts at a standard normal token's (``sqrt(H)``, so the outputs keep their usual size) and doubles until the
    router itself picks only ``experts`` (up to 64x; the last one is returned, and the report says where its pairs
    went)."""
    linear = full.router.linear_router
    weight = linear.weight.detach().double()
    k = full.router.top_k
    target = torch.full((weight.shape[0],), -8.0, dtype=torch.float64)
    target[list(experts[:k])] = 8.0
    if linear.bias is not None:
        target = target - linear.bias.detach().double()
    direction = torch.linalg.lstsq(weight, target.unsqueeze(1)).solution.squeeze(1)
    direction = direction * (weight.shape[1] ** 0.5 / direction.norm())
    allowed = set(experts)
    for scale in (1, 2, 4, 8, 16, 32, 64):
        x = direction * scale
        with torch.no_grad():
            chosen = full.router(x.to(linear.weight.dtype).unsqueeze(0))[2]
        if set(chosen.flatten().tolist()) <= allowed:
            break
    return x


def block_inputs(full: nn.Module, layout: SPMDLayout, tokens: int, mode: str, padding: bool = False,
                 seed: int = 0) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """``make_inputs`` for the whole world: ``i -> (hidden_states (G * B, S, H)[, padding_mask (G * B, S)])``, ``G``
    token groups (``D`` per MoE block), each one sequence of ``tokens`` (prefill) or ``tokens`` sequences of one
    token (decode). ``i = 0`` repeats one token aimed at EP rank 0's experts (every pair of the block on one rank;
    :class:`SPMDReport` says where they went); other ``i`` draw random tokens. ``padding`` masks the last quarter
    of each group's tokens."""
    groups = layout.expert_model_parallel_size * layout.expert_data_parallel_size
    shape = (groups, tokens) if mode == "prefill" else (groups * tokens, 1)
    dtype, hidden = full.expert_mlps.dtype, full.hidden_size
    ep = (layout.moe_decode_expert_model_parallel_size or layout.expert_model_parallel_size) if mode == "decode" \
        else layout.expert_model_parallel_size
    per_rank = full.router.num_experts // ep
    target = one_rank_token(full, range(per_rank))

    def make(i: int) -> tuple[torch.Tensor, ...]:
        if i == 0:
            x = target.expand(*shape, hidden)
        else:
            x = torch.randn(*shape, hidden, generator=torch.Generator().manual_seed(seed + i), dtype=torch.float64)
        x = x.to(dtype).contiguous()
        if not padding:
            return (x,)
        mask = torch.ones(groups, tokens, dtype=torch.bool)
        mask[:, tokens - max(1, tokens // 4):] = False
        return x, mask.view(shape)

    return make


def local_inputs(layout: SPMDLayout, block: Sequence[torch.Tensor], rank: int, mode: str) -> list[torch.Tensor]:
    sharded = layout.sequence_parallel and mode == "prefill"
    return [layout.local(t, rank, sharded).contiguous() for t in block]


# ----------------------------------------------------------------------------------------------------------
# the checks


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
    - ``parameters``: what each HLO parameter is (:class:`ProgramParameter`), ``hlo_text``: the program.
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


def _shared_values_equal(programs: Sequence[RankProgram]) -> bool:
    first = programs[0]
    for program in programs[1:]:
        for p, mine, theirs in zip(first.parameters, first.arguments, program.arguments, strict=True):
            if p.kind == "shared" and not torch.equal(mine.cpu(), theirs.cpu()):
                return False
    return True


def trace_world(ranks: Sequence[nn.Module], layout: SPMDLayout, world: Sequence[torch.Tensor], mode: str
                ) -> list[RankProgram]:
    """Every rank's program: rank ``r``'s layer (on its device, :func:`to_devices`) traced on its part of the
    world-wide inputs ``world`` (:meth:`SPMDLayout.local`). Call inside :func:`session`."""
    programs = []
    for rank, module in enumerate(ranks):
        device = device_of(module)
        inputs = [t.to(torch.device(device)) for t in local_inputs(layout, world, rank, mode)]
        _materialize(inputs, device)
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
    fallbacks = _fallback_counts(met)
    hashes, routing_ranks, diffs, refs = set(), [], [], []
    identical, compilations, transfers, host_sync = True, 0, 0, None
    first: RankProgram | None = None
    ep = (layout.moe_decode_expert_model_parallel_size or layout.expert_model_parallel_size) if mode == "decode" \
        else layout.expert_model_parallel_size
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
            identical &= _shared_values_equal(programs)
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
        fallback_ops=_new_fallbacks(met, fallbacks), max_abs_diff=max(diffs, default=float("inf")),
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
        "inputs": _describe([a for p, a in zip(program.parameters, program.arguments) if p.kind == "input"]),
        "parameters": parameters,
    }


# ----------------------------------------------------------------------------------------------------------
# nxd-moe trace --tp --ep


def spmd_layout_from_args(args: argparse.Namespace) -> SPMDLayout | None:
    """The layout ``nxd-moe trace``'s parallel flags ask for, or None for a single-device trace."""
    layout = SPMDLayout(args.tp, args.ep, args.sp, args.decode_tp, args.decode_ep)
    if layout.world_size == 1 and not args.sp and args.decode_tp is None and args.decode_ep is None:
        return None
    return layout


def neuronx_cc_command(out_dir: str, layout: SPMDLayout, lnc: int) -> dict:
    """The compile command for the exported program, and the cores it runs on."""
    return {
        "command": f"neuronx-cc compile {out_dir}/model.hlo_module.pb --framework XLA --target trn2 --lnc {lnc} "
                   f"--model-type transformer --auto-cast none --output {out_dir}/model.neff",
        "lnc": lnc,
        "world_size": layout.world_size,
        "physical_neuron_cores": layout.world_size * lnc,
    }


def trace(args: argparse.Namespace, layout: SPMDLayout) -> dict:
    """``nxd-moe trace`` for a parallel layout: build every rank's layer, check the SPMD program over
    ``args.routings`` routings on ``world_size`` XLA CPU devices, export it; the report extends the single-device
    one (``parallel``, ``collectives``, ``shards``, ``neuronx_cc``)."""
    from nxd_moe.build import build_moe
    from nxd_moe.config import ExpertParallelConfig
    from nxd_moe.trace import layer_report, setup

    run = setup(args)
    layout.check(run.model.num_experts, run.tokens, args.mode)  # bad layouts fail here, before anything is built
    dispatch = "all_to_all_v" if args.dispatch == "all_to_all" else args.dispatch

    def build(**kwargs) -> nn.Module:
        return build_moe(run.model, scale=run.scale, dtype=run.dtype, seed=args.seed,
                         sequence_parallel=layout.sequence_parallel,
                         expert_parallel_config=ExpertParallelConfig(dispatch), **run.overrides, **kwargs)

    devices = xla_devices(layout.world_size)
    full, ranks = build_rank_layers(build, layout)
    atol = args.atol if args.atol is not None else (1e-5 if run.dtype in (torch.float32, torch.float64) else 6e-2)
    make_inputs = block_inputs(full, layout, run.tokens, args.mode, args.padding, args.seed)
    with torch.no_grad():
        stats = full(*make_inputs(1), return_stats=True)[-1].summary()
    to_devices(ranks, devices)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    static = check_spmd(full, ranks, layout, make_inputs, args.mode, n=args.routings, atol=atol)
    whole = {k: v.shape for k, v in full.state_dict().items()}
    exported = export_spmd(ranks, layout, make_inputs(1), args.mode, out_dir, whole) if static.host_sync is None else {}
    report = layer_report(args, run, full, stats, experts=ranks[0].expert_mlps)
    report.update({
        "parallel": {**layout.to_dict(), "dispatch": dispatch, "token_groups": layout.expert_model_parallel_size},
        "export": {"skipped": "SPMD program: torch.export and torch.compile have no XLA collectives; the XLA "
                              "checks below are the proof"},
        "compile": {"skipped": "SPMD program (see export)"},
        "xla": {"hlo": exported, "check_static": static.to_dict()},
        "collectives": static.collectives,
        "neuronx_cc": neuronx_cc_command(str(out_dir), layout, args.lnc),
    })
    report["ok"] = static.ok
    (out_dir / "trace.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


LABEL = 27


def format_report(report: dict, out_dir: str) -> str:
    par, static = report["parallel"], report["xla"]["check_static"]
    hlo = report["xla"]["hlo"]
    decode = ""
    if par["moe_decode_tensor_model_parallel_size"] or par["moe_decode_expert_model_parallel_size"]:
        decode = (f", decode TP {par['moe_decode_tensor_model_parallel_size']} EP "
                  f"{par['moe_decode_expert_model_parallel_size']}")
    lines = [
        f"nxd-moe trace: {report['config']}  (scale 1/{report['scale']}: H={report['hidden_size']}, "
        f"E={report['num_experts']}, k={report['top_k']}, router={report['router']}; {report['dtype']})",
        f"SPMD program for {par['world_size']} ranks: TP {par['tensor_model_parallel_size']} x EP "
        f"{par['expert_model_parallel_size']}{decode}, sequence parallel {'on' if par['sequence_parallel'] else 'off'}"
        f", dispatch {par['dispatch']}; rank = an s32[1] input (SPMDRank)",
        f"{report['mode']} {report['tokens']} tokens per token group ({par['token_groups']} groups)"
        f"{' with padding' if report['padding'] else ''} -> {report['experts_mode']}, expert weights "
        f"{describe_weights(report['quantization'], report['dtype'])}",
    ]
    ok = "ok" if static["static"] else "FAILED"
    lines.append(f"{'one program':<{LABEL}}{ok}: {static['routings']} routings x {static['world_size']} ranks -> "
                 f"{static['graphs']} graph, identical on every rank {static['identical_across_ranks']}, "
                 f"{static['compilations']} compilation, {static['transfers_during_trace']} host transfers, fallbacks "
                 f"{static['fallback_ops'] or 'none'}" + (f"; {static['host_sync']}" if static["host_sync"] else ""))
    lines.append(f"{'routings':<{LABEL}}EP ranks receiving pairs: {static['routing_ranks']}")
    ok = "ok" if static["matches_single_device"] else "FAILED"
    lines.append(f"{'run on ' + str(static['world_size']) + ' XLA devices':<{LABEL}}{ok}: max |rank output - "
                 f"single-device layer| {static['max_abs_diff']:.2e} (max |output| {static['max_abs_ref']:.2e}, "
                 f"atol {static['atol']:g} relative above 1)")
    for op, c in report["collectives"].items():
        lines.append(f"    {op:<15} x{c['count']:<3} replica_groups {c['replica_groups']}, "
                     f"{c['bytes_per_rank'] / 1024:.1f} KiB received per rank")
    if hlo:
        lines.append(f"{'files':<{LABEL}}{out_dir}/{hlo['files']['hlo_proto']} ({hlo['hlo_instructions']} "
                     f"instructions), {out_dir}/{hlo['files']['parameters']}, {out_dir}/shards/rank*.pt")
        cc = report["neuronx_cc"]
        lines.append(f"compile for Trainium2 ({cc['world_size']} ranks, {cc['physical_neuron_cores']} NeuronCores at "
                     f"LNC {cc['lnc']}): {cc['command']}")
    lines.append("all checks passed" if report["ok"] else "SOME CHECKS FAILED")
    return "\n".join(lines)
