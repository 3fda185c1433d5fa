"""Incremental detokenization: only final text is emitted (no half characters, no prefix of a
stop string that is later cut)."""

from __future__ import annotations

import codecs
import random

import pytest
from tokenizers import Tokenizer, decoders, models

from services.gpu_worker.generation.detokenizer import (
    IncrementalDetokenizer,
    _overlap,
    skipped_ids,
)
from services.gpu_worker.generation.tiny_llama import build_tokenizer

pytestmark = pytest.mark.unit

TOKENIZER = build_tokenizer()


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False).ids


def feed(text: str, stops: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    pieces = []
    for token in ids(text):
        piece, stopped = detokenizer.push(token, stops)
        pieces.append(piece)
        if stopped:
            return pieces, True
    held, stopped = detokenizer.flush(stops)
    pieces.append(held)
    return pieces, stopped


class Counting:
    """TOKENIZER, recording the number of ids of each decode in `windows`."""

    def __init__(self, windows: list[int]) -> None:
        self.windows = windows

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.windows.append(len(token_ids))
        return TOKENIZER.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def get_added_tokens_decoder(self) -> dict:
        return TOKENIZER.get_added_tokens_decoder()

    def to_str(self) -> str:
        return TOKENIZER.to_str()


def test_text_round_trips_piece_by_piece() -> None:
    pieces, stopped = feed("hello world")
    assert "".join(pieces) == "hello world" and not stopped
    assert pieces[0] == "h"


def test_a_multibyte_character_is_emitted_only_when_complete() -> None:
    pieces, _ = feed("é!")  # "é" is two bytes, so two tokens
    assert pieces[0] == "" and pieces[1] == "é"
    assert "".join(pieces) == "é!"


def test_a_stream_ending_in_half_a_character_shows_it_as_decoding_shows_it() -> None:
    """The last tokens' half character is not dropped: the reply ends as decoding every token
    at once ends it (U+FFFD), and a stop string before it still cuts the reply."""
    tokens = ids("ok é")[:-1]  # "é"'s first byte only
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    pieces = [detokenizer.push(token, ())[0] for token in tokens]
    assert "".join(pieces) == "ok "
    assert detokenizer.flush() == ("\ufffd", False)
    assert TOKENIZER.decode(tokens)[-1] == "\ufffd"
    stopped = IncrementalDetokenizer(TOKENIZER)
    pieces = [stopped.push(token, ("k \ufffd",))[0] for token in tokens]
    assert "".join(pieces) == "o"
    assert stopped.flush(("k \ufffd",)) == ("", True)


def test_stop_string_is_cut_and_never_partly_shown() -> None:
    pieces, stopped = feed("say STOP now", stops=("STOP",))
    assert stopped
    assert "".join(pieces) == "say "
    # While "S", "ST", "STO" could still become the stop string, nothing of it was emitted.
    assert all("S" not in piece for piece in pieces)


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop() -> None:
    pieces, stopped = feed("STAR", stops=("STOP",))
    assert not stopped
    assert "".join(pieces) == "STAR"
    assert pieces[:2] == ["", ""], "'S' and 'ST' were held while they could start 'STOP'"


@pytest.mark.parametrize("seed", range(5))
def test_pieces_of_random_tokens_add_up_to_decoding_them_all_at_once(seed: int) -> None:
    """Byte-level tokens drawn at random (half UTF-8 sequences, specials and all): the pieces
    emitted token by token, then flushed, equal one decode of every token."""
    rng = random.Random(seed)
    tokens = [rng.randrange(TOKENIZER.get_vocab_size()) for _ in range(300)]
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    pieces = [detokenizer.push(token, ())[0] for token in tokens]
    pieces.append(detokenizer.flush()[0])
    whole = TOKENIZER.decode(tokens, skip_special_tokens=True)
    assert "".join(pieces) == whole


def test_a_run_of_special_tokens_keeps_every_window_short() -> None:
    """EOS generated again and again (`ignore_eos`) decodes to nothing: it never joins a
    window, so each token still decodes a few ids, not every one since the last text (a reply
    of n such tokens cost O(n^2)), and the text around it is what decoding it all gives."""
    windows: list[int] = []  # the length of every window decoded

    eos = TOKENIZER.token_to_id("</s>")
    detokenizer = IncrementalDetokenizer(Counting(windows))  # type: ignore[arg-type]
    sequence = [*ids("hello "), *[eos] * 2000, *ids("world")]
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == TOKENIZER.decode(sequence, skip_special_tokens=True)
    assert max(windows) <= 8, max(windows)


def test_a_tokenizer_that_cannot_be_weakly_referenced_still_has_its_specials_skipped() -> None:
    """tokenizers before 0.23 (the floor is 0.20) cannot be weakly referenced: their special
    ids are read for each detokenizer instead of cached, and still skipped."""

    class Unreferenceable:
        __slots__ = ()  # no __weakref__ slot, as Tokenizer before 0.23

        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            return TOKENIZER.decode(token_ids, skip_special_tokens=skip_special_tokens)

        def get_added_tokens_decoder(self) -> dict:
            return TOKENIZER.get_added_tokens_decoder()

    eos = TOKENIZER.token_to_id("</s>")
    assert skipped_ids(Unreferenceable()) == {eos, TOKENIZER.token_to_id("<s>")}  # type: ignore[arg-type]
    detokenizer = IncrementalDetokenizer(Unreferenceable())  # type: ignore[arg-type]
    sequence = [*ids("hi "), eos, *ids("there")]
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == "hi there"


def test_a_long_run_of_undecodable_bytes_keeps_every_window_short() -> None:
    """A model that repeats a lone UTF-8 continuation byte (a random-weight one does) made
    every window end in U+FFFD, so none was taken and each token decoded every token since the
    last text: O(n^2) for the reply. Text after which the rest only added characters is final
    and taken, so windows stay short, and the text is still what decoding it all gives."""
    windows: list[int] = []  # the length of every window decoded

    euro = ids("€")  # three byte tokens: E2 82 AC
    assert len(euro) == 3
    lone = euro[1]  # 0x82, a continuation byte with no lead
    sequence = [*ids("hello "), *[lone] * 1500, *euro, *[lone] * 500, *euro[:2]]
    detokenizer = IncrementalDetokenizer(Counting(windows))  # type: ignore[arg-type]
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == TOKENIZER.decode(sequence, skip_special_tokens=True)
    assert "€" in "".join(pieces)
    assert max(windows) <= 16, max(windows)


def byte_fallback_tokenizer() -> Tokenizer:
    """A SentencePiece-style tokenizer (Llama-2's, Mistral's decoder): byte tokens <0x00> to
    <0xFF> (ids 3 to 258) and one word piece, "▁ok" (259)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab["▁ok"] = 259
    model = models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>")
    tokenizer = Tokenizer(model)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    return tokenizer


def test_a_byte_fallback_decoder_is_never_settled_inside_a_run_of_bytes() -> None:
    """SentencePiece's byte fallback shows a whole run of byte tokens as U+FFFD when any of
    them is invalid: text a character follows is not final there. Taken as final (the rule
    for byte-level BPE), the run's later windows decoded valid characters shorter than their
    context, and " ok" was lost."""
    tokenizer = byte_fallback_tokenizer()
    euro = [3 + 0xE2, 3 + 0x82, 3 + 0xAC]
    sequence = [3 + 0x82, *euro * 12, 259]
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == tokenizer.decode(sequence, skip_special_tokens=True)
    assert "".join(pieces).endswith(" ok")


class CountingOf:
    """`tokenizer`, recording the number of ids of each decode in `windows`."""

    def __init__(self, tokenizer: Tokenizer, windows: list[int]) -> None:
        self.tokenizer, self.windows = tokenizer, windows

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.windows.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def get_added_tokens_decoder(self) -> dict:
        return self.tokenizer.get_added_tokens_decoder()

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def to_str(self) -> str:
        return self.tokenizer.to_str()


def fallback_bytes(data: bytes) -> list[int]:
    """The byte fallback tokenizer's byte tokens for `data`."""
    return [3 + b for b in data]


def test_a_long_invalid_run_of_byte_fallback_tokens_keeps_every_window_short() -> None:
    """A run of byte tokens invalid for good (it starts with a lone continuation byte) decodes
    as one U+FFFD per token whatever follows: it was held until it ended, each token decoding
    the whole run (O(n^2) on the engine's loop: 1.5 s of CPU for 4,000 tokens). Each token of
    it is now one U+FFFD as it comes, and the text is still what decoding it all gives."""
    windows: list[int] = []
    tokenizer = byte_fallback_tokenizer()
    sequence = [259, *fallback_bytes(b"\x82" + "€".encode() * 500), 259]
    detokenizer = IncrementalDetokenizer(CountingOf(tokenizer, windows))  # type: ignore[arg-type]
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == tokenizer.decode(sequence, skip_special_tokens=True)
    assert "".join(pieces) == "ok" + "\ufffd" * 1501 + " ok"
    assert max(windows) <= 16, max(windows)
    assert sum(1 for piece in pieces if piece) > 1400, "emitted as it came, not held"


def test_a_byte_fallback_run_that_turns_invalid_keeps_the_characters_it_made() -> None:
    """Characters a run made before a byte made it invalid for good were emitted: the stream
    keeps them and adds one U+FFFD per later byte token (decoding the whole sequence shows
    U+FFFD for the first ones too; a stream cannot take text back)."""
    windows: list[int] = []
    tokenizer = byte_fallback_tokenizer()
    sequence = [*fallback_bytes("€".encode() + b"\xff" * 600), 259]
    detokenizer = IncrementalDetokenizer(CountingOf(tokenizer, windows))  # type: ignore[arg-type]
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == "€" + "\ufffd" * 600 + " ok"
    assert max(windows) <= 16, max(windows)


@pytest.mark.parametrize("seed", range(5))
def test_byte_fallback_runs_valid_or_invalid_from_their_start_add_up_to_one_decode(
    seed: int,
) -> None:
    """Runs of byte tokens that are UTF-8 (of 1- to 4-byte characters) or invalid from their
    first byte, separated by a word piece or ending the stream: the pieces equal one decode."""
    rng = random.Random(seed)
    tokenizer = byte_fallback_tokenizer()
    sequence: list[int] = []
    for _ in range(30):
        if rng.random() < 0.5:
            text = "".join(rng.choice("Aé€😀") for _ in range(rng.randrange(1, 8)))
            sequence += fallback_bytes(text.encode())
        else:
            lead = bytes([rng.choice((0x82, 0xFF, 0xC0))])
            sequence += fallback_bytes(lead + rng.randbytes(rng.randrange(40)))
        sequence.append(259)
    sequence.pop()  # the stream ends inside its last run
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == tokenizer.decode(sequence, skip_special_tokens=True)


def streamed_byte_fallback(sequence: list[int]) -> str:
    """What a stream of `sequence` (byte fallback tokenizer) shows, by its rule: the text of a
    run of byte tokens as its characters complete while it is UTF-8 so far, and, once it is
    invalid for good, one U+FFFD per byte token not yet shown (a run cut short by a word piece
    or the stream's end counts as invalid); "▁ok" is " ok" (no space first)."""
    out, run, shown, bad = "", b"", 0, False

    def close() -> None:
        nonlocal out, run, shown, bad
        if not bad:
            out += "\ufffd" * (len(run) - shown)
        run, shown, bad = b"", 0, False

    for token in sequence:
        if token == 259:
            close()
            out += " ok" if out else "ok"
            continue
        run += bytes([token - 3])
        if bad:
            out += "\ufffd"
            continue
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            decoder.decode(run)
        except UnicodeDecodeError:
            out, bad = out + "\ufffd" * (len(run) - shown), True
            continue
        if not decoder.getstate()[0]:
            out += run.decode()[len(run[:shown].decode()) :]
            shown = len(run)
    close()
    return out


@pytest.mark.parametrize("seed", range(20))
def test_random_byte_fallback_streams_show_what_the_rule_says(seed: int) -> None:
    """Random byte tokens (valid characters, their pieces, U+FFFD spelled, bytes never valid,
    pairs invalid only together: ED A0, F0 80) and word pieces: a stream shows what
    `streamed_byte_fallback` says, however short or long each run's invalid tail (the count of
    U+FFFD depended on whether the tail reached 8 tokens)."""
    rng = random.Random(seed)
    tokenizer = byte_fallback_tokenizer()
    pool = [*fallback_bytes(bytes.fromhex("41e282acc3a9fff09f9880eda0efbfbd")), 259]
    sequence = [rng.choice(pool) for _ in range(rng.randrange(1, 80))]
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == streamed_byte_fallback(sequence)


def test_a_spelled_u_fffd_is_shown_as_soon_as_complete() -> None:
    """A run that spells U+FFFD (EF BF BD) and then turns invalid: the spelled character was
    complete, so it is shown, and the invalid byte after it is one U+FFFD more. It was held
    while fewer than 8 tokens waited, then shown as one U+FFFD per byte token."""
    tokenizer = byte_fallback_tokenizer()
    sequence = [*fallback_bytes(bytes.fromhex("41efbfbd80")), 259]
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == streamed_byte_fallback(sequence) == "A\ufffd\ufffd ok"


def test_a_byte_fallback_whose_byte_tokens_cannot_be_looked_up_holds_half_characters() -> None:
    """A byte fallback decoder whose tokenizer cannot look its byte tokens up (no
    `token_to_id`): no run can be judged, so text ending in half a character is held as before
    runs were judged, not shown as U+FFFD."""
    tokenizer = byte_fallback_tokenizer()

    class NoLookup:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

        def get_added_tokens_decoder(self) -> dict:
            return tokenizer.get_added_tokens_decoder()

        def to_str(self) -> str:
            return tokenizer.to_str()

    sequence = fallback_bytes("中文".encode())
    detokenizer = IncrementalDetokenizer(NoLookup())  # type: ignore[arg-type]
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    assert "".join(pieces) == "中文" and detokenizer.flush()[0] == ""


def test_a_byte_level_tokenizer_with_a_token_spelled_like_a_byte_is_no_byte_fallback() -> None:
    """A byte-level BPE tokenizer with an added token "<0x41>": taken for a byte fallback, its
    text ending in half a character was judged complete and shown as U+FFFD ("a€b" streamed
    as "a\ufffdb"). Only a vocabulary with all 256 byte tokens is a byte fallback's."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<0x41>"])
    sequence = ids("a€b")
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == "a€b"


def test_a_run_of_byte_fallback_tokens_spelling_u_fffd_keeps_every_window_short() -> None:
    """U+FFFD itself as byte tokens (EF BF BD), again and again: the text ends in U+FFFD, yet
    the run is complete UTF-8, read as it comes (held, each token decoded the whole run)."""
    windows: list[int] = []
    tokenizer = byte_fallback_tokenizer()
    sequence = [*fallback_bytes("\ufffd".encode() * 300), 259]
    detokenizer = IncrementalDetokenizer(CountingOf(tokenizer, windows))  # type: ignore[arg-type]
    pieces = [detokenizer.push(token, ())[0] for token in sequence]
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == tokenizer.decode(sequence, skip_special_tokens=True)
    # Read at a character's end once 8 wait: a context and a window of up to 3 more each.
    assert max(windows) <= 2 * (8 + 3), max(windows)


def test_tokens_that_never_end_a_character_cost_a_few_decodes_each() -> None:
    """Byte-level BPE tokens that span characters ("€" is E2 82 AC; tokens E2 82 and AC E2 82
    repeated): no token ends a character, so no text settles, and looking for it at every end
    of the window cost O(n) decodes a token. It looks at the last few ends only."""
    windows: list[int] = []
    byte_level = TOKENIZER.get_vocab()
    vocab = {**byte_level, "âĤ": len(byte_level), "¬âĤ": len(byte_level) + 1}
    spanning = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    spanning.decoder = decoders.ByteLevel()
    sequence = [vocab["âĤ"], *[vocab["¬âĤ"]] * 300]

    class Recording:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            windows.append(len(token_ids))
            return spanning.decode(token_ids, skip_special_tokens=skip_special_tokens)

        def get_added_tokens_decoder(self) -> dict:
            return spanning.get_added_tokens_decoder()

        def to_str(self) -> str:
            return spanning.to_str()

    detokenizer = IncrementalDetokenizer(Recording())  # type: ignore[arg-type]
    pieces = []
    for token in sequence:
        before = len(windows)
        pieces.append(detokenizer.push(token, ())[0])
        assert len(windows) - before <= 6
    pieces.append(detokenizer.flush()[0])
    assert "".join(pieces) == spanning.decode(sequence)


def test_a_tokenizer_is_read_whole_only_when_a_run_needs_settling() -> None:
    """Whether text may settle is read from the tokenizer's JSON (megabytes for some): it was
    read for every request where a tokenizer cannot be weakly referenced (tokenizers before
    0.23), on the event loop. It is read when a run first needs it, once per detokenizer."""

    class Unreferenced:
        __slots__ = ("reads",)

        def __init__(self) -> None:
            self.reads = 0

        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            return TOKENIZER.decode(token_ids, skip_special_tokens=skip_special_tokens)

        def get_added_tokens_decoder(self) -> dict:
            return TOKENIZER.get_added_tokens_decoder()

        def to_str(self) -> str:
            self.reads += 1
            return TOKENIZER.to_str()

    tokenizer = Unreferenced()
    for text in ("hello world", "héllo wörld", "€ 😀") * 3:  # characters of one to 4 bytes
        detokenizer = IncrementalDetokenizer(tokenizer)  # type: ignore[arg-type]
        for token in ids(text):
            detokenizer.push(token, ())
    assert tokenizer.reads == 0
    lone = ids("€")[1]
    detokenizer = IncrementalDetokenizer(tokenizer)  # type: ignore[arg-type]
    for _ in range(40):
        detokenizer.push(lone, ())
    assert tokenizer.reads == 1


@pytest.mark.parametrize("seed", range(3))
def test_the_held_back_overlap_is_the_longest_suffix_that_starts_a_stop_string(seed: int) -> None:
    """`_overlap`, found from the stop string's occurrences of the text's last character, is
    the longest suffix of the text that is a proper prefix of the stop string, as trying every
    size says (random texts and stops over a small alphabet, where overlaps are common)."""
    rng = random.Random(seed)
    for _ in range(2000):
        text = "".join(rng.choice("ab€") for _ in range(rng.randrange(0, 12)))
        stop = "".join(rng.choice("ab€") for _ in range(rng.randrange(1, 12)))
        longest = max(
            (n for n in range(1, min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:n])),
            default=0,
        )
        assert _overlap(text, stop) == longest, (text, stop)


def test_a_reply_keeps_its_first_space_after_a_prompt_under_a_stripping_decoder() -> None:
    """SentencePiece's decoder (Llama-2's, Mistral's) strips the sequence's first space: a
    reply decoded alone began "ok", not " ok", after the prompt "ok" (and a joined prompt
    and reply read "okok"). With the prompt's last tokens as the first window's context, the
    reply reads as decoding prompt and reply together shows it."""
    tokenizer = byte_fallback_tokenizer()
    prompt = [1, 259, *fallback_bytes("é".encode()), 259]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.push(token, ())[0] for token in (259, 259)]
    pieces.append(detokenizer.flush()[0])
    assert pieces[0] == " ok"
    whole = tokenizer.decode([*prompt, 259, 259], skip_special_tokens=True)
    assert tokenizer.decode(prompt, skip_special_tokens=True) + "".join(pieces) == whole


@pytest.mark.parametrize("seed", range(30))
def test_a_reply_after_any_prompt_adds_up_to_decoding_both(seed: int) -> None:
    """Prompts ending in or cut through byte runs (valid characters, their pieces, bytes never
    valid): the context never makes a reply show what decoding it alone does not, but its
    first space; and after a prompt whose text ends in a whole character, prompt and reply
    read as decoding them together does."""
    rng = random.Random(seed)
    tokenizer = byte_fallback_tokenizer()
    pool = [*fallback_bytes("é€".encode()), 259]
    prompt = [rng.choice(pool) for _ in range(rng.randrange(0, 12))]
    reply = [259, *fallback_bytes("€".encode()), 259]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.push(token, ())[0] for token in reply]
    pieces.append(detokenizer.flush()[0])
    alone = tokenizer.decode(reply, skip_special_tokens=True)
    assert "".join(pieces).lstrip(" ") == alone
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)
    if not prompt_text.endswith("\ufffd"):
        whole = tokenizer.decode([*prompt, *reply], skip_special_tokens=True)
        assert prompt_text + "".join(pieces) == whole
