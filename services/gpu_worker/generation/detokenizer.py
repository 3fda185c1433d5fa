"""Incremental detokenization with stop strings.

Text is only emitted once it is final: never half a UTF-8 character (the decoder shows it as
U+FFFD until the rest arrives; a stream that ends before it does ends with the U+FFFD, as
decoding the whole sequence shows it), and never a suffix that could still grow into a stop string
(the client must not see the start of a stop string that is then cut off).

Each token decodes a short window, not the whole sequence (which made a reply of n tokens cost
O(n^2)): the tokens since the last emitted ones plus those emitted last time as context, so
that word-boundary rules (a leading space, a merged byte sequence) see what precedes the new
token. The new text is the window's decode minus the context's; decoding the window alone
gives the same text as decoding the sequence because both end at the same token boundary.

A SentencePiece byte fallback decodes a run of byte tokens as UTF-8, or, if any byte of the
run is invalid, as one U+FFFD per byte token. A run invalid for good (its bytes can never
become UTF-8, however it goes on) is therefore final as it stands: from then on each of its
tokens adds one U+FFFD, emitted as it comes (`_bad_run`), where holding the run until it ended
made each token decode the whole run (O(n^2), on the engine's event loop). Characters a run
made before it turned invalid have been emitted already: the stream keeps them, where decoding
the whole sequence shows U+FFFD for them too (vLLM's incremental detokenizer does the same),
and each of its byte tokens not yet shown is one U+FFFD, however soon the run ends. A run that
is UTF-8 and complete is read as it stands, though its text ends in a U+FFFD it spells.

The first window has the prompt's last few tokens as its context (`prompt_context`), as vLLM's
and TGI's detokenizers do: a decoder that strips the sequence's first space (SentencePiece's
`Strip` or `Metaspace`, Llama-2's and Mistral's) would otherwise drop the space of the reply's
first word ("Paris" for " Paris" after "The capital of France is").
"""

from __future__ import annotations

import codecs
import json
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"
#: Tokens read while their text ends in half a character before `_settled` looks for text that
#: is final among them: a UTF-8 character's bytes span at most 4 tokens.
_MAX_UNREAD = 8
_MAX_UTF8 = 4
#: Prompt tokens the first window starts with (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        """The detokenizer of a reply to `prompt_ids` (whose last tokens are its first
        window's context, never emitted)."""
        self._tokenizer = tokenizer
        self._ids: list[int] = prompt_context(tokenizer, prompt_ids)
        #: The decoded text so far (complete characters only).
        self._text = ""
        #: Characters of `_text` handed to the caller.
        self._num_emitted = 0
        #: `_ids[_prefix:_read]` decoded last time as new text: the next window's context.
        self._prefix = 0
        #: `_ids[:_read]` are in `_text` (or are the prompt's context).
        self._read = len(self._ids)
        #: Tokens decoding skips (special tokens): never kept in a window, or a run of them
        #: (EOS generated with `ignore_eos`) would grow every window, O(n^2) again.
        self._skipped = skipped_ids(tokenizer)
        #: Whether text a character follows is final (`_settled`): not so for a SentencePiece
        #: byte fallback, which shows a whole run of byte tokens as U+FFFD if any is invalid.
        #: Read when first needed (rarely), not per request: it reads the tokenizer's JSON.
        self._may_settle: bool | None = None
        #: A byte fallback's byte tokens (`<0xNN>`) and their bytes (`byte_tokens`: looked up,
        #: no JSON) at the first text ending in U+FFFD; None until then.
        self._byte_of: dict[int, int] | None = None
        #: Whether the run of byte tokens the ids end in is invalid for good and read as
        #: U+FFFDs: each further byte token of it is one more (`_read_bad_byte`).
        self._bad_run = False

    def push(self, token_id: int, stops: Sequence[str]) -> tuple[str, bool]:
        """Adds a token; returns (text now final, whether a stop string was reached). After a
        stop, the text up to (not including) the stop string has been returned."""
        if token_id in self._skipped:
            return "", False  # decodes to nothing, wherever it stands
        self._ids.append(token_id)
        if self._bad_run and token_id in (self._byte_of or ()):
            self._read_bad_byte()
        elif not self._read_window(is_final=False):
            return "", False
        if not stops:  # nothing to look for, nothing held back (most requests)
            return self._emit_until(len(self._text)), False
        cut = self._stop_cut(stops)
        if cut is not None:
            return self._emit_until(cut), True
        held = max((_overlap(self._text, s) for s in stops if s), default=0)
        return self._emit_until(len(self._text) - held), False

    def flush(self, stops: Sequence[str] = ()) -> tuple[str, bool]:
        """Whatever was held back, once the stream ends without a stop string reached: text
        held as the possible start of one, and the last tokens' text even if they end in half
        a character (shown as U+FFFD, as decoding the whole sequence shows it); and whether a
        stop string those last tokens complete cut the text before it (as `push` returns)."""
        self._read_window(is_final=True)
        cut = self._stop_cut(stops)
        return self._emit_until(len(self._text) if cut is None else cut), cut is not None

    def _read_window(self, *, is_final: bool) -> bool:
        """Adds the tokens not yet read to `_text`, unless they end in half a character and
        more may complete it (not `is_final`): then those up to where the text is settled,
        once _MAX_UNREAD wait (a byte fallback's run of byte tokens: as `_byte_run` reads
        it); whether text was added."""
        self._bad_run = False  # read past the byte run, if it was one: it has ended
        context = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        end = len(self._ids)
        if window.endswith(_INCOMPLETE) and not is_final:
            if self._byte_tokens():  # a byte fallback: its run of byte tokens says, now
                start, verdict = self._byte_run()
                if verdict == "bad":
                    return self._read_bad_run(context, start)
                if verdict == "pending":
                    return False
            elif end - self._read < _MAX_UNREAD:
                return False
            else:
                if self._may_settle is None:
                    self._may_settle = may_settle(self._tokenizer)
                if not self._may_settle:  # a byte fallback whose byte tokens are unknown
                    return False
                end, window = self._settled(context, window)
        # A byte fallback's run that made characters has turned invalid: they show as U+FFFD
        # now. What was emitted stays; its unread byte tokens are one U+FFFD each.
        if not window.startswith(context) and self._byte_tokens() and self._read_turned_run():
            return True
        if len(window) <= len(context):
            return False
        self._text += window[len(context) :]
        self._prefix, self._read = self._read, end
        return True

    def _byte_tokens(self) -> dict[int, int]:
        """The tokenizer's byte tokens (none but a byte fallback's), looked up once."""
        if self._byte_of is None:
            self._byte_of = byte_tokens(self._tokenizer)
        return self._byte_of

    def _settled(self, context: str, window: str) -> tuple[int, str]:
        """Where a run of tokens whose text keeps ending in U+FFFD (bytes that never make a
        character: a random model repeating one) has settled text, and that text: the last
        token after which the rest only added characters (a character ended, or an invalid
        byte showed as U+FFFD for good, there). Else `_read` (nothing), held as before."""
        # The last few ends only: where no token ends a character (tokens of byte-level BPE
        # spanning characters), looking further would cost O(n) decodes a token.
        for end in range(len(self._ids) - 1, max(self._read, len(self._ids) - _MAX_UTF8), -1):
            text = self._decode(self._ids[self._prefix : end])
            if len(context) < len(text) < len(window) and window.startswith(text):
                return end, text
        return self._read, context

    def _byte_run(self) -> tuple[int, str]:
        """Where the run of byte tokens the ids end in starts (judged from the window's start,
        where any earlier part of it ended a character, a run being read only where its text is
        complete, or was bad already: `_bad_run`), and whether it is "bad" (invalid for good:
        no later byte makes it UTF-8), "pending" (valid, a character not yet complete) or
        "complete" (valid, or no run: a U+FFFD the text ends in is a character of its own)."""
        ids, byte_of = self._ids, self._byte_tokens()
        start = len(ids)
        while start > self._prefix and ids[start - 1] in byte_of:
            start -= 1
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            decoder.decode(bytes(byte_of[i] for i in ids[start:]))
        except UnicodeDecodeError:
            return start, "bad"
        return start, "pending" if decoder.getstate()[0] else "complete"

    def _read_bad_run(self, context: str, start: int) -> bool:
        """Reads the unread tokens, which end in a run of byte tokens from `start` invalid for
        good: those before the run as decoded, the run's one U+FFFD each (`_bad_run`)."""
        ids = self._ids
        bad_from = max(start, self._read)
        before = self._decode(ids[self._prefix : bad_from])  # the unread tokens before the run
        self._text += before[len(context) :] + _INCOMPLETE * (len(ids) - bad_from)
        self._prefix, self._read = self._read, len(ids)
        self._bad_run = True
        return True

    def _read_turned_run(self) -> bool:
        """Reads the byte tokens from `_read` on of a run that turned invalid, one U+FFFD each,
        then the tokens after it as usual; False if no byte token is there (another decoder's
        text changing: the window is read as before)."""
        ids, byte_of = self._ids, self._byte_tokens()
        run_end = self._read
        while run_end < len(ids) and ids[run_end] in byte_of:
            run_end += 1
        if run_end == self._read:
            return False
        self._text += _INCOMPLETE * (run_end - self._read)
        self._prefix, self._read = run_end - 1, run_end  # the next context: one byte token
        if run_end == len(ids):
            self._bad_run = True
        else:
            self._read_window(is_final=True)  # after the run: a token ended it
        return True

    def _read_bad_byte(self) -> None:
        """Reads one more byte token of a run invalid for good: one more U+FFFD."""
        self._text += _INCOMPLETE
        self._prefix, self._read = self._read, len(self._ids)

    def _stop_cut(self, stops: Sequence[str]) -> int | None:
        """Where the first stop string in the text not yet emitted (or overlapping it) starts;
        None without one."""
        search_from = max(0, self._num_emitted - max((len(s) for s in stops), default=0))
        cuts = [i for s in stops if s and (i := self._text.find(s, search_from)) >= 0]
        return min(cuts) if cuts else None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True) if ids else ""

    def _emit_until(self, end: int) -> str:
        new = self._text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return new


V = TypeVar("V")


class _PerTokenizer(Generic[V]):
    """What `read(tokenizer)` says, read once per tokenizer (a detokenizer is made per request,
    and some reads parse the tokenizer's JSON); read each time where a tokenizer cannot be
    weakly referenced (tokenizers before 0.23; the floor is 0.20)."""

    def __init__(self, read: Callable[[Tokenizer], V]) -> None:
        self._read = read
        self._known: weakref.WeakKeyDictionary[Tokenizer, V] = weakref.WeakKeyDictionary()

    def __call__(self, tokenizer: Tokenizer) -> V:
        try:
            known = self._known.get(tokenizer)
        except TypeError:  # not weakly referenced: read each time
            return self._read(tokenizer)
        if known is None:
            known = self._known[tokenizer] = self._read(tokenizer)
        return known


def _special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    added = tokenizer.get_added_tokens_decoder()
    return frozenset(i for i, token in added.items() if token.special)


#: The ids `decode(..., skip_special_tokens=True)` skips: `tokenizer`'s special tokens (a
#: tokenizer may have hundreds).
skipped_ids = _PerTokenizer(_special_ids)


def prompt_context(tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> list[int]:
    """The last PROMPT_CONTEXT_TOKENS of `prompt_ids` that decoding keeps (not special tokens,
    which a window never keeps), as a first window's context: from its first byte token that
    can start a character (not the rest of one cut in two), to its last token that ends a
    whole character."""
    if not prompt_ids:
        return []
    skipped, byte_of = skipped_ids(tokenizer), byte_tokens(tokenizer)
    context: list[int] = []
    for token in reversed(prompt_ids):
        if len(context) == PROMPT_CONTEXT_TOKENS:
            break
        if token not in skipped:
            context.append(token)
    context.reverse()
    start = 0
    while start < len(context) and byte_of.get(context[start], 0) & 0xC0 == 0x80:
        start += 1  # a UTF-8 continuation byte
    context = context[start:]
    while context:  # without tokens that end in half a character (or bytes never valid)
        text = tokenizer.decode(context, skip_special_tokens=True)
        if text and not text.endswith(_INCOMPLETE):
            return context
        context.pop()
    return []


def _may_settle(tokenizer: Tokenizer) -> bool:
    try:
        decoder = json.loads(tokenizer.to_str()).get("decoder")
    except Exception:  # not a `tokenizers` one, or a custom part that does not serialize
        return False
    return "ByteFallback" not in json.dumps(decoder)


#: Whether `tokenizer` decodes bytes as lossy UTF-8 does (byte-level BPE), where text a
#: character follows never changes; not a SentencePiece `ByteFallback` decoder (its JSON, read
#: once, may be megabytes).
may_settle = _PerTokenizer(_may_settle)


def _byte_tokens(tokenizer: Tokenizer) -> dict[int, int]:
    token_to_id = getattr(tokenizer, "token_to_id", None)
    if token_to_id is None:  # not a `tokenizers` one: no byte token known
        return {}
    added: Mapping[int, object] = getattr(tokenizer, "get_added_tokens_decoder", dict)()
    found = {}
    for byte in range(256):
        for token in {f"<0x{byte:02X}>", f"<0x{byte:02x}>"}:
            if (token_id := token_to_id(token)) is not None and token_id not in added:
                found[token_id] = byte
    return found if len(set(found.values())) == 256 else {}


#: A byte fallback's byte tokens (`<0x00>` to `<0xFF>`, upper or lower case) by id, and the
#: byte each stands for: 512 lookups, not a copy of the vocabulary (100,000 tokens or more).
#: Empty unless the model's vocabulary (added tokens aside) has all 256, as every byte
#: fallback's does: a byte-level tokenizer with a token spelled `<0x41>` is no byte fallback.
byte_tokens = _PerTokenizer(_byte_tokens)


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`. Only prefixes
    ending in `text`'s last character can be one: found with rfind, not tried size by size
    (16 stop strings of 256 characters cost about 4,000 tries a token, on the event loop)."""
    if not text:
        return 0
    last = text[-1]
    end = stop.rfind(last, 0, min(len(stop) - 1, len(text)))
    while end >= 0:
        if text.endswith(stop[: end + 1]):
            return end + 1
        end = stop.rfind(last, 0, end)
    return 0
