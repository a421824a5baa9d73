import random
import time
from collections import Counter

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from csd_engine.drafters import bigram as bigram_module
from csd_engine.drafters.bigram import (bigram_from_corpus, bigram_from_model, corpus_from_files,
                                        load_or_build, tokenizer_key)


def bigram_bruteforce(sequences: list[list[int]], vocab_size: int) -> list[int]:
    successors = Counter((a, b) for sequence in sequences for a, b in zip(sequence, sequence[1:]))
    unigram = Counter(token for sequence in sequences for token in sequence)
    most_frequent = min(unigram, key=lambda token: (-unigram[token], token))
    table = []
    for a in range(vocab_size):
        seen = [(count, b) for (first, b), count in successors.items() if first == a]
        table.append(min(seen, key=lambda item: (-item[0], item[1]))[1] if seen else most_frequent)
    return table


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
        expected = bigram_bruteforce(sequences, vocab_size)
        assert bigram_from_corpus(sequences, vocab_size).tolist() == expected, f"seed={seed} {sequences}"
        flat = [token for sequence in sequences for token in sequence]
        assert (bigram_from_corpus(torch.tensor(flat, dtype=torch.int64), vocab_size).tolist()
                == bigram_bruteforce([flat], vocab_size)), f"seed={seed} {flat}"
        rows = [[rng.choice(used) for _ in range(8)] for _ in range(rng.randint(1, 4))]
        assert (bigram_from_corpus(torch.tensor(rows, dtype=torch.int64), vocab_size).tolist()
                == bigram_bruteforce(rows, vocab_size)), f"seed={seed} {rows}"


def test_corpus_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        bigram_from_corpus([[0, 4]], 4)
    with pytest.raises(ValueError, match="no tokens"):
        bigram_from_corpus([[], []], 4)
    with pytest.raises(TypeError, match="int64"):
        bigram_from_corpus(torch.zeros(3, dtype=torch.float32), 4)
    with pytest.raises(ValueError, match="vocab_size"):
        bigram_from_corpus([[0]], 0)


def test_model_table_asks_every_token_in_batches():
    seed = time.time_ns() % 2**32
    generator = torch.Generator().manual_seed(seed)
    vocab_size = int(torch.randint(1, 3000, (1,), generator=generator))
    batch_size = int(torch.randint(1, 700, (1,), generator=generator))
    greedy_next = torch.randint(0, vocab_size, (vocab_size,), generator=generator)
    asked = []

    def next_token_fn(tokens):
        asked.append(tokens.clone())
        return greedy_next[tokens].to(torch.int32)

    table = bigram_from_model(next_token_fn, vocab_size, batch_size=batch_size)
    assert table.dtype == torch.int64
    assert torch.equal(table, greedy_next), f"seed={seed}"
    assert torch.equal(torch.cat(asked), torch.arange(vocab_size)), f"seed={seed}"
    assert max(len(tokens) for tokens in asked) <= batch_size, f"seed={seed}"


def test_model_table_rejects_bad_next_tokens():
    with pytest.raises(ValueError, match="shape"):
        bigram_from_model(lambda tokens: tokens[:-1], 10, batch_size=4)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        bigram_from_model(lambda tokens: tokens + 5, 10, batch_size=4)


def test_tokenizer_key_is_stable_and_tells_tokenizers_apart():
    first = word_tokenizer(["the", "cat", "sat"])
    assert tokenizer_key(first) == tokenizer_key(word_tokenizer(["the", "cat", "sat"]))
    assert tokenizer_key(first) != tokenizer_key(word_tokenizer(["the", "sat", "cat"]))  # other ids
    assert tokenizer_key(first) != tokenizer_key(word_tokenizer(["the", "cat", "sat", "on"]))
    with pytest.raises(TypeError, match="get_vocab"):
        tokenizer_key(object())


def test_load_or_build_caches_on_disk(tmp_path, monkeypatch):
    seed = time.time_ns() % 2**32
    table = torch.randint(0, 50, (50,), generator=torch.Generator().manual_seed(seed))
    builds = []

    def build():
        builds.append(1)
        return table.clone()

    first = load_or_build("abc123", "corpus-test", build, cache_dir=str(tmp_path))
    second = load_or_build("abc123", "corpus-test", build, cache_dir=str(tmp_path))
    assert len(builds) == 1
    assert torch.equal(first, table) and torch.equal(second, table), f"seed={seed}"
    assert [path.name for path in tmp_path.iterdir()] == ["bigram-abc123-corpus-test.pt"]  # no temp left
    load_or_build("abc123", "model-x", build, cache_dir=str(tmp_path))  # another source: another entry
    assert len(builds) == 2
    monkeypatch.setenv("CSD_CACHE_DIR", str(tmp_path / "from-env"))
    load_or_build("abc123", "corpus-test", build)
    assert len(builds) == 3 and (tmp_path / "from-env" / "bigram-abc123-corpus-test.pt").exists()


def test_load_or_build_rejects_bad_names_and_tables(tmp_path):
    with pytest.raises(ValueError, match="letters"):
        load_or_build("a/b", "corpus", lambda: torch.zeros(3, dtype=torch.int64), cache_dir=str(tmp_path))
    with pytest.raises(TypeError, match="int64"):
        load_or_build("key", "corpus", lambda: torch.zeros(3), cache_dir=str(tmp_path))
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
