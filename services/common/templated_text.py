"""Token ids of a prompt a model's chat template rendered: the template's special tokens (its
`bos_token`, `<|eot_id|>`...) as the tokens they name, the callers' message contents as text
whatever they hold, and nothing added (the template writes its own BOS, as Hugging Face's
`apply_chat_template` has it).

The whole rendering is tokenized at once, the ids Hugging Face gives, unless a content holds a
special token's text. Then the text between the template's own special tokens is tokenized as
text: the tokenizer splits its input at special tokens anyway, so only the contents' special
tokens read differently (a tokenizer that prefixes only the start of its input with a space
marker, Metaspace's `first`, prefixes each of those pieces too)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from services.common.errors import InvalidInput


@dataclass(frozen=True)
class TemplatedText:
    """A prompt a model's chat template rendered: the template's own text is trusted (its
    special tokens are meant), the callers' message contents in it are not.

    `literal_spans`: where each content sits in `text` ((start, end) in characters, in order),
    or None when the template rendered the contents in a way that could not be told apart
    from its own text; `literals`: the contents as the callers sent them; `marked`: the same
    template's rendering with stand-ins for the contents ("" when it failed)."""

    text: str
    literal_spans: tuple[tuple[int, int], ...] | None
    literals: tuple[str, ...]
    marked: str = ""


class TemplateTokens:
    """Reads templated prompts with one tokenizer (its copy that reads special tokens in text
    as the tokens they name, for the template's own text)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._text = tokenizer  # reads special tokens' text as text
        self._parsing = Tokenizer.from_str(tokenizer.to_str())
        self._parsing.encode_special_tokens = False
        added = tokenizer.get_added_tokens_decoder()
        self._specials = {i: token.content for i, token in added.items() if token.special}

    def ids(self, prompt: TemplatedText) -> list[int]:
        """The token ids of `prompt` (module docstring); raises InvalidInput for contents that
        cannot be kept text."""
        text = prompt.text
        encoding = self._parsing.encode(text, add_special_tokens=False)
        specials = [
            (token, start, end)
            for token, (start, end) in zip(encoding.ids, encoding.offsets, strict=True)
            if token in self._specials
        ]
        spans = prompt.literal_spans
        if spans is None:
            self._check_unlocated(prompt, [token for token, _, _ in specials])
            return list(encoding.ids)
        own = [s for s in specials if not _in_spans(text, s[1], s[2], spans)]
        if len(own) == len(specials):
            return list(encoding.ids)
        ids: list[int] = []
        position = 0
        for token, start, end in own:
            ids += self._as_text(text[position:start])
            ids.append(token)
            position = end
        return ids + self._as_text(text[position:])

    def _as_text(self, piece: str) -> list[int]:
        return self._text.encode(piece, add_special_tokens=False).ids if piece else []

    def _check_unlocated(self, prompt: TemplatedText, specials: Sequence[int]) -> None:
        """Refuses contents that could not be located and would make special tokens: the
        rendering's special tokens must be those of its rendering with stand-ins for the
        contents (or, without one, no content may hold a special token's text)."""
        if prompt.marked:
            marked = self._parsing.encode(prompt.marked, add_special_tokens=False).ids
            if [t for t in marked if t in self._specials] == list(specials):
                return
            raise InvalidInput(
                "the model's chat template makes special tokens of the message contents"
            )
        for literal in prompt.literals:
            if held := [t for t in self._specials.values() if t in literal]:
                raise InvalidInput(
                    f"a message holds the special token {held[0]!r}, which this model's chat "
                    "template would not keep as text"
                )


def _in_spans(text: str, start: int, end: int, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether the token at text[start:end] sits in a content: its own characters overlap a
    span (a token that strips the whitespace next to it may take a content's)."""
    piece = text[start:end]
    start += len(piece) - len(piece.lstrip())
    end -= len(piece) - len(piece.rstrip())
    return any(start < span_end and span_start < end for span_start, span_end in spans)
