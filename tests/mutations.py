"""Realistic mistakes the test suite must catch, injected one at a time.

    .venv/bin/python -m tests.mutations            # every mutation against the strategy tests
    .venv/bin/python -m tests.mutations NAME ...   # some of them

Each mutation patches the code for a whole pytest run (tests/conftest.py applies the one named
by CSD_MUTATION before any test module builds an engine); the run must fail. The report says,
per mutation, whether the suite caught it and which tests failed first.
"""
import os
import subprocess
import sys

import torch

TESTS = ["tests/strategies/test_distribution.py", "tests/strategies/test_every_strategy.py"]


def _residual_not_renormalised():
    """The emitted distribution keeps the rejection residual unnormalised:
    e = min(q, l p) + (1 - sum min(q, l p)) * max(0, p - min(q, l p)) (no division by its mass)."""
    from csd_engine.kernels import emitted
    emitted.normalised_residual = lambda residual, fallback: residual


def _raw_distribution_passed_up():
    """An intermediate review passes its reviewer's raw distribution p up as the proposal of the
    tokens it emits, instead of the distribution e they were emitted with."""
    from csd_engine.kernels import emitted, verify

    def raw(logits, draft_tokens, num_drafts, draft_probs, temperature, top_k, top_p, lenience, result, **_):
        return verify.reviewer_probs(logits, temperature, top_k, top_p)

    emitted.emitted_distribution_ref = emitted.emitted_distribution = raw


def _drafter_cache_keeps_a_rejected_token():
    """Rolling a drafter's cache back keeps one slot too many: the first rejected token stays."""
    from csd_engine.models.cache import KVCache

    def rollback(self, lengths):
        torch.minimum(self.lengths, lengths + 1, out=self.lengths)

    KVCache.rollback = rollback


MUTATIONS = {
    "residual-not-renormalised": _residual_not_renormalised,
    "raw-distribution-passed-up": _raw_distribution_passed_up,
    "drafter-cache-keeps-a-rejected-token": _drafter_cache_keeps_a_rejected_token,
}


def apply(name: str) -> None:
    if name not in MUTATIONS:
        raise SystemExit(f"unknown mutation {name!r}; known: {', '.join(MUTATIONS)}")
    MUTATIONS[name]()


def main(names: list[str]) -> int:
    missed = []
    for name in names or MUTATIONS:
        env = dict(os.environ, CSD_MUTATION=name, TRITON_INTERPRET="1")
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                              "--maxfail=3", *TESTS], env=env, capture_output=True, text=True)
        failed = [line.split(" - ")[0] for line in run.stdout.splitlines() if line.startswith("FAILED")]
        caught = run.returncode != 0 and bool(failed)
        print(f"{name}: {'caught' if caught else 'MISSED'}" + (f" by {', '.join(failed)}" if failed else ""),
              flush=True)
        if not caught:
            missed.append(name)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
