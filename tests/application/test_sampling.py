"""On-device sampling: draws follow the distribution transformers' warpers define (temperature, then top-k, then
top-p over the softmax), checked by a chi-square test against a float64 reference written from that definition;
a fixed seed reproduces a run; per-sequence parameters apply per sequence; bad parameters are named."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nxd_moe.application import (
    ApplicationConfig,
    CausalLMApplication,
    SamplingConfig,
    prepare_sampling_params,
    sampling,
)
from nxd_moe.application.sampling import greedy_tokens, sample_tokens

V = 64
DRAWS = 40_000


def reference_distribution(logits: np.ndarray, top_k: int, top_p: float, temperature: float) -> np.ndarray:
    """The probabilities transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper leave,
    in float64: scale, keep the k largest, softmax, keep the most probable tokens until their mass reaches top_p."""
    scaled = logits.astype(np.float64) / temperature
    keep = np.argsort(-scaled, kind="stable")[:top_k]
    p = np.exp(scaled[keep] - scaled[keep].max())
    p /= p.sum()
    mass_before = np.cumsum(p) - p
    p = np.where(mass_before < top_p, p, 0.0)
    out = np.zeros_like(scaled)
    out[keep] = p / p.sum()
    return out


def chi_square_bound(df: int, z: float = 4.753) -> float:
    """Upper quantile of chi-square(df) at z standard deviations (4.753: p = 1e-6), Wilson-Hilferty's cube-root
    approximation (accurate to a few percent for df >= 3)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    kept = probs > 0
    expected = probs[kept] * counts.sum()
    return float(((counts[kept] - expected) ** 2 / expected).sum()), int(kept.sum()) - 1


@pytest.fixture(scope="module")
def logits():
    return torch.randn(V, generator=torch.Generator().manual_seed(5), dtype=torch.float64).float() * 2.0


@pytest.mark.parametrize("top_k, top_p, temperature", [(12, 0.85, 0.7), (64, 0.5, 1.3), (5, 1.0, 2.0)])
def test_draws_follow_the_warped_softmax(logits, top_k, top_p, temperature):
    torch.manual_seed(0)
    params = prepare_sampling_params(DRAWS, top_k, top_p, temperature)
    draws = sample_tokens(logits.expand(DRAWS, V), params, global_topk=V).numpy()
    probs = reference_distribution(logits.numpy(), top_k, top_p, temperature)
    counts = np.bincount(draws, minlength=V).astype(np.float64)
    assert counts[probs == 0].sum() == 0, "a token outside top-k / top-p was drawn"
    stat, df = chi_square(counts, probs)
    assert df >= 2 and stat < chi_square_bound(df), (stat, df)


def test_the_chi_square_test_rejects_a_sampler_that_ignores_the_temperature(logits):
    """Negative control: the same draws judged against the distribution without the temperature fail."""
    torch.manual_seed(0)
    draws = sample_tokens(logits.expand(DRAWS, V), prepare_sampling_params(DRAWS, 12, 0.85, 0.7), global_topk=V)
    wrong = reference_distribution(logits.numpy(), 12, 0.85, 1.0)
    counts = np.bincount(draws.numpy(), minlength=V).astype(np.float64)
    stat, df = chi_square(counts[wrong > 0], wrong[wrong > 0])
    assert counts[wrong == 0].sum() > 0 or stat > chi_square_bound(df)


def test_top_k_one_is_the_argmax_and_global_topk_caps_the_candidates(logits):
    rows = logits.expand(8, V)
    assert torch.equal(sample_tokens(rows, prepare_sampling_params(8, 1, 0.9, 3.0)), rows.argmax(-1))
    torch.manual_seed(1)
    draws = sample_tokens(logits.expand(2000, V), prepare_sampling_params(2000, 0, 1.0, 50.0), global_topk=4)
    assert set(draws.tolist()) <= set(logits.topk(4).indices.tolist())


@pytest.mark.parametrize("shape", [(5,), (2, 1, 9), (3, 0)])
def test_logits_of_another_shape_are_named(shape):
    for params in (None, torch.tensor([[2.0, 0.9, 0.7]] * (shape[0] if len(shape) > 1 else 1))):
        with pytest.raises(ValueError, match=r"logits must be \(B, V\) with V >= 1, got shape"):
            sampling.sample_tokens(torch.zeros(shape), params)


@pytest.mark.parametrize("vocab", [7, sampling.ARGMAX_CHUNK, sampling.ARGMAX_CHUNK + 1, 3 * sampling.ARGMAX_CHUNK - 5])
def test_greedy_tokens_are_torch_argmax(vocab):
    """The two-stage argmax is ``torch.argmax``: the first of equal maxima (planted in two chunks, and twice in one
    chunk), a NaN counted as the maximum, a row of -inf, a vocabulary that is not a multiple of the chunk and one
    within a chunk; bf16 and float32."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    last = vocab - 1
    logits[1, [last, vocab // 2]] = 50.0  # equal maxima, the later one in a later chunk when there are two
    logits[2, [3, 5]] = 50.0  # equal maxima in one chunk
    logits[3, [last, 1]] = float("nan")
    logits[4] = float("-inf")
    logits[5, last] = 50.0  # the maximum in the padded last chunk
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(greedy_tokens(logits.to(dtype)), logits.to(dtype).argmax(dim=-1))


def test_sampling_params_are_checked():
    with pytest.raises(ValueError, match="top_p must be in"):
        prepare_sampling_params(2, 5, 1.5, 1.0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        prepare_sampling_params(2, 5, 0.5, 0.0)
    with pytest.raises(TypeError, match="top_k must be an int"):
        prepare_sampling_params(2, 2.5, 0.5, 1.0)
    with pytest.raises(ValueError, match="3 values for a batch of 2"):
        prepare_sampling_params(2, [1, 2, 3], 0.5, 1.0)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingConfig(do_sample=True, top_p=0.0)


def test_a_one_token_vocabulary_is_served_and_an_empty_one_named():
    assert torch.equal(greedy_tokens(torch.zeros(3, 1)), torch.zeros(3, dtype=torch.long))
    assert torch.equal(sample_tokens(torch.zeros(3, 1), prepare_sampling_params(3, 0, 0.5, 2.0)),
                       torch.zeros(3, dtype=torch.long))


def test_top_k_zero_and_top_k_of_every_candidate_keep_them_all():
    """``top_k <= 0`` keeps every candidate (NxDI's convention), as does a ``top_k`` of all of them: three equal
    logits, each drawn a third of the time -- the last candidate included."""
    torch.manual_seed(2)
    for top_k in (0, -3, 3):
        draws = sample_tokens(torch.zeros(3000, 3), prepare_sampling_params(3000, top_k, 1.0, 1.0), global_topk=3)
        counts = np.bincount(draws.numpy(), minlength=3).astype(np.float64)
        stat, df = chi_square(counts, np.full(3, 1 / 3))
        assert stat < chi_square_bound(max(df, 3)), (top_k, counts)


def test_global_topk_caps_the_candidates_of_one_sequence():
    """One sequence (B = 1, fewer rows than candidates): its draws still spread over all global_topk candidates."""
    torch.manual_seed(3)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, -5.0, -6.0, -7.0, -8.0]])
    draws = [int(sample_tokens(logits, prepare_sampling_params(1, 0, 1.0, 100.0), global_topk=4))
             for _ in range(400)]
    assert set(draws) == {0, 1, 2, 3}


def test_the_default_global_topk_is_nxdis_256():
    """300 equal logits: the draws cover exactly the 256 candidates the default ``global_topk`` keeps."""
    torch.manual_seed(5)
    draws = sample_tokens(torch.zeros(20000, 300), prepare_sampling_params(20000, 0, 1.0, 1.0))
    assert len(set(draws.tolist())) == 256


def test_top_p_reached_exactly_keeps_only_the_prefix_that_reaches_it():
    """Two equal logits (probabilities exactly 1/2 each): ``top_p = 0.5`` is reached by the first candidate alone,
    so only one token is ever drawn; just above 0.5 both are."""
    torch.manual_seed(4)
    logits = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]]).expand(500, 4)
    assert len(set(sample_tokens(logits, prepare_sampling_params(500, 0, 0.5, 1.0)).tolist())) == 1
    assert set(sample_tokens(logits, prepare_sampling_params(500, 0, 0.51, 1.0)).tolist()) == {0, 1}


def test_prepare_sampling_params_rows():
    """Per-sequence values given as a list, a tuple or a 1-D tensor; an integral float ``top_k``; float32 rows."""
    params = prepare_sampling_params(2, [2.0, 3], torch.tensor([0.5, 0.25]), (1.5, 0.75))
    assert params.dtype == torch.float32
    assert params.tolist() == [[2.0, 0.5, 1.5], [3.0, 0.25, 0.75]]
    assert prepare_sampling_params(1).tolist() == [[1.0, 1.0, 1.0]]
    assert prepare_sampling_params(3, 4, 0.5).tolist() == [[4.0, 0.5, 1.0]] * 3  # one number: every sequence


@pytest.mark.parametrize("call, error, message", [
    (lambda: prepare_sampling_params(0), ValueError, "batch_size must be in [1, inf], got 0"),
    (lambda: prepare_sampling_params(2, 1, 0.0), ValueError, "top_p must be in (0, 1], got 0.0"),
    (lambda: SamplingConfig(do_sample=1), TypeError, "on_device_sampling_config.do_sample must be a bool"),
    (lambda: SamplingConfig(dynamic="yes"), TypeError, "on_device_sampling_config.dynamic must be a bool"),
    (lambda: SamplingConfig(top_k=2.5), TypeError, "on_device_sampling_config.top_k must be an int"),
    (lambda: SamplingConfig(global_topk=0), ValueError,
     "on_device_sampling_config.global_topk must be in [1, inf], got 0"),
    (lambda: SamplingConfig(top_p=1.5), ValueError, "on_device_sampling_config.top_p must be in (0, 1], got 1.5"),
    (lambda: SamplingConfig(top_p="all"), TypeError, "on_device_sampling_config.top_p must be"),
    (lambda: SamplingConfig(temperature=0.0), ValueError, "on_device_sampling_config.temperature must be > 0"),
])
def test_bad_settings_are_named_whole(call, error, message):
    with pytest.raises(error) as caught:
        call()
    assert str(caught.value).startswith(message), str(caught.value)


def test_the_smallest_settings_are_accepted():
    assert SamplingConfig(global_topk=1, top_p=1.0, temperature=1e-3).global_topk == 1
    assert prepare_sampling_params(1, 0, 1.0, 1e-3).shape == (1, 3)


@pytest.fixture(scope="module")
def model():
    from nxd_moe.models.hf_models import build_hf_model

    return build_hf_model("qwen3-30b-a3b", num_layers=1, scale=16, seed=4)


def _app(model, dynamic: bool):
    sampling = SamplingConfig(do_sample=True, top_k=40, top_p=0.95, temperature=8.0, dynamic=dynamic)
    return CausalLMApplication(model, ApplicationConfig(batch_size=2, seq_len=40, max_context_length=8,
                                                        torch_dtype="float32", on_device_sampling_config=sampling))


def test_a_seed_reproduces_a_sampled_generation(model):
    app = _app(model, dynamic=False)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(app.generate(ids, max_new_tokens=24, eos_token_id=[]).tokens)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    greedy = app.generate(ids, max_new_tokens=24, eos_token_id=[], do_sample=False).tokens
    assert not torch.equal(runs[0], greedy)


def test_dynamic_parameters_apply_per_sequence(model):
    """Sequence 0 with top_k=1 takes the greedy path while sequence 1 samples; without ``dynamic`` the config's
    parameters apply to both whatever generate is given."""
    ids = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6]])
    greedy = _app(model, dynamic=True).generate(ids, max_new_tokens=20, eos_token_id=[], do_sample=False).tokens
    torch.manual_seed(3)
    mixed = _app(model, dynamic=True).generate(ids, max_new_tokens=20, eos_token_id=[], top_k=[1, 40]).tokens
    assert torch.equal(mixed[0], greedy[0]) and not torch.equal(mixed[1], greedy[1])
    torch.manual_seed(3)
    static = _app(model, dynamic=False).generate(ids, max_new_tokens=20, eos_token_id=[], top_k=[1, 40]).tokens
    assert not torch.equal(static[0], greedy[0])


def test_sampling_on_a_greedy_application_is_refused(model):
    app = CausalLMApplication(model, ApplicationConfig(batch_size=1, seq_len=16, torch_dtype="float32"))
    with pytest.raises(ValueError, match="do_sample=True, but the application's programs take the argmax"):
        app.generate(torch.tensor([[1, 2]]), max_new_tokens=3, do_sample=True)
