"""The ``nki.isa`` instructions, one module per family:

- :mod:`.matmul`: ``nc_matmul``, ``nc_transpose`` (the Tensor Engine);
- :mod:`.arithmetic`: ``activation``, ``activation_reduce``, ``tensor_tensor``, ``tensor_scalar``,
  ``scalar_tensor_tensor``, ``reciprocal``, ``tensor_reduce``, ``tensor_scalar_reduce`` (the Scalar and Vector
  Engines' arithmetic, and their accumulator registers);
- :mod:`.copy`: ``tensor_copy``, ``tensor_copy_predicated``, ``memset``, ``iota``, ``dequantize`` (writing tiles
  without ALU arithmetic);
- :mod:`.stats`: ``bn_stats``, ``bn_aggr`` (batch-norm statistics);
- :mod:`.dma`: ``dma_copy``, ``dma_compute``, ``dma_transpose`` (the DMA queues);
- :mod:`.registers`: ``register_alloc``, ``register_move``, ``register_load``, ``register_store``;
- :mod:`.cores`: ``core_barrier``, ``sendrecv`` (the two cores of an LNC2 logical core);
- :mod:`.top8`: ``max8``, ``nc_find_index8``, ``nc_match_replace8``, ``topk`` (the top-k building blocks);
- :mod:`.select`: ``affine_select``, ``range_select``, ``select_reduce``, ``sequence_bounds`` (masks and
  selections, e.g. attention masks);
- :mod:`.scan`: ``tensor_tensor_scan``, ``tensor_scalar_cumulative``, ``tensor_partition_reduce`` (recurrences
  along the free axis, reductions across partitions);
- :mod:`.gather`: ``nc_n_gather``, ``local_gather``, ``nonzero_with_count`` (gathers within each partition),
  ``nc_stream_shuffle`` (across the partitions of a quadrant);
- :mod:`.prng`: ``rng``, ``dropout``, ``set_rng_seed``, ``rand_set_state``, ``rand_get_state`` (the engines'
  random number generators);
- :mod:`.trn3`: ``activate2``, ``exponential``, ``rand2``, ``quantize_mx``, ``nc_matmul_mx`` -- NeuronCore-v4
  (Trn3) only: they raise :class:`~nxd_moe.nki_kernels.hardware.Trn3OnlyError`.

:mod:`nxd_moe.nki_kernels.isa` re-exports every name, so ``nki.isa`` (``nisa``) is one namespace. Each follows the
NKI API reference's signature, checks its documented limits (raising
:class:`~nxd_moe.nki_kernels.hardware.HardwareLimitError`), computes in fp32, rounds to the destination and is
counted on its engine. The family modules are leaves: each imports only
:mod:`~nxd_moe.nki_kernels.instruction_support` (what every instruction shares) and the modules below it (the
machine, tensors, dtypes, opcodes, ``isa_constants``), never ``isa`` or a sibling
(``tests/test_bad_input.py::test_instruction_modules_are_leaves`` enforces it).
"""
