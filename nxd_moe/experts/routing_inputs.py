"""From a router's output to what every expert algorithm consumes: the chosen-expert mask and weights."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Routing(NamedTuple):
    """Routing decisions in the form the expert algorithms take.

    ``expert_index (T, k)``: the chosen experts. ``expert_mask (T, E)`` bool: True where token t goes to expert e
    (all False for padded tokens, so they take no block slot and no capacity). ``affinities (T, E)``: the
    combine weights, zero off the mask, L1-normalised over the chosen experts if asked. ``prescale``: scale the
    expert *input* by the affinity instead of its output (Llama 4's early affinity modulation). ``has_padding``:
    a padding mask was applied, so some pairs may be masked out (static: known without reading the mask).
    """

    expert_index: torch.Tensor
    expert_mask: torch.Tensor
    affinities: torch.Tensor
    prescale: bool
    has_padding: bool = False

    def pair_weights(self) -> torch.Tensor:
        """``(T, k)`` weight of each (token, chosen expert) pair in the final sum; 0 for padded tokens.

        With ``prescale`` the affinity is already inside the expert output, so the weight is 1.
        """
        valid = self.pair_valid()
        if self.prescale:
            return valid.to(self.affinities.dtype)
        return self.affinities.gather(1, self.expert_index)

    def pair_valid(self) -> torch.Tensor:
        """``(T, k)`` bool: the pair is real (its token is not padding)."""
        return self.expert_mask.gather(1, self.expert_index)


def expert_mask(expert_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``(T, k)`` indices -> ``(T, E)`` k-hot bool mask (comparisons, no one_hot: static and XLA-friendly)."""
    experts = torch.arange(num_experts, device=expert_index.device)
    return (expert_index.unsqueeze(-1) == experts).any(dim=1)


def build_routing(
    expert_affinities: torch.Tensor,
    expert_index: torch.Tensor,
    num_experts: int,
    normalize: bool,
    prescale: bool,
    padding_mask: torch.Tensor | None = None,
) -> Routing:
    """Mask affinities to the chosen experts, normalise them, and remove padded tokens."""
    mask = expert_mask(expert_index, num_experts)
    if padding_mask is not None:
        mask = mask & padding_mask.reshape(-1, 1)
    affinities = torch.where(mask, expert_affinities, torch.zeros((), dtype=expert_affinities.dtype,
                                                                    device=expert_affinities.device))
    if normalize:
        affinities = F.normalize(affinities, p=1.0, dim=1)
    return Routing(expert_index, mask, affinities, prescale, padding_mask is not None)
