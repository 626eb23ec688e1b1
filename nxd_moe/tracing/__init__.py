"""Proof that an MoE forward is one static graph, and its export for ``neuronx-cc``: one layer or a whole decoder
on one device, or a parallel layout as ONE SPMD program for every rank. :mod:`nxd_moe.trace` and
:mod:`nxd_moe.trace_spmd` re-export the public names; the modules, each importing only the ones listed before it:

- :mod:`~nxd_moe.tracing.tensors`: the tensors of a pytree, described and compared;
- :mod:`~nxd_moe.tracing.static_graph`: ``torch.export`` and ``torch.compile(fullgraph)`` checks (no torch_xla);
- :mod:`~nxd_moe.tracing.xla`: ``torch_xla`` imported on first use, its metrics and devices;
- :mod:`~nxd_moe.tracing.hlo`: an HLO's entry parameters, the files a runtime feeds them from, its op histogram;
- :mod:`~nxd_moe.tracing.collectives`: what an SPMD program's HLO communicates;
- :mod:`~nxd_moe.tracing.block_counts`: the blocks a dynamic-while forward computed, counted on the device;
- :mod:`~nxd_moe.tracing.eager_parity`: XLA against eager, eager routed as XLA routed;
- :mod:`~nxd_moe.tracing.single_device`: ``check_static`` and ``export_hlo`` on one XLA device;
- :mod:`~nxd_moe.tracing.spmd_layout`: a parallel layout as one SPMD program, and each rank's layer;
- :mod:`~nxd_moe.tracing.inputs`: inputs that vary the routing (a layer, a decoder step, an SPMD world);
- :mod:`~nxd_moe.tracing.spmd_program`: one rank's program traced, compiled once, run on every device;
- :mod:`~nxd_moe.tracing.spmd`: ``check_spmd`` and ``export_spmd``;
- ``nxd-moe trace``: :mod:`~nxd_moe.tracing.options` (its arguments resolved), :mod:`~nxd_moe.tracing.report_lines`,
  :mod:`~nxd_moe.tracing.layer_command`, :mod:`~nxd_moe.tracing.decoder_command` (the one module above the model
  layer: transformers), :mod:`~nxd_moe.tracing.spmd_command` and :mod:`~nxd_moe.tracing.command` (flags, entry
  point).

``torch_xla`` and ``transformers`` are optional: imported by the functions that need them, never on import.
"""
