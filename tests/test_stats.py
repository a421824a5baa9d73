"""The statistics every random path is judged by: a correct law must pass them (at the rate
their alpha promises), a wrong one must fail them."""
import torch

from tests.stats import ALPHA, chi_square_pvalue

# A verified first token's law from a CI failure: one category expects 0.025 of 20000 draws.
LAW = torch.tensor([2.8675e-03, 1.4513e-02, 4.8131e-03, 1.3514e-03, 1.4948e-02, 7.5569e-01, 4.5658e-02,
                    2.3489e-02, 1.2595e-06, 3.3515e-03, 1.2080e-01, 1.2520e-02], dtype=torch.float64)
DRAWS = 20000


def test_one_draw_of_a_rare_category_does_not_fail_a_correct_law():
    counts = (LAW / LAW.sum() * DRAWS).round()
    counts[8] = 1  # expected 0.025: happens in 2.5% of correct runs
    assert chi_square_pvalue(counts, LAW) > ALPHA


def test_chi_square_rejects_a_correct_law_at_about_its_alpha():
    g = torch.Generator().manual_seed(0)
    trials, alpha = 2000, 0.01
    rejected = sum(chi_square_pvalue(torch.bincount(torch.multinomial(LAW.float(), DRAWS, True, generator=g),
                                                    minlength=LAW.numel()), LAW) <= alpha
                   for _ in range(trials))
    assert rejected / trials < 2 * alpha  # pooling only the categories under the floor: 3.5%


def test_chi_square_rejects_a_wrong_law_and_a_draw_of_an_impossible_category():
    counts = (LAW / LAW.sum() * DRAWS).round()
    moved = counts.clone()
    moved[5] -= 300  # 1.5 points of probability moved between the two likeliest categories
    moved[10] += 300
    assert chi_square_pvalue(moved, LAW) < ALPHA
    impossible = LAW.clone()
    impossible[8] = 0
    assert chi_square_pvalue(counts + torch.nn.functional.one_hot(torch.tensor(8), 12), impossible) == 0.0
