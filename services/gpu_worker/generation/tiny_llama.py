"""Create a tiny Llama checkpoint with RANDOM (seeded) weights and a byte-level tokenizer.

    python -m services.gpu_worker.generation.tiny_llama OUT_DIR [--seed 0] [--size tiny|100m]

The output is gibberish by design: it lets the generation engine (paged KV cache, continuous
batching, streaming) run end to end without downloading a real model. The files are in Hugging
Face's layout (`config.json`, `model.safetensors`, `tokenizer.json`), so
`transformers.LlamaForCausalLM.from_pretrained(OUT_DIR)` loads the same model as the worker.
Nothing is written when OUT_DIR already holds a complete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from services.gpu_worker.generation.llama import LlamaConfig, LlamaForCausalLM

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
# Byte b has id b; the two special tokens follow.
BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "README.txt")
_WEIGHTS = "model.safetensors"

_README = """\
tiny-llama: a Llama-architecture decoder with RANDOM weights (seed {seed}).

Created by `python -m services.gpu_worker.generation.tiny_llama`. It has never been trained: its
output is gibberish. It exists to exercise the generation engine (paged KV cache, continuous
batching, token streaming) without downloading a real model.

Tokenizer: byte-level, ids 0-255 are the bytes, {bos} = {bos_id} (prepended by the tokenizer),
{eos} = {eos_id}. Any UTF-8 text round-trips exactly.
"""


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel expects)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer() -> Tokenizer:
    """256 byte tokens with no merges, plus `<s>` and `</s>`; encoding prepends `<s>`."""
    vocab = {char: byte for byte, char in _byte_to_unicode().items()}
    # In the vocabulary with fixed ids; add_special_tokens then only marks them special.
    vocab |= {BOS_TOKEN: BOS_TOKEN_ID, EOS_TOKEN: EOS_TOKEN_ID}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS_TOKEN, EOS_TOKEN])
    # Llama tokenizers start every prompt with BOS; `add_special_tokens=False` skips it.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)]
    )
    return tokenizer


#: The shapes `--size` names: tiny-llama's own (every step is launch overhead on a GPU), and a
#: ~100M-parameter model (104M with the byte vocabulary) whose steps give a GPU real work.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
    "100m": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
}


def _hf_config(vocab_size: int, size: str) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **SIZES[size],
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        # transformers >= 5 reads rope_parameters; older versions the top-level rope_theta.
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
    }


def create_tiny_llama(out_dir: Path, *, seed: int = 0, size: str = "tiny") -> Path:
    """Write the checkpoint (of `SIZES[size]`) into `out_dir` unless it is already complete;
    returns `out_dir`."""
    if all((out_dir / name).is_file() for name in (*_FILES, _WEIGHTS)):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": 512,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    config_path = out_dir / "config.json"
    config = _hf_config(tokenizer.get_vocab_size(), size)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "README.txt").write_text(
        _README.format(
            seed=seed, bos=BOS_TOKEN, bos_id=BOS_TOKEN_ID, eos=EOS_TOKEN, eos_id=EOS_TOKEN_ID
        )
    )
    # torch's default initialization (N(0, 1) embeddings, uniform linears) gives logits with a
    # clear spread, so greedy decoding is not decided by rounding between near-ties.
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig.from_json(config_path))
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    # The weights go last, whole (written aside, then renamed): their presence marks the
    # checkpoint complete, and a write cut short (a process killed) left a truncated file
    # that passed for complete.
    partial = out_dir / f"{_WEIGHTS}.partial"
    save_file(state, str(partial), metadata={"format": "pt"})
    os.replace(partial, out_dir / _WEIGHTS)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="tiny", help="tiny (default) or 100m"
    )
    args = parser.parse_args(argv)
    print(create_tiny_llama(args.out_dir, seed=args.seed, size=args.size))


if __name__ == "__main__":
    main()
