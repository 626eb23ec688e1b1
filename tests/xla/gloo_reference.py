"""One rank of the gloo (``torch.distributed``) run that ``test_spmd_trace.py`` compares the SPMD program with.

``python gloo_reference.py OUT_DIR RANK WORLD_SIZE LAYOUT_JSON``: builds the parallel layer of ``layer()`` (the
same weights the test's single-device layer has) under ``parallel_state.initialize_model_parallel``, runs it on
this rank's part of ``OUT_DIR/input.pt`` (the world's input) and saves the output as ``OUT_DIR/rank{RANK}.pt``.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "parallel"), str(ROOT / "tests"), str(ROOT)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from parallel_worker import make_moe, randomize_  # noqa: E402

from nxd_moe import parallel_state  # noqa: E402
from nxd_moe.parallel.sharding import load_full_state_dict  # noqa: E402
from nxd_moe.trace_spmd import SPMDLayout  # noqa: E402


def layer(layout: SPMDLayout, model_parallel: bool | None = None, **kwargs):
    """The test layer: the single-device one (``model_parallel=False``, random weights, seed 1) or a sharded one
    (weights to be loaded)."""
    moe = make_moe(model_parallel, sp=layout.sequence_parallel, **kwargs)
    return randomize_(moe, seed=1) if model_parallel is False else moe


def main() -> None:
    out_dir, rank, world_size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(sys.argv[4])
    layout = SPMDLayout(**spec.pop("layout"))
    mode = spec.pop("mode")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir / 'store'}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        parallel_state.initialize_model_parallel(
            layout.tensor_model_parallel_size, layout.expert_model_parallel_size,
            moe_decode_tensor_model_parallel_size=layout.moe_decode_tensor_model_parallel_size,
            moe_decode_expert_model_parallel_size=layout.moe_decode_expert_model_parallel_size)
        full = layer(layout, False, **spec)
        moe = load_full_state_dict(layer(layout, **spec), full.state_dict())
        world = torch.load(out_dir / "input.pt")
        mine = [layout.local(t, rank, layout.sequence_parallel and mode == "prefill") for t in world]
        with torch.no_grad():
            torch.save(moe(*mine)[0], out_dir / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
