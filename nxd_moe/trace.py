"""Prove that an MoE forward is one static graph, and export it for ``neuronx-cc``: the public names of
:mod:`nxd_moe.tracing`, where the code lives (this module re-exports them, so ``from nxd_moe.trace import ...``
keeps working).

- :func:`check_static` runs the forward under XLA for several routings and reports how many distinct graphs were
  traced and compiled, the host syncs and CPU fallbacks seen while tracing, and the largest difference from eager
  PyTorch; :func:`export_hlo` writes the HLO module of one forward (text and ``HloModuleProto``), its parameter map
  and ``report.json`` (:mod:`nxd_moe.tracing.single_device`, :mod:`nxd_moe.tracing.hlo`);
- :func:`export_program` (``torch.export``, strict) and :func:`compile_check` (``torch.compile(fullgraph=True)``)
  check the same property without ``torch_xla``, on any torch (:mod:`nxd_moe.tracing.static_graph`);
- ``nxd-moe trace`` does all of it for a shipped config; with ``--model-layers`` for a whole transformers decoder
  of its architecture, one decode step or one prefill over a static KV cache (:mod:`nxd_moe.tracing.command`).

``torch_xla`` is imported only by the functions that need it (``pip install -e '.[xla]'``, which moves the
environment to torch 2.9). Without ``PJRT_DEVICE`` set, the XLA CPU client is used.
"""

from __future__ import annotations

from nxd_moe.tracing.block_counts import BlockCount
from nxd_moe.tracing.command import HELP, add_arguments, main, trace
from nxd_moe.tracing.decoder_command import format_model_report, trace_model
from nxd_moe.tracing.hlo import (
    ProgramParameter,
    hlo_entry_parameters,
    hlo_op_histogram,
    hlo_parameters,
    input_names,
    module_tensor_names,
    run_exported,
    save_parameter_values,
)
from nxd_moe.tracing.inputs import model_inputs, moe_inputs, routing_summary
from nxd_moe.tracing.layer_command import format_layer_report as format_report
from nxd_moe.tracing.layer_command import layer_report
from nxd_moe.tracing.options import (
    DEFAULT_CACHE_LENGTH,
    DEFAULT_MODEL_TOKENS,
    DEFAULT_TOKENS,
    DYNAMIC_WHILE_FLAGS,
    TraceSetup,
    setup,
)
from nxd_moe.tracing.report_lines import LABEL
from nxd_moe.tracing.single_device import StaticReport, check_static, export_hlo
from nxd_moe.tracing.static_graph import (
    SYNC_OPS,
    CompileReport,
    DataDependentGraph,
    ExportReport,
    assert_static_graph,
    compile_check,
    data_dependence,
    export_program,
    static_backend,
)
from nxd_moe.tracing.tensors import Inputs
from nxd_moe.tracing.xla import XLA_INSTALL_HINT, import_torch_xla

__all__ = [
    "DEFAULT_CACHE_LENGTH", "DEFAULT_MODEL_TOKENS", "DEFAULT_TOKENS", "DYNAMIC_WHILE_FLAGS", "HELP", "LABEL",
    "SYNC_OPS", "XLA_INSTALL_HINT", "BlockCount", "CompileReport", "DataDependentGraph", "ExportReport", "Inputs",
    "ProgramParameter", "StaticReport", "TraceSetup", "add_arguments", "assert_static_graph", "check_static",
    "compile_check", "data_dependence", "export_hlo", "export_program", "format_model_report", "format_report",
    "hlo_entry_parameters", "hlo_op_histogram", "hlo_parameters", "import_torch_xla", "input_names", "layer_report",
    "main", "model_inputs", "module_tensor_names", "moe_inputs", "routing_summary", "run_exported",
    "save_parameter_values", "setup", "static_backend", "trace", "trace_model",
]
