"""The experts' small parts, each setting against a float64 reference written out here: the shared experts'
projection (``experts/shared.py``), shard descriptions (``experts/shard.py``), the decode algorithms
(``experts/decode.py``), the rank-local routing (``experts/local_routing.py``) and the blockwise matmul
(``experts/blockwise.py``)."""

from __future__ import annotations

import pytest
import torch

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.blockwise import blockwise_forward, gather_block_inputs
from nxd_moe.experts.decode import all_experts_forward, selective_loading_forward
from nxd_moe.experts.local_routing import local_routing
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.experts.shard import ShardSpec, WeightShard
from nxd_moe.experts.shared import DenseProjection
from nxd_moe.experts.token_mapping import BlockMapping
from nxd_moe.moe_configs import GLUType

F64 = torch.float64


# ---------------------------------------------------------------- shared.py


@pytest.mark.parametrize("transposed", [False, True])
def test_dense_projection_layout_init_and_forward(transposed):
    torch.manual_seed(3)
    in_f, out_f = 4, 96
    p = DenseProjection(in_f, out_f, transposed, F64)
    assert p.transposed is transposed
    assert p.weight.dtype == F64 and p.weight.requires_grad
    assert tuple(p.weight.shape) == ((in_f, out_f) if transposed else (out_f, in_f))
    # kaiming_uniform(a=sqrt 5) on the (out, in) view: bound 1/sqrt(in)
    bound = 1.0 / in_f ** 0.5
    assert p.weight.abs().max() <= bound
    assert p.weight.abs().max() > 0.95 * bound
    w_out_in = p.weight.detach().t() if transposed else p.weight.detach()
    assert p.matrix() is p.weight
    x = torch.randn(3, in_f, dtype=F64)
    ref = torch.tensor([[sum(x[t, i].item() * w_out_in[o, i].item() for i in range(in_f)) for o in range(out_f)]
                        for t in range(3)], dtype=F64)
    torch.testing.assert_close(p(x), ref, rtol=1e-12, atol=1e-12)
    assert p.extra_repr() == f"transposed={transposed}"
    on_meta = DenseProjection(in_f, out_f, transposed, torch.bfloat16, device="meta")
    assert on_meta.weight.is_meta and on_meta.weight.dtype == torch.bfloat16
    q_meta = DenseProjection(in_f, 32, transposed, torch.bfloat16, device="meta", quantization="fp8")
    assert q_meta.weight.is_meta and tuple(q_meta.scale.shape) == (1, 32)


def test_dense_projection_dequantizes_to_its_dtype_and_block_scales():
    p = DenseProjection(16, 8, True, torch.bfloat16, quantization="fp8")
    assert p.matrix().dtype == torch.bfloat16
    assert p(torch.ones(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
    torch.manual_seed(11)
    b = DenseProjection(256, 128, False, torch.float32, quantization="fp8_block")
    assert tuple(b.scale.shape) == (2, 1)
    full_scale = b.scale.detach().to(F64).repeat_interleave(128, 0).repeat_interleave(128, 1)
    torch.testing.assert_close(b.matrix().to(F64), (b.weight.detach().to(F64) * full_scale).t(), rtol=1e-6, atol=0)
    b.load_state_dict({k: v.clone() for k, v in b.state_dict().items()})


@pytest.mark.parametrize("transposed", [False, True])
def test_dense_projection_fp8_stores_in_out_and_dequantizes(transposed):
    torch.manual_seed(5)
    in_f, out_f = 16, 8
    p = DenseProjection(in_f, out_f, transposed, torch.float32, quantization="fp8")
    assert p.extra_repr() == f"transposed={transposed}, quantization='fp8'"
    assert tuple(p.weight.shape) == (in_f, out_f) and p.weight.dtype == torch.float8_e4m3fn
    assert tuple(p.scale.shape) == (1, out_f)
    assert not p.weight.requires_grad and not p.scale.requires_grad
    w_in_out = p.weight.detach().to(F64) * p.scale.detach().to(F64)
    assert w_in_out.abs().max() <= 1.0 / in_f ** 0.5 * 1.07
    assert w_in_out.abs().max() > 0.5 / in_f ** 0.5
    m = p.matrix()
    assert m.dtype == torch.float32
    torch.testing.assert_close(m.to(F64), w_in_out if transposed else w_in_out.t(), rtol=1e-6, atol=0)
    x = torch.randn(3, in_f)
    torch.testing.assert_close(p(x).to(F64), x.to(F64) @ w_in_out, rtol=1e-5, atol=1e-5)
    # store_quantized from a given (transposed-named) weight
    w = torch.randn(in_f, out_f) if transposed else torch.randn(out_f, in_f)
    p.store_quantized(w)
    w_in = (w if transposed else w.t()).to(F64)
    amax = w_in.abs().amax(dim=0, keepdim=True)
    torch.testing.assert_close(p.scale.to(F64), amax / 448.0, rtol=1e-6, atol=0)
    torch.testing.assert_close(p.weight.to(F64) * p.scale.to(F64), w_in, rtol=0.07, atol=0)
    # meta weight: empty tensors of the format's shapes
    p.store_quantized(torch.empty(w.shape, device="meta"))
    assert p.weight.is_meta and tuple(p.weight.shape) == (in_f, out_f) and tuple(p.scale.shape) == (1, out_f)


def test_dense_projection_checks_loaded_quantized_tensors():
    p = DenseProjection(16, 8, False, torch.float32, quantization="fp8")
    good = {k: v.clone() for k, v in p.state_dict().items()}
    p.load_state_dict(good)
    with pytest.raises(ValueError, match=r"^DenseProjection\.weight must be 2-D \(the stored \(in, out\) matrix\), "
                                         r"got shape \(1, 16, 8\)$"):
        p.load_state_dict({"weight": good["weight"].unsqueeze(0), "scale": good["scale"]})
    with pytest.raises(ValueError, match=r"^DenseProjection\.scale must be 2-D"):
        p.load_state_dict({"weight": good["weight"], "scale": good["scale"][0]})
    outer = torch.nn.Module()
    outer.projX = DenseProjection(16, 8, True, torch.float32, quantization="fp8")
    with pytest.raises(ValueError, match=r"^projX\.weight must be 2-D"):
        outer.load_state_dict({"projX.weight": good["weight"][0], "projX.scale": good["scale"]})
    with pytest.raises(ValueError, match="projX"):  # the format's own check, named
        outer.load_state_dict({"projX.weight": good["weight"].t().contiguous(), "projX.scale": good["scale"]})
    with pytest.raises(ValueError, match=r"^SharedExperts\.quantization must be one of"):
        DenseProjection(16, 8, False, torch.float32, quantization="no-such-format")
    with pytest.raises(ValueError, match=r"shared-expert projection \(in=16, out=8\)"):
        DenseProjection(16, 8, False, torch.float32, quantization="mxfp4")
    # a state dict holding only one of the two tensors is left to load_state_dict's own key checks
    missing = p.load_state_dict({"weight": good["weight"]}, strict=False)
    assert missing.missing_keys == ["scale"]


# ---------------------------------------------------------------- shard.py


def test_shard_spec_defaults_and_weight_shard_specs():
    assert ShardSpec("w") == ShardSpec("w", None, None, 1, 0, 1)
    s = WeightShard((5, 2, 7))
    assert (s.intermediate_parts, s.intermediate_part) == (1, 0)
    assert s.spec("a.b") == ShardSpec("a.b", (5, 2, 7), None, 1, 0, 1)
    assert s.spec("a.b", dim=2, stride=2) == ShardSpec("a.b", (5, 2, 7), None, 1, 0, 1)
    t = WeightShard((5, 2, 7), 3, 2)
    assert t.spec("g", None, 2) == ShardSpec("g", (5, 2, 7), None, 1, 0, 1)
    assert t.spec("g", 2) == ShardSpec("g", (5, 2, 7), 2, 3, 2, 1)
    assert t.spec("g", 1, 2) == ShardSpec("g", (5, 2, 7), 1, 3, 2, 2)
    assert t.holds_same_weights_as(WeightShard((5, 2, 7), 3, 2))
    assert not t.holds_same_weights_as(WeightShard((5, 2, 7), 3, 1))
    assert not t.holds_same_weights_as(s)


# ---------------------------------------------------------------- helpers


def _weights(num_experts, hidden, inter, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, hidden, inter, generator=g, dtype=F64)
    w2 = torch.randn(num_experts, inter, hidden, generator=g, dtype=F64)
    act = ExpertActivation("relu", glu_mlp=False, glu_type=GLUType.GLU)
    return ExpertWeights(w1, w2, None, None, act), w1, w2


def _expert_ref(x_row, w1, w2, e):
    h = [max(0.0, sum(x_row[i] * w1[e, i, j].item() for i in range(w1.shape[1]))) for j in range(w1.shape[2])]
    return [sum(h[j] * w2[e, j, o].item() for j in range(w1.shape[2])) for o in range(w2.shape[2])]


def _routing(prescale, has_padding=True):
    # 5 tokens, 4 experts, k = 2; token 3 padded (all off the mask)
    index = torch.tensor([[2, 0], [1, 3], [3, 2], [0, 1], [2, 1]])
    aff = torch.tensor([[0.3, 0.0, 0.7, 0.0], [0.0, 0.25, 0.0, 0.75], [0.0, 0.0, 0.4, 0.6],
                        [0.0, 0.0, 0.0, 0.0], [0.0, 0.9, 0.1, 0.0]], dtype=F64)
    mask = torch.zeros(5, 4, dtype=torch.bool).scatter(1, index, True)
    mask[3] = False
    return Routing(index, mask, aff, prescale, has_padding)


def _reference(x, routing, w1, w2, prescale):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(routing.expert_index.shape[1]):
            e = int(routing.expert_index[t, j])
            if not routing.expert_mask[t, e]:
                continue
            a = routing.affinities[t, e].item()
            row = [v * a for v in x[t].tolist()] if prescale else x[t].tolist()
            y = _expert_ref(row, w1, w2, e)
            out[t] += torch.tensor(y, dtype=F64) * (1.0 if prescale else a)
    return out


# ---------------------------------------------------------------- decode.py


@pytest.mark.parametrize("prescale", [False, True])
def test_selective_loading_and_all_experts_match_the_definition(prescale):
    weights, w1, w2 = _weights(4, 3, 5, seed=1)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    routing = _routing(prescale)
    ref = _reference(x, routing, w1, w2, prescale)
    torch.testing.assert_close(selective_loading_forward(x, routing, weights, "gather"), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(selective_loading_forward(x, routing, weights), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(all_experts_forward(x, routing, weights), ref, rtol=1e-12, atol=1e-12)


def test_all_experts_does_not_leak_an_unchosen_experts_nan_and_keeps_the_dtype():
    weights, w1, w2 = _weights(4, 3, 5, seed=4)
    w2 = w2.clone()
    w2[3] = float("nan")  # expert 3 chosen by nobody below
    weights = weights._replace(down_proj=w2)
    index = torch.tensor([[0, 1], [2, 1]])
    mask = torch.zeros(2, 4, dtype=torch.bool).scatter(1, index, True)
    aff = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.0, 0.2, 0.8, 0.0]], dtype=F64)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(5), dtype=F64)
    for prescale in (False, True):
        routing = Routing(index, mask, aff, prescale)
        ref = _reference(x, routing, w1, w2, prescale)
        torch.testing.assert_close(all_experts_forward(x, routing, weights), ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(selective_loading_forward(x, routing, weights), ref, rtol=1e-12, atol=1e-12)
    w32 = ExpertWeights(w1.float(), w2.float(), None, None, weights.activation)
    routing = Routing(index, mask, aff.float(), False)
    out = all_experts_forward(x.float(), routing, w32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.to(F64), _reference(x.float().to(F64), routing._replace(affinities=aff), w1.float()
                                                       .to(F64), w2.float().to(F64), False), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- local_routing.py


@pytest.mark.parametrize("prescale", [False, True])
def test_local_routing_keeps_this_ranks_pairs_and_fills_with_unchosen_experts(prescale):
    # 8 global experts; this rank holds 2 -> local 1, 5 -> local 0, 6 -> local 2
    local_slot = torch.tensor([1, -1, -1, -1, -1, 0, 2, -1])
    pair_expert = torch.tensor([[6, -1, 0], [-1, -1, -1], [5, 6, -1], [0, 5, 6]])
    pair_weight = torch.tensor([[0.5, 0.375, 0.125], [0.125, 0.25, 0.625], [0.25, 0.375, 0.375], [0.5, 0.375, 0.125]],
                               dtype=F64)
    r = local_routing(pair_expert, pair_weight, local_slot, 3, prescale)
    assert r.prescale is prescale and r.has_padding is True
    assert r.expert_mask.tolist() == [[False, True, True], [False, False, False], [True, False, True],
                                      [True, True, True]]
    assert r.affinities.dtype == F64 and r.expert_mask.dtype == torch.bool
    assert r.affinities.tolist() == [[0.0, 0.125, 0.5], [0.0, 0.0, 0.0], [0.25, 0.0, 0.375],
                                     [0.375, 0.5, 0.125]]
    # chosen local experts first (ascending), then unchosen ones (ascending)
    assert r.expert_index.tolist() == [[1, 2, 0], [0, 1, 2], [0, 2, 1], [0, 1, 2]]
    # k > E_l: k' = E_l
    r2 = local_routing(torch.tensor([[5, 0, -1, 6]]), torch.tensor([[0.1, 0.2, 0.3, 0.4]]), local_slot, 3, prescale)
    assert r2.expert_index.tolist() == [[0, 1, 2]]
    # k < E_l: k' = k; a pair whose expert is not held here (slot -1) is dropped
    slot4 = torch.tensor([3, -1, 0, 1, 2])
    r3 = local_routing(torch.tensor([[3, 1], [-1, 4]]), torch.tensor([[0.75, 0.25], [0.5, 0.5]]), slot4, 4, prescale)
    assert r3.expert_mask.tolist() == [[False, True, False, False], [False, False, True, False]]
    assert r3.expert_index.tolist() == [[1, 0], [2, 0]]
    assert r3.affinities.tolist() == [[0.0, 0.75, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0]]
    m = local_routing(pair_expert.to("meta"), pair_weight.to("meta"), local_slot.to("meta"), 3, prescale)
    assert m.expert_mask.is_meta and m.affinities.is_meta and m.expert_index.is_meta


# ---------------------------------------------------------------- blockwise.py


def _mapping():
    # 5 tokens, 4 experts, block size 2; expert e's tokens in token order; padded token 3 takes no slot
    routing = _routing(False)
    slots, block_to_expert, slot_of = [], [], {}
    for e in range(4):
        toks = [t for t in range(5) if routing.expert_mask[t, e]]
        for b in range(0, max(len(toks), 1), 2):
            chunk = toks[b:b + 2] + [-1] * (2 - len(toks[b:b + 2]))
            for i, t in enumerate(chunk):
                if t >= 0:
                    slot_of[(t, e)] = len(slots) + i
            slots += chunk
            block_to_expert.append(e)
    slots += [-1, -1]  # one unused tail block
    block_to_expert.append(3)
    n = len(block_to_expert)
    token_slot = torch.tensor([[slot_of.get((t, int(e)), 2 * n) for e in routing.expert_index[t]] for t in range(5)])
    conditions = torch.tensor([int(any(s >= 0 for s in slots[2 * b:2 * b + 2])) for b in range(n)], dtype=torch.int32)
    return BlockMapping(torch.tensor(block_to_expert), torch.tensor(slots), conditions, token_slot,
                        routing.expert_mask.sum(0), 2)


@pytest.mark.parametrize("prescale", [False, True])
def test_gather_block_inputs_reads_each_slots_token_and_zeros_padding(prescale):
    mapping = _mapping()
    routing = _routing(prescale)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(7), dtype=F64) + 2.0
    got = gather_block_inputs(x, routing, mapping)
    assert tuple(got.shape) == (mapping.num_blocks, 2, 3)
    for b in range(mapping.num_blocks):
        e = int(mapping.block_to_expert[b])
        for i in range(2):
            t = int(mapping.token_position_to_id[2 * b + i])
            want = torch.zeros(3, dtype=F64) if t < 0 else x[t] * (routing.affinities[t, e].item() if prescale else 1)
            torch.testing.assert_close(got[b, i], want, rtol=1e-15, atol=0)


@pytest.mark.parametrize("prescale", [False, True])
def test_blockwise_forward_matches_the_definition(prescale):
    weights, w1, w2 = _weights(4, 3, 5, seed=8)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(9), dtype=F64)
    routing = _routing(prescale)
    mapping = _mapping()
    ref = _reference(x, routing, w1, w2, prescale)
    torch.testing.assert_close(blockwise_forward(x, routing, mapping, weights), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(blockwise_forward(x, routing, mapping, weights, "gather"), ref, rtol=1e-12, atol=1e-12)


def test_bfloat16_inputs_keep_their_dtype_and_the_matmul_impl_is_passed_on():
    weights, w1, w2 = _weights(4, 3, 5, seed=12)
    wb = ExpertWeights(w1.bfloat16(), w2.bfloat16(), None, None, weights.activation)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(13), dtype=F64)
    for prescale in (False, True):
        routing = _routing(prescale)
        rb = routing._replace(affinities=routing.affinities.float())
        ref = _reference(x.bfloat16().to(F64), routing, w1.bfloat16().to(F64), w2.bfloat16().to(F64), prescale)
        for out in (selective_loading_forward(x.bfloat16(), rb, wb), all_experts_forward(x.bfloat16(), rb, wb),
                    blockwise_forward(x.bfloat16(), rb, _mapping(), wb)):
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.to(F64), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
        with pytest.raises(ValueError, match="matmul impl must be one of"):
            selective_loading_forward(x, routing, weights, "no-such-impl")
        with pytest.raises(ValueError, match="matmul impl must be one of"):
            blockwise_forward(x, routing, _mapping(), weights, "no-such-impl")

