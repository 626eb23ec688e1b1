"""The projections of one input as one GEMM in the compiled token step (nxd_moe.application.fused_projections):
the weights stacked in place with their values unchanged, the captured graph's linear calls on one input fused into
one over the stacked rows with the same outputs (float64), and nothing fused where the weights are not stacked or
the inputs differ; the application's compiled token step gives the eager step's tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nxd_moe.application import ApplicationConfig, CausalLMApplication
from nxd_moe.application import fused_projections as fp
from nxd_moe.application.fused_projections import fuse_projections, share_projection_storage, stacked_rows

H = 24


class Block(nn.Module):
    """q, k, v of one input -- ``k_input="other"``: k of another; ``calls``: as modules, or as ``F.linear(x,
    weight=..., bias=...)`` (``"keywords"``) or ``F.linear(x, weight[, bias])`` (``"positional"``) -- with q used before
    k is made; o of their concatenation; a module called twice; a linear whose
    weight is computed; element-wise ops of one input with two stacked biases."""

    def __init__(self, bias: bool, k_input: str = "same", calls: str = "modules"):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(H, 32, bias=bias), nn.Linear(H, 8, bias=bias), nn.Linear(H, 8, bias=bias)
        self.o = nn.Linear(48, H, bias=bias)
        self.twice = nn.Linear(H, H, bias=False)
        self.k_input, self.calls = k_input, calls

    def project(self, module: nn.Linear, x):
        if self.calls == "keywords":
            return F.linear(x, weight=module.weight, bias=module.bias)
        if self.calls == "positional":
            return F.linear(x, module.weight) if module.bias is None else F.linear(x, module.weight, module.bias)
        return module(x)

    def forward(self, x):
        other = self.twice(self.twice(x))
        q = torch.tanh(self.project(self.q, x))
        k = self.project(self.k, other if self.k_input == "other" else x)
        out = self.o(torch.cat([q, k, self.project(self.v, x)], dim=-1)) + other + F.linear(x, self.o.weight[:, :H])
        if self.k.bias is not None:  # not linear calls, though of one input and stacked parameters
            y = x[..., :8]
            out = out + (torch.add(y, self.k.bias) * torch.add(y, self.v.bias)).sum(-1, keepdim=True)
        return out


def _blocks(bias: bool, count: int = 1, **kw) -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(*[Block(bias, **kw) for _ in range(count)]).double()


def _input():
    return torch.randn(3, 1, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))


def _linear_calls(gm) -> int:
    return sum(n.target in (torch._C._nn.linear, F.linear) for n in gm.graph.nodes)


def _captured(model: nn.Module, x: torch.Tensor):
    """Dynamo's graph of ``model`` fused by ``fuse_projections`` -> (linear calls before, after, whether the graph
    was returned unchanged, outputs of the fused graph run eagerly)."""
    seen = {}

    def backend(gm, example_inputs):
        fused = fuse_projections(gm, example_inputs)
        seen.update(before=_linear_calls(gm), after=_linear_calls(fused), same=fused is gm)
        return fused.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    return seen["before"], seen["after"], seen["same"], out


def _close(actual, expected):
    # the same dot products of <= 48 float64 terms, maybe summed in another order
    torch.testing.assert_close(actual, expected, rtol=0, atol=48 * 2.0 ** -52 * 64)


@pytest.mark.parametrize("bias, calls", [(False, "modules"), (True, "modules"), (True, "keywords"),
                                         (False, "positional")])
def test_projections_of_one_input_become_one_gemm(bias, calls):
    """Three blocks: each one's q, k, v (module calls or F.linear's, with or without biases) one GEMM, the rest as
    it was, the outputs equal."""
    model = _blocks(bias, count=3, calls=calls)
    x = _input()
    expected = model(x)
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert share_projection_storage(model, lambda: model(x)) == (3 if calls == "modules" else 0)
    if calls != "modules":  # F.linear calls are not modules: stack them the way the probe would
        for block in model:
            fp._stack([block.q.weight, block.k.weight, block.v.weight])
            if bias:
                fp._stack([block.q.bias, block.k.bias, block.v.bias])
    for name, p in model.named_parameters():  # the same values, now rows of one tensor
        assert torch.equal(p, values[name])
    for block in model:
        assert stacked_rows([block.q.weight, block.k.weight, block.v.weight]) is not None
        if bias:
            assert stacked_rows([block.q.bias, block.k.bias, block.v.bias]) is not None
        assert stacked_rows([block.o.weight, block.twice.weight]) is None
    before, after, same, out = _captured(model, x)
    assert (before, after, same) == (21, 15, False)  # per block q, k, v -> one; o, twice (x2), the computed one stay
    _close(out, expected)


def test_calls_fuse_in_the_order_of_their_rows_not_of_the_graph():
    """Stacked v, q, k (a probe that calls them so) while the forward calls q, k, v: still one GEMM, outputs equal."""
    model = _blocks(False)
    block, x = model[0], _input()
    expected = model(x)
    assert share_projection_storage(model, lambda: [block.v(x), block.q(x), block.k(x)]) == 1
    assert stacked_rows([block.v.weight, block.q.weight, block.k.weight]) is not None
    before, after, _, out = _captured(model, x)
    assert (before, after) == (7, 5)
    _close(out, expected)


def test_nothing_is_fused_where_weights_are_not_stacked_or_inputs_differ():
    x = _input()
    assert _captured(_blocks(True), x)[:3] == (7, 7, True)  # not stacked: each its own GEMM, the graph as it was
    other = _blocks(False, k_input="other")
    assert share_projection_storage(other, lambda: other(x)) == 1  # q and v only
    assert stacked_rows([other[0].q.weight, other[0].k.weight]) is None
    assert _captured(other, x)[:2] == (7, 6)
    # a group whose parameter is re-pointed since is no longer fused, and does not stop the groups after it
    model = _blocks(False, count=2)
    share_projection_storage(model, lambda: model(x))
    model[0].k.weight.data = model[0].k.weight.detach().clone()
    expected = model(x)
    before, after, _, out = _captured(model, x)
    assert (before, after) == (14, 12)
    _close(out, expected)


def test_stacked_rows_takes_only_consecutive_contiguous_rows_of_one_width_and_dtype():
    base = torch.arange(48, dtype=torch.float32)
    rows = base[:32].view(8, 4)
    whole = stacked_rows([rows[:3], rows[3:4], rows[4:8]])
    assert torch.equal(whole, rows) and whole.data_ptr() == rows.data_ptr()  # a view, from the first's offset
    later = stacked_rows([rows[2:3], rows[3:5]])
    assert torch.equal(later, rows[2:5]) and later.storage_offset() == 8
    assert stacked_rows([rows[:2], rows[3:4]]) is None  # a gap
    assert stacked_rows([rows[2:3], rows[:2]]) is None  # out of order
    assert stacked_rows([rows[:2], base[8:12]]) is None  # consecutive, but of another dim
    assert stacked_rows([rows[:2], base[8:16].view(4, 2)]) is None  # consecutive, another width
    assert stacked_rows([rows[:2], base.view(torch.int32)[8:12].view(1, 4)]) is None  # consecutive, another dtype
    assert stacked_rows([rows[:2], base[8:16].view(4, 2).t()]) is None  # consecutive, (2, 4), not contiguous
    assert stacked_rows([rows[:2], rows[2:4].clone()]) is None  # another storage


def test_the_backend_gives_inductor_the_fused_graph(monkeypatch):
    """``compile_with_fused_projections`` hands Inductor's ``compile_fx`` the fused graph and the inputs Dynamo
    gave (``compile_fx`` replaced by a recorder that runs the graph eagerly)."""
    import torch._inductor.compile_fx as inductor

    model = _blocks(False)
    x = _input()
    share_projection_storage(model, lambda: model(x))
    expected = model(x)
    given = []

    def recorder(gm, example_inputs):
        given.append((_linear_calls(gm), len(example_inputs)))
        return gm.forward

    monkeypatch.setattr(inductor, "compile_fx", recorder)
    torch._dynamo.reset()
    out = torch.compile(model, backend=fp.compile_with_fused_projections, fullgraph=True)(x)
    assert given and given[0][0] == 5 and given[0][1] >= 1
    _close(out, expected)


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
