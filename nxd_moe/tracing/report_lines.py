"""Lines shared by ``nxd-moe trace``'s printed reports (one layer, a whole decoder, a parallel layout): the column
of check names, a check's verdict, the HLO parameter map and the comparison with eager."""

from __future__ import annotations

from collections import Counter

LABEL = 27  # width of the check names in the report


def verdict(flag: bool) -> str:
    """A check's result as the report prints it."""
    return "ok" if flag else "FAILED"


def parameters_line(hlo: dict, out_dir: str) -> str:
    """The HLO's entry parameters by kind, and where their map and values are."""
    kinds = Counter(p["kind"] for p in hlo["parameters"])
    files = hlo["files"]
    return (f"{'HLO parameters':<{LABEL}}{len(hlo['parameters'])}: {kinds['input']} inputs, {kinds['weight']} weights "
            f"-> {out_dir}/{files['weights']}, {kinds['shared']} shared -> {out_dir}/{files['shared']}; map "
            f"{out_dir}/{files['parameters']}")


def parity_with_eager(static: dict) -> str:
    """check_static's comparison with eager, for the report line."""
    flips = static["routing_flips"]
    ties = f", near-tie flips {'/'.join(map(str, flips))} (eager routed as XLA routed)" if any(flips) else ""
    return (f"max |XLA - eager| {static['max_abs_diff']:.2e}, router logits {static['router_logits_max_abs_diff']:.2e}"
            f"{ties}")
