"""IncrementalText against the plain definition, on random outputs arriving in random steps:
the deltas concatenate to decode(all tokens) (split UTF-8 characters included), and a stop
string cuts the text before its first occurrence, keeping the tokens up to the one that
completed it."""
import random

from csd_engine.text import IncrementalText
from tests.strategies.test_continuous import ByteTokenizer


def run(tokens, steps, stop=()):
    text = IncrementalText(ByteTokenizer(), stop)
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
