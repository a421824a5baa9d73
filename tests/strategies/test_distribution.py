"""Every strategy samples exactly the target's distribution, tested with stated power.

Fixture: a target whose next-token laws are peaked (init scale 2.5: the first token here has
probabilities 0.40 / 0.25 / 0.08 / ...), drafters that agree with it often but not always,
and a prompt after which MaG proposes a token both models like (p_target = 0.40,
p_drafter = 0.33), so every path of the rule is taken often (test_every_path_is_taken):
drafts accepted and rejected at the first position, all drafts accepted (bonus token),
lenient acceptance at intermediate levels (with lenience 2 the drafter accepts MaG's first
token with probability 0.65 instead of 0.33).

Power (test_the_tests_have_power): with DRAWS = 20,000 pairs, moving 2 points of probability
between the two most likely first tokens (0.40 and 0.25 at T = 1), or between the two most
likely (first, second) pairs, is detected in >= 90% of 200 simulated runs at the tests'
alpha, for every temperature / filter setting used here (measured: 0.92-1.0). A shift
between two tokens this likely is the hardest to see; fewer draws (8,000) caught it in only
20% of runs.
"""
import pytest
import torch

from csd_engine import Autoregressive, Cascade, Engine, Pearl, Speculative, Staged
from tests.stats import ALPHA, assert_pairs_follow, detection_rate
from tests.strategies.common import DRAWS, joint_first_two, sample_pairs
from tests.tiny_models import perturbed, tiny_llama

PROMPT = [88, 14, 80, 74, 68, 30, 88]  # MaG matches "88" and proposes 14, then 80, 74, ...
BATCH = 5000

CASES = {  # name -> (drafters, strategy, temperature, top_k, top_p)
    "autoregressive-top-k-p": ((), Autoregressive(), 0.8, 6, 0.9),
    "speculative-model": (("d1",), Speculative(k=3), 1.0, 0, 1.0),
    "speculative-mag": (("mag",), Speculative(k=3), 1.0, 0, 1.0),
    # the drafter samples its drafts under the same filters: its q must be the filtered distribution
    "speculative-model-top-k-p": (("d1",), Speculative(k=3), 0.8, 6, 0.9),
    # rows draft 2 tokens at the prior rate; the drafter's top probability is 0.32 at the first and
    # 0.21-0.83 at the second, by the first token drawn: a threshold of 0.3 stops some drafts at 1
    "speculative-auto-t0.7": (("d1",), Speculative.auto(max_tokens=3, model_cost=0.1, min_confidence=0.3),
                              0.7, 0, 1.0),
    "cascade2-l1": (("d1", "mag"), Cascade(k_matrix=[[2, 1], [0, 2]], lenience=1, mag_tokens=2), 1.0, 0, 1.0),
    "cascade2-l2-t0.7": (("d1", "mag"), Cascade(k_matrix=[[2, 1], [0, 2]], lenience=2, mag_tokens=2), 0.7, 0, 1.0),
    "cascade3-l2": (("d1", "d2", "mag"), Cascade(k_matrix=[[2, 1, 1], [0, 2, 1], [0, 0, 2]], lenience=2,
                                                 mag_tokens=2), 1.0, 0, 1.0),
    "cascade3-l3-t0.7": (("d1", "d2", "mag"), Cascade(k_matrix=[[1, 2, 0], [0, 1, 1], [0, 0, 2]], lenience=3,
                                                      mag_tokens=2), 0.7, 0, 1.0),
    "cascade-tree-l2": (("d1", "mag"), Cascade(k_matrix=[[2, 1], [0, 2]], lenience=2, mag_tokens=2, tree=(3, 2)),
                        1.0, 0, 1.0),
    "cascade-auto": (("d1", "mag"), Cascade.auto(), 1.0, 0, 1.0),
    "cascade-auto-tree-t0.7": (("d1", "mag"), Cascade.auto(tree=(3, 2)), 0.7, 0, 1.0),
    # every MaG match goes direct: the target verifies MaG's 4-token copy (wider than K's plan) alone
    "cascade-direct-l2": (("d1", "mag"), Cascade(k_matrix=[[1, 1], [0, 1]], lenience=2, mag_tokens=1,
                                                 direct_match=1, direct_tokens=4), 1.0, 0, 1.0),
    "staged-mag": (("d1", "mag"), Staged(branching=(3, 2), mag_tokens=2), 1.0, 0, 1.0),
    # one level: the drafter's chain (MaG's tokens it accepted) decides the second token
    "staged-mag-chain": (("d1", "mag"), Staged(branching=(3,), mag_tokens=2), 1.0, 0, 1.0),
    "staged-mag-unreviewed-t0.7": (("d1", "mag"), Staged(branching=(3,), mag_tokens=2, mag_review=False), 0.7, 0, 1.0),
    "pearl": (("d1",), Pearl(gamma=3, overlap=True), 1.0, 0, 1.0),
}


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=31, scale=2.5)
    return {"target": target, "d1": perturbed(target, noise=0.25, seed=32),
            "d2": perturbed(target, noise=0.5, seed=33)}


_engines = {}


def engine_for(models, drafters) -> Engine:
    if drafters not in _engines:
        _engines[drafters] = Engine(models["target"], drafters=[models[d] if d != "mag" else "mag" for d in drafters],
                                    max_batch_size=BATCH, max_seq_len=16, verify_backend="torch")
    return _engines[drafters]


@pytest.mark.parametrize("name", CASES)
def test_samples_follow_the_target(models, name):
    drafters, strategy, temperature, top_k, top_p = CASES[name]
    pairs, _ = sample_pairs(engine_for(models, drafters), PROMPT, strategy, temperature, top_k, top_p)
    assert_pairs_follow(pairs, joint_first_two(models["target"], PROMPT, temperature, top_k, top_p))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 6, 0.9)])
def test_the_tests_have_power(models, temperature, top_k, top_p):
    joint = joint_first_two(models["target"], PROMPT, temperature, top_k, top_p)
    for where in ("first", "pair"):
        rate = detection_rate(joint, DRAWS, 0.02, where)
        assert rate >= 0.9, f"a 2-point shift ({where}) is detected in only {rate:.0%} of runs at alpha {ALPHA}"


def test_every_path_is_taken(models):
    """Count what the verification calls of a batched cascade run decide. K = [[1, 0], [0, 2]]:
    each step is one review by the drafter of MaG's two tokens, then the target's check of
    the drafter's token, so the calls alternate review, target. At the target: full
    rejections and accepted drafts (bonus token) are both frequent; at the reviews, lenience
    2 accepts clearly more of MaG's tokens than lenience 1 (the lenient path is taken)."""
    calls = {}
    for lenience in (1, 2):
        engine = Engine(models["target"], drafters=[models["d1"], "mag"], max_batch_size=2000, max_seq_len=16,
                        verify_backend="torch")
        chain, seen = engine.verifier.chain, []

        def counting(logits, drafts, num_drafts, q, *args, chain=chain, seen=seen, **kwargs):
            res = chain(logits, drafts, num_drafts, q, *args, **kwargs)
            offered = num_drafts > 0
            seen.append((res.num_accepted.long()[offered], num_drafts.long()[offered]))
            return res

        engine.verifier.chain = counting
        sample_pairs(engine, PROMPT, Cascade(k_matrix=[[1, 0], [0, 2]], lenience=lenience, mag_tokens=2), 1.0,
                     draws=2000)
        calls[lenience] = (seen[0::2], seen[1::2])  # (reviews, target checks)
    reviews, checks = calls[2]
    n, d = map(torch.cat, zip(*checks))
    assert (n == 0).float().mean() > 0.1, "the target almost never rejects its first draft"
    assert (n == d).float().mean() > 0.1, "the target almost never accepts every draft (no bonus token)"
    lenient = torch.cat([n for n, _ in reviews]).float().mean()
    strict = torch.cat([n for n, _ in calls[1][0]]).float().mean()
    assert lenient > strict + 0.1, f"lenience 2 accepts {lenient:.2f} MaG tokens per review, lenience 1 {strict:.2f}"
