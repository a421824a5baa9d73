"""Incremental detokenization and stop strings for one request.

Each step decodes only a window: the tokens since the last text it could settle, with the
settled step's tokens before them as context (decoding a window alone would change how its
first token spaces or joins), so a step costs the same however long the output is. Text is
settled up to the last token where it does not end in U+FFFD (an incomplete UTF-8 sequence, to
be completed by the next tokens), or, for a U+FFFD the model meant, once three more tokens that
carry bytes (not special ones) leave it in place.
Deltas handed out also hold back the last `len(longest stop) - 1` characters, which may be the
start of a stop string, so the deltas, concatenated, are exactly the final text.
"""
import codecs
import os
import re

REPLACEMENT = "\ufffd"
MAX_CONTINUATION_TOKENS = 3  # a UTF-8 character's bytes after its first: each token but a special one carries one or more
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


class IncrementalText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        # special tokens carry no text (skip_special_tokens): they complete no character
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.special = frozenset(getattr(tokenizer, "all_special_ids", None) or ()) | \
            {i for i, token in added.items() if getattr(token, "special", False)}
        self.text = ""  # the settled text of ids[:read]
        self.prefix = 0  # the window's context starts at this token
        self.read = 0  # tokens whose text is settled
        self.sent = ""  # text handed out so far
        self.searched = 0  # length of the text already searched for stop strings
        self.last = (0, 0, 0)  # (text length, prefix, read) before the latest update

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _piece(self, ids: list[int], end: int) -> str:
        """The text ids[read:end] add after the settled text."""
        context = self.decode(ids[self.prefix:self.read])
        return self.decode(ids[self.prefix:end])[len(context):]

    def update(self, ids: list[int], final: bool = False) -> None:
        """Settle the text of the new tokens of `ids` (all of it when final)."""
        self.last = (len(self.text), self.prefix, self.read)
        piece = self._piece(ids, len(ids))
        if piece and (final or not piece.endswith(REPLACEMENT)):
            self.text += piece
            self.prefix, self.read = self.read, len(ids)
            return
        # The longest run of the new tokens whose text is settled: one that does not end in U+FFFD
        # (a step that stops inside a character holds back that character only), or one whose
        # U+FFFD three tokens that carry bytes follow (its characters had every byte they can have:
        # a real U+FFFD, or invalid bytes), where the text up to it stays a prefix.
        bound, carrying = len(ids), 0
        while bound > self.read and carrying < MAX_CONTINUATION_TOKENS:
            bound -= 1
            carrying += ids[bound] not in self.special
        bound = bound if carrying == MAX_CONTINUATION_TOKENS else self.read
        for end in range(len(ids) - 1, self.read, -1):
            head = self._piece(ids, end)
            if head and piece.startswith(head) and (not head.endswith(REPLACEMENT) or end <= bound):
                self.text += head
                self.prefix, self.read = self.read, end
                return

    def stop_at(self, ids: list[int]) -> int | None:
        """If the settled text now holds a stop string: return how many tokens to keep and cut the
        text before the first stop string in their text, as token-by-token decoding would. They
        end with the first token whose text holds, as the settled text does, the stop string that
        ends first (not a match on a character still incomplete there); a stop string that only a
        later token completes, even one starting earlier, was never reached."""
        if not self.stop:
            return None
        start, self.searched = max(0, self.searched - self.hold), len(self.text)
        ends = [i + len(s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if not ends:
            return None
        reached = self.text[:min(ends)]
        base, prefix, read = self.last  # the text and window before this update
        context = self.decode(ids[prefix:read])
        for keep in range(read + 1, len(ids) + 1):
            text = self.text[:base] + self.decode(ids[prefix:keep])[len(context):]
            if text.startswith(reached):
                break
        kept = self.text[:len(os.path.commonprefix([text, self.text]))]  # the kept tokens' text, settled
        self.text = kept[:min(i for i in (kept.find(s, start) for s in self.stop) if i >= 0)]
        return keep

    def delta(self, final: bool) -> str:
        """The new part of the text that is safe to hand out (all of it when final)."""
        end = len(self.text) if final else len(self.text) - self.hold
        if end <= len(self.sent):
            return ""
        new, self.sent = self.text[len(self.sent):end], self.text[:end]
        return new


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): bytes that are printable Latin-1 characters stand
    for themselves, the other bytes for U+0100, U+0101, ... in order. Character -> byte."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(others)}}


BYTE_OF = _byte_level_alphabet()


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """Each token's own bytes, which join to the bytes of the text the tokens decode to. Decoding
    a token alone turns a piece of a multi-byte character into U+FFFD; here a byte-level BPE
    piece maps back through its alphabet, a byte-fallback piece (<0xE3>) is its byte, a
    SentencePiece word piece's U+2581 a space, an added token is its text, and a special token
    (which the text skips) is empty."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    kinds = decoder.__getstate__().decode() if decoder is not None else ""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    out = []
    for t, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        byte = BYTE_TOKEN.fullmatch(piece) if "ByteFallback" in kinds and piece else None
        if t in added or not piece:  # a special token is not in the text (skip_special_tokens)
            out.append(tokenizer.decode([t], skip_special_tokens=True).encode())
        elif "ByteLevel" in kinds and all(c in BYTE_OF for c in piece):
            out.append(bytes(BYTE_OF[c] for c in piece))
        elif byte:
            out.append(bytes([int(byte[1], 16)]))
        elif "Metaspace" in kinds or "\u2581" in kinds:
            out.append(piece.replace("\u2581", " ").encode())
        else:
            out.append(tokenizer.decode([t]).encode())
    return out


class TextOffsets:
    """Where each token starts in the text its bytes decode to (UTF-8, U+FFFD for what does not
    decode, as the tokenizers' lossy decoding): the index of the character its first byte begins,
    or completes when a character began in an earlier token. The decoder keeps a character split
    across calls, so a stream's chunks get the offsets the whole text gives."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.count = 0  # characters decoded so far

    def starts(self, pieces: list[bytes]) -> list[int]:
        out = []
        for piece in pieces:
            out.append(self.count)
            self.count += len(self.decoder.decode(piece))
        return out
