"""``nki.isa`` instructions beyond the core set in :mod:`nxd_moe.nki_kernels.isa`, one module per family:

- :mod:`.top8`: ``max8``, ``nc_find_index8``, ``nc_match_replace8``, ``topk`` (the top-k building blocks);
- :mod:`.select`: ``affine_select``, ``range_select``, ``select_reduce``, ``sequence_bounds`` (masks and
  selections, e.g. attention masks);
- :mod:`.scan`: ``tensor_tensor_scan``, ``tensor_scalar_cumulative``, ``tensor_partition_reduce`` (recurrences
  along the free axis, reductions across partitions);
- :mod:`.gather`: ``nc_n_gather`` (a gather within each partition);
- :mod:`.prng`: ``rng``, ``dropout``, ``set_rng_seed``, ``rand_set_state``, ``rand_get_state`` (the engines'
  random number generators);
- :mod:`.trn3`: ``activate2``, ``exponential``, ``rand2`` -- NeuronCore-v4 (Trn3) only: they raise
  :class:`~nxd_moe.nki_kernels.instructions.trn3.Trn3OnlyError`.

:mod:`nxd_moe.nki_kernels.isa` re-exports every name, so ``nki.isa`` (``nisa``) is still one namespace. Each
follows the NKI API reference's signature, checks its documented limits (raising
:class:`~nxd_moe.nki_kernels.machine.HardwareLimitError`), computes in fp32, rounds to the destination and is
counted on its engine. The family modules are leaves: each imports only
:mod:`~nxd_moe.nki_kernels.instruction_support` (what every instruction shares), ``machine`` and ``language``, never
``isa`` or a sibling (``tests/test_bad_input.py::test_instruction_modules_are_leaves`` enforces it).
"""
