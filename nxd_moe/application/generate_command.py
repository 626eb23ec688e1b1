"""``nxd-moe generate``: a transformers model generating through nxd_moe's layer against transformers' default
(:mod:`nxd_moe.models.generate`), or, with ``--app DIR``, a compiled application generating with its own loop
(:func:`~nxd_moe.application.command.generate_from_app`)."""

from __future__ import annotations

import argparse
import json

from nxd_moe.application.command import generate_from_app
from nxd_moe.models import generate as transformers_generate

HELP = transformers_generate.HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = transformers_generate.add_arguments(parser)
    source.add_argument("--app", help="a compiled application directory (nxd-moe compile): generate with nxd_moe's "
                                      "own loop (CUDA graphs per bucket on a GPU) instead of transformers'")
    parser.add_argument("--prompt-ids", default=None, help="with --app: one prompt as comma-separated token ids")


def main(args: argparse.Namespace) -> int:
    if args.app is None:
        return transformers_generate.main(args)
    try:
        report = generate_from_app(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"nxd-moe generate: error: {e}") from None
    print(json.dumps(report, indent=2) if args.json else
          f"nxd-moe generate --app {report['app']}: batch {report['batch']}, prompt {report['prompt_len']}, "
          f"{report['new_tokens']} new tokens on {report['device']}: time to first token {report['ttft_ms']} ms, "
          f"decode {report['decode_tokens_per_s']} tokens/s\n{report['tokens']}")
    return 0
