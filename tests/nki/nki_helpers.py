"""Helpers for the NKI simulator tests: routed problems with a known block layout, the upstream comparison, and
analytic expectations written from the definitions (plain Python over the mapping, no kernel code)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from conftest import make_experts

from nxd_moe import BlockwiseMatmulConfig, ExpertMLPsV2
from nxd_moe.experts.routing_inputs import Routing, build_routing
from nxd_moe.experts.token_mapping import BlockMapping, num_blocks, token_to_block_mapping
from nxd_moe.nki_kernels.backend import KernelCall, blockwise_call, pads_token_rows, to_numpy, weight_arrays
from nxd_moe.reference import reference_for_experts

UPSTREAM_RTOL = 2e-2  # nki-library's bf16 tolerance, on the global range (maxAllClose "max" mode)
UPSTREAM_ATOL = 1e-5


def max_all_close(actual, expected, rtol: float = UPSTREAM_RTOL, atol: float = UPSTREAM_ATOL, msg: str = "") -> None:
    """``|actual - expected| <= atol + rtol * max|expected|`` everywhere (nki-library's comparison)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{msg} shape {a.shape} != {e.shape}"
    bound = atol + rtol * np.abs(e).max()
    err = np.abs(a - e)
    assert np.isfinite(a).all(), f"{msg} non-finite output at rows {np.unique(np.argwhere(~np.isfinite(a))[:, 0])}"
    worst_row = np.unravel_index(err.argmax(), err.shape)[0]
    assert (err <= bound).all(), f"{msg} max err {err.max():.3e} > {bound:.3e} (row {worst_row})"


def skewed_expert_index(seed: int = 0) -> torch.Tensor:
    """``(300, 2)`` over 4 experts with 280 / 200 / 80 / 40 tokens: at block size 256 expert 0 fills two blocks,
    the others one each (5 active blocks of N = 6), tokens in a shuffled order."""
    rows = [(0, 1)] * 180 + [(0, 2)] * 70 + [(0, 3)] * 30 + [(1, 2)] * 10 + [(1, 3)] * 10
    index = torch.tensor(rows)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    flip = torch.rand(len(rows), generator=torch.Generator().manual_seed(seed + 1)) < 0.5
    index = index[order]
    return torch.where(flip.unsqueeze(1), index.flip(1), index)


@dataclass
class Case:
    """A routed prefill problem: module, inputs, routing and block mapping as ``ExpertMLPsV2`` builds them."""

    experts: ExpertMLPsV2
    x: torch.Tensor
    affinities: torch.Tensor
    expert_index: torch.Tensor
    padding_mask: torch.Tensor | None
    routing: Routing
    mapping: BlockMapping

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    def golden(self) -> np.ndarray:
        """The float64 dense reference on the same (rounded) weights and inputs."""
        keep = None if self.padding_mask is None else self.padding_mask.unsqueeze(1).expand_as(self.expert_index)
        return reference_for_experts(self.experts, self.x, self.affinities, self.expert_index, keep=keep).numpy()

    def call(self, config: BlockwiseMatmulConfig) -> KernelCall:
        """The kernel ``config`` selects, with its NKI-contract inputs (as the nki_sim backend builds them)."""
        dtype = self.x.dtype
        x = to_numpy(self.x)
        aff = to_numpy(self.routing.affinities, dtype)
        if pads_token_rows(config):
            x = np.concatenate([x, np.zeros((1, x.shape[1]), dtype=x.dtype)])
            aff = np.concatenate([aff, np.zeros((1, aff.shape[1]), dtype=aff.dtype)])
        arrays = {"hidden_states": x, "expert_affinities_masked": aff.reshape(-1, 1),
                  **weight_arrays(self.experts.expert_weights(), dtype)}
        top_k = self.expert_index.shape[1]
        return blockwise_call(arrays, self.mapping.token_position_to_id.numpy(), self.mapping.block_to_expert.numpy(),
                              self.mapping.conditions.numpy(), config, tokens=self.tokens, top_k=top_k,
                              activation=self.experts.activation, prescale=self.routing.prescale,
                              accumulate=top_k > 1 or self.padding_mask is not None)

    def output(self, out: np.ndarray) -> np.ndarray:
        """The kernel output's first T rows (slot 0 for shard-on-block)."""
        return out[:self.tokens, 0] if out.ndim == 3 else out[:self.tokens]


def make_case(expert_index: torch.Tensor, num_experts: int, block_size: int, hidden: int = 256,
              intermediate: int = 256, dtype=torch.bfloat16, padding_mask: torch.Tensor | None = None, seed: int = 0,
              blocks: int | None = None, **config_overrides) -> Case:
    """``blocks``: the number of blocks (default: NxD's worst case for the shape)."""
    tokens, top_k = expert_index.shape
    experts = make_experts(num_experts=num_experts, hidden_size=hidden, intermediate_size=intermediate, top_k=top_k,
                           block_size=block_size, dtype=dtype, seed=seed, **config_overrides)
    gen = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    affinities = torch.softmax(torch.randn(tokens, num_experts, generator=gen), dim=-1)
    cfg = experts.routed_experts_mlp_config
    routing = build_routing(affinities, expert_index, num_experts, normalize=cfg.normalize_top_k_affinities,
                            prescale=cfg.early_expert_affinity_modulation, padding_mask=padding_mask)
    if blocks is None:
        blocks = num_blocks(tokens, top_k, num_experts, block_size)
    mapping = token_to_block_mapping(routing.expert_mask, routing.expert_index, block_size, blocks)
    return Case(experts, x, affinities, expert_index, padding_mask, routing, mapping)


# ----------------------------------------------------------------------------------------------------------------
# analytic expectations (from the mapping, by hand)


def weight_loads(block_sequence: list[int]) -> int:
    """Loads with weight skipping: the first block, then every change of expert along the sequence."""
    return sum(1 for i, e in enumerate(block_sequence) if i == 0 or e != block_sequence[i - 1])


def real_rows(mapping: BlockMapping, blocks: list[int]) -> int:
    """Real-token slots in the given blocks."""
    ids = mapping.token_position_to_id.view(-1, mapping.block_size)
    return sum(int((ids[b] >= 0).sum()) for b in blocks)
