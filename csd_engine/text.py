"""Incremental detokenization and stop strings for one request.

Each step decodes only a window: the tokens since the last text it could settle, with the
settled step's tokens before them as context (decoding a window alone would change how its
first token spaces or joins), so a step costs the same however long the output is. Text is
settled only when it does not end in U+FFFD (an incomplete UTF-8 sequence, to be completed by
the next token). Deltas handed out also hold back the last `len(longest stop) - 1`
characters, which may be the start of a stop string, so the deltas, concatenated, are exactly
the final text.
"""
REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
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

    def stop_at(self, ids: list[int]) -> int | None:
        """If the settled text now holds a stop string: cut the text before the first one and
        return how many tokens to keep (they end with the one that completed it)."""
        if not self.stop:
            return None
        start, self.searched = max(0, self.searched - self.hold), len(self.text)
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not found:
            return None
        base, prefix, read = self.last  # the text and window before this update
        context = self.decode(ids[prefix:read])
        keep = len(ids)
        for n in range(read + 1, len(ids) + 1):
            text = self.text[:base] + self.decode(ids[prefix:n])[len(context):]
            if any(text.find(s, start) >= 0 for s in self.stop):
                keep = n
                break
        self.text = self.text[:min(found)]
        return keep

    def delta(self, final: bool) -> str:
        """The new part of the text that is safe to hand out (all of it when final)."""
        end = len(self.text) if final else len(self.text) - self.hold
        if end <= len(self.sent):
            return ""
        new, self.sent = self.text[len(self.sent):end], self.text[:end]
        return new
