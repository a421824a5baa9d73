"""The emitted-distribution kernel (kernels/emitted.py) against its PyTorch reference: ragged
drafts, greedy and sampling rows, top-k / top-p, lenience 1 and > 1 (a float and per row),
with and without draft distributions, several vocabulary blocks, bf16 logits, a strided view
of wider logits (what a cascade review passes), and residuals that vanish. Its sums run in
another order than torch's, so values agree to rounding, not bit for bit."""
import pytest
import torch

from csd_engine.kernels.emitted import emitted_distribution, emitted_distribution_ref
from csd_engine.kernels.verify import verify_ref
from tests.kernels.test_verify import DEVICE, random_batch
from tests.stats import fresh_seed

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _both(inputs: dict, lenience):
    result = verify_ref(**inputs, lenience=lenience)
    args = {name: value for name, value in inputs.items() if name not in ("seed", "offset")}
    return (emitted_distribution(**args, lenience=lenience, result=result),
            emitted_distribution_ref(**args, lenience=lenience, result=result), result)


@pytest.mark.parametrize("batch, k, vocab, with_draft_probs, lenience, dtype", [
    (5, 0, 50, False, 1.0, torch.float32),
    (6, 3, 300, True, 1.0, torch.float32),
    (6, 3, 300, False, 2.5, torch.float32),
    (4, 2, 5000, True, 3.0, torch.bfloat16),  # three vocabulary blocks
    (3, 4, 4100, False, "per row", torch.float32),
])
def test_kernel_equals_reference(batch, k, vocab, with_draft_probs, lenience, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    inputs = random_batch(gen, batch, k, vocab, with_draft_probs, dtype)
    if lenience == "per row":
        lenience = (1 + 3 * torch.rand(batch, generator=gen)).to(DEVICE)
    got, want, result = _both(inputs, lenience)
    assert got.shape == want.shape == (batch, k + 1, vocab) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"seed={seed}")
    rows = torch.arange(k + 1, device=DEVICE) <= result.num_accepted[:, None]
    assert torch.allclose(got.sum(-1)[rows], torch.ones(()), atol=1e-4), f"seed={seed}: not a distribution"
    assert not got[~rows].any(), f"seed={seed}: entries past num_accepted"


def test_strided_logits():
    """Logits as a slice of a wider forward's output (row and position strides of the wide
    tensor), drafts from a q equal to p up to rounding (lenience 1: a residual of rounding)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    inputs = random_batch(gen, 4, 3, 700, True)
    wide = torch.randn(4, 7, 700, generator=gen).to(DEVICE)
    wide[:, 2:6] = inputs["logits"]
    inputs["logits"] = wide[:, 2:6]
    inputs["temperature"] = torch.full((4,), 0.9, device=DEVICE)
    inputs["top_k"] = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    inputs["top_p"] = torch.ones(4, device=DEVICE)
    inputs["draft_probs"] = torch.softmax(inputs["logits"][:, :3].float() / 0.9, -1)
    got, want, result = _both(inputs, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"seed={seed}")


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_vanished_residuals_fall_back_to_p(with_draft_probs):
    """Top-k 1 makes p one-hot at the argmax; drafts of that token leave no residual at all
    (sum r = 0 exactly), where e is min(q, l p) + (1 - sum min(q, l p)) p: no 0 / 0."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    inputs = random_batch(gen, 3, 2, 300, with_draft_probs)
    inputs["temperature"] = torch.full((3,), 0.7, device=DEVICE)
    inputs["top_k"] = torch.ones(3, dtype=torch.int32, device=DEVICE)
    inputs["draft_tokens"] = inputs["logits"][:, :2].argmax(-1)
    if with_draft_probs:
        inputs["draft_probs"] = torch.nn.functional.one_hot(inputs["draft_tokens"], 300).float()
    for lenience in (1.0, 2.0):
        got, want, result = _both(inputs, lenience)
        assert (result.num_accepted == inputs["num_drafts"]).all()
        assert not got.isnan().any(), f"seed={seed}"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"seed={seed}")
