"""The split-key decode attention kernel (:mod:`nxd_moe.triton_kernels.decode_attention`; on a CPU under Triton's
interpreter) against softmax attention in float64 written from its definition, and the transformers attention
function that puts it under the application's models (:mod:`nxd_moe.application.attention`)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from conftest import assert_nan_stays_in_its_row, assert_rounding_close, rounding_tolerance  # noqa: E402

from nxd_moe.application import ApplicationConfig, CausalLMApplication  # noqa: E402
from nxd_moe.application.attention import ATTENTION, decode_kernel_applies, nxd_moe_sdpa_attention  # noqa: E402
from nxd_moe.models.hf_models import build_hf_model  # noqa: E402
from nxd_moe.triton_kernels.decode_attention import BLOCK_N, decode_attention, decode_attention_op, num_splits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(query, key, value, mask, scale, head_of=None):
    """softmax(q k^T * scale + mask) v in float64, query head ``i`` reading key/value head ``head_of(i)`` (default
    ``i // G``), as ``(B, 1, Hq, D)``."""
    heads, kv_heads = query.shape[1], key.shape[1]
    head_of = head_of or (lambda i: i // (heads // kv_heads))
    index = torch.tensor([head_of(i) for i in range(heads)], device=key.device)
    k, v = key.double()[:, index], value.double()[:, index]
    scores = query.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask.double()
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


def causal_mask(positions, keys, dtype, low=None):
    """Additive ``(B, 1, 1, keys)``: 0 up to each sequence's position, ``low`` (the dtype's lowest) after."""
    low = torch.finfo(dtype).min if low is None else low
    allowed = torch.arange(keys, device=positions.device)[None, :] <= positions[:, None]
    return torch.where(allowed, 0.0, low).to(dtype)[:, None, None, :]


def inputs(batch, heads, kv_heads, keys, dim, dtype, capacity=None, seed=0):
    """query ``(B, Hq, 1, D)``; key, value the first ``keys`` positions of a cache of ``capacity`` (strided views,
    as the application's cache slices are)."""
    g = torch.Generator().manual_seed(seed)
    capacity = capacity or keys
    q = torch.randn(batch, heads, 1, dim, generator=g)
    k = torch.randn(batch, kv_heads, capacity, dim, generator=g)[:, :, :keys]
    v = torch.randn(batch, kv_heads, capacity, dim, generator=g)[:, :, :keys]
    return (t.to(DEVICE, dtype) for t in (q, k, v))


def tolerance(dtype, keys):
    # fp32: sums of `keys` products (IEEE dot); bf16: the probabilities rounded to bf16 for the tensor cores and the
    # output stored in bf16 -- two roundings -- over the same sums
    return rounding_tolerance(dtype, keys, triton_roundings=0 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,kv_heads,keys,dim,splits", [
    (3, 8, 2, 150, 64, None),   # GQA groups of 4, a slice of a longer cache, the splits the GPU would get
    (2, 6, 1, 200, 80, 3),      # one key/value head for six query heads, a head size that is no power of two
    (1, 4, 4, 70, 128, 5),      # no grouping; more splits than key blocks: the last splits hold no key
])
def test_equals_softmax_attention(dtype, batch, heads, kv_heads, keys, dim, splits):
    q, k, v = inputs(batch, heads, kv_heads, keys, dim, dtype, capacity=keys + 37)
    positions = torch.tensor([keys - 1, keys // 3, 5][:batch], device=DEVICE)
    mask = causal_mask(positions, keys, dtype)
    scale = 0.3  # not 1/sqrt(D): a dropped scale shows
    out = decode_attention(q, k, v, mask, scale, splits)
    assert out.shape == (batch, 1, heads, dim) and out.dtype == dtype
    assert_rounding_close(out, reference(q, k, v, mask, scale), tolerance(dtype, keys))


def test_the_checks_see_a_wrong_head_grouping_and_a_dropped_mask():
    """Negative controls: the comparison above rejects the kernel's output against a reference that maps query
    heads to key/value heads round-robin, or that drops the mask."""
    q, k, v = inputs(2, 8, 2, 96, 64, torch.float32)
    mask = causal_mask(torch.tensor([40, 95], device=DEVICE), 96, torch.float32)
    out = decode_attention(q, k, v, mask, 0.125)
    with pytest.raises(AssertionError):
        assert_rounding_close(out, reference(q, k, v, mask, 0.125, head_of=lambda i: i % 2), tolerance(q.dtype, 96))
    with pytest.raises(AssertionError):
        assert_rounding_close(out, reference(q, k, v, None, 0.125), tolerance(q.dtype, 96))


def test_no_mask_and_a_mask_shared_by_every_sequence():
    q, k, v = inputs(3, 4, 2, 100, 64, torch.float32)
    assert_rounding_close(decode_attention(q, k, v, None, 0.2), reference(q, k, v, None, 0.2),
                          tolerance(q.dtype, 100))
    shared = causal_mask(torch.tensor([60], device=DEVICE), 100, torch.float32)
    assert_rounding_close(decode_attention(q, k, v, shared, 0.2), reference(q, k, v, shared, 0.2),
                          tolerance(q.dtype, 100))


def test_keys_masked_with_minus_infinity_over_whole_splits():
    """A -inf mask (not the dtype's lowest) that covers every key of the first splits: those splits weigh nothing,
    no NaN."""
    keys = 4 * BLOCK_N
    q, k, v = inputs(2, 4, 2, keys, 64, torch.float32)
    allowed = torch.zeros(2, keys, dtype=torch.bool, device=DEVICE)
    allowed[0, -3:] = True
    allowed[1, BLOCK_N + 7:2 * BLOCK_N] = True
    mask = torch.where(allowed, 0.0, float("-inf"))[:, None, None, :]
    out = decode_attention(q, k, v, mask, 0.125, splits=4)
    assert_rounding_close(out, reference(q, k, v, mask, 0.125), tolerance(q.dtype, keys))


def test_a_nan_token_stays_in_its_sequence():
    _, k, v = inputs(3, 4, 2, 80, 64, torch.float32)
    q = torch.randn(3, 4, 64, device=DEVICE)
    assert_nan_stays_in_its_row(lambda x: decode_attention(x[:, :, None], k, v, None, 0.125), q, 1)


def test_the_splits_fill_the_gpu_but_never_exceed_the_key_blocks():
    assert num_splits(1, 4, 8192, 132) == 66  # 2 programs per multiprocessor over 4 key/value heads
    assert num_splits(1, 4, 4096, 132) == 64  # 64 blocks of 64 keys
    assert num_splits(64, 8, 4096, 132) == 1
    assert num_splits(1, 4, 100, 132) == 2  # 100 keys: two blocks of 64


def test_bad_input_is_named():
    q, k, v = inputs(2, 8, 2, 64, 64, torch.float32)
    with pytest.raises(ValueError, match=r"query \(B, Hq, 1, D\)"):
        decode_attention(q.expand(2, 8, 3, 64), k, v, None, 1.0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        decode_attention(q[:, :7], k[:, :2], v[:, :2], None, 1.0)
    with pytest.raises(ValueError, match="key and value must be"):
        decode_attention(q, k, v[:, :, :32], None, 1.0)
    with pytest.raises(ValueError, match=r"mask must broadcast as \(B=2, 1, 1, L=64\)"):
        decode_attention(q, k, v, torch.zeros(2, 1, 1, 63, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match=r"splits must be in \[1, 64\]"):
        decode_attention(q, k, v, None, 1.0, splits=0)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, None, 1.0)


def test_the_op_agrees_with_its_fake_for_compiled_graphs():
    q, k, v = inputs(2, 8, 2, 70, 64, torch.float32)
    mask = causal_mask(torch.tensor([10, 69], device=DEVICE), 70, torch.float32)
    torch.library.opcheck(decode_attention_op, (q, k, v, mask, 0.125),
                          test_utils=("test_schema", "test_faketensor"))


class _Attention(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups


def test_the_attention_function_is_sdpa_where_the_kernel_does_not_apply():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    module = _Attention(4).eval()
    q, k, v = inputs(2, 8, 2, 40, 64, torch.float32)
    mask = causal_mask(torch.tensor([10, 39], device=DEVICE), 40, torch.float32)
    assert decode_kernel_applies(module, q, k, v, mask, 0.0, {})
    out, weights = nxd_moe_sdpa_attention(module, q, k, v, mask, scaling=0.2)
    assert weights is None
    assert_rounding_close(out, reference(q, k, v, mask, 0.2), tolerance(q.dtype, 40))
    # two query tokens, a dropout in training, a boolean mask, a softcap: each goes to SDPA unchanged
    q2 = torch.randn(2, 8, 2, 64, device=DEVICE)
    mask2 = torch.zeros(2, 1, 2, 40, device=DEVICE)
    assert not decode_kernel_applies(module, q2, k, v, mask2, 0.0, {})
    assert not decode_kernel_applies(module.train(), q, k, v, mask, 0.1, {})
    assert not decode_kernel_applies(module.eval(), q, k, v, mask > -1, 0.0, {})
    assert not decode_kernel_applies(module, q, k, v, mask, 0.0, {"softcap": 30.0})
    assert not decode_kernel_applies(module, q, k, v[..., :32], mask, 0.0, {})
    out2, _ = nxd_moe_sdpa_attention(module, q2, k, v, mask2, scaling=0.2)
    assert torch.equal(out2, sdpa_attention_forward(module, q2, k, v, mask2, scaling=0.2)[0])


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "llama4-scout"])
def test_greedy_tokens_equal_with_the_decode_kernel(name):
    """The application with its one-token attention on the kernel (chosen here on the CPU, where Triton's
    interpreter runs it) generates transformers' greedy tokens across two token-generation buckets: Qwen3 (grouped
    heads), Llama 4 (chunked attention layers: the application's per-layer-type masks)."""
    from test_generate import left_padded
    model = build_hf_model(name, num_layers=1, scale=32, seed=5)
    ids, mask = left_padded(model.config.get_text_config().vocab_size)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    app = CausalLMApplication(copy.deepcopy(model), ApplicationConfig(
        batch_size=3, seq_len=24, max_context_length=16, torch_dtype="float32",
        context_encoding_buckets=[16], token_generation_buckets=[16, 24]), decode_attention=True)
    assert app.model.config.get_text_config()._attn_implementation == ATTENTION
    out = app.generate(ids, mask, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(out.sequences, expected), name


def test_models_on_another_attention_keep_it():
    from nxd_moe.application.attention import use_decode_attention
    model = build_hf_model("gpt-oss-20b", num_layers=1, scale=32, seed=5)  # eager: its attention sinks
    assert model.config._attn_implementation == "eager"
    assert not use_decode_attention(model)
    assert model.config._attn_implementation == "eager"


def test_which_path_each_call_takes(monkeypatch):
    """The kernel where it computes SDPA's function, SDPA otherwise -- seen by which of the two is called."""
    import nxd_moe.triton_kernels.decode_attention as kernel_module
    calls = []
    real = kernel_module.decode_attention_op
    monkeypatch.setattr(kernel_module, "decode_attention_op", lambda *a: calls.append("kernel") or real(*a))
    module = _Attention(4)
    q, k, v = inputs(2, 8, 2, 40, 64, torch.float32)
    mask = causal_mask(torch.tensor([10, 39], device=DEVICE), 40, torch.float32)

    def path(*args, **kw):
        calls.clear()
        nxd_moe_sdpa_attention(*args, **kw)
        return calls == ["kernel"]

    assert path(module.train(), q, k, v, mask, dropout=0.0)  # training, but nothing dropped
    assert path(module.eval(), q, k, v, mask, dropout=0.1)  # a dropout outside training drops nothing
    assert not path(module.train(), q, k, v, mask, dropout=0.1)
    assert not path(module.eval(), q, k, v, mask > -1)  # a boolean mask: SDPA's
    assert path(module, q, k, v, mask[:1])  # one mask row for every sequence
    q3, k3, v3 = inputs(3, 8, 2, 40, 64, torch.float32)
    assert not decode_kernel_applies(module, q3, k3, v3, torch.zeros(2, 1, 1, 40, device=DEVICE), 0.0, {})
    if DEVICE == "cpu":  # Triton runs CPU tensors only in its interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not path(module, q, k, v, mask)


def test_the_default_scale_and_inputs_of_any_strides():
    """``scaling=None`` is 1/sqrt(D); a query whose head dimension is strided and a key stored transposed are
    made contiguous first."""
    module = _Attention(4).eval()
    q, k, v = inputs(2, 8, 2, 40, 64, torch.float32)
    out, _ = nxd_moe_sdpa_attention(module, q, k, v, None)
    assert_rounding_close(out, reference(q, k, v, None, 64 ** -0.5), tolerance(q.dtype, 40))
    q_strided = q[:, :, 0].transpose(1, 2).contiguous().transpose(1, 2)[:, :, None]  # head dim stride 8, heads 1
    k_transposed = k.transpose(2, 3).contiguous().transpose(2, 3)
    assert q_strided.stride(-1) != 1 and q_strided.stride(1) == 1 and k_transposed.stride(-2) == 1
    out, _ = nxd_moe_sdpa_attention(module, q_strided, k_transposed, v, None, scaling=0.2)
    assert_rounding_close(out, reference(q, k, v, None, 0.2), tolerance(q.dtype, 40))


def test_sdpa_gets_every_argument_it_is_given():
    module = _Attention(4).train()
    q = torch.randn(2, 8, 3, 64, device=DEVICE)
    _, k, v = inputs(2, 8, 2, 40, 64, torch.float32)
    out, _ = nxd_moe_sdpa_attention(module, q, k, v, None, dropout=1.0)  # every weight dropped: zeros
    assert out.abs().max() == 0
    with pytest.raises(ValueError, match="softcap"):  # SDPA's own refusal: the keyword reached it
        nxd_moe_sdpa_attention(module.eval(), q, k, v, None, softcap=30.0)


def test_an_sdpa_model_switches_to_the_kernel_and_computes_the_same_step():
    """``use_decode_attention`` registers the function and SDPA's masks under :data:`ATTENTION` and switches the
    model; a decode step of the switched model equals the SDPA model's."""
    from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
    from transformers.masking_utils import sdpa_mask

    from nxd_moe.application.attention import use_decode_attention
    model = build_hf_model("qwen3-30b-a3b", num_layers=1, scale=32, seed=5)
    switched = copy.deepcopy(model)
    assert use_decode_attention(switched)
    assert AttentionInterface()[ATTENTION] is nxd_moe_sdpa_attention
    assert AttentionMaskInterface()[ATTENTION] is sdpa_mask
    assert switched.config._attn_implementation == ATTENTION
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    logits = []
    for m in (model, switched):
        with torch.no_grad():
            cache = DynamicCache(config=m.config)
            m(ids[:, :5], past_key_values=cache, use_cache=True)
            logits.append(m(ids[:, 5:], past_key_values=cache, use_cache=True).logits)
    assert_rounding_close(logits[1], logits[0], rounding_tolerance(torch.float32, 2048, triton_roundings=0))
