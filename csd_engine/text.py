"""Incremental detokenization and stop strings for one request.

Each step appends tokens; `update` decodes the whole output again (a few ms even for
thousands of tokens) and hands out only text that can no longer change: it holds back a
trailing incomplete UTF-8 sequence (decoded as U+FFFD) and, when the request has stop strings,
the last `len(longest stop) - 1` characters, which may be the start of one. So the deltas,
concatenated, are exactly the final text.
"""
REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = ""  # text handed out so far

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stop_at(self, ids: list[int], text: str, checked: int) -> tuple[int, str] | None:
        """If the output `ids` (decoded: `text`) contains a stop string: (tokens to keep, the
        text before the stop). The tokens kept end with the one that completed the stop string;
        `checked` is how many tokens were already known to contain none."""
        if not self.stop:
            return None
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut < 0:
            return None
        for n in range(checked + 1, len(ids) + 1):
            if any(s in self.decode(ids[:n]) for s in self.stop):
                return n, text[:cut]
        return len(ids), text[:cut]

    def delta(self, text: str, final: bool) -> str:
        """The new part of `text` (the decoded output so far) that is safe to hand out."""
        end = len(text)
        if not final:
            end -= self.hold
            while end > 0 and text[end - 1] == REPLACEMENT:
                end -= 1
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):end], text[:end]
        return new
