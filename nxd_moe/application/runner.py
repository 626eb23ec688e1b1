"""Running the programs: state on the device, one step at a time, eagerly or replayed from CUDA graphs.

:class:`ProgramRunner` owns the generation state as fixed device buffers -- the last token of each sequence
``(B,)``, its position ``(B,)``, whether it is done ``(B,)``, every token generated so far ``(B, max_length)``, the
step counter, the EOS ids and pad id, the sampling parameters ``(B, 3)`` -- and two steps that read and write only
those buffers and the KV cache:

- :meth:`~ProgramRunner.context_encoding` of a bucket: the prompts in that bucket's input buffers -> first tokens,
  state initialised for their cache lines;
- :meth:`~ProgramRunner.token_generation` of a bucket: one token for every sequence, state advanced.

Because a step's inputs are the state it left, token generation needs nothing from the host: on CUDA each bucket's
step is captured once as a CUDA graph (token generation optionally compiled by Inductor first) and replayed back to
back, the host only choosing the bucket (known from the step count) -- no synchronisation per token.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from nxd_moe.application.config import ApplicationConfig
from nxd_moe.application.fused_projections import compile_with_fused_projections
from nxd_moe.application.programs import CausalLMPrograms, finish
from nxd_moe.graphs import replayed_steps

__all__ = ["MAX_EOS_TOKENS", "ProgramRunner"]

# EOS ids a generate call may give (a static buffer; -1 fills the rest and matches no token).
MAX_EOS_TOKENS = 8

# Compiled token-generation steps made in this process: every runner's step is the same code, whose compiled
# variants (one per runner and bucket) Dynamo counts against one recompile limit.
_compiled_steps = 0


class ProgramRunner:
    """Executes ``programs`` under ``config``. ``sampling``: the programs draw tokens (top-k / top-p /
    temperature, one parameter row per sequence) instead of taking the argmax. ``cuda_graphs``: capture each
    step per bucket and replay it (CUDA only). ``compile_token_generation``: compile the token-generation step with
    ``torch.compile`` (Inductor, no CUDA graphs of its own; the projections of one input as one GEMM where their
    weights are stacked, :mod:`~nxd_moe.application.fused_projections`) before capturing it."""

    def __init__(self, programs: CausalLMPrograms, config: ApplicationConfig, *, sampling: bool,
                 cuda_graphs: bool = False, compile_token_generation: bool = False, shared_pool: bool = True):
        self.programs, self.config, self.sampling = programs, config, sampling
        device = next(programs.cache.buffers()).device
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, it is on {device}")
        self.device, self.cuda_graphs = device, cuda_graphs
        batch, length = config.batch_size, config.max_length
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, **long)
        self.positions = torch.zeros(batch, **long)
        self.done = torch.ones(batch, dtype=torch.bool, device=device)
        self.out = torch.zeros(batch, length, **long)
        self.step = torch.zeros(1, **long)
        self.eos_token_ids = torch.full((MAX_EOS_TOKENS,), -1, **long)
        self.pad_token_id = torch.zeros((), **long)
        self.sampling_params = torch.ones(batch, 3, dtype=torch.float32, device=device)
        rows = config.ctx_batch_size
        self.context_inputs = {
            bucket: (torch.zeros(rows, bucket, **long), torch.ones(rows, **long), torch.arange(rows, **long),
                     torch.zeros(rows, dtype=torch.bool, device=device))
            for bucket in config.context_encoding_buckets}
        self._token_generation_fn: Callable[[int], None] = self._token_generation_eager
        if compile_token_generation:
            global _compiled_steps
            _compiled_steps += len(config.token_generation_buckets)
            compiled = torch.compile(self._token_generation_eager, backend=compile_with_fused_projections,
                                     fullgraph=True, dynamic=False)

            def compiled_step(bucket: int) -> None:
                # compiled without Inductor's CUDA-graph trees (this runner captures the step itself), so the
                # layer's kernels may keep their scratch across calls as in an eager step
                with kept_kernel_memory():
                    compiled(bucket)

            self._token_generation_fn = compiled_step
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.shared_pool = shared_pool

    # ------------------------------------------------------------------------------------------------------
    # the two steps, as functions of the state buffers

    def _context_encoding_eager(self, bucket: int) -> None:
        ids, lengths, seq_ids, active = self.context_inputs[bucket]
        params = self.sampling_params.index_select(0, seq_ids) if self.sampling else None
        sampled, _ = self.programs.context_encoding(ids, lengths, seq_ids, params)
        tokens, done = finish(sampled, ~active, self.eos_token_ids, self.pad_token_id)
        self.tokens.index_copy_(0, seq_ids, tokens)
        self.positions.index_copy_(0, seq_ids, lengths)
        self.done.index_copy_(0, seq_ids, done)
        self.out.select(1, 0).index_copy_(0, seq_ids, tokens)
        self.step.fill_(1)

    def _token_generation_eager(self, bucket: int) -> None:
        params = self.sampling_params if self.sampling else None
        tokens, done = self.programs.token_generation(self.tokens, self.positions, self.done, bucket,
                                                      self.eos_token_ids, self.pad_token_id, params)
        self.out.scatter_(1, self.step.view(1, 1).expand(tokens.shape[0], 1), tokens[:, None])
        self.tokens.copy_(tokens)
        self.done.copy_(done)
        self.positions.add_(1)
        self.step.add_(1)

    # ------------------------------------------------------------------------------------------------------

    def context_encoding(self, bucket: int) -> None:
        self._run(("context_encoding", bucket), self._context_encoding_eager, bucket)

    def token_generation(self, bucket: int) -> None:
        self._run(("token_generation", bucket), self._token_generation_fn, bucket)

    @torch.no_grad()
    def _run(self, key: tuple[str, int], step: Callable[[int], None], bucket: int) -> None:
        if not self.cuda_graphs:
            with _recompile_limit(_compiled_steps + 8):
                step(bucket)
            return
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(step, bucket)
            self.graphs[key] = graph
        graph.replay()

    def _capture(self, step: Callable[[int], None], bucket: int) -> torch.cuda.CUDAGraph:
        # warm-up on a side stream (kernel compilation, Inductor's autotuning, device tables the layer caches),
        # then the capture on that same stream: what the layer keeps per stream (the one-launch decode's counters
        # and scratch) is then made eagerly, never inside a graph; every graph shares one memory pool (one step
        # runs at a time)
        saved = [t.clone() for t in self.state_tensors()]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), _recompile_limit(_compiled_steps + 8), replayed_steps():
            for _ in range(2):
                step(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        if self._pool is None or not self.shared_pool:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side), _recompile_limit(_compiled_steps + 8), \
                replayed_steps():
            step(bucket)
        for t, s in zip(self.state_tensors(), saved):  # the warm-up and capture ran the step: undo it
            t.copy_(s)
        return graph

    def capture_all(self) -> None:
        """Capture every bucket's steps now (what ``load`` does), so no generate call captures."""
        for bucket in self.config.context_encoding_buckets:
            self.context_encoding(bucket)
        for bucket in self.config.token_generation_buckets:
            self.token_generation(bucket)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.tokens, self.positions, self.done, self.out, self.step]


def kept_kernel_memory() -> contextlib.AbstractContextManager:
    """:func:`nxd_moe.triton_kernels.plain_compiled_graphs` where the Triton kernels import, else nothing to do."""
    try:
        from nxd_moe.triton_kernels import plain_compiled_graphs
    except ImportError:  # no Triton: no kernel keeps memory
        return contextlib.nullcontext()
    return plain_compiled_graphs()


@contextlib.contextmanager
def _recompile_limit(at_least: int):
    """Dynamo's per-function recompile limit raised to ``at_least`` (its default, 8, would fail the ninth compiled
    step under ``fullgraph=True``)."""
    import torch._dynamo

    config = torch._dynamo.config
    names = [n for n in ("recompile_limit", "cache_size_limit") if hasattr(config, n)]
    values = {n: max(getattr(config, n), at_least) for n in names}
    with config.patch(**values):
        yield
