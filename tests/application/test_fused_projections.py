"""The projections of one input as one GEMM in the compiled token step (nxd_moe.application.fused_projections):
the weights stacked in place with their values unchanged, the captured graph's linear calls on one input fused into
one over the stacked rows with the same outputs (float64), and nothing fused where the weights are not stacked or
the inputs differ; the application's compiled token step gives the eager step's tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nxd_moe.application import ApplicationConfig, CausalLMApplication
from nxd_moe.application.fused_projections import fuse_projections, share_projection_storage, stacked_rows

H = 24


class Block(nn.Module):
    """q, k, v of one input (``k_input="other"``: k of another), o of their sum, and one module called twice."""

    def __init__(self, bias: bool, k_input: str = "same"):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(H, 32, bias=bias), nn.Linear(H, 8, bias=bias), nn.Linear(H, 8, bias=bias)
        self.o = nn.Linear(48, H, bias=bias)
        self.twice = nn.Linear(H, H, bias=False)
        self.k_input = k_input

    def forward(self, x):
        other = self.twice(self.twice(x))
        q = self.q(x)
        k = self.k(other if self.k_input == "other" else x)
        return self.o(torch.cat([q, k, self.v(x)], dim=-1)) + other


def _block(bias: bool, **kw) -> Block:
    torch.manual_seed(3)
    return Block(bias, **kw).double()


def _captured(block: Block, x: torch.Tensor):
    """Dynamo's graph of ``block`` fused by ``fuse_projections`` -> (linear calls before, after, outputs of the fused
    graph run eagerly)."""
    seen = {}

    def backend(gm, example_inputs):
        fused = fuse_projections(gm, example_inputs)
        count = lambda g: sum(n.target is torch._C._nn.linear for n in g.graph.nodes)  # noqa: E731
        seen.update(before=count(gm), after=count(fused))
        return fused.forward

    torch._dynamo.reset()
    out = torch.compile(block, backend=backend, fullgraph=True)(x)
    return seen["before"], seen["after"], out


@pytest.mark.parametrize("bias", [False, True])
def test_projections_of_one_input_become_one_gemm(bias):
    block = _block(bias)
    x = torch.randn(3, H, dtype=torch.float64)
    expected = block(x)
    values = {name: p.detach().clone() for name, p in block.named_parameters()}
    assert share_projection_storage(block, lambda: block(x)) == 1
    for name, p in block.named_parameters():  # the same values, now rows of one tensor
        assert torch.equal(p, values[name])
    assert stacked_rows([block.q.weight, block.k.weight, block.v.weight]) is not None
    if bias:
        assert stacked_rows([block.q.bias, block.k.bias, block.v.bias]) is not None
    assert stacked_rows([block.o.weight, block.twice.weight]) is None
    before, after, out = _captured(block, x)
    assert (before, after) == (6, 4)  # q, k, v -> one; o and the twice-called module stay
    # the same dot products of H float64 terms, maybe summed in another order
    torch.testing.assert_close(out, expected, rtol=0, atol=H * 2.0 ** -52 * 16)


def test_nothing_is_fused_where_weights_are_not_stacked_or_inputs_differ():
    x = torch.randn(3, H, dtype=torch.float64)
    assert _captured(_block(True), x)[:2] == (6, 6)  # not stacked: each its own GEMM
    other = _block(False, k_input="other")
    assert share_projection_storage(other, lambda: other(x)) == 1  # q and v only
    assert stacked_rows([other.q.weight, other.k.weight]) is None
    assert _captured(other, x)[:2] == (6, 5)
    # a stacked group whose parameter is re-pointed since is no longer fused
    block = _block(False)
    share_projection_storage(block, lambda: block(x))
    block.k.weight.data = block.k.weight.detach().clone()
    assert _captured(block, x)[:2] == (6, 6)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_the_compiled_token_step_with_fused_projections_gives_the_eager_tokens(name):
    """Inductor on the CPU, float32, three token-generation buckets (a recompile each): the compiled step, its q/k/v
    (GPT-OSS: with biases) one GEMM, gives the eager application's greedy tokens."""
    from nxd_moe.models.hf_models import build_hf_model

    config = ApplicationConfig(batch_size=3, seq_len=64, max_context_length=32, torch_dtype="float32",
                               context_encoding_buckets=[8, 32], token_generation_buckets=[16, 32, 64])
    ids = torch.randint(1, 100, (3, 11), generator=torch.Generator().manual_seed(5))

    def tokens(compiled: bool):
        torch._dynamo.reset()
        app = CausalLMApplication(build_hf_model(name, num_layers=2, scale=32, seed=1), config, cuda_graphs=False,
                                  compile_token_generation=compiled)
        if compiled:
            attention = app.model.model.layers[0].self_attn
            assert stacked_rows([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]) is not None
        return app.generate(ids, max_new_tokens=40, eos_token_id=[]).sequences

    assert torch.equal(tokens(True), tokens(False))
