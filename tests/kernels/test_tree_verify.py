"""tree_verify (Triton) against tree_verify_ref, and both against the target distribution.

* Random trees, greedy and sampling rows in one batch: the kernel must reproduce the
  reference exactly (same counter-based random numbers), and both must equal a float64,
  node-by-node walk written straight from docs/algorithms.md, Token trees.
* Losslessness: over 20000 seeds in one batched call, the first emitted token (depth-1 tree)
  and the first two emitted tokens (depth-2 tree) follow the target's processed distribution.
  The Triton interpreter is too slow for 20000 rows: without a GPU the kernel must equal the
  reference on a few rows of the same trees; on a GPU it also runs the full tests.
"""

import pytest
import torch
import torch.nn.functional as F

from csd_engine.kernels.random import gumbel_ref, uniform_ref
from csd_engine.kernels.tree_verify import TreeVerifyResult, tree_verify, tree_verify_ref
from tests.stats import assert_distribution, fresh_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DRAWS = 20000
LOGIT_SCALE = 3.0  # peaked targets, so that draft tokens are often accepted

# The Triton interpreter turns a runtime loop bound (a 1-element array) into an int: NumPy warns.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Processed distribution of one [V] logits row, straight from the definitions (float64)."""
    z = logits.double() / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.numel():
        keep = z >= z.sort(descending=True).values[top_k - 1]
    if top_p < 1:
        p = torch.where(keep, torch.exp(z - z.max()), 0)
        p = p / p.sum()
        mass_at_or_above = torch.stack([p[z >= v].sum() for v in z])
        keep = keep & (z >= z[keep & (mass_at_or_above >= top_p)].max())
    p = torch.where(keep, torch.exp(z - z.max()), 0)
    return p / p.sum()


def sampling_settings(batch: int, gen: torch.Generator):
    """Per-row temperature (0 = greedy on ~30% of rows), top_k, top_p (on ~30%), seed, offset."""
    greedy = torch.rand(batch, generator=gen) < 0.3
    temperature = torch.where(greedy, 0.0, 0.5 + torch.rand(batch, generator=gen))
    filtered = torch.rand(batch, generator=gen) < 0.3
    top_k = torch.where(filtered & (torch.rand(batch, generator=gen) < 0.5), 5, 0).to(torch.int32)
    top_p = torch.where(filtered, 0.7 + 0.25 * torch.rand(batch, generator=gen), 1.0)
    seed = torch.randint(0, 2**40, (batch,), generator=gen)
    offset = torch.randint(0, 2**20, (batch,), generator=gen)
    return temperature, top_k, top_p, seed, offset


def fixed_settings(rows: int, temperature: float, top_k: int, top_p: float, gen: torch.Generator):
    """The same temperature, top_k, top_p on every row; a random seed and offset per row."""
    return (torch.full((rows,), temperature), torch.full((rows,), top_k, dtype=torch.int32), torch.full((rows,), top_p),
            torch.randint(0, 2**40, (rows,), generator=gen), torch.randint(0, 2**20, (rows,), generator=gen))


def random_parents(nodes: int, real: int, gen: torch.Generator) -> torch.Tensor:
    """A parent array with `real` real nodes, each hung under one of the last three nodes
    (branchy but deep), then padding."""
    parents = torch.full((nodes,), -2, dtype=torch.int64)
    parents[0] = -1
    for i in range(1, real):
        parents[i] = int(torch.randint(max(0, i - 3), i, (), generator=gen))
    return parents


def random_case(batch: int, nodes: int, vocab: int, drawn: bool, gen: torch.Generator):
    """Random trees whose draft tokens are often the target's top candidates at the parent.
    With `drawn`, every node's children share one proposal q (near the target) and are drawn
    from it or copied from the target's top 3; padded nodes' logits and q are NaN so that any
    read of them shows."""
    logits = LOGIT_SCALE * torch.randn(batch, nodes, vocab, generator=gen)
    proposals = torch.softmax(logits + torch.randn(batch, nodes, vocab, generator=gen), dim=-1)
    parents = torch.stack([random_parents(nodes, int(torch.randint(1, nodes + 1, (), generator=gen)), gen)
                           for _ in range(batch)])
    tokens = torch.randint(0, vocab, (batch, nodes), generator=gen)
    draft_probs = torch.zeros(batch, nodes, vocab)
    for b in range(batch):
        for i in range(1, nodes):
            parent = int(parents[b, i])
            if parent < 0:
                logits[b, i] = float("nan")
                draft_probs[b, i] = float("nan")
                continue
            draft_probs[b, i] = proposals[b, parent]
            top3 = logits[b, parent].topk(3).indices
            if torch.rand((), generator=gen) < 0.5:
                tokens[b, i] = top3[int(torch.randint(0, 3, (), generator=gen))]
            elif drawn:
                tokens[b, i] = torch.multinomial(proposals[b, parent], 1, generator=gen)[0]
    return logits, tokens, parents, (draft_probs if drawn else None)


def to_device(*tensors):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors]


def spec_walk(logits, tokens, parents, draft_probs, temperature, top_k, top_p, seed, offset) -> tuple[list[int], int]:
    """docs/algorithms.md, Token trees, on one row, node by node, in float64: (accepted path, emitted
    token). Same random numbers as the kernel: u of the r-th child tried at depth d is
    uniform(seed, offset + d, 0) for r = 0 (the chain verifier's), uniform(seed, offset + d, 1 + V + r)
    after it; the final sample's noise is gumbel(seed, offset + d, 1 + y)."""
    vocab = logits.shape[-1]
    node, path = 0, []
    while True:
        counter = offset + len(path)
        children = [i for i in range(node + 1, len(parents)) if parents[i] == node]
        if temperature == 0:
            best = int(logits[node].argmax())
            matching = [c for c in children if tokens[c] == best]
            if not matching:
                return path, best
            node = matching[0]
            path.append(node)
            continue
        target = target_probs(logits[node], temperature, top_k, top_p)
        residual = target
        accepted = None
        for r, child in enumerate(children):
            token = int(tokens[child])
            u = float(uniform_ref(seed, counter, 0 if r == 0 else 1 + vocab + r))
            q = F.one_hot(torch.tensor(token), vocab).double() if draft_probs is None else draft_probs[child].double()
            if u * q[token] < residual[token]:
                accepted = child
                break
            residual = (residual - q).clamp(min=0)
            if residual.sum() == 0:
                break  # p' vanished: nothing more can be accepted
            residual = residual / residual.sum()
        if accepted is None:
            if residual.sum() == 0:
                residual = target
            noise = gumbel_ref(seed, counter, 1 + torch.arange(vocab)).double()
            return path, int((residual.log() + noise).argmax())
        node = accepted
        path.append(node)


def assert_matches_spec(result: TreeVerifyResult, args, where: str) -> None:
    """Every row's path is a tree path, -1 after it, and equals spec_walk's."""
    logits, tokens, parents, draft_probs, *settings = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    num_accepted, accepted_nodes, next_token = (t.cpu() for t in (result.num_accepted, result.accepted_nodes, result.next_token))
    for b in range(logits.shape[0]):
        depth = int(num_accepted[b])
        path = accepted_nodes[b, :depth].tolist()
        assert (accepted_nodes[b, depth:] == -1).all(), f"row {b}: {accepted_nodes[b]} {where}"
        assert [int(parents[b, node]) for node in path] == ([0] + path)[:-1], f"row {b}: {path} is not a tree path {where}"
        row_settings = [s[b].item() for s in settings]
        row_draft = None if draft_probs is None else draft_probs[b]
        want = spec_walk(logits[b].float(), tokens[b], parents[b], row_draft, *row_settings)
        got = (path, int(next_token[b]))
        assert got == want, f"row {b} settings {row_settings}: got {got}, spec {want} {where}"


def assert_kernel_matches_reference(args, where: str) -> None:
    got = tree_verify(*args)
    want = tree_verify_ref(*args)
    for field in ("num_accepted", "accepted_nodes", "next_token"):
        assert torch.equal(getattr(got, field), getattr(want, field)), f"{field}: {getattr(got, field)} vs {getattr(want, field)} {where}"
    assert got.num_accepted.dtype == torch.int64 and got.accepted_nodes.dtype == got.next_token.dtype == torch.int64
    assert_matches_spec(got, args, where)


@pytest.mark.parametrize("vocab, drawn, dtype", [(64, False, torch.float32), (64, True, torch.float32),
                                                 (300, False, torch.bfloat16), (300, True, torch.float32)])
def test_kernel_matches_reference(vocab, drawn, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 5, (), generator=gen))
    nodes = int(torch.randint(2, 21, (), generator=gen))
    logits, tokens, parents, draft_probs = random_case(batch, nodes, vocab, drawn, gen)
    args = to_device(logits.to(dtype), tokens, parents, draft_probs, *sampling_settings(batch, gen))
    assert_kernel_matches_reference(args, f"(test seed {seed}, B={batch}, N={nodes}, V={vocab}, drawn={drawn})")


def test_vanished_residual_samples_target():
    """A proposal q >= 1 everywhere empties p' at the first rejection (max(0, p' - q) = 0):
    the row must then sample the target p_v itself, with the Gumbel noise of depth 0."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch, vocab = 6, 40
    logits = LOGIT_SCALE * torch.randn(batch, 3, vocab, generator=gen)
    tokens = logits[:, 0].argsort(dim=-1)[:, :3]  # the least likely tokens: rejected all but surely
    parents = torch.tensor([-1, 0, 0]).expand(batch, 3)
    draft_probs = torch.full((batch, 3, vocab), 2.0)
    args = to_device(logits, tokens, parents, draft_probs, *fixed_settings(batch, 1.0, 0, 1.0, gen))
    where = f"(test seed {seed})"
    for verify in (tree_verify, tree_verify_ref):
        result = verify(*args)
        assert (result.num_accepted == 0).all(), where
        assert_matches_spec(result, args, where)


@pytest.mark.parametrize("verify", [tree_verify, tree_verify_ref])
@pytest.mark.parametrize("drawn", [False, True])
def test_a_chain_shaped_tree_walks_as_the_chain_verifier(verify, drawn):
    """One child per depth (padding past each row's draft length): the tree accepts and emits
    what kernels.verify does for that chain at lenience 1 with the same seeds, its first child
    at a depth drawing the chain's uniform. A cascade step is verified as a tree when any row
    wants one, and a row that wants none is such a tree beside it: its tokens must not depend on
    whether a neighbour wanted a tree (a seeded request's tokens on its own)."""
    from csd_engine.kernels.verify import verify_ref
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rows, width, vocab = 64, 4, 64
    logits = LOGIT_SCALE * torch.randn(rows, width + 1, vocab, generator=gen)
    q = torch.softmax(logits[:, :width] + torch.randn(rows, width, vocab, generator=gen), dim=-1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(rows, width)
    num_drafts = torch.randint(0, width + 1, (rows,), generator=gen)
    settings = sampling_settings(rows, gen)
    chain = verify_ref(logits, drafts, num_drafts, q if drawn else None, *settings)
    parents = torch.arange(-1, width).repeat(rows, 1)
    parents[torch.arange(width + 1)[None, :] > num_drafts[:, None]] = -2
    tokens = torch.cat([drafts[:, :1], drafts], dim=1)  # node 0 (the root) is never checked
    draft_probs = torch.cat([q[:, :1], q], dim=1) if drawn else None
    tree = verify(*to_device(logits, tokens, parents, draft_probs, *settings))
    assert chain.num_accepted.tolist() == tree.num_accepted.cpu().tolist(), f"seed {seed}"
    assert chain.next_token.tolist() == tree.next_token.cpu().tolist(), f"seed {seed}"
    sampled = settings[0] > 0
    assert 0 < int((chain.num_accepted[sampled] < num_drafts[sampled]).sum()) < int(sampled.sum()), \
        "every sampled row rejected, or none did: the test saw one outcome only"


def emitted_tokens(result: TreeVerifyResult, tokens: torch.Tensor, count: int) -> torch.Tensor:
    """[B, count] the first `count` tokens a row emits: its accepted draft tokens, then the
    correction / bonus, then -1 for what only a later step emits."""
    batch, nodes = tokens.shape
    path_tokens = tokens.gather(1, result.accepted_nodes.clamp(min=0))
    depth = torch.arange(nodes, device=tokens.device)
    emitted = torch.where(depth < result.num_accepted[:, None], path_tokens, -1)
    emitted = torch.cat([emitted, torch.full_like(emitted[:, :1], -1)], dim=1)
    emitted[torch.arange(batch, device=tokens.device), result.num_accepted.long()] = result.next_token
    return emitted[:, :count]


IMPLEMENTATIONS = [pytest.param(tree_verify_ref, id="reference"),
                   pytest.param(tree_verify, id="kernel", marks=pytest.mark.gpu)]
SETTINGS = [(1.0, 0, 1.0), (0.7, 4, 0.85)]  # (temperature, top_k, top_p)


def depth1_tree(rows: int, vocab: int, mixed: bool, gen: torch.Generator):
    """Deterministic: the drafter's top 3 under the root (draft_probs None), then two padded
    nodes. Mixed: the drafter's top 2 (one-hot q), then three i.i.d. draws from its q."""
    target = LOGIT_SCALE * torch.randn(vocab, generator=gen)
    q = torch.softmax(target + 1.5 * torch.randn(vocab, generator=gen), dim=-1)
    nodes = 6
    logits = target.expand(rows, nodes, vocab).clone()
    logits[:, 1:] = torch.randn(rows, nodes - 1, vocab, generator=gen)  # after a child: irrelevant here
    parents = torch.tensor([-1, 0, 0, 0, 0, 0]).expand(rows, nodes).contiguous()
    tokens = torch.zeros(rows, nodes, dtype=torch.int64)
    if not mixed:
        tokens[:, 1:4] = q.topk(3).indices
        parents[:, 4:] = -2
        return (logits, tokens, parents, None), target
    tokens[:, 1:3] = q.topk(2).indices
    tokens[:, 3:] = torch.multinomial(q, rows * 3, replacement=True, generator=gen).view(rows, 3)
    draft_probs = q.expand(rows, nodes, vocab).clone()
    draft_probs[:, 1:3] = F.one_hot(tokens[:, 1:3], vocab).float()
    return (logits, tokens, parents, draft_probs), target


@pytest.mark.parametrize("verify", IMPLEMENTATIONS)
@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
@pytest.mark.parametrize("mixed", [False, True], ids=["top3", "top2+iid3"])
def test_first_token_follows_target(verify, temperature, top_k, top_p, mixed):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    vocab = 8
    for _ in range(20):  # a case whose one-hot children (the drafter's top 3 or 2) hold enough target mass
        tree, target = depth1_tree(DRAWS, vocab, mixed, gen)
        if target_probs(target, temperature, top_k, top_p)[tree[1][0, 1:3 if mixed else 4]].sum() >= 0.4:
            break
    args = to_device(*tree, *fixed_settings(DRAWS, temperature, top_k, top_p, gen))
    where = f"(test seed {seed})"
    result = verify(*args)
    first = emitted_tokens(result, args[1], 1)[:, 0].cpu()
    assert result.num_accepted.float().mean() > 0.2, f"trees too rarely accepted to test anything {where}"
    try:
        assert_distribution(first, target_probs(target, temperature, top_k, top_p))
    except AssertionError as error:
        raise AssertionError(f"{error} {where}") from None


def depth2_case(rows: int, vocab: int, drawn: bool, gen: torch.Generator):
    """Root -> nodes 1, 2; node 1 -> nodes 3, 4; node 2 -> node 5. The target's logits after
    token y are next_logits[y], so the depth-2 distribution depends on the depth-1 token.
    drawn: children i.i.d. from a drafter q that also depends on the parent's token;
    otherwise the drafter's top 2 (top 1 under node 2), deterministic."""
    root_logits = LOGIT_SCALE * torch.randn(vocab, generator=gen)
    next_logits = LOGIT_SCALE * torch.randn(vocab, vocab, generator=gen)
    root_q = torch.softmax(root_logits + torch.randn(vocab, generator=gen), dim=-1)
    next_q = torch.softmax(next_logits + torch.randn(vocab, vocab, generator=gen), dim=-1)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2]).expand(rows, 6).contiguous()
    tokens = torch.zeros(rows, 6, dtype=torch.int64)
    if drawn:
        tokens[:, 1:3] = torch.multinomial(root_q, rows * 2, replacement=True, generator=gen).view(rows, 2)
    else:
        tokens[:, 1:3] = root_q.topk(2).indices
    for child, parent in ((3, 1), (4, 1), (5, 2)):
        q = next_q[tokens[:, parent]]
        tokens[:, child] = torch.multinomial(q, 1, generator=gen)[:, 0] if drawn else q.topk(1 + (child == 4)).indices[:, -1]
    logits = torch.randn(rows, 6, vocab, generator=gen)  # depth-2 nodes: only their bonus token, not tested
    logits[:, 0] = root_logits
    logits[:, 1:3] = next_logits[tokens[:, 1:3]]
    draft_probs = None
    if drawn:
        draft_probs = torch.stack([root_q.expand(rows, vocab)] * 3 + [next_q[tokens[:, p]] for p in (1, 1, 2)], dim=1)
    return (logits, tokens, parents, draft_probs), (root_logits, next_logits)


@pytest.mark.parametrize("verify", IMPLEMENTATIONS)
@pytest.mark.parametrize("drawn", [False, True], ids=["top-b", "iid"])
def test_first_two_tokens_follow_target(verify, drawn):
    """Joint law of the first two emitted tokens = p_root(y1) * p_y1(y2). A row that accepts
    nothing emits only y1; the next step, a root-only tree after y1, emits its y2."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    vocab, temperature, top_k, top_p = 5, 0.8, 4, 0.95
    for _ in range(20):  # a case whose depth-1 children hold enough of the target's mass to be accepted
        tree, (root_logits, next_logits) = depth2_case(DRAWS, vocab, drawn, gen)
        p1, children = target_probs(root_logits, temperature, top_k, top_p), tree[1][:, 1:3]
        if (p1[children[:, 0]] + p1[children[:, 1]] * (children[:, 1] != children[:, 0])).mean() >= 0.4:
            break
    args = to_device(*tree, *fixed_settings(DRAWS, temperature, top_k, top_p, gen))
    where = f"(test seed {seed})"
    result = verify(*args)
    pair = emitted_tokens(result, args[1], 2)

    pending = (pair[:, 1] < 0).nonzero()[:, 0]  # nothing accepted: y2 comes from the next step
    assert len(pending) < 0.8 * DRAWS, f"trees too rarely accepted to test anything {where}"
    if len(pending):  # (with top-b children covering the target's support, every row accepts)
        y1 = pair[pending, 0]
        root_only = [next_logits.to(DEVICE)[y1][:, None], y1[:, None], torch.full_like(y1[:, None], -1), None]
        temperature_, top_k_, top_p_, seed_, offset_ = (s[pending] for s in args[4:])
        pair[pending, 1] = verify(*root_only, temperature_, top_k_, top_p_, seed_, offset_ + 1).next_token

    joint = target_probs(root_logits, temperature, top_k, top_p)[:, None] * torch.stack(
        [target_probs(next_logits[y], temperature, top_k, top_p) for y in range(vocab)])
    try:
        assert_distribution((pair[:, 0] * vocab + pair[:, 1]).cpu(), joint.flatten())
    except AssertionError as error:
        raise AssertionError(f"{error} {where}") from None


@pytest.mark.parametrize("build", [lambda rows, gen: depth1_tree(rows, 8, False, gen),
                                   lambda rows, gen: depth1_tree(rows, 8, True, gen),
                                   lambda rows, gen: depth2_case(rows, 5, False, gen),
                                   lambda rows, gen: depth2_case(rows, 5, True, gen)],
                         ids=["depth1-top3", "depth1-top2+iid3", "depth2-top-b", "depth2-iid"])
def test_kernel_matches_reference_on_distribution_trees(build):
    """The kernel's side of the distribution tests on CPU: a few rows of the same trees."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rows = 3
    tree, _ = build(rows, gen)
    assert_kernel_matches_reference(to_device(*tree, *fixed_settings(rows, 0.8, 0, 1.0, gen)), f"(test seed {seed})")


def valid_inputs():
    batch, nodes, vocab = 2, 4, 16
    return dict(logits=torch.randn(batch, nodes, vocab), tokens=torch.randint(0, vocab, (batch, nodes)),
                parents=torch.tensor([[-1, 0, 1, 1], [-1, 0, -2, -2]]), draft_probs=None,
                temperature=torch.ones(batch), top_k=torch.zeros(batch, dtype=torch.int32), top_p=torch.ones(batch),
                seed=torch.zeros(batch, dtype=torch.int64), offset=torch.zeros(batch, dtype=torch.int64))


@pytest.mark.parametrize("change, error", [
    (dict(parents=torch.tensor([[-1, 0, 2, 1], [-1, 0, -2, -2]])), ValueError),  # parent == own index
    (dict(parents=torch.tensor([[-1, 0, 1, 3], [-1, 0, -2, -2]])), ValueError),  # parent after the node
    (dict(parents=torch.tensor([[0, 0, 1, 1], [-1, 0, -2, -2]])), ValueError),  # root has a parent
    (dict(parents=torch.tensor([[-1, 0, 1, 1], [-1, -2, 0, -2]])), ValueError),  # padding before a real node
    (dict(tokens=torch.full((2, 4), 16)), ValueError),  # token outside the vocabulary
    (dict(logits=torch.randn(2, 16)), ValueError),
    (dict(tokens=torch.zeros(2, 3, dtype=torch.int64)), ValueError),
    (dict(draft_probs=torch.rand(2, 4, 15)), ValueError),
    (dict(top_p=torch.ones(3)), ValueError),
    (dict(top_p=torch.zeros(2)), ValueError),
    (dict(temperature=-torch.ones(2)), ValueError),
    (dict(tokens=torch.zeros(2, 4)), TypeError),
])
@pytest.mark.parametrize("verify", [tree_verify, tree_verify_ref], ids=["kernel", "reference"])
def test_bad_input_is_rejected(verify, change, error):
    inputs = valid_inputs() | change
    with pytest.raises(error):
        verify(**inputs)
