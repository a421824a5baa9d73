"""Statistical checks for everything random: sampled tokens against an exact distribution.

The strategy tests compare the first two sampled tokens of many seeded requests with their
exact joint law under the target (`joint_first_two`), by two chi-square tests: the first
token's marginal and the joint over pairs. `detection_rate` is the power check behind the
number of draws: it moves probability in the exact law, samples from the moved law and
counts how often the same tests reject.
"""
import time

import torch

ALPHA = 1e-4  # per test: a correct rule fails a run of the whole suite with ~0.5% chance


def fresh_seed() -> int:
    """A new seed every run, so that repeated runs cover more draws; printed, so that pytest
    shows it with any failure, statistical ones included, to rerun with."""
    seed = time.time_ns() % 2**31
    print(f"seed={seed}")
    return seed


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit of `counts` (observed, one per category) against
    `probs`. The least likely categories are pooled into one, smallest first, until every
    group's expected count reaches `min_expected`, as the test's approximation needs: pooling
    only those under the floor could leave a group expecting 0.03 draws, where one draw alone
    fails the test (a correct rule failed CI 2% of the time that way). Returns the p-value."""
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    probs = probs / probs.sum()
    if (counts[probs == 0] > 0).any():
        return 0.0  # a category with probability zero was observed
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs * counts.sum()
    order = expected.argsort()
    expected, counts = expected[order], counts[order]
    pooled = int((expected < min_expected).sum())
    while 0 < pooled < expected.numel() and expected[:pooled].sum() < min_expected:
        pooled += 1
    if pooled:
        counts = torch.cat([counts[:pooled].sum().reshape(1), counts[pooled:]])
        expected = torch.cat([expected[:pooled].sum().reshape(1), expected[pooled:]])
    dof = expected.numel() - 1
    if dof < 1:
        return 1.0
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def assert_distribution(samples: torch.Tensor, probs: torch.Tensor, alpha: float = ALPHA) -> None:
    """Assert that integer `samples` are draws from `probs` (1-D over the categories)."""
    counts = torch.bincount(samples.flatten().long(), minlength=probs.numel()).to(torch.float64)
    assert counts.numel() == probs.numel(), "a sample fell outside the categories"
    p = chi_square_pvalue(counts, probs)
    tv = 0.5 * (counts / counts.sum() - probs.double() / probs.sum()).abs().sum().item()
    assert p > alpha, f"samples do not follow the distribution: chi-square p={p:.2e}, total variation {tv:.4f}"


def largest_deviation_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0,
                             normal_from: float = 500.0) -> float:
    """p-value of the most surprising category count (Bonferroni over the categories tested).
    Far more powerful than chi-square against probability moved between a few likely
    categories, which a wrong accept/reject rule typically does. Each category's two-sided
    tail: the normal approximation to its binomial count where n p >= normal_from (skew
    1/sqrt(n p) small), the exact Poisson tail below, where the normal one is far too thin
    (20 seen at 5 expected, two-sided: normal 2e-11, Poisson 7e-7) and a correct rule failed the suite."""
    counts, probs = counts.double().flatten(), probs.double().flatten() / probs.sum()
    n = counts.sum()
    expected = probs * n
    tested = expected >= min_expected
    if (counts[probs == 0] > 0).any():
        return 0.0
    z = (counts - expected) / (expected * (1 - probs)).clamp_min(1e-300).sqrt()
    normal = torch.special.erfc(z.abs() / 2 ** 0.5)
    at_least = torch.where(counts > 0, torch.special.gammainc(counts.clamp_min(1), expected), 1.0)  # P(X >= c)
    at_most = torch.special.gammaincc(counts + 1, expected)  # P(X <= c)
    poisson = (2 * torch.minimum(at_least, at_most)).clamp(max=1.0)
    tail = torch.where(expected >= normal_from, normal, poisson)[tested]
    return float(torch.clamp(tail.min() * int(tested.sum()), max=1.0))


def pair_pvalues(pairs: torch.Tensor, joint: torch.Tensor) -> list[float]:
    """p-values of four tests of `pairs` [N, 2] drawn from `joint` [V, V] (joint[a, b] =
    P(first = a, second = b)): chi-square and largest deviation, on the first token's
    marginal and on the pairs."""
    vocab = joint.shape[0]
    cells = torch.bincount(pairs[:, 0].long() * vocab + pairs[:, 1].long(), minlength=vocab * vocab).double()
    first = cells.view(vocab, vocab).sum(1)
    return [test(observed, law) for observed, law in ((first, joint.sum(1)), (cells, joint.flatten()))
            for test in (chi_square_pvalue, largest_deviation_pvalue)]


def assert_pairs_follow(pairs: torch.Tensor, joint: torch.Tensor, alpha: float = ALPHA) -> None:
    """Each of pair_pvalues' four tests at alpha / 4."""
    names = ("first token, chi-square", "first token, largest deviation", "pairs, chi-square",
             "pairs, largest deviation")
    for name, p in zip(names, pair_pvalues(pairs, joint)):
        assert p > alpha / 4, f"sampled tokens do not follow the target ({name}): p={p:.2e}"


def moved(joint: torch.Tensor, points: float, where: str) -> torch.Tensor:
    """The joint law with `points` of probability moved from the most likely to the second most
    likely first token (where="first": each pair of a first token scales with it) or between
    the two most likely pairs (where="pair")."""
    joint = joint.double().clone()
    if where == "first":
        first = joint.sum(1)
        a, b = first.topk(2).indices.tolist()
        joint[a] *= (first[a] - points) / first[a]
        joint[b] *= (first[b] + points) / first[b]
    else:
        a, b = joint.flatten().topk(2).indices.tolist()
        flat = joint.view(-1)
        flat[a] -= points
        flat[b] += points
    return joint


def detection_rate(joint: torch.Tensor, draws: int, points: float, where: str, trials: int = 200,
                   alpha: float = ALPHA, seed: int = 0) -> float:
    """How often `assert_pairs_follow` rejects `draws` pairs sampled from the moved law."""
    law = moved(joint, points, where).flatten()
    g = torch.Generator().manual_seed(seed)
    vocab = joint.shape[0]
    hits = 0
    for _ in range(trials):
        cells = torch.multinomial(law.float(), draws, replacement=True, generator=g)
        pairs = torch.stack([cells // vocab, cells % vocab], 1)
        hits += min(pair_pvalues(pairs, joint)) <= alpha / 4
    return hits / trials
