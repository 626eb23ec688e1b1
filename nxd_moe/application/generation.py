"""The generation loop: context encoding, then token-generation steps back to back, the host reading every K steps.

:func:`generate_tokens` is what :meth:`CausalLMApplication.generate <nxd_moe.application.CausalLMApplication.
generate>` runs. The host decides everything it can from sizes alone -- the context bucket of each prompt group,
the token-generation bucket of each step (the longest prompt plus the step count), how many steps -- and reads the
device only every ``read_every`` steps, asynchronously: it looks at the flags of the previous read while the next
``read_every`` steps run, so the device never waits for it. A finished sequence keeps feeding padding until every
sequence is done or the token budget is spent (transformers' ``generate`` semantics: EOS ends a sequence, the
output is as long as the longest one).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from nxd_moe.application.runner import MAX_EOS_TOKENS, ProgramRunner
from nxd_moe.checks import check_int

__all__ = ["GenerationOutput", "generate_tokens", "prompts_of"]


@dataclass
class GenerationOutput:
    """``sequences (B, W + n)``: the input ids (as given, padding included) followed by the ``n`` generated tokens
    (``pad_token_id`` after a sequence's EOS) -- what transformers' ``generate`` returns. ``tokens (B, n)`` the
    generated part; ``lengths (B,)`` generated tokens up to and including each EOS; ``timings``: seconds spent in
    context encoding (to the first token on the host) and in token generation, and the steps run."""

    sequences: torch.Tensor
    tokens: torch.Tensor
    lengths: torch.Tensor
    timings: dict = field(default_factory=dict)


def prompts_of(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's prompt: the ids where ``attention_mask`` is 1 (left or right padding; the kept positions must
    be contiguous), all of the row without a mask."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
            torch.long, torch.int, torch.int32):
        what = getattr(input_ids, "dtype", type(input_ids).__name__)
        raise TypeError(f"input_ids must be an integer tensor (batch, tokens), got {what} "
                        f"{tuple(getattr(input_ids, 'shape', ()))}")
    if attention_mask is None:
        return list(input_ids.cpu().long())
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids' "
                         f"{tuple(input_ids.shape)}")
    prompts = []
    for b, (row, mask) in enumerate(zip(input_ids.cpu().long(), attention_mask.cpu().bool())):
        kept = mask.nonzero()[:, 0]
        if kept.numel() == 0:
            raise ValueError(f"attention_mask row {b} is all zeros: an empty prompt has no token to continue")
        if kept[-1] - kept[0] + 1 != kept.numel():
            raise ValueError(f"attention_mask row {b} has padding between prompt tokens; pad on one side only")
        prompts.append(row[kept])
    return prompts


def generate_tokens(runner: ProgramRunner, prompts: Sequence[torch.Tensor], width: int, *,
                    max_new_tokens: int, eos_token_ids: Sequence[int], pad_token_id: int,
                    sampling_params: torch.Tensor | None = None, read_every: int = 16,
                    on_tokens: Callable[[torch.Tensor], None] | None = None, progress: bool = False,
                    group=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Generate up to ``max_new_tokens`` for each prompt; returns ``(tokens (B, n), lengths (B,), timings)``.

    ``width``: the input's padded width (``max_length`` counts it, as transformers does). ``on_tokens``: called with
    each block of tokens ``(B, k)`` as it is read (every ``read_every`` steps, then the rest). ``group``: under
    expert parallelism, the ranks that step together (bucket choices and the stop agree across them).
    """
    config = runner.config
    batch = len(prompts)
    check_int("read_every", read_every, minimum=1)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    if batch > config.batch_size:
        raise ValueError(f"input batch of {batch} sequences exceeds the application's batch_size "
                         f"({config.batch_size})")
    if len(eos_token_ids) > MAX_EOS_TOKENS:
        raise ValueError(f"eos_token_id: at most {MAX_EOS_TOKENS} ids, got {len(eos_token_ids)}")
    lengths = [int(p.numel()) for p in prompts]
    longest = max(lengths)
    if longest > config.max_context_length:
        raise ValueError(f"a prompt of {longest} tokens is longer than max_context_length "
                         f"({config.max_context_length}, the largest context-encoding bucket)")
    # every rank of an expert-parallel group runs the same programs: agree on the sizes first
    longest, max_new_tokens = _agree_max(runner.device, group, longest, max_new_tokens)
    if longest + max_new_tokens > config.max_length:
        raise ValueError(f"{longest} prompt tokens + {max_new_tokens} new tokens exceed max_length "
                         f"({config.max_length}): ask for at most {config.max_length - longest} new tokens")

    device = runner.device
    runner.eos_token_ids.fill_(-1)
    if eos_token_ids:
        runner.eos_token_ids[:len(eos_token_ids)] = torch.tensor(list(eos_token_ids), device=device)
    runner.pad_token_id.fill_(pad_token_id)
    if sampling_params is not None:
        runner.sampling_params.fill_(1.0)
        runner.sampling_params[:batch] = sampling_params.to(device)
    start = time.perf_counter()
    rows = config.ctx_batch_size
    groups = math.ceil(config.batch_size / rows)
    bucket = config.context_bucket(longest)  # one bucket for every group: the programs' shapes agree across ranks
    for g in range(groups):
        ids, lens, seq_ids, active = runner.context_inputs[bucket]
        host_ids = torch.full((rows, bucket), pad_token_id, dtype=torch.long)
        host_lens = torch.ones(rows, dtype=torch.long)
        host_active = torch.zeros(rows, dtype=torch.bool)
        for r in range(rows):
            b = g * rows + r
            if b < batch:
                host_ids[r, :lengths[b]] = prompts[b]
                host_lens[r], host_active[r] = lengths[b], True
        ids.copy_(host_ids)
        lens.copy_(host_lens)
        active.copy_(host_active)
        seq_ids.copy_(torch.arange(g * rows, (g + 1) * rows))
        runner.context_encoding(bucket)
    first = runner.out[:batch, :1].to("cpu", copy=True)  # the first token on the host: the time to it
    ttft = time.perf_counter() - start
    if on_tokens is not None:
        on_tokens(first)
    pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []
    bar = _progress(progress, max_new_tokens)
    steps, read_to, stopped = 1, 1, False
    while steps < max_new_tokens and not stopped:
        chunk = min(read_every, max_new_tokens - steps)
        for _ in range(chunk):
            runner.token_generation(config.generation_bucket(longest + steps))
            steps += 1
        pending.append(_read_async(runner, batch, read_to, steps, group))
        read_to = steps
        # look at the read before this one: it is read_every steps old, so the device is not waited for
        if len(pending) > 1:
            stopped = _deliver(pending.pop(0), on_tokens, bar)
    for read in pending:
        _deliver(read, on_tokens, bar)
    if bar is not None:
        bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    total = time.perf_counter() - start
    tokens = runner.out[:batch, :steps].to("cpu", copy=True)  # a copy: the next generate reuses the buffer
    lengths_out = _generated_lengths(tokens, eos_token_ids)
    keep = int(lengths_out.max())  # transformers stops when every sequence is done
    timings = {"context_encoding_s": ttft, "token_generation_s": total - ttft, "steps": steps}
    return tokens[:, :keep], lengths_out, timings


def _agree_max(device: torch.device, group, *values: int) -> tuple[int, ...]:
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return tuple(int(v) for v in t.tolist())


def _read_async(runner: ProgramRunner, batch: int, start: int, stop: int, group):
    """Enqueue the copy of tokens ``[start, stop)`` and of "every sequence done" to the host; returns the pending
    read. Under a group the flag is every rank's (one all-reduce per read, not per token)."""
    all_done = runner.done[:batch].all().to(torch.int32).reshape(1)
    if group is not None:
        dist.all_reduce(all_done, op=dist.ReduceOp.MIN, group=group)
    if runner.device.type != "cuda":
        return start, runner.out[:batch, start:stop].clone(), all_done.clone(), None
    tokens = torch.empty((batch, stop - start), dtype=torch.long, pin_memory=True)
    flag = torch.empty(1, dtype=torch.int32, pin_memory=True)
    tokens.copy_(runner.out[:batch, start:stop], non_blocking=True)
    flag.copy_(all_done, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return start, tokens, flag, event


def _deliver(read, on_tokens, bar) -> bool:
    _, tokens, flag, event = read
    if event is not None:
        event.synchronize()
    if on_tokens is not None:
        on_tokens(tokens)
    if bar is not None:
        bar.update(tokens.shape[1])
    return bool(flag.item())


def _generated_lengths(tokens: torch.Tensor, eos_token_ids: Sequence[int]) -> torch.Tensor:
    """Tokens each sequence generated up to and including its first EOS (all of them without one)."""
    n = tokens.shape[1]
    if not eos_token_ids:
        return torch.full((tokens.shape[0],), n, dtype=torch.long)
    hit = torch.isin(tokens, torch.tensor(list(eos_token_ids)))
    first = torch.where(hit.any(dim=1), hit.float().argmax(dim=1) + 1, torch.tensor(n))
    return first.long()


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="tok", desc="generate")
    bar.update(1)
    return bar
