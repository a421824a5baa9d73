"""The bigram table MaG falls back on (docs/algorithms.md, MaG, step 4).

A `BigramTable`: `next_token[a]` is the most likely token after `a` ([vocab_size] int64)
and `prob[a]` its probability ([vocab_size] float32), which MaG compares with its
confidence threshold. It is built from a corpus tokenized with the models' tokenizer (the
paper used Wikipedia) or from a model's own greedy next token for every vocabulary entry,
and cached on disk under a key derived from the tokenizer's vocabulary, so that two
tokenizers never share a table.
"""
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

import torch

PAIR_CHUNK = 1 << 24  # tokens counted at once: memory stays ~ distinct pairs + this
TEXT_CHUNK_CHARS = 1 << 20  # characters handed to the tokenizer per call
CACHE_VERSION = 2  # in the cached file's name: a table of another layout is rebuilt, never misread


class BigramTable(NamedTuple):
    """next_token [V] int64: most likely successor of each token; prob [V] float32: its
    probability (0 where nothing is known). `MaG(*table)` takes both."""
    next_token: torch.Tensor
    prob: torch.Tensor

    def check(self) -> "BigramTable":
        if (not isinstance(self.next_token, torch.Tensor) or self.next_token.dtype != torch.int64
                or self.next_token.dim() != 1):
            raise TypeError("a bigram table's next_token must be a 1-D int64 tensor [vocab_size]")
        if (not isinstance(self.prob, torch.Tensor) or self.prob.dtype != torch.float32
                or self.prob.shape != self.next_token.shape):
            raise TypeError(f"a bigram table's prob must be a float32 tensor shaped like next_token "
                            f"{tuple(self.next_token.shape)}")
        return self


def _corpus_sequences(token_ids) -> Iterable[torch.Tensor]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype != torch.int64 or token_ids.dim() not in (1, 2):
            raise TypeError("a corpus tensor must be int64 [N] (one sequence) or [rows, N], "
                            f"got {token_ids.dtype} with {token_ids.dim()} dims")
        return [token_ids] if token_ids.dim() == 1 else token_ids
    return (torch.as_tensor(sequence, dtype=torch.int64) for sequence in token_ids)


def _corpus_batches(token_ids, vocab_size: int) -> Iterable[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Lists of (tokens, pair keys `a * vocab_size + b`) covering about PAIR_CHUNK tokens
    each; every token, and every pair of neighbours within a sequence, comes exactly once."""
    batch, size = [], 0
    for sequence in _corpus_sequences(token_ids):
        if sequence.numel() and (sequence.min() < 0 or sequence.max() >= vocab_size):
            raise ValueError(f"corpus token ids must lie in [0, {vocab_size}), got "
                             f"[{sequence.min().item()}, {sequence.max().item()}]")
        for start in range(0, sequence.numel(), PAIR_CHUNK):
            window = sequence[start:start + PAIR_CHUNK + 1]  # one token more: the last pair
            batch.append((window[:PAIR_CHUNK], window[:-1] * vocab_size + window[1:]))
            size += window.numel()
            if size >= PAIR_CHUNK:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _add_pair_counts(keys: torch.Tensor, counts: torch.Tensor,
                     new_keys: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a chunk of pair keys into the sorted distinct keys and their counts."""
    merged, slot = torch.unique(torch.cat([keys, *new_keys]), return_inverse=True)
    added = torch.ones(slot.numel() - keys.numel(), dtype=torch.int64)
    totals = torch.zeros(merged.numel(), dtype=torch.int64).index_add_(0, slot, torch.cat([counts, added]))
    return merged, totals


def bigram_from_corpus(token_ids: Iterable[Sequence[int]] | torch.Tensor, vocab_size: int) -> BigramTable:
    """next_token[a] = the most frequent successor of `a` in the corpus, prob[a] =
    count(a, next_token[a]) / count(a, any token).

    token_ids: sequences of token ids (pairs never cross from one sequence to the next), or
    an int64 tensor [N] (one sequence) or [rows, N]. Ties go to the smallest token id;
    tokens never seen followed by anything map to the corpus's most frequent token with
    probability 0.
    Counting is vectorised over pair keys `a * vocab_size + b`, deduplicated with
    torch.unique (a dense vocab_size^2 count table would not fit for real vocabularies).
    """
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    unigram = torch.zeros(vocab_size, dtype=torch.int64)
    keys = counts = torch.empty(0, dtype=torch.int64)
    for batch in _corpus_batches(token_ids, vocab_size):
        tokens, pairs = zip(*batch)
        unigram += torch.bincount(torch.cat(tokens), minlength=vocab_size)
        keys, counts = _add_pair_counts(keys, counts, pairs)
    if unigram.sum() == 0:
        raise ValueError("the corpus has no tokens")
    # One amax per predecessor picks the highest count, then the smallest successor:
    # score = count * V + (V - 1 - successor).
    predecessor, successor = keys // vocab_size, keys % vocab_size
    best = torch.full((vocab_size,), -1, dtype=torch.int64)
    best.scatter_reduce_(0, predecessor, counts * vocab_size + (vocab_size - 1 - successor), reduce="amax")
    followed = torch.zeros(vocab_size, dtype=torch.int64).index_add_(0, predecessor, counts)  # count(a, any)
    prob = (best.clamp(min=0) // vocab_size).double() / followed.clamp(min=1)
    return BigramTable(torch.where(best >= 0, vocab_size - 1 - best % vocab_size, unigram.argmax()),
                       prob.float())


def bigram_from_model(logits_fn: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                      batch_size: int = 256) -> BigramTable:
    """next_token[a] = the model's greedy next token after `a` alone, prob[a] = the model's
    probability of it (softmax in float32; ties go to the smallest token id).

    logits_fn(tokens [N] int64, on the CPU) -> next-token logits [N, vocab_size] (any device,
    any floating dtype) is called on consecutive batches of at most `batch_size` vocabulary
    entries.
    """
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    table = BigramTable(torch.empty(vocab_size, dtype=torch.int64), torch.empty(vocab_size, dtype=torch.float32))
    for start in range(0, vocab_size, batch_size):
        tokens = torch.arange(start, min(start + batch_size, vocab_size), dtype=torch.int64)
        logits = logits_fn(tokens)
        if (not isinstance(logits, torch.Tensor) or not logits.is_floating_point()
                or logits.shape != (tokens.numel(), vocab_size)):
            raise ValueError(f"logits_fn must return floating-point logits of shape {(tokens.numel(), vocab_size)}, "
                             f"got {getattr(logits, 'dtype', type(logits).__name__)} {tuple(getattr(logits, 'shape', ()))}")
        prob, following = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        table.next_token[start:start + tokens.numel()] = following.cpu()
        table.prob[start:start + tokens.numel()] = prob.cpu()
    return table


def tokenizer_key(tokenizer) -> str:
    """Stable hex key of a tokenizer: sha256 of its class name and sorted vocabulary."""
    if not callable(getattr(tokenizer, "get_vocab", None)):
        raise TypeError(f"tokenizer must have get_vocab() (a transformers or tokenizers tokenizer), "
                        f"got {type(tokenizer).__name__}")
    payload = json.dumps([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())])
    return hashlib.sha256(payload.encode()).hexdigest()


def _check_file_name_part(name: str, value) -> None:
    if not isinstance(value, str) or not value or not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(f"{name} names a cache file: it must be a non-empty string of letters, "
                         f"digits, '-', '_' and '.', got {value!r}")


def load_or_build(key: str, source: str, build: Callable[[], BigramTable],
                  cache_dir: str | None = None) -> BigramTable:
    """The table cached at `cache_dir/bigram-v2-{key}-{source}.pt`, built and saved if missing.

    key: usually `tokenizer_key(tokenizer)`; source: what the table was built from (e.g.
    "corpus-wiki" or "model-qwen2.5-0.5b"), chosen by the caller. cache_dir defaults to
    $CSD_CACHE_DIR, else ~/.cache/csd_engine. The file (a dict of the table's tensors) is
    written to a temporary name and renamed, so a reader never sees half a table.
    """
    _check_file_name_part("key", key)
    _check_file_name_part("source", source)
    directory = Path(cache_dir or os.environ.get("CSD_CACHE_DIR") or Path.home() / ".cache" / "csd_engine")
    path = directory / f"bigram-v{CACHE_VERSION}-{key}-{source}.pt"
    if path.exists():
        return BigramTable(**torch.load(path, weights_only=True)).check()
    table = build()
    if not isinstance(table, BigramTable):
        raise TypeError(f"build() must return a BigramTable, got {type(table).__name__}")
    table.check()
    directory.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(table._asdict(), file)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return table


def _text_chunks(paths: Iterable[str | os.PathLike], max_chars: int | None) -> Iterable[str]:
    """About TEXT_CHUNK_CHARS characters at a time, each finished to the end of its line
    so that no word is cut in two; at most max_chars characters in all."""
    budget = sys.maxsize if max_chars is None else max_chars
    for path in paths:
        with open(path, encoding="utf-8") as file:
            while budget > 0:
                chunk = file.read(min(TEXT_CHUNK_CHARS, budget))
                if not chunk:
                    break
                chunk += file.readline()[:budget - len(chunk)]
                budget -= len(chunk)
                yield chunk


def corpus_from_files(paths: Iterable[str | os.PathLike] | str | os.PathLike, tokenizer,
                      max_chars: int | None = None) -> torch.Tensor:
    """1-D int64 token ids of UTF-8 text files, read in order and concatenated.

    tokenizer: a transformers tokenizer, applied without special tokens to chunks of text
    that end at line ends (so ids can differ from tokenizing the whole text at once only
    where a token would span a chunk's final newline). max_chars caps the characters read.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if max_chars is not None and (not isinstance(max_chars, int) or max_chars < 0):
        raise ValueError(f"max_chars must be None or a non-negative int, got {max_chars!r}")
    ids = [torch.as_tensor(tokenizer.encode(chunk, add_special_tokens=False), dtype=torch.int64)
           for chunk in _text_chunks(paths, max_chars)]
    return torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64)
