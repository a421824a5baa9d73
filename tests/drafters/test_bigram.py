import random
import time
from collections import Counter

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from csd_engine.drafters import bigram as bigram_module
from csd_engine.drafters.bigram import (BigramTable, bigram_from_corpus, bigram_from_model, corpus_from_files,
                                        load_or_build, tokenizer_key)
from csd_engine.drafters.mag import MaG


def bigram_bruteforce(sequences: list[list[int]], vocab_size: int) -> tuple[list[int], list[float]]:
    successors = Counter((a, b) for sequence in sequences for a, b in zip(sequence, sequence[1:]))
    unigram = Counter(token for sequence in sequences for token in sequence)
    most_frequent = min(unigram, key=lambda token: (-unigram[token], token))
    table, probs = [], []
    for a in range(vocab_size):
        seen = [(count, b) for (first, b), count in successors.items() if first == a]
        count, b = min(seen, key=lambda item: (-item[0], item[1])) if seen else (0, most_frequent)
        table.append(b)
        probs.append(count / max(1, sum(count for count, _ in seen)))
    return table, probs


def as_lists(table: BigramTable) -> tuple[list[int], list[float]]:
    assert table.next_token.dtype == torch.int64 and table.prob.dtype == torch.float32
    return table.next_token.tolist(), table.prob.tolist()


def assert_same_table(got: BigramTable, expected: tuple[list[int], list[float]], context: str) -> None:
    next_token, prob = as_lists(got)
    assert next_token == expected[0], context
    assert prob == pytest.approx(expected[1], abs=1e-6), context


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {word: index for index, word in enumerate(["[UNK]", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("chunk", [None, 7])  # 7 tokens: counts merged across many chunks
def test_corpus_table_matches_counter(monkeypatch, chunk):
    if chunk is not None:
        monkeypatch.setattr(bigram_module, "PAIR_CHUNK", chunk)
    seed = time.time_ns() % 2**32
    rng = random.Random(seed)
    for _ in range(30):
        vocab_size = rng.randint(1, 12)
        # Few distinct tokens per corpus, so ties and never-seen predecessors are common.
        used = rng.sample(range(vocab_size), rng.randint(1, vocab_size))
        sequences = [[rng.choice(used) for _ in range(rng.randint(0, 30))] for _ in range(rng.randint(1, 5))]
        if not any(sequences):
            sequences[0].append(rng.choice(used))
        assert_same_table(bigram_from_corpus(sequences, vocab_size), bigram_bruteforce(sequences, vocab_size),
                          f"seed={seed} {sequences}")
        flat = [token for sequence in sequences for token in sequence]
        assert_same_table(bigram_from_corpus(torch.tensor(flat, dtype=torch.int64), vocab_size),
                          bigram_bruteforce([flat], vocab_size), f"seed={seed} {flat}")
        rows = [[rng.choice(used) for _ in range(8)] for _ in range(rng.randint(1, 4))]
        assert_same_table(bigram_from_corpus(torch.tensor(rows, dtype=torch.int64), vocab_size),
                          bigram_bruteforce(rows, vocab_size), f"seed={seed} {rows}")


def test_corpus_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        bigram_from_corpus([[0, 4]], 4)
    with pytest.raises(ValueError, match="no tokens"):
        bigram_from_corpus([[], []], 4)
    with pytest.raises(TypeError, match="int64"):
        bigram_from_corpus(torch.zeros(3, dtype=torch.float32), 4)
    with pytest.raises(ValueError, match="vocab_size"):
        bigram_from_corpus([[0]], 0)


def test_corpus_table_drives_mag():
    table = bigram_from_corpus([[0, 1, 0, 1, 0, 2]], 3)  # after 0: 1 twice, 2 once; 2 never followed
    assert table.next_token.tolist() == [1, 0, 0] and table.prob.tolist() == pytest.approx([2 / 3, 1, 0])
    tokens = torch.tensor([[2, 0]])
    got = MaG(*table, min_bigram_prob=0.6).propose(tokens, torch.tensor([2]), torch.tensor([2]), 4)
    assert got.tokens.tolist() == [[1, 0, 1, 0]] and got.length.tolist() == [4]
    got = MaG(*table, min_bigram_prob=0.7).propose(tokens, torch.tensor([2]), torch.tensor([2]), 4)
    assert got.length.tolist() == [0]


def test_model_table_asks_every_token_in_batches():
    seed = time.time_ns() % 2**32
    generator = torch.Generator().manual_seed(seed)
    vocab_size = int(torch.randint(4, 600, (1,), generator=generator))
    batch_size = int(torch.randint(1, 200, (1,), generator=generator))
    # Values exact in bfloat16, so batches returned in either dtype give the same table.
    logits = (3 * torch.randn(vocab_size, vocab_size, generator=generator)).to(torch.bfloat16).float()
    logits[1::3, 2:4] = 50.0  # ties: the smallest id wins
    logits[0] = 0.0  # uniform
    asked = []

    def logits_fn(tokens):
        asked.append(tokens.clone())
        return logits[tokens].to(torch.bfloat16 if tokens[0] % 2 else torch.float32)

    table = bigram_from_model(logits_fn, vocab_size, batch_size=batch_size)
    expected = torch.softmax(logits, -1)
    assert torch.equal(table.next_token, expected.argmax(-1)), f"seed={seed}"
    assert table.next_token[0] == 0 and (table.next_token[1::3] == 2).all(), f"seed={seed}"
    torch.testing.assert_close(table.prob, expected.amax(-1), msg=f"seed={seed}")
    assert torch.equal(torch.cat(asked), torch.arange(vocab_size)), f"seed={seed}"
    assert max(len(tokens) for tokens in asked) <= batch_size, f"seed={seed}"


def test_model_table_rejects_bad_logits():
    with pytest.raises(ValueError, match="shape"):
        bigram_from_model(lambda tokens: torch.zeros(len(tokens), 9), 10, batch_size=4)
    with pytest.raises(ValueError, match="floating"):
        bigram_from_model(lambda tokens: tokens, 10, batch_size=4)


def test_tokenizer_key_is_stable_and_tells_tokenizers_apart():
    first = word_tokenizer(["the", "cat", "sat"])
    assert tokenizer_key(first) == tokenizer_key(word_tokenizer(["the", "cat", "sat"]))
    assert tokenizer_key(first) != tokenizer_key(word_tokenizer(["the", "sat", "cat"]))  # other ids
    assert tokenizer_key(first) != tokenizer_key(word_tokenizer(["the", "cat", "sat", "on"]))
    with pytest.raises(TypeError, match="get_vocab"):
        tokenizer_key(object())


def test_load_or_build_caches_on_disk(tmp_path, monkeypatch):
    seed = time.time_ns() % 2**32
    generator = torch.Generator().manual_seed(seed)
    table = BigramTable(torch.randint(0, 50, (50,), generator=generator), torch.rand(50, generator=generator))
    torch.save(table.next_token, tmp_path / "bigram-abc123-corpus-test.pt")  # version 1: ignored, kept
    builds = []

    def build():
        builds.append(1)
        return BigramTable(table.next_token.clone(), table.prob.clone())

    first = load_or_build("abc123", "corpus-test", build, cache_dir=str(tmp_path))
    second = load_or_build("abc123", "corpus-test", build, cache_dir=str(tmp_path))
    assert len(builds) == 1
    for loaded in (first, second):
        assert isinstance(loaded, BigramTable), f"seed={seed}"
        assert torch.equal(loaded.next_token, table.next_token) and torch.equal(loaded.prob, table.prob)
    assert sorted(path.name for path in tmp_path.iterdir()) == [  # no temporary file left
        "bigram-abc123-corpus-test.pt", "bigram-v2-abc123-corpus-test.pt"]
    load_or_build("abc123", "model-x", build, cache_dir=str(tmp_path))  # another source: another entry
    assert len(builds) == 2
    monkeypatch.setenv("CSD_CACHE_DIR", str(tmp_path / "from-env"))
    load_or_build("abc123", "corpus-test", build)
    assert len(builds) == 3 and (tmp_path / "from-env" / "bigram-v2-abc123-corpus-test.pt").exists()


def test_load_or_build_rejects_bad_names_and_tables(tmp_path):
    table = BigramTable(torch.zeros(3, dtype=torch.int64), torch.zeros(3))
    with pytest.raises(ValueError, match="letters"):
        load_or_build("a/b", "corpus", lambda: table, cache_dir=str(tmp_path))
    with pytest.raises(TypeError, match="BigramTable"):
        load_or_build("key", "corpus", lambda: table.next_token, cache_dir=str(tmp_path))
    with pytest.raises(TypeError, match="int64"):
        load_or_build("key", "corpus", lambda: BigramTable(torch.zeros(3), table.prob), cache_dir=str(tmp_path))
    with pytest.raises(TypeError, match="float32"):
        load_or_build("key", "corpus", lambda: BigramTable(table.next_token, torch.zeros(4)), cache_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("chunk_chars", [None, 5])  # 5 characters: many chunks per file
def test_corpus_from_files_tokenizes_every_file_in_order(tmp_path, monkeypatch, chunk_chars):
    if chunk_chars is not None:
        monkeypatch.setattr(bigram_module, "TEXT_CHUNK_CHARS", chunk_chars)
    seed = time.time_ns() % 2**32
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta"]
    tokenizer = word_tokenizer(words)
    texts = ["\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
                       for _ in range(rng.randint(1, 8))) for _ in range(3)]
    paths = []
    for number, text in enumerate(texts):
        paths.append(tmp_path / f"part{number}.txt")
        paths[-1].write_text(text, encoding="utf-8")
    ids = corpus_from_files(paths, tokenizer)
    expected = [token for text in texts for token in tokenizer.encode(text, add_special_tokens=False)]
    assert ids.dtype == torch.int64 and ids.tolist() == expected, f"seed={seed} {texts}"
    # max_chars cuts the concatenated text after that many characters.
    max_chars = rng.randint(0, len(texts[0]) + len(texts[1]))
    first, second = texts[0][:max_chars], texts[1][:max(0, max_chars - len(texts[0]))]
    expected = [token for text in (first, second) for token in tokenizer.encode(text, add_special_tokens=False)]
    assert corpus_from_files(paths, tokenizer, max_chars=max_chars).tolist() == expected, f"seed={seed} {texts}"
