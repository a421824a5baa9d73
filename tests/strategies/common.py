"""Checks every strategy must pass: greedy equal to plain greedy decoding token for token,
and sampled output following the target's own distribution."""
import torch

from csd_engine import Autoregressive, Engine, SamplingParams
from csd_engine.ops import PADDING
from tests.stats import assert_pairs_follow

DRAWS = 20000  # >= 90% power against a 2-point shift (tests/strategies/test_distribution.py)
NON_FINITE_PARAMS = SamplingParams(max_new_tokens=6)


def broken_and_plain(model_factory):
    """(a model whose embedding of token 5 is NaN, the healthy model's tokens for [1, 2, 3]):
    for assert_a_non_finite_request_fails_alone."""
    broken = model_factory()
    with torch.no_grad():
        broken.model.embed_tokens.weight[5] = float("nan")
    plain = Engine(model_factory(), max_batch_size=1, max_seq_len=32).generate([[1, 2, 3]], NON_FINITE_PARAMS)[0]
    return broken, plain.token_ids


def assert_a_non_finite_request_fails_alone(engine: Engine, strategy, plain: list[int]) -> None:
    """Two requests on `engine` over broken_and_plain's model: the one whose prompt holds token 5
    ends with an error and no tokens, the other runs to its length with the healthy model's tokens."""
    with engine.scheduler(strategy) as scheduler:
        good, bad = scheduler.add([1, 2, 3], NON_FINITE_PARAMS), scheduler.add([4, 5, 6], NON_FINITE_PARAMS)
        done = {}
        while scheduler.has_unfinished():
            done.update((out.request_id, out) for out in scheduler.step() if out.finished)
    assert done[bad].finish_reason == "error" and "non-finite logits" in done[bad].error
    assert done[bad].result.token_ids == []
    assert done[bad].result.metrics.wall_time_s > 0  # its time runs to the step that failed it
    assert done[good].result.token_ids == plain and done[good].finish_reason == "length"


def processed_probs(logits, temperature, top_k=0, top_p=1.0):
    """The target's sampling distribution over the last axis, computed independently of the engine."""
    z = logits.double() / temperature
    if top_k:
        z = torch.where(z >= z.topk(top_k, dim=-1).values[..., -1:], z, -torch.inf)
    p = torch.softmax(z, -1)
    if top_p < 1:
        sorted_p, order = p.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each entry
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, before < top_p)
        p = torch.where(keep, p, 0)
    return p / p.sum(-1, keepdim=True)


def joint_first_two(target_model, prompt, temperature, top_k=0, top_p=1.0) -> torch.Tensor:
    """[V, V] exact law of the first two sampled tokens: P(a) P(b | a)."""
    with torch.no_grad():
        first = processed_probs(target_model(torch.tensor([prompt])).logits[0, -1], temperature, top_k, top_p)
        vocab = first.shape[0]
        continued = torch.tensor([prompt + [a] for a in range(vocab)])
        second = processed_probs(target_model(continued).logits[:, -1], temperature, top_k, top_p)
    return first[:, None] * second


def assert_greedy_equals_autoregressive(engine: Engine, prompts, strategy, max_new_tokens=24):
    params = SamplingParams(max_new_tokens=max_new_tokens)
    plain = engine.generate(prompts, params, strategy=Autoregressive())
    fast = engine.generate(prompts, params, strategy=strategy)
    for i, (a, b) in enumerate(zip(plain, fast)):
        assert b.token_ids == a.token_ids, f"row {i}: {strategy} diverged from greedy decoding"
        assert b.finish_reason == a.finish_reason
    return fast


def sample_pairs(engine: Engine, prompt, strategy, temperature=1.0, top_k=0, top_p=1.0, draws=DRAWS):
    """The first two tokens of `draws` seeded requests for `prompt`, generated in batches of
    the engine's max_batch_size. Returns ([draws, 2] tokens, the results)."""
    base = int(torch.randint(0, 2**31, (1,)))
    results = []
    for start in range(0, draws, engine.max_batch_size):
        n = min(engine.max_batch_size, draws - start)
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=2,
                                 seed=base + start + i) for i in range(n)]
        results += engine.generate([prompt] * n, params, strategy=strategy)
    return torch.tensor([r.token_ids[:2] for r in results]), results


def assert_samples_follow_target(engine: Engine, target_model, prompt, strategy, temperature=1.0, top_k=0,
                                 top_p=1.0, draws=None):
    """The first two sampled tokens of `draws` requests (one seed per request; default: one
    batch of the engine's max_batch_size) follow the target: the first token's marginal and
    the joint law of the pair. The tests with stated power are in test_distribution.py."""
    pairs, results = sample_pairs(engine, prompt, strategy, temperature, top_k, top_p, draws or engine.max_batch_size)
    assert_pairs_follow(pairs, joint_first_two(target_model, prompt, temperature, top_k, top_p))
    return results


def check_proposals(engine: Engine) -> list[int]:
    """Wrap the engine's verifier so that every verification asserts: each draft slot (tree
    node) a row fills comes with the distribution its token was drawn from (a probability
    vector giving that token mass; one-hot for deterministic tokens). A lost proposal (zeros)
    makes the check accept the token whatever its probability. Returns a list that collects,
    per verification call with proposals, how many rows filled every slot."""
    full, chain, tree = [], engine.verifier.chain, engine.verifier.tree

    def check(drafts, filled, q):  # filled [B, W]: the slots (nodes) each row's draft uses
        if q is None:
            return
        assert torch.allclose(q.sum(-1)[filled], torch.ones((), dtype=q.dtype)), \
            "a drafted slot's proposal is not a distribution"
        assert (q.gather(2, drafts[:, :, None])[:, :, 0][filled] > 0).all(), \
            "a drafted token has no mass under its own proposal"
        full.append(int(filled.all(1).sum()))

    def checked_chain(logits, drafts, num_drafts, q, *args, **kwargs):
        check(drafts, torch.arange(drafts.shape[1], device=drafts.device)[None, :] < num_drafts[:, None], q)
        return chain(logits, drafts, num_drafts, q, *args, **kwargs)

    def checked_tree(logits, tokens, parents, q, *args, **kwargs):
        check(tokens[:, 1:], parents[:, 1:] != PADDING, None if q is None else q[:, 1:])
        return tree(logits, tokens, parents, q, *args, **kwargs)

    engine.verifier.chain, engine.verifier.tree = checked_chain, checked_tree
    return full
