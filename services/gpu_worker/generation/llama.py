"""A Llama-architecture decoder in plain torch, loading Hugging Face `LlamaForCausalLM` checkpoints.

Written here rather than imported from `transformers` for the same reasons as the BERT backend:
no framework dispatch on the hot path and no `transformers` dependency at run time. More
importantly, attention is not done here: each layer hands its rotated queries, keys and values
to an `AttentionFn` supplied by the caller, so the model runner can keep keys and values in a
paged KV cache while this module stays a pure function of (tokens, positions). Parameter names
mirror Hugging Face's, so `load_state_dict` maps the checkpoint one to one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""`(layer_index, q [N, heads, head_dim], k [N, kv_heads, head_dim], v [N, kv_heads, head_dim])`
-> `[N, heads, head_dim]`, for the flattened tokens of one forward (already rotated)."""


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face Llama `config.json` that this implementation uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    # Some checkpoints (Llama 3 instruct) list several end-of-turn tokens.
    eos_token_id: int | tuple[int, ...] | None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """`eos_token_id` as a tuple, empty when the checkpoint names none."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return self.eos_token_id

    @classmethod
    def from_json(cls, path: Path) -> LlamaConfig:
        """Read `config.json`; ValueError for variants this implementation would compute wrongly.
        The end-of-sequence tokens are those it names and those of a `generation_config.json`
        beside it, as Hugging Face's `generate` stops on (Llama 3 Instruct lists its
        end-of-turn `<|eot_id|>` there only)."""
        raw: dict[str, Any] = json.loads(path.read_text())
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: only hidden_act=silu is supported, got {raw['hidden_act']}")
        if raw.get("rope_scaling") is not None:
            raise ValueError(f"{path}: rope_scaling is not supported, got {raw['rope_scaling']}")
        # transformers >= 5 writes `rope_parameters`; older checkpoints a top-level `rope_theta`.
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{path}: only default RoPE is supported, got {rope['rope_type']}")
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag, False):
                raise ValueError(f"{path}: {flag}=true is not supported")
        heads = raw["num_attention_heads"]
        eos = _token_ids(raw.get("eos_token_id"))
        generation_path = path.parent / "generation_config.json"
        if generation_path.is_file():
            generation = json.loads(generation_path.read_text())
            eos = (*eos, *_token_ids(generation.get("eos_token_id")))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=tuple(dict.fromkeys(eos)) or None,
        )


def _token_ids(value: Any) -> tuple[int, ...]:
    """A config's token id field (an id, a list of them, or null) as a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 and scale in the input dtype, as Hugging Face does, so bf16 runs
        # round the same way as the reference. One rms_norm call rather than its five
        # elementwise steps: on a GPU each is a kernel launch, and eager steps are launch-bound.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_width = config.num_attention_heads * config.head_dim
        kv_width = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=False)
        #: q, k and v projections as one matmul, once `fuse()` has run (a loaded model).
        self.qkv_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """Replaces the three projections by one (their weights stacked): one launch instead of
        three, and one rotation for queries and keys together."""
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        fused = nn.Linear(self.q_proj.in_features, sum(w.shape[0] for w in weights), bias=False)
        fused.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=False)
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        layer_index: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        num_tokens, heads, kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        if self.qkv_proj is None:
            raise RuntimeError("call fuse() first: from_pretrained does, for every model it loads")
        qkv = self.qkv_proj(hidden).view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        qk = qkv[:, : heads + kv_heads]
        qk = qk * cos + _rotate_half(qk) * sin
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        context = attention(layer_index, q, k, v)
        return self.o_proj(context.reshape(num_tokens, heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(config)
        self.mlp = _MLP(config)
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)


class _LlamaModel(nn.Module):
    """Hugging Face's `LlamaModel`: the `model.` prefix of the checkpoint."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Flattened tokens of any number of sequences in, final hidden states out.

    Positions come in explicitly and attention is delegated, so one forward can mix prefill
    chunks and decode steps of different sequences.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _LlamaModel(config)
        # Tied checkpoints store no lm_head; logits then reuse the embedding matrix.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # A plain attribute, not a buffer: `.to(dtype=bfloat16)` must not round the frequencies.
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
        self._inv_freq = 1.0 / (config.rope_theta**exponents)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # Angles in float32 (as the reference does), then cast: [N, 1, head_dim] to broadcast
        # over heads.
        if self._inv_freq.device != positions.device:  # once: no copy per step (or in a graph)
            self._inv_freq = self._inv_freq.to(positions.device)
        angles = positions[:, None].float() * self._inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """input_ids, positions: int64 [N]; returns final-norm hidden states [N, hidden]."""
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self._rotary(positions, hidden.dtype)
        for index, module in enumerate(self.model.layers):
            layer = cast(_DecoderLayer, module)  # nn.ModuleList is not generic
            attended = layer.self_attn(index, layer.input_layernorm(hidden), cos, sin, attention)
            hidden = hidden + attended
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [M, hidden] -> logits [M, vocab] in the model's dtype."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    @classmethod
    def from_pretrained(
        cls, model_dir: Path, *, device: torch.device, dtype: torch.dtype
    ) -> LlamaForCausalLM:
        """Load `config.json` + `model.safetensors` strictly (a missing or extra weight raises)."""
        config = LlamaConfig.from_json(model_dir / "config.json")
        model = cls(config).to(dtype=dtype)
        state = load_file(str(model_dir / "model.safetensors"))
        # Old checkpoints saved the rotary frequencies; tied ones may still carry a copy of the
        # embedding under lm_head. Neither is a parameter here.
        state = {
            name: tensor
            for name, tensor in state.items()
            if not name.endswith("rotary_emb.inv_freq")
            and not (config.tie_word_embeddings and name == "lm_head.weight")
        }
        model.load_state_dict(state, strict=True)
        for module in model.model.layers:
            cast(_DecoderLayer, module).self_attn.fuse()
        return model.to(device=device).eval()
