"""Tokenization and text validation of one text-model version.

Shared by the gateway (which tokenizes so workers spend no CPU on it) and the worker (which
tokenizes direct `text` calls), so both accept exactly the same inputs and produce the same ids.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from services.common.bundles import split_at
from services.common.errors import InvalidInput
from services.common.model_repository import ModelConfig, ModelConfigError, ModelKind
from services.common.templated_text import TemplatedText, TemplateTokens

#: Characters per token above which a text cannot fit even before tokenizing it (cheap check).
_MAX_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class TokenIds:
    """A text input sent already tokenized, by the version's own tokenizer, special tokens
    included (gateways to workers; clients of the embedding APIs to gateways)."""

    ids: np.ndarray


class TextEncoder:
    def __init__(self, weights_dir: Path, config: ModelConfig) -> None:
        tokenizer_path = weights_dir / "tokenizer.json"
        model_config_path = weights_dir / "config.json"
        for path in (tokenizer_path, model_config_path):
            if not path.exists():
                raise ModelConfigError(f"{config.name}: missing {path}")
        #: Where the version's files are (its own folder, or where its version.toml points).
        self.weights_dir = weights_dir
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        # Shipped tokenizer.json files often truncate and pad (MiniLM's to 128). Over-long
        # inputs are refused instead of silently truncated, and batches are padded by the model.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        # Text is untrusted: a literal "[CLS]" or "</s>" typed by a user stays text and never
        # becomes the special token (not saved in tokenizer.json, so set on every load).
        self.tokenizer.encode_special_tokens = True
        model_config = json.loads(model_config_path.read_text())
        context = int(model_config["max_position_embeddings"])
        if config.generation is not None:
            # A prompt may use the context except for at least one generated token.
            self.max_tokens = min(config.generation.max_model_len, context) - 1
        else:
            self.max_tokens = min(config.length_buckets[-1], context)
        # Encoders take [CLS] ... [SEP]; a decoder prompt can be a single token.
        self._min_tokens = 2 if config.kind is ModelKind.EMBEDDING else 1
        # An id must be one the tokenizer can decode and the model can embed.
        self.vocab_size = min(self.tokenizer.get_vocab_size(), int(model_config["vocab_size"]))
        self._name = config.name
        digest = hashlib.sha256(tokenizer_path.read_bytes())
        digest.update(json.dumps(dict(config.preprocessing), sort_keys=True).encode())
        digest.update(str(self.max_tokens).encode())
        self.fingerprint = digest.hexdigest()[:16]

    @functools.cached_property
    def _truncating(self) -> Tokenizer:
        """The same tokenizer cutting to the longest input (special tokens kept), made on the
        first call that asks for truncation; a copy, so the refusing one is never
        reconfigured mid-call."""
        truncating = Tokenizer.from_str(self.tokenizer.to_str())
        truncating.encode_special_tokens = True
        truncating.enable_truncation(self.max_tokens)
        return truncating

    @functools.cached_property
    def _templates(self) -> TemplateTokens:
        """How templated prompts read, made on the first one."""
        return TemplateTokens(self.tokenizer)

    def encode_templated(self, prompt: TemplatedText) -> np.ndarray:
        """Token ids (int64) of a prompt a chat template rendered, its special tokens read as
        tokens and its message contents as text (services.common.templated_text); raises
        InvalidInput."""
        self._check_text(prompt.text, truncate=False)
        return self.check_ids(np.asarray(self._templates.ids(prompt), dtype=np.int64))

    def _check_text(self, text: str, *, truncate: bool) -> str:
        """`text` after the cheap checks; truncating, cut to the characters that can fit.
        Whitespace alone is text, as OpenAI's and TEI's APIs take it: refused, one "\n" chunk
        of a document splitter's failed its whole batch (review finding)."""
        if not text:
            raise InvalidInput("text input is empty")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (JSON may escape one)
                raise InvalidInput("text input is not valid Unicode text") from None
        limit = self.max_tokens * _MAX_CHARS_PER_TOKEN
        if truncate:
            return text[:limit]
        if len(text) > limit:
            raise InvalidInput(
                f"text of {len(text)} characters cannot fit in {self.max_tokens} tokens"
            )
        return text

    def check_ids(self, ids: np.ndarray) -> np.ndarray:
        """Validates pre-tokenized ids (special tokens included); returns them as int64."""
        if len(ids) < self._min_tokens:
            raise InvalidInput(f"token_ids must hold at least {self._min_tokens} token(s)")
        if len(ids) > self.max_tokens:
            raise InvalidInput(
                f"input is {len(ids)} tokens; {self._name} accepts at most {self.max_tokens}"
            )
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise InvalidInput(f"token ids must be in [0, {self.vocab_size})")
        return ids.astype(np.int64, copy=False)

    def check_ids_many(self, rows: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`check_ids` of every row, in one pass over all their ids when every row is valid (a
        bundle's rows are checked at once, not row by row); raises the first bad row's error."""
        if len(rows) > 1:
            lengths = [len(ids) for ids in rows]
            flat = np.concatenate(rows)
            if self.ids_fit(flat, lengths):
                ends = list(itertools.accumulate(lengths))
                return split_at(flat.astype(np.int64, copy=False), ends)
        return [self.check_ids(ids) for ids in rows]

    def ids_fit(self, flat: np.ndarray, lengths: Sequence[int] | np.ndarray) -> bool:
        """Whether rows of `lengths` ids, concatenated in `flat`, all pass `check_ids`."""
        lengths = np.asarray(lengths)
        return bool(
            lengths.size
            and lengths.min() >= self._min_tokens
            and lengths.max() <= self.max_tokens
            and flat.size
            and flat.min() >= 0
            and flat.max() < self.vocab_size
        )

    def encode_many(self, texts: Sequence[str], *, truncate: bool = False) -> list[np.ndarray]:
        """Token ids per text (int64), after the cheap checks; raises InvalidInput.
        `truncate`: a text longer than `max_tokens` is cut to its first tokens (the special
        tokens kept) instead of refused."""
        checked = self.check_texts(texts, truncate=truncate)
        return [self.check_ids(ids) for ids in self.tokenize(checked, truncate=truncate)]

    def check_texts(self, texts: Sequence[str], *, truncate: bool = False) -> list[str]:
        """`texts` after the cheap checks (no tokenizing); raises InvalidInput."""
        return [self._check_text(text, truncate=truncate) for text in texts]

    def tokenize(self, checked: Sequence[str], *, truncate: bool = False) -> list[np.ndarray]:
        """Token ids of texts that passed `check_texts`, unchecked: `check_ids` says whether
        each fits. One call for all: the Rust tokenizer batches them, outside the GIL."""
        tokenizer = self._truncating if truncate else self.tokenizer
        return [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch_fast(checked)]
