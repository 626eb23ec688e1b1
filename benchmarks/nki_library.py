"""Run AWS nki-library's MoE kernels unmodified on the nxd_moe NKI simulator; compare them with nki-library's own
torch references and with our kernels on the same problems.

    python benchmarks/nki_library.py PATH [--only NAME[,NAME]] [--out FILE]

``PATH`` is a checkout of github.com/aws-neuron/nki-library (not vendored here; its ``src/`` and root go on
``sys.path``). Each case builds one small MoE problem (routing and token->block mapping from nxd_moe's own
``token_to_block_mapping``), runs the nki-library kernel through ``nki.simulate(kernel[lnc])`` after
:func:`nxd_moe.nki_kernels.compat.install`, the nki-library torch reference (``moe_cte_torch_ref`` /
``moe_tkg_torch_ref``), and our kernel on the same inputs, and reports in JSON: the max absolute difference to the
reference (and nki-library's global-range criterion ``|a - b| <= atol + rtol * max|ref|``, rtol 2e-2, atol 1e-5),
DMA bytes, matmul FLOPs and the Trn2 cost model's estimate for both kernels, or the error that stopped a kernel.

nki-library's torch reference module imports ``neuron_dtypes`` (an unavailable Neuron package) for its MX paths
only; a stand-in that refuses MX casts is registered for the run. MX (Trn3) kernels are not run: the simulated
target is Trn2.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import subprocess
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy as np
import torch

from nxd_moe.config import BlockShardStrategy, GLUType, SkipMode
from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.token_mapping import num_blocks, token_to_block_mapping
from nxd_moe.nki_kernels import compat
from nxd_moe.nki_kernels.cost_model import TRN2
from nxd_moe.nki_kernels.kernels import (
    ExpertAffinityScaleMode,
    bwmm_shard_on_block,
    bwmm_shard_on_H,
    bwmm_shard_on_I,
    moe_tkg_all_expert,
    moe_tkg_selective_expert,
)
from nxd_moe.nki_kernels.lnc import simulate

RTOL, ATOL = 2e-2, 1e-5  # nki-library's MoE tolerances (reference section 3.3)
BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass
class Problem:
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    block_size: int = 256
    seed: int = 0
    skew: float = 0.0  # added to expert 0's router logit: long runs of expert-0 blocks (weight skipping)
    act: str = "silu"  # or "gelu" (exact)
    bias: bool = False  # gate/up bias (E, 2, I) and down bias (E, H)
    clamp: float | None = None  # GPT-OSS style: gate clamped above at clamp, up to [-clamp, clamp]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def build(self) -> "Problem":
        rng = np.random.default_rng(self.seed)
        t, h, i, e, k = self.tokens, self.hidden, self.intermediate, self.experts, self.top_k
        logits = rng.standard_normal((t, e))
        logits[:, 0] += self.skew
        index = np.argsort(-logits, axis=1)[:, :k]
        chosen = np.take_along_axis(logits, index, axis=1)
        weights = np.exp(chosen) / np.exp(chosen).sum(axis=1, keepdims=True)
        affinities = np.zeros((t, e), np.float32)
        np.put_along_axis(affinities, index, weights.astype(np.float32), axis=1)
        self.arrays = {
            "x": rng.standard_normal((t, h)).astype(BF16),
            "gate_up": rng.uniform(-0.1, 0.1, (e, h, 2, i)).astype(BF16),
            "down": rng.uniform(-0.1, 0.1, (e, i, h)).astype(BF16),
            "affinities": affinities.astype(BF16),
            "index": index.astype(np.int32),
        }
        if self.bias:
            self.arrays["gate_up_bias"] = rng.uniform(-0.5, 0.5, (e, 2, i)).astype(BF16)
            self.arrays["down_bias"] = rng.uniform(-0.5, 0.5, (e, h)).astype(BF16)
        return self

    def library_options(self, lib, tkg: bool) -> dict:
        """The activation, clamp and bias arguments in nki-library's names (TKG and CTE name them differently)."""
        act = {"silu": lib.ActFnType.SiLU, "gelu": lib.ActFnType.GELU}[self.act]
        out = {"activation_fn" if tkg else "activation_function": act}
        if self.clamp is not None:
            # (moe_tkg_torch_ref ignores a gate lower limit, so none is set)
            out.update(gate_clamp_upper_limit=self.clamp, up_clamp_upper_limit=self.clamp,
                       up_clamp_lower_limit=-self.clamp)
        if self.bias:
            out.update({"expert_gate_up_bias" if tkg else "gate_and_up_proj_bias": self.arrays["gate_up_bias"],
                        "expert_down_bias" if tkg else "down_proj_bias": self.arrays["down_bias"]})
        return out

    def our_biases(self) -> dict:
        return {"gate_and_up_proj_bias": self.arrays.get("gate_up_bias"),
                "down_proj_bias": self.arrays.get("down_bias")}

    def mapping(self):
        mask = torch.zeros(self.tokens, self.experts, dtype=torch.bool)
        mask.scatter_(1, torch.from_numpy(self.arrays["index"]).long(), True)
        blocks = num_blocks(self.tokens, self.top_k, self.experts, self.block_size, pad_to_even=True)
        return token_to_block_mapping(mask, torch.from_numpy(self.arrays["index"]).long(), self.block_size, blocks)

    def activation(self) -> ExpertActivation:
        limit = self.clamp
        return ExpertActivation(hidden_act=self.act, glu_mlp=True, glu_type=GLUType.GLU, gate_upper=limit,
                                up_lower=None if limit is None else -limit, up_upper=limit)


def _torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == BF16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(a)


def _counts(run) -> dict:
    acc = run.accounting
    return {"dma_bytes": acc.dma_bytes(), "dma_bytes_by_tensor": acc.summary()["dma_bytes_by_tensor"],
            "matmul_flops": acc.matmul_flops,
            "estimated_us": round(TRN2.estimate_run(run).total_ns / 1e3, 3),
            "sbuf_high_water_bytes": acc.sbuf_high_water}


def _compare(out: np.ndarray, ref: np.ndarray) -> dict:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err = float(np.abs(out - ref).max())
    bound = ATOL + RTOL * float(np.abs(ref).max())
    return {"max_abs_error": err, "ref_max_abs": float(np.abs(ref).max()), "within_tolerance": err <= bound,
            "nan": int(np.isnan(out).sum())}


# ---------------------------------------------------------------------------------------------------------- TKG


def tkg_case(lib, p: Problem, all_expert: bool, lnc: int) -> dict:
    nki = sys.modules["nki"]
    a = p.arrays
    kw = {"is_all_expert": all_expert, "expert_affinities_scaling_mode": lib.ExpertAffinityScaleMode.POST_SCALE,
          **p.library_options(lib, tkg=True)}
    if all_expert:
        kw["rank_id"] = np.zeros((1, 1), np.int32)
    out = nki.simulate(nki.jit(lib.moe_tkg)[lnc])(a["x"], a["gate_up"], a["down"], a["affinities"], a["index"], **kw)
    library_run = compat.last_run()
    ref_kw = {k: torch.from_numpy(v) if k == "rank_id" else _torch(v) if isinstance(v, np.ndarray) else v
              for k, v in kw.items()}
    ref = lib.moe_tkg_torch_ref(_torch(a["x"]), _torch(a["gate_up"]), _torch(a["down"]), _torch(a["affinities"]),
                                torch.from_numpy(a["index"]), **ref_kw)
    ref = (ref["out"] if isinstance(ref, dict) else ref).float().numpy()
    ours_kernel = moe_tkg_all_expert if all_expert else moe_tkg_selective_expert
    args = {"hidden_states": a["x"], "expert_affinities_masked": a["affinities"].reshape(-1, 1),
            "gate_up_proj_weight": a["gate_up"], "down_proj_weight": a["down"], "activation": p.activation(),
            **p.our_biases()}
    if not all_expert:
        args["expert_index"] = a["index"]
    ours = simulate(ours_kernel, lnc)(**args)
    return {"library": {**_compare(out, ref), **_counts(library_run)},
            "ours": {"kernel": ours_kernel.__name__, **_compare(ours.outputs, ref), **_counts(ours)}}


# ---------------------------------------------------------------------------------------------------------- CTE


def _cte_inputs(p: Problem, skip_token: bool):
    a, m = p.arrays, p.mapping()
    t, e, h = p.tokens, p.experts, p.hidden
    positions = m.token_position_to_id.numpy().astype(np.int32)
    rows = t if skip_token else t + 1
    hidden = np.zeros((rows, h), BF16)
    hidden[:t] = a["x"]
    affinities = np.zeros((rows, e), BF16)
    affinities[:t] = a["affinities"]
    if not skip_token:
        positions = np.where(positions < 0, t, positions).astype(np.int32)
    return {"hidden_states": hidden, "expert_affinities_masked": affinities.reshape(-1, 1),
            "gate_up_proj_weight": a["gate_up"], "down_proj_weight": a["down"],
            "token_position_to_id": positions,
            "block_to_expert": m.block_to_expert.numpy().astype(np.int32).reshape(-1, 1)}, m


def cte_case(lib, p: Problem, variant: str, lnc: int, skip_token: bool = False, skip_weight: bool = False) -> dict:
    nki = sys.modules["nki"]
    inputs, mapping = _cte_inputs(p, skip_token)
    n = len(inputs["block_to_expert"])
    conditions = np.concatenate([mapping.conditions.numpy().astype(np.int32), np.zeros(1, np.int32)])
    kw = {"block_size": p.block_size, "skip_dma": lib.SkipMode(skip_token, skip_weight),
          "is_tensor_update_accumulating": p.top_k > 1}
    options = p.library_options(lib, tkg=False)
    if variant == "shard_on_H":  # experimental in nki-library: not behind moe_cte
        out = nki.simulate(lib.bwmm_shard_on_H[lnc])(**inputs, **kw)  # SiLU, no bias: its only options
    else:
        if variant == "shard_on_i_hybrid":
            kw["conditions"] = conditions
        spec = lib.MoECTESpec(implementation=lib.MoECTEImplementation[variant])
        out = nki.simulate(lib.moe_cte[lnc])(**inputs, spec=spec, **kw, **options)
    library_run = compat.last_run()
    out = out[0] if isinstance(out, (tuple, list)) else out
    func = {"shard_on_block": "SHARD_ON_BLOCK", "shard_on_i_dropping": "SHARD_ON_INTERMEDIATE_DROPPING",
            "shard_on_H": "SHARD_ON_HIDDEN"}.get(variant, "SHARD_ON_INTERMEDIATE")
    ref = lib.moe_cte_torch_ref(
        **{k: _torch(v) for k, v in inputs.items()}, block_size=p.block_size, bwmm_func=BWMMFunc[func],
        lnc_degree=lnc, conditions=torch.from_numpy(conditions) if variant == "shard_on_i_hybrid" else None,
        skip_dma=lib.SkipMode(skip_token, skip_weight), is_tensor_update_accumulating=p.top_k > 1,
        top_k=p.top_k, **{k: _torch(v) if isinstance(v, np.ndarray) else v for k, v in options.items()})["output"]
    ref = ref.float().numpy()
    if out.ndim == 3:  # shard-on-block with accumulation: per-core slots, slot 0 holds the sum
        out = out[:, 0] if variant == "shard_on_block" else out[0]
        ref = ref[:, 0] if variant == "shard_on_block" else ref[0]
    tokens = slice(0, p.tokens)
    ours_kernel, ours_kw = {
        "shard_on_block": (bwmm_shard_on_block, {"block_sharding_strategy": BlockShardStrategy.PING_PONG}),
        "shard_on_H": (bwmm_shard_on_H, {})}.get(variant, (bwmm_shard_on_I, {}))
    if variant == "shard_on_i_hybrid":
        ours_kw = {"conditions": conditions, "num_static_block": max(0, n - p.experts)}
    ours = simulate(ours_kernel, lnc)(**inputs, block_size=p.block_size, activation=p.activation(),
                                      skip_dma=SkipMode(skip_token, skip_weight),
                                      expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
                                      is_tensor_update_accumulating=p.top_k > 1, **p.our_biases(), **ours_kw)
    ours_out = ours.outputs[:, 0] if ours.outputs.ndim == 3 else ours.outputs
    return {"blocks": n,
            "library": {**_compare(out[tokens], ref[tokens]), **_counts(library_run)},
            "ours": {"kernel": ours_kernel.__name__, **_compare(ours_out[tokens], ref[tokens]), **_counts(ours)}}


# ------------------------------------------------------------------------------------------------ index kernels


def _exact(out, ref) -> dict:
    out, ref = np.asarray(out), np.asarray(ref)
    return {"equal": bool(out.shape == ref.shape and np.array_equal(out, ref)),
            "mismatches": int((out != ref).sum()) if out.shape == ref.shape else None}


def nonzero_case(lib, p: Problem, lnc: int) -> dict:
    """nki-library's on-device token->expert index kernels (NxD's EP mapping path, reference section 2.3):
    ``find_nonzero_indices`` over the ``(T, E)`` masked affinities, then ``indexed_flatten`` of its index rows into
    blocks of ``B`` -- each against its torch reference (exact: these are integers)."""
    nki = sys.modules["nki"]
    affinities = p.arrays["affinities"].astype(np.float32)
    indices, counts = nki.simulate(lib.find_nonzero_indices[lnc])(affinities)
    find_run = compat.last_run()
    ref = lib.find_nonzero_indices_torch_ref(torch.from_numpy(affinities))
    f_len = 16
    blocks = -(-np.asarray(counts, np.int64) // p.block_size)
    offsets = (np.concatenate([[0], np.cumsum(blocks)[:-1]]) * (p.block_size // f_len)).astype(np.int32)
    output_len = int(blocks.sum()) * p.block_size + p.tokens
    output_len += -output_len % 128
    flat = nki.simulate(lib.indexed_flatten[lnc])(np.asarray(indices, np.int32), f_len, output_len, offsets)
    flat_run = compat.last_run()
    flat_ref = lib.indexed_flatten_torch_ref(torch.from_numpy(np.asarray(ref["indices"], np.int32)), f_len,
                                             output_len, torch.from_numpy(offsets))["flattened_array"]
    # our torch mapping of the same routing: the same slots for the real blocks, then padding blocks of -1
    mine = p.mapping().token_position_to_id.numpy()
    real = int(blocks.sum()) * p.block_size
    return {"find_nonzero_indices": {**_exact(indices, ref["indices"].numpy()),
                                     "counts_equal": bool(np.array_equal(counts, ref["nonzero_counts"].numpy())),
                                     **_counts(find_run)},
            "indexed_flatten": {**_exact(flat, flat_ref.numpy()), **_counts(flat_run)},
            "matches_nxd_moe_token_position_to_id": bool(np.array_equal(np.asarray(flat)[:real], mine[:real])
                                                          and (mine[real:] == -1).all())}


# ---------------------------------------------------------------------------------------------------------- driver


_SELECTOR_MODULE = "test.integration.nkilib.core.moe.moe_cte.test_moe_cte_common"


class BWMMFunc(enum.Enum):
    """The kernel variants nki-library's ``moe_cte_torch_ref`` distinguishes (its ``bwmm_func`` argument)."""

    SHARD_ON_BLOCK = 1
    SHARD_ON_HIDDEN = 2
    SHARD_ON_INTERMEDIATE = 3
    SHARD_ON_INTERMEDIATE_DROPPING = 6


def load_library(path: str) -> types.SimpleNamespace:
    """Import nki-library's MoE entry points and torch references from the checkout at ``path``."""
    compat.install()
    if "neuron_dtypes" not in sys.modules:
        stand_in = types.ModuleType("neuron_dtypes", "stand-in: MX casts are Trn3-only and not simulated")

        def static_cast(*args, **kwargs):
            raise NotImplementedError("neuron_dtypes.static_cast (MX formats) is not available")

        stand_in.static_cast = static_cast
        stand_in.__getattr__ = lambda name: f"neuron_dtypes.{name} (stand-in)"  # dtype names its tables list
        sys.modules["neuron_dtypes"] = stand_in
    # moe_cte_torch_ref imports its kernel selector from nki-library's test suite, which needs scipy and the
    # Neuron test harness; the selector's members are the ones that reference compares against.
    selector = types.ModuleType(_SELECTOR_MODULE, "stand-in for nki-library's test-side BWMMFunc")
    selector.BWMMFunc = BWMMFunc
    sys.modules.setdefault(_SELECTOR_MODULE, selector)
    sys.path[:0] = [f"{path}/src", path]
    from nkilib_src.nkilib.core.moe.moe_cte.moe_cte import MoECTEImplementation, MoECTESpec, moe_cte
    from nkilib_src.nkilib.core.moe.moe_cte.moe_cte_torch import moe_cte_torch_ref
    from nkilib_src.nkilib.core.moe.moe_cte.moe_cte_utils import SkipMode as LibSkipMode
    from nkilib_src.nkilib.core.moe.moe_tkg.moe_tkg import moe_tkg
    from nkilib_src.nkilib.core.moe.moe_tkg.moe_tkg_torch import moe_tkg_torch_ref
    from nkilib_src.nkilib.core.subkernels.find_nonzero_indices import find_nonzero_indices
    from nkilib_src.nkilib.core.subkernels.find_nonzero_indices_torch import find_nonzero_indices_torch_ref
    from nkilib_src.nkilib.core.subkernels.indexed_flatten import indexed_flatten
    from nkilib_src.nkilib.core.subkernels.indexed_flatten_torch import indexed_flatten_torch_ref
    from nkilib_src.nkilib.core.utils.common_types import ActFnType
    from nkilib_src.nkilib.core.utils.common_types import ExpertAffinityScaleMode as LibScale
    from nkilib_src.nkilib.experimental.moe.forward.bwmm_shard_on_H import blockwise_mm_baseline_shard_hidden

    return types.SimpleNamespace(moe_cte=moe_cte, MoECTEImplementation=MoECTEImplementation, MoECTESpec=MoECTESpec,
                                 moe_cte_torch_ref=moe_cte_torch_ref, SkipMode=LibSkipMode, moe_tkg=moe_tkg,
                                 moe_tkg_torch_ref=moe_tkg_torch_ref, ActFnType=ActFnType,
                                 ExpertAffinityScaleMode=LibScale, bwmm_shard_on_H=blockwise_mm_baseline_shard_hidden,
                                 find_nonzero_indices=find_nonzero_indices,
                                 find_nonzero_indices_torch_ref=find_nonzero_indices_torch_ref,
                                 indexed_flatten=indexed_flatten, indexed_flatten_torch_ref=indexed_flatten_torch_ref)


TKG_PROBLEM = dict(tokens=4, hidden=512, intermediate=128, experts=4, top_k=2)
CTE_PROBLEM = dict(tokens=128, hidden=512, intermediate=256, experts=4, top_k=2, block_size=256)
# expert 0 takes most tokens: runs of its blocks on each core, so weight skipping has loads to skip
SKEWED_PROBLEM = dict(tokens=256, hidden=512, intermediate=256, experts=4, top_k=2, block_size=128, skew=3.0)
VARIANT_PROBLEM = dict(CTE_PROBLEM, bias=True, clamp=1.0)
# moe_cte's intermediate step handles SiLU and Swish only: with GELU it leaves the activations unwritten, which the
# simulator's NaN-filled fresh memory shows (an nki-library limitation this case documents)
GELU_PROBLEM = dict(CTE_PROBLEM, act="gelu")
TKG_VARIANT_PROBLEM = dict(TKG_PROBLEM, act="gelu", bias=True, clamp=1.0)
INDEX_PROBLEM = dict(tokens=256, hidden=128, intermediate=128, experts=8, top_k=2, block_size=128)
# the dropping kernel computes one block per expert (block index = expert), with blocks of >= 1024 tokens
DROPPING_PROBLEM = dict(tokens=512, hidden=512, intermediate=256, experts=2, top_k=1, block_size=1024)

CASES: dict[str, tuple[Callable, dict, dict]] = {
    "moe_tkg_selective_lnc1": (tkg_case, TKG_PROBLEM, {"all_expert": False, "lnc": 1}),
    "moe_tkg_selective_lnc2": (tkg_case, TKG_PROBLEM, {"all_expert": False, "lnc": 2}),
    "moe_tkg_all_expert_lnc1": (tkg_case, TKG_PROBLEM, {"all_expert": True, "lnc": 1}),
    "moe_tkg_all_expert_lnc2": (tkg_case, TKG_PROBLEM, {"all_expert": True, "lnc": 2}),
    "moe_tkg_selective_gelu_bias_clamp_lnc1": (tkg_case, TKG_VARIANT_PROBLEM, {"all_expert": False, "lnc": 1}),
    "moe_tkg_all_expert_gelu_bias_clamp_lnc2": (tkg_case, TKG_VARIANT_PROBLEM, {"all_expert": True, "lnc": 2}),
    "moe_cte_shard_on_block_lnc2": (cte_case, CTE_PROBLEM, {"variant": "shard_on_block", "lnc": 2}),
    "moe_cte_shard_on_block_bias_clamp_lnc2": (cte_case, VARIANT_PROBLEM, {"variant": "shard_on_block", "lnc": 2}),
    "moe_cte_shard_on_i_bias_clamp_lnc2": (cte_case, VARIANT_PROBLEM, {"variant": "shard_on_i", "lnc": 2}),
    "moe_cte_shard_on_block_gelu_lnc2": (cte_case, GELU_PROBLEM, {"variant": "shard_on_block", "lnc": 2}),
    "moe_cte_shard_on_block_skip_token_lnc2": (cte_case, CTE_PROBLEM,
                                               {"variant": "shard_on_block", "lnc": 2, "skip_token": True}),
    "moe_cte_shard_on_block_skip_weight_lnc2": (cte_case, SKEWED_PROBLEM,
                                                {"variant": "shard_on_block", "lnc": 2, "skip_weight": True}),
    "moe_cte_shard_on_block_skip_token_weight_lnc2": (cte_case, SKEWED_PROBLEM,
                                                      {"variant": "shard_on_block", "lnc": 2, "skip_token": True,
                                                       "skip_weight": True}),
    "moe_cte_shard_on_i_lnc2": (cte_case, CTE_PROBLEM, {"variant": "shard_on_i", "lnc": 2}),
    "moe_cte_shard_on_i_hybrid_lnc2": (cte_case, CTE_PROBLEM, {"variant": "shard_on_i_hybrid", "lnc": 2}),
    "bwmm_shard_on_H_lnc2 (experimental)": (cte_case, CTE_PROBLEM, {"variant": "shard_on_H", "lnc": 2}),
    "find_nonzero_indices + indexed_flatten lnc2": (nonzero_case, INDEX_PROBLEM, {"lnc": 2}),
    "moe_cte_shard_on_i_dropping_lnc2": (cte_case, DROPPING_PROBLEM, {"variant": "shard_on_i_dropping", "lnc": 2}),
}


def run_cases(path: str, only: list[str] | None = None) -> dict[str, Any]:
    lib = load_library(path)
    results: dict[str, Any] = {}
    for name, (fn, shape, kw) in CASES.items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(sys.stderr):  # nki-library prints progress; stdout carries the JSON
                results[name] = {"problem": shape, **fn(lib, Problem(**shape).build(), **kw)}
        except Exception as e:  # a kernel that does not run is a result too
            frames = traceback.extract_tb(e.__traceback__)
            results[name] = {"problem": shape, "error": f"{type(e).__name__}: {e}",
                             "at": [f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-4:]]}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
    return results


def _commit(path: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None  # an exported snapshot: say which in the results' name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a checkout of aws-neuron/nki-library")
    parser.add_argument("--only", help="comma-separated case names (default: all): " + ", ".join(CASES))
    parser.add_argument("--out", help="write the JSON here as well as to stdout")
    ns = parser.parse_args(argv)
    results = run_cases(ns.path, ns.only.split(",") if ns.only else None)
    text = json.dumps({"nki_library": ns.path, "nki_library_commit": _commit(ns.path), "rtol": RTOL, "atol": ATOL,
                       "cases": results}, indent=2)
    print(text)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
