"""IncrementalText against the plain definition, on random outputs arriving in random steps:
the deltas concatenate to decode(all tokens) (split UTF-8 characters included), and a stop
string cuts the text before its first occurrence, keeping the tokens up to the one that
completed it."""
import random

from csd_engine.text import IncrementalText, TextOffsets, token_bytes
from tests.strategies.test_continuous import ByteTokenizer


def run(tokens, steps, stop=(), tokenizer=None):
    text = IncrementalText(tokenizer or ByteTokenizer(), stop)
    out, deltas, i = [], [], 0
    for size in steps:
        out += tokens[i:i + size]
        i += size
        final = i >= len(tokens)
        text.update(out)
        keep = text.stop_at(out)
        if keep is None and final:
            text.update(out, final=True)
            keep = text.stop_at(out)
        if keep is not None:
            del out[keep:]
            final = True
        deltas.append(text.delta(final))
        if final:
            return out, "".join(deltas), text.text
    raise AssertionError("steps do not cover the tokens")


def test_deltas_and_stop_strings_match_the_definition():
    rng = random.Random(0)
    tok = ByteTokenizer()
    for trial in range(300):
        tokens = [rng.randrange(96) for _ in range(rng.randint(1, 40))]
        steps = [rng.randint(1, 5) for _ in range(40)]
        full = tok.decode(tokens)
        out, joined, final = run(tokens, steps)
        assert out == tokens and joined == final == full, trial
        clean = [i for i in range(len(full) - 2) if "\ufffd" not in full[i:i + 3]]
        if not clean:
            continue
        at = rng.choice(clean)
        stop = full[at:at + rng.randint(1, 3)]
        out, joined, final = run(tokens, steps, (stop, "\x00never"))
        cut = full.find(stop)
        keep = next(n for n in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:n]))
        assert joined == final == full[:cut], trial
        assert out == tokens[:keep], trial


def test_several_stop_strings_cut_where_token_by_token_decoding_stops():
    """The tokens end with the first that completes any stop string, and the text is cut before
    the first stop string in their text: one that a later token of the same step would complete,
    starting earlier ("ebb" around the stop "b"), was never reached."""
    rng = random.Random(1)
    tok = ByteTokenizer()
    overlapping = 0
    for trial in range(400):
        tokens = [rng.randrange(96) for _ in range(rng.randint(2, 40))]
        steps = [rng.randint(1, 6) for _ in range(40)]
        full = tok.decode(tokens)
        clean = [i for i in range(len(full) - 3) if "\ufffd" not in full[i:i + 4]]
        if not clean:
            continue
        at = rng.choice(clean)
        longer = full[at:at + rng.randint(2, 4)]
        inner = longer[rng.randrange(1, len(longer)):]  # completes before the longer one around it
        stops = (longer, inner) if rng.random() < 0.5 else (inner, longer)
        out, joined, final = run(tokens, steps, stops)
        keep = next(n for n in range(1, len(tokens) + 1) if any(s in tok.decode(tokens[:n]) for s in stops))
        reached = tok.decode(tokens[:keep])
        cut = min(i for i in (reached.find(s) for s in stops) if i >= 0)
        overlapping += full.find(longer) < cut
        assert out == tokens[:keep], trial
        assert joined == final == reached[:cut], (trial, stops)
    assert overlapping >= 3, "too few cases where a longer stop string starts before the first one completed"


def _check_pieces(tokenizer, ids):
    """token_bytes join to the bytes of the text the engine decodes (special tokens skipped),
    though some tokens decode alone to U+FFFD, and TextOffsets puts each token at the character
    it begins or completes, the same when the tokens come in chunks."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    pieces = token_bytes(tokenizer, ids)
    assert b"".join(pieces) == text.encode()
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # what decoding alone gives
    offsets = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    want = [len(text.encode()[:o].decode(errors="ignore")) for o in offsets]
    assert TextOffsets().starts(pieces) == want
    for size in (1, 2, 3):
        chunked = TextOffsets()
        assert [s for i in range(0, len(pieces), size) for s in chunked.starts(pieces[i:i + size])] == want


def test_text_offsets_of_split_and_broken_characters():
    """A character split over tokens (in one chunk or across two) starts where it begins; a
    stray continuation byte is a character of its own (U+FFFD, as lossy decoding gives it); a
    token with no text (a special one) stands where the next character starts."""
    split = [b"\xc3", b"\xa9"] * 3  # "ééé"
    assert TextOffsets().starts(split) == [0, 0, 1, 1, 2, 2]
    chunked = TextOffsets()
    assert chunked.starts(split[:3]) + chunked.starts(split[3:]) == [0, 0, 1, 1, 2, 2]
    pieces = [b"o", b"\xaa", b"T", b"", b"\xe6\x97", b"\xa5!"]
    assert b"".join(pieces).decode(errors="replace") == "o\ufffdT\u65e5!"
    assert TextOffsets().starts(pieces) == [0, 1, 2, 3, 3, 3]


def test_token_bytes_of_byte_level_bpe():
    """SmolLM2's tokenizer (byte-level BPE): multi-byte characters split across tokens, an emoji,
    an added special token."""
    from transformers import AutoTokenizer

    from csd_engine.models import zoo
    tokenizer = AutoTokenizer.from_pretrained(zoo.resolve("smollm2-135m"))
    _check_pieces(tokenizer, tokenizer("日本語のテキスト ok é 🙂 end<|im_end|>")["input_ids"])


def test_token_bytes_of_sentencepiece_byte_fallback():
    """A Llama-style tokenizer: word pieces with U+2581 and byte-fallback pieces <0xE6>..."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "b": 1, "\u2581a": 2, "<0xE6>": 3, "<0x97>": 4, "<0xA5>": 5}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    _check_pieces(tokenizer, [1, 2, 3, 4, 5, 2])  # "b a日 a"


class ReplacementTokenizer:
    """Token 0 is the character U+FFFD itself (three bytes, complete); 1 is 'a'; 2 and 3 are the
    two bytes of 'é'."""

    pieces = ["\ufffd".encode(), b"a", b"\xc3", b"\xa9"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[t] for t in ids).decode("utf-8", errors="replace")


def test_a_real_replacement_character_streams_three_tokens_late():
    """A U+FFFD the model emits is not an unfinished character: the text settles once three more
    tokens (as many as a UTF-8 character can still need) leave it in place, step by step, while
    a split 'é' is held until its second byte, and only it: the 'a' before it goes out."""
    text = IncrementalText(ReplacementTokenizer())
    out = []
    for step in range(12):
        out.append(0)
        text.update(out)
        assert len(text.text) >= len(out) - 3, f"step {step}: {len(text.text)} of {len(out)} characters settled"
        assert text.read >= len(out) - 3
    out += [1, 2]
    text.update(out)
    assert text.text == "\ufffd" * 12 + "a"  # the first byte of 'é' is held, not the 'a' before it
    out.append(3)
    text.update(out)
    assert text.text == "\ufffd" * 12 + "aé"



class SplitEmojiTokenizer(ReplacementTokenizer):
    """Tokens: ' ', then the first two and the last two bytes of U+1FAE0 (a four-byte emoji), 'x'."""

    pieces = [b" ", b"\xf0\x9f", b"\xab\xa0", b"x"]


def test_a_step_that_ends_inside_a_character_holds_back_that_character_only():
    """A step whose tokens end with half an emoji streams the text before it at once (it had
    waited, whole, for the emoji's last bytes); the deltas add up to the final text."""
    text, deltas = IncrementalText(SplitEmojiTokenizer()), []
    for ids, settled in (([3, 0, 1], "x "), ([3, 0, 1, 2], "x \U0001fae0"), ([3, 0, 1, 2, 3, 1], "x \U0001fae0x")):
        text.update(ids)
        assert text.text == settled and "\ufffd" not in text.text
        deltas.append(text.delta(final=False))
    assert deltas == ["x ", "\U0001fae0", "x"]

def test_deltas_hold_back_only_what_may_start_a_stop_string():
    """Without stop strings a step's settled text goes out whole; with them, only the last
    len(longest stop) - 1 characters wait."""
    ids = [2, 3, 4, 6]  # one character each: "cdeg"
    for stop, delta in (((), "cdeg"), (("xyz", "q"), "cd")):
        text = IncrementalText(ByteTokenizer(), stop)
        text.update(ids)
        assert text.stop_at(ids) is None
        assert text.delta(final=False) == delta, stop


class SpecialTokenizer(ReplacementTokenizer):
    """ReplacementTokenizer, with tokens 4-6 special (no text, skipped as the engine decodes)."""

    pieces = ReplacementTokenizer.pieces + [b"<s1>", b"<s2>", b"<s3>"]
    all_special_ids = [4, 5, 6]

    def decode(self, ids, skip_special_tokens=True):
        return super().decode([t for t in ids if not (skip_special_tokens and t in self.all_special_ids)])


def test_special_tokens_inside_a_character_do_not_settle_it_early():
    """Special tokens carry no bytes: three of them between 'é's two bytes leave it unfinished, so
    one token per step gives the text a whole step gives (not U+FFFD, its second byte lost)."""
    tokens = [1, 2, 4, 5, 6, 3, 1]  # "a" + first byte of é + three special tokens + second byte + "a"
    for steps in ([1] * 7, [7], [2, 3, 2]):
        out, joined, final = run(tokens, steps, tokenizer=SpecialTokenizer())
        assert joined == final == "aéa", steps


def test_a_stop_string_holding_u_fffd_is_not_matched_on_an_unfinished_character():
    """'é' arriving over two tokens of one step decodes as U+FFFD after the first: a stop string
    "\ufffd" must match only the real U+FFFD that follows, where one token per step stops too,
    keeping the tokens up to the one that completed it."""
    tokens = [1, 2, 3, 1, 0, 1, 1]  # "aéa" + U+FFFD + "aa"
    for steps in ([1] * 7, [7], [2, 5], [3, 4]):
        out, joined, final = run(tokens, steps, stop=("\ufffd",), tokenizer=ReplacementTokenizer())
        assert (out, joined, final) == ([1, 2, 3, 1, 0], "aéa", "aéa"), steps


class WordTokenizer:
    """Multi-character tokens: 0 'x', 1 'abc', 2 'd'."""

    pieces = ["x", "abc", "d"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[t] for t in ids)


def test_a_token_completing_two_stop_strings_cuts_before_the_first_to_start():
    """'abc' completes both 'b' and 'abc': the text is cut before 'abc', which starts first, in any
    steps (the stop string that ends first decides only which tokens are kept)."""
    for steps in ([1, 1, 1], [3], [2, 1]):
        assert run([0, 1, 2], steps, stop=("b", "abc"), tokenizer=WordTokenizer()) == ([0, 1], "x", "x"), steps
