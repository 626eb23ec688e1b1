"""On-device sampling: the next token chosen inside the program, from the last position's logits.

Greedy (argmax), or top-k / top-p / temperature sampling with one parameter row per sequence -- NxD Inference's
``sampling_params`` ``(B, 3)``: ``[top_k, top_p, temperature]`` -- so requests with different settings share one
program (NxDI's ``dynamic`` sampling). As in NxDI, the candidates are the ``global_topk`` largest logits (a static
shape), ``top_k`` keeps the first ``k`` of them (``top_k <= 0`` or ``> global_topk``: all of them), temperature divides
the logits, ``top_p`` keeps the smallest prefix of the sorted candidates whose probability reaches ``p`` (at least
one), and the token is drawn by inverting the cumulative distribution of what is kept with one uniform number per
sequence, drawn on the device (``torch.rand``: the default generator, so ``torch.manual_seed`` makes a run
reproducible, in a CUDA graph too). The order -- temperature, then top-k, then top-p -- is transformers'
(its ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``); top-k and temperature commute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nxd_moe.checks import check_bool, check_float, check_int

__all__ = ["SamplingConfig", "greedy_tokens", "prepare_sampling_params", "sample_tokens"]


@dataclass(frozen=True)
class SamplingConfig:
    """How the programs choose tokens (NxDI's ``OnDeviceSamplingConfig`` fields).

    ``do_sample``: False = greedy. ``top_k`` / ``top_p`` / ``temperature``: the defaults of every sequence
    (``generate`` may give others per call, or per sequence when ``dynamic``). ``global_topk``: how many candidates
    sampling looks at (a static shape; ``top_k`` above it is capped there). ``dynamic``: per-sequence parameters at
    run time (else the config's values are used for every sequence, whatever ``generate`` is given).
    """

    do_sample: bool = False
    top_k: int = 1
    top_p: float = 1.0
    temperature: float = 1.0
    dynamic: bool = False
    global_topk: int = 256

    def __post_init__(self) -> None:
        check_bool("on_device_sampling_config.do_sample", self.do_sample)
        check_bool("on_device_sampling_config.dynamic", self.dynamic)
        check_int("on_device_sampling_config.top_k", self.top_k)
        check_int("on_device_sampling_config.global_topk", self.global_topk, minimum=1)
        _check_top_p("on_device_sampling_config.top_p", self.top_p)
        check_float("on_device_sampling_config.temperature", self.temperature, positive=True)


def _check_top_p(name: str, value) -> float:
    value = check_float(name, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")
    return value


def prepare_sampling_params(batch_size: int, top_k=1, top_p=1.0, temperature=1.0,
                            device: torch.device | str = "cpu") -> torch.Tensor:
    """``(batch_size, 3)`` float32 rows ``[top_k, top_p, temperature]``; each argument a number (every sequence)
    or a sequence of ``batch_size`` numbers. Checked: ``top_k`` integral, ``top_p`` in (0, 1], temperature > 0."""
    check_int("batch_size", batch_size, minimum=1)
    columns = []
    for name, value in (("top_k", top_k), ("top_p", top_p), ("temperature", temperature)):
        values = list(value) if isinstance(value, (list, tuple)) else (
            value.tolist() if isinstance(value, torch.Tensor) and value.dim() else [value] * batch_size)
        if len(values) != batch_size:
            raise ValueError(f"{name}: {len(values)} values for a batch of {batch_size}")
        for v in values:
            if name == "top_k":
                if isinstance(v, float) and v.is_integer():
                    v = int(v)
                check_int(name, v)
            elif name == "top_p":
                _check_top_p(name, v)
            else:
                check_float(name, v, positive=True)
        columns.append([float(v) for v in values])
    return torch.tensor(list(zip(*columns)), dtype=torch.float32, device=device)


# Logits per chunk of the greedy argmax's first stage.
ARGMAX_CHUNK = 2048


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be (B, V) with V >= 1, got shape {tuple(logits.shape)}")


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits (B, V)`` -> ``(B,)`` int64: ``logits.argmax(-1)`` (the first of equal maxima; a NaN counts as the
    maximum), in two stages over chunks of ``ARGMAX_CHUNK`` logits. One reduction over a vocabulary of 150k logits
    runs one program per row (33 us of an H200's decode step at batch 1); over chunks the first stage spreads a row
    over many programs. Chunk maxima keep the first maximum: the first chunk holding the maximum, and in it the
    first position."""
    _check_logits(logits)
    batch, vocab = logits.shape
    if vocab <= ARGMAX_CHUNK:
        return logits.argmax(dim=-1)
    chunks = -(-vocab // ARGMAX_CHUNK)
    padded = torch.nn.functional.pad(logits, (0, chunks * ARGMAX_CHUNK - vocab), value=float("-inf"))
    values, positions = padded.view(batch, chunks, ARGMAX_CHUNK).max(dim=-1)
    chunk = values.argmax(dim=-1, keepdim=True)
    return (chunk * ARGMAX_CHUNK + positions.gather(1, chunk))[:, 0]


def sample_tokens(logits: torch.Tensor, sampling_params: torch.Tensor | None, global_topk: int = 256) -> torch.Tensor:
    """Next tokens ``(B,)`` int64 from ``logits (B, V)``: argmax when ``sampling_params`` is None, else a draw as
    the module docstring says (``sampling_params (B, 3)``)."""
    if sampling_params is None:
        return greedy_tokens(logits)
    _check_logits(logits)
    candidates = min(global_topk, logits.shape[-1])
    values, indices = logits.float().topk(candidates, dim=-1)  # sorted, largest first
    top_k, top_p, temperature = sampling_params.float().unbind(-1)
    rank = torch.arange(candidates, device=logits.device)
    k = torch.where((top_k <= 0) | (top_k > candidates), candidates, top_k)
    values = values / temperature[:, None]
    values = values.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)
    # keep a candidate while the probability before it is below top_p (the first is always kept)
    before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand(logits.shape[0], 1, device=logits.device) * cdf[:, -1:]
    choice = (cdf <= u).sum(dim=-1).clamp(max=candidates - 1)
    return indices.gather(1, choice[:, None])[:, 0]
