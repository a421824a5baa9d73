"""Statistical checks for everything random: sampled tokens against an exact distribution."""
import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit of `counts` (observed, one per category) against
    `probs`. Categories whose expected count is below `min_expected` are pooled into one, as
    the test's approximation needs. Returns the p-value."""
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    probs = probs / probs.sum()
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return 0.0  # a category with probability zero was observed
    obs, exp = obs[keep], exp[keep]
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def assert_distribution(samples: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-4) -> None:
    """Assert that integer `samples` are draws from `probs` (1-D over the categories)."""
    counts = torch.bincount(samples.flatten().long(), minlength=probs.numel()).to(torch.float64)
    assert counts.numel() == probs.numel(), "a sample fell outside the categories"
    p = chi_square_pvalue(counts, probs)
    tv = 0.5 * (counts / counts.sum() - probs.double() / probs.sum()).abs().sum().item()
    assert p > alpha, f"samples do not follow the distribution: chi-square p={p:.2e}, total variation {tv:.4f}"
