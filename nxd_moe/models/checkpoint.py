"""A small local checkpoint directory of a shipped architecture: transformers weights (safetensors), config,
generation config and a word-level tokenizer with a chat template -- what NxD Inference scripts read from a model
path (``load_pretrained_config``, ``AutoTokenizer``, ``GenerationConfig.from_pretrained``), for trying them without
a Hub download: ``nxd-moe checkpoint --config qwen3-30b-a3b --scale 16 --layers 2 --out DIR``.

The weights are random (:func:`nxd_moe.models.hf_models.build_hf_model`): the text a model generates is noise, but
every step the real model takes is taken.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nxd_moe.arguments import positive_int
from nxd_moe.models.hf_models import build_hf_model

__all__ = ["SPECIAL_TOKENS", "write_checkpoint"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen's chat layout: each message between <|im_start|>role and <|im_end|>, then the assistant's turn opened
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(vocab_size: int, words: int = 512):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = min(words, vocab_size - len(SPECIAL_TOKENS) - 1)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab["[UNK]"] = len(vocab)
    for i in range(words):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="[UNK]", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_checkpoint(out: str | os.PathLike, config: str = "qwen3-30b-a3b", *, num_layers: int = 2, scale: int = 16,
                     seed: int = 0, dtype: torch.dtype | str = torch.float32, max_new_tokens: int | None = 16) -> Path:
    """Write the checkpoint of ``config`` (``num_layers`` MoE layers, widths divided by ``scale``, weights from
    ``seed``) to ``out`` and return it. Its generation config is greedy, ends at ``<|im_end|>`` and, with
    ``max_new_tokens``, stops there (transformers lets it take precedence over a ``max_length`` argument)."""
    from transformers import GenerationConfig

    out = Path(out)
    model = build_hf_model(config, num_layers=num_layers, scale=scale, seed=seed, dtype=dtype)
    tokenizer = _tokenizer(model.config.get_text_config().vocab_size)
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"), max_new_tokens=max_new_tokens)
    model.save_pretrained(out)  # transformers 5 writes safetensors only
    tokenizer.save_pretrained(out)
    return out


HELP = "write a small local checkpoint (random weights, tokenizer, generation config) of a shipped architecture"


def add_arguments(parser) -> None:
    parser.add_argument("--config", required=True, help="a shipped architecture (name or YAML)")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--layers", type=positive_int, default=2, help="MoE layers (default 2)")
    parser.add_argument("--scale", type=positive_int, default=16, help="divide the widths by this (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16,
                        help="the generation config's max_new_tokens (default 16)")


def main(args) -> int:
    try:
        path = write_checkpoint(args.out, args.config, num_layers=args.layers, scale=args.scale, seed=args.seed,
                                dtype=args.dtype, max_new_tokens=args.max_new_tokens)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"nxd-moe checkpoint: error: {e}") from None
    print(f"nxd-moe checkpoint: {args.config} ({args.layers} MoE layers, scale 1/{args.scale}) -> {path}")
    return 0
