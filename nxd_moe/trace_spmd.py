"""Parallel layouts as ONE SPMD program: the parallel MoE traced under ``torch_xla`` for every rank at once. The
public names of the SPMD modules of :mod:`nxd_moe.tracing`, where the code lives (this module re-exports them, so
``from nxd_moe.trace_spmd import ...`` keeps working):

- :class:`SPMDLayout`, :func:`build_rank_layers`: a layout and each rank's layer (:mod:`nxd_moe.tracing.spmd_layout`);
- :func:`xla_devices`, :func:`replicated`: one XLA CPU device per rank, compiling as one replica of them
  (:mod:`nxd_moe.tracing.xla`);
- :func:`trace_rank`, :func:`compile_program`, :func:`run_replicated`: one rank's program traced lazily, compiled
  once, run on every device at once (:mod:`nxd_moe.tracing.spmd_program`);
- :func:`check_spmd`, :func:`export_spmd`: several routings checked against the single-device layer; the HLO, the
  per-rank shards and the parameter map written (:mod:`nxd_moe.tracing.spmd`);
- ``nxd-moe trace --tp --ep`` runs both (:func:`trace`, :mod:`nxd_moe.tracing.spmd_command`).
"""

from __future__ import annotations

from nxd_moe.tracing.collectives import COLLECTIVES, collective_summary
from nxd_moe.tracing.hlo import (
    ProgramParameter,
    hlo_op_histogram,
    hlo_parameters,
    module_tensor_names,
    save_parameter_values,
)
from nxd_moe.tracing.inputs import block_inputs, local_inputs, one_rank_token
from nxd_moe.tracing.report_lines import LABEL
from nxd_moe.tracing.spmd import SPMDReport, check_spmd, export_spmd, shared_values_equal, trace_world
from nxd_moe.tracing.spmd_command import format_layout_report as format_report
from nxd_moe.tracing.spmd_command import neuronx_cc_command, spmd_layout_from_args
from nxd_moe.tracing.spmd_command import trace_layout as trace
from nxd_moe.tracing.spmd_layout import SPMDLayout, build_rank_layers
from nxd_moe.tracing.spmd_program import (
    RankProgram,
    compile_program,
    run_replicated,
    session,
    to_devices,
    trace_rank,
)
from nxd_moe.tracing.xla import device_of, import_torch_xla, replicated, xla_devices

__all__ = [
    "COLLECTIVES", "LABEL", "ProgramParameter", "RankProgram", "SPMDLayout", "SPMDReport", "block_inputs",
    "build_rank_layers", "check_spmd", "collective_summary", "compile_program", "device_of", "export_spmd",
    "format_report", "hlo_op_histogram", "hlo_parameters", "import_torch_xla", "local_inputs", "module_tensor_names",
    "neuronx_cc_command", "one_rank_token", "replicated", "run_replicated", "save_parameter_values", "session",
    "shared_values_equal", "spmd_layout_from_args", "to_devices", "trace", "trace_rank", "trace_world",
    "xla_devices",
]
