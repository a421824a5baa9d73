"""Sampling parameters: one per request, validated on construction."""
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from csd_engine.checks import is_integral, is_unicode

MIN_TEMPERATURE = 1e-6  # below it (but for 0, greedy) logits / temperature overflows float32 for large logits
MAX_TOP_K = 2 ** 31 - 1  # the engine keeps top_k as int32 (any top_k >= the vocabulary keeps every token)
MAX_SEED = 2 ** 63 - 1  # and seeds as int64


@dataclass(frozen=True)
class SamplingParams:
    """Frozen, so that it is always what its checks passed: `dataclasses.replace(params, ...)`
    makes a changed copy (checked again). temperature 0 is greedy decoding. top_k 0 and top_p 1.0 switch those filters off.
    seed=None draws a fresh seed for every request (also when one params object serves many);
    the same request with the same seed gives the same tokens whatever else shares the batch.
    stop_token_ids end a request in addition to the model's end-of-sequence tokens (the
    tokenizer's and the generation config's) unless ignore_eos; max_tokens, OpenAI's name, may be
    given instead of max_new_tokens (default 64) and is moved into it (then None). stop: strings
    that end a request, its text cut before the first one (also when a speculative step
    committed tokens past it; the token ids end with the token that completed it). logprobs:
    return each token's log-probability under the target's processed distribution
    (temperature, top-k, top-p; the raw model's for greedy rows)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int | None = None  # 64 unless given (here or as max_tokens)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None  # OpenAI's name for max_new_tokens, moved into it
    stop: tuple[str, ...] | str | None = None
    logprobs: bool = False

    def __post_init__(self):
        if self.max_tokens is not None:
            if self.max_new_tokens is not None and self.max_new_tokens != self.max_tokens:
                raise ValueError(f"max_tokens ({self.max_tokens}) and max_new_tokens ({self.max_new_tokens}) "
                                 "disagree: give one of them")
            self._set(max_new_tokens=self.max_tokens, max_tokens=None)
        if self.max_new_tokens is None:
            self._set(max_new_tokens=64)
        for name, kind, what in (("temperature", (int, float), "a number"), ("top_p", (int, float), "a number"),
                                 ("top_k", int, "an int"), ("max_new_tokens", int, "an int")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise TypeError(f"SamplingParams.{name} must be {what}, got {type(value).__name__}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} (smaller ones "
                             f"overflow float32 when the logits are divided by them), got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, 2**31 - 1] (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None:
            if not is_integral(self.seed) or not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be an int in [0, 2**63 - 1] or None, got {self.seed!r}")
            self._set(seed=int(self.seed))  # a NumPy integer as the int it is
        if self.stop_token_ids is not None:
            ids = _token_ids(self.stop_token_ids)
            if ids is None:
                raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
            self._set(stop_token_ids=ids)
        if self.stop is not None:
            many = isinstance(self.stop, Iterable) and not isinstance(self.stop, (str, bytes, Mapping))
            stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop) if many else None
            if stop is None or not all(isinstance(s, str) and s and is_unicode(s) for s in stop):
                raise ValueError(f"stop must be a non-empty string or a list of them (valid Unicode: no lone "
                                 f"surrogates), got {self.stop!r}")
            self._set(stop=stop)
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams.{name} must be True or False, got {getattr(self, name)!r}")

    def _set(self, **values) -> None:
        """Normalize fields while checking them (the instance is frozen afterwards)."""
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _token_ids(values) -> tuple[int, ...] | None:
    """values as a tuple of ints >= 0 (Python or NumPy ints, not bools or floats), or None."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        return None
    values = list(values)
    if any(isinstance(t, bool) for t in values):
        return None
    try:
        ids = tuple(operator.index(t) for t in values)
    except TypeError:
        return None
    return ids if all(t >= 0 for t in ids) else None
