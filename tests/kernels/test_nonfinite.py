"""The non-finite flag kernel (kernels/nonfinite.py) against its PyTorch reference: NaN, +inf
and -inf at chosen rows, positions and vocabulary blocks (the last, partial block included),
bf16 and strided logits, flags that were already set staying set."""
import pytest
import torch

from csd_engine.kernels.nonfinite import flag_nonfinite, flag_nonfinite_ref
from tests.kernels.test_verify import DEVICE
from tests.stats import fresh_seed


@pytest.mark.parametrize("batch, n, vocab, dtype", [(1, 1, 50, torch.float32), (6, 5, 9000, torch.float32),
                                                    (4, 3, 4097, torch.bfloat16)])
def test_kernel_equals_reference(batch, n, vocab, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, n, vocab, generator=gen) * 30).to(dtype)
    bad = [(b, int(torch.randint(0, n, (), generator=gen)), int(torch.randint(0, vocab, (), generator=gen)))
           for b in range(1, batch, 2)]
    for (b, j, v), value in zip(bad, [float("nan"), float("inf"), float("-inf")] * batch):
        logits[b, j, v] = value
    if batch > 1:
        logits[batch - 1, n - 1, vocab - 1] = float("nan")  # the last entry of the last, partial block
    logits = logits.to(DEVICE)
    before = torch.zeros(batch, dtype=torch.bool, device=DEVICE)
    before[0] = True  # set by an earlier forward: stays set
    want = before.clone()
    flag_nonfinite_ref(logits, want)
    got = before.clone()
    flag_nonfinite(logits, got)
    assert torch.equal(got, want), f"seed={seed}"
    expected = {0} | {b for b, _, _ in bad} | ({batch - 1} if batch > 1 else set())
    assert set(torch.nonzero(got).flatten().tolist()) == expected, f"seed={seed}"


def test_strided_logits_and_bad_flags():
    wide = torch.randn(3, 4, 200, device=DEVICE)
    wide[2, 0, 7] = float("inf")  # outside the view
    wide[1, 3, 150] = float("nan")
    flags = torch.zeros(3, dtype=torch.bool, device=DEVICE)
    flag_nonfinite(wide[:, 1:, :], flags)
    assert flags.tolist() == [False, True, False]
    flag_nonfinite(wide.transpose(1, 2).contiguous().transpose(1, 2), flags)  # no unit stride over V
    assert flags.tolist() == [False, True, True]
    with pytest.raises(ValueError, match="flags \\[B\\] bool"):
        flag_nonfinite(wide, flags.int())


def test_only_the_positions_used_are_checked():
    """positions / counts: a row is flagged by its logits at positions[b, j] for j < counts[b]
    alone (the target's emitted tokens'), kernel and reference alike."""
    logits = torch.randn(4, 5, 300, device=DEVICE)
    logits[0, 3, 10] = float("nan")  # past row 0's count: not used
    logits[1, 1, 299] = float("inf")  # used by row 1
    logits[2, 4, 0] = float("-inf")  # on row 2's path (position 4), past its count otherwise
    logits[3, 0, 5] = float("nan")  # position 0: always used
    positions = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 4, 3, 1], [0, 4, 4, 4]], device=DEVICE)
    counts = torch.tensor([3, 2, 2, 1], device=DEVICE)
    for flag in (flag_nonfinite, flag_nonfinite_ref):
        flags = torch.zeros(4, dtype=torch.bool, device=DEVICE)
        flag(logits, flags, counts=counts)
        assert flags.tolist() == [False, True, False, True], flag.__name__
        flags.zero_()
        flag(logits, flags, positions, counts)
        assert flags.tolist() == [False, True, True, True], flag.__name__
