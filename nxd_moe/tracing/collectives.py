"""What an SPMD program communicates, read from its HLO text: each collective's count, replica groups and the bytes
one rank receives."""

from __future__ import annotations

import re

COLLECTIVES = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce")

_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%\S+ = (\([^()]*\)|\S+) (" + "|".join(COLLECTIVES) + r")\((.*?)\),"
                         r".*?replica_groups=(\{(?:\{[\d,]*\},?)*\})", re.MULTILINE)
_SHAPE = re.compile(r"([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _shape_bytes(text: str) -> int:
    """Bytes of the arrays in an HLO shape or operand list, scalars left out: the only scalars a collective carries
    are the ordering tokens ``torch_xla`` threads through its all-reduces."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if not dims:
            continue
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _BYTES[dtype]
    return total


def collective_summary(hlo_text: str) -> dict[str, dict]:
    """Per collective opcode in the HLO: ``count``, the distinct ``replica_groups`` and ``bytes_per_rank`` -- what one
    rank receives under the usual algorithms (:mod:`nxd_moe.parallel.collectives`' rule): all-gather ``(G-1)/G`` of
    its result, reduce-scatter ``G-1`` times its result, all-reduce ``2 (G-1)/G`` of its operand, all-to-all
    ``(G-1)/G`` of its operand (``G`` the group size)."""
    out: dict[str, dict] = {}
    for result, op, operands, groups_text in _COLLECTIVE.findall(hlo_text):
        groups = [[int(r) for r in g.split(",") if r] for g in re.findall(r"\{([\d,]*)\}", groups_text[1:-1])]
        size = len(groups[0])
        moved = {"all-gather": _shape_bytes(result) * (size - 1) // size,
                 "reduce-scatter": _shape_bytes(result) * (size - 1),
                 "all-reduce": 2 * _shape_bytes(operands) * (size - 1) // size,
                 "all-to-all": _shape_bytes(operands) * (size - 1) // size}[op]
        entry = out.setdefault(op, {"count": 0, "replica_groups": [], "bytes_per_rank": 0})
        entry["count"] += 1
        entry["bytes_per_rank"] += moved
        if groups not in entry["replica_groups"]:
            entry["replica_groups"].append(groups)
    return dict(sorted(out.items()))
