"""What the self-tuning strategies (Speculative.auto(), Cascade.auto()) price their drafts with:
what a forward costs by its width on this platform and a drafter's forward relative to the
target's. The choice itself, from counted acceptance rates, is kernels/draft_budget.py.

Costs are in target forwards of one token (of as many rows as the step has: `prices`). Nothing
here is timed: a seeded request gives the same tokens however often it runs, and whatever shares
its batch where each row chooses from its own counts alone (one row, a GPU, batch_invariant=True).
"""
import torch

from csd_engine import ops
from csd_engine.checks import is_number
from csd_engine.kernels.draft_budget import Prices
from csd_engine.models.quant import TORCH_CPU_PACKED_SLOWDOWN, on_torch_cpu_ops, parse_scheme
from csd_engine.strategies.base import Models


def check_pricing(owner: str, prior, prior_rate, model_cost, width_cost) -> None:
    """The pricing settings Speculative.auto() and Cascade.auto() share; `owner` names the
    strategy in the error."""
    if not is_number(prior) or not prior > 0:
        raise ValueError(f"{owner}(prior=...) must be a number > 0 (drafts' worth), got {prior!r}")
    if not is_number(prior_rate) or not 0 <= prior_rate < 1:
        raise ValueError(f"{owner}(prior_rate=...) must be a number in [0, 1), got {prior_rate!r}")
    for name, value in (("model_cost", model_cost), ("width_cost", width_cost)):
        if value is not None and (not is_number(value) or not 0 <= value < float("inf")):
            raise ValueError(f"{owner}({name}=...) must be a number >= 0 (relative to one target forward) or None "
                             f"(the platform's default), got {value!r}")


# A forward's cost by width (tokens fed) relative to a one-token forward where a bf16 target runs
# on csd_engine's CPU kernel (no native bf16): the Qwen 1.5B's forwards on a 2-core AVX2 EPYC,
# the mean of two interleaved runs (bench/measured/forward-cost-qwen-bf16-int8-interleaved-avx2-cpu-2026-11-26*.json;
# 2 tokens measured 0.98x, kept at 1). Flat while streaming the weights dominates (to 4 tokens),
# then compute-bound; the step at 7 is where the kernel splits x's rows into two tiles (6 + 1 -> 4 + 3).
KERNEL_WIDTH_COSTS = ((1, 1.0), (2, 1.0), (3, 1.07), (4, 1.13), (5, 1.36), (6, 1.48), (7, 1.85), (8, 1.95),
                      (9, 2.19), (11, 2.66), (13, 2.95), (17, 3.87))
# The same where the kernel runs on a CPU with native bf16 (its AVX-512 tiles, faster than torch's
# oneDNN path there): the Qwen 1.5B on a 2-core AVX-512 EPYC, 300 tokens of context, median of 3
# (bench/measured/forward-cost-qwen-bf16-avx512-kernel-cpu-2026-11-27.json; 2 tokens measured 1.14x,
# min 1.11x, kept at 3's). A one-token forward is half of oneDNN's there, wide ones cost the same.
# Past 17 rows torch's matmul takes over (ops.NATIVE_BF16_KERNEL_MAX_ROWS), which the points from
# 24 on price (the target's rows of DRAFTER_ROW_COSTS's run): a step of several rows is that wide.
AVX512_KERNEL_WIDTH_COSTS = ((1, 1.0), (2, 1.1), (3, 1.1), (5, 1.12), (7, 1.49), (9, 1.65), (11, 1.85),
                             (13, 2.24), (17, 2.68), (24, 3.3), (32, 3.75), (48, 4.85), (64, 6.57))
# The same on a CPU with AMX, where the kernel's one-token forward is 0.56x torch's (oneDNN's AMX
# tiles, flat to 13 tokens) but its wide ones cost more: the Qwen 1.5B on a 2-core Sapphire Rapids
# Xeon, 300 tokens of context, median of 5 (bench/measured/forward-cost-qwen-bf16-amx-kernel-vs-torch-cpu-2026-12-01.json)
# averaged with an ad hoc interleaved run of the same widths (docs/measurements.md).
AMX_KERNEL_WIDTH_COSTS = ((1, 1.0), (2, 1.09), (3, 1.16), (4, 1.22), (5, 1.36), (7, 2.02), (9, 2.17), (13, 3.28),
                          (17, 3.61))
# The same where the kernel runs AMX's bf16 tiles (csrc/bf16_linear.cpp's matmul_amx; the two
# curves above are its FMA tiles): the Qwen 1.5B on a 2-core Sapphire Rapids Xeon, 300 tokens of
# context, median of 5 (bench/measured/forward-cost-qwen-bf16-amx-tiles-cpu-2026-12-06.json). A
# call's matmuls cost about what one row's do up to 16 rows; what grows is the rest of the forward,
# and at 17 a second tile of rows.
AMX_TILE_WIDTH_COSTS = ((1, 1.0), (2, 1.02), (3, 1.03), (5, 1.15), (7, 1.26), (9, 1.28), (13, 1.34), (17, 1.73))

# A float32 target on the CPU whose weights stream from memory (torch's matmuls: a one-token forward
# takes the matrix-vector path, every wider one the matrix-matrix path, which costs about twice as
# much at any width up to 17): the Qwen 1.5B on a 2-core AVX-512 EPYC, 300 tokens of context,
# median of 3, 2026-12-01 (bench/measured/forward-cost-qwen-1.5b-float32-cpu-2026-12-01.json).
FLOAT32_CPU_WIDTH_COSTS = ((1, 1.0), (2, 2.15), (3, 3.04), (4, 2.09), (5, 2.24), (7, 2.98), (9, 2.64), (13, 2.44),
                           (17, 2.71))
# A quantized drafter's forward of n rows relative to the price of its one-row forward that
# cost_ratio gives it (its bytes' share of the target's one-row forward), by weight bits: the Qwen
# 0.5B with int4 / int8 weights (csd_engine's kernels to 17 rows, then its dense copies on torch's
# matmul) against the 1.5B's one-row 63.9 ms, on a 2-core AVX-512 EPYC, 300 tokens of context,
# median of 5 (bench/measured/forward-cost-qwen-bf16-int4-int8-to-64-rows-avx512-cpu-2026-12-06.json).
# Above 1 at one row: unpacking the weights costs more than streaming their bytes (the self-tuning
# strategies keep the bytes' price there, what they were tuned with at one row).
DRAFTER_ROW_COSTS = {  # by weight bits
    4: ((1, 1.74), (2, 2.15), (3, 2.39), (4, 3.17), (6, 4.1), (8, 5.58), (12, 7.53), (16, 9.88), (17, 10.77),
        (18, 14.04), (24, 15.02), (32, 17.54), (48, 23.19), (64, 26.87)),
    8: ((1, 1.13), (2, 1.12), (3, 1.32), (4, 1.57), (6, 2.03), (8, 2.85), (12, 3.61), (16, 4.98), (17, 5.75),
        (18, 7.28), (24, 7.88), (32, 9.39), (48, 12.1), (64, 15.03)),
}
# Weights past any CPU's last-level cache, which every forward streams from memory: below it (a
# model of a few MB) a wide forward costs about what a one-token one does.
STREAMED_WEIGHT_BYTES = 256 << 20


def on_bf16_kernel(models: Models) -> bool:
    """The target's bf16 forwards run on csd_engine's CPU kernel on a CPU without native bf16 (where
    KERNEL_WIDTH_COSTS and the parameter price were measured)."""
    return (models.device.type == "cpu" and getattr(models.target, "dtype", None) == torch.bfloat16
            and ops.kernel_without_native_bf16())


def on_kernel_with_native_bf16(models: Models) -> bool:
    """The target's bf16 forwards run on csd_engine's CPU kernel on a CPU with native bf16."""
    return (models.device.type == "cpu" and getattr(models.target, "dtype", None) == torch.bfloat16
            and ops.bf16_kernel_pays() and not ops.kernel_without_native_bf16())


def target_curve(models: Models) -> tuple | None:
    """The platform's measured (width, cost) points for the target's forwards (the constants above),
    or None where none applies (a GPU, a target of a few MB, torch's bf16 matmul)."""
    float32_cpu = (models.device.type == "cpu" and getattr(models.target, "dtype", None) == torch.float32
                   and (getattr(models.target, "weight_bytes", None) or 0) >= STREAMED_WEIGHT_BYTES)
    native_bf16_curve = AMX_TILE_WIDTH_COSTS if ops.bf16_kernel_on_amx() else \
        AMX_KERNEL_WIDTH_COSTS if torch.cpu._is_amx_tile_supported() else AVX512_KERNEL_WIDTH_COSTS
    return KERNEL_WIDTH_COSTS if on_bf16_kernel(models) else \
        native_bf16_curve if on_kernel_with_native_bf16(models) else \
        FLOAT32_CPU_WIDTH_COSTS if float32_cpu else None


def _on_curve(curve: tuple, w: torch.Tensor) -> torch.Tensor:
    """The curve at w (float64), interpolated between its points, extended at its last slope."""
    x, y = (torch.tensor(v, dtype=torch.float64) for v in zip(*curve))
    i = (torch.searchsorted(x, w, right=True) - 1).clamp(0, len(x) - 2)
    return y[i] + (w - x[i]) * (y[i + 1] - y[i]) / (x[i + 1] - x[i])


def width_costs(models: Models, width_cost: float | None, n: int) -> torch.Tensor:
    """[n + 1] float32 on the models' device: a forward over w tokens relative to a one-token
    forward, for w = 0..n (0 costs as 1). 1 + width_cost (w - 1) where width_cost is given; else
    the platform's: KERNEL_WIDTH_COSTS, AVX512_KERNEL_WIDTH_COSTS or AMX_KERNEL_WIDTH_COSTS
    (interpolated, extended at its last slope) where csd_engine's bf16 kernel runs the target, FLOAT32_CPU_WIDTH_COSTS for a
    float32 target on the CPU of STREAMED_WEIGHT_BYTES or more, 1 + 0.02 (w - 1) elsewhere
    (torch's bf16 matmul on the AVX-512 EPYC, bench/draft_policy.py's timing: 9 / 17 tokens
    1.15-1.18 / 1.35-1.44x one, the line 1.16 / 1.32; a GPU's forward is flat far wider)."""
    w = torch.arange(n + 1, dtype=torch.float64).clamp(min=1)
    curve = target_curve(models)
    if width_cost is None and curve is not None:
        cost = _on_curve(curve, w)
    else:
        cost = 1 + (0.02 if width_cost is None else width_cost) * (w - 1)
    return cost.to(models.device, torch.float32)


def prices(models: Models, width_cost: float | None, model_cost: float, n: int, drafter: int | None,
           rows: int) -> Prices:
    """What a self-tuning strategy's choices cost in a step of `rows` rows, in one-token target
    forwards of as many rows (kernels/draft_budget.py). Where the platform's CPU curve prices the
    target (width_cost None) and the engine is not batch_invariant, every forward computes the
    step's rows (DecodeState.rows_in_use, else all the scheduler's) as wide as the widest, so at
    rows > 1: a forward of w tokens a row costs
    curve(rows w) / curve(rows); the model's forward model_cost drafter(rows) / curve(rows), its
    first drafter(2 rows) / curve(rows) (it also feeds the target's bonus token where the target
    took the whole draft), drafter = DRAFTER_ROW_COSTS for a quantized model, else the target's
    curve; and the rows share one choice, the best for their summed tokens (Prices.shared).
    Elsewhere (one row, a GPU, explicit settings, batch_invariant=True: a row's choices never
    depend on its neighbours) each row chooses alone at one row's prices.
    drafter: the model's index in models.drafters (None: no neural drafter)."""
    width = width_costs(models, width_cost, n)
    model = torch.tensor([model_cost], dtype=torch.float32, device=models.device)
    curve = target_curve(models)
    if rows == 1 or width_cost is not None or curve is None or models.batch_invariant:
        return Prices(width, model, model)
    at = lambda c, x: float(_on_curve(c, torch.tensor(float(x), dtype=torch.float64)))  # noqa: E731
    w = torch.arange(n + 1, dtype=torch.float64).clamp(min=1)
    width = (_on_curve(curve, rows * w) / at(curve, rows)).to(models.device, torch.float32)
    scheme = drafter is not None and getattr(models.drafters[drafter], "quantize", None)
    drafter_curve = DRAFTER_ROW_COSTS.get(parse_scheme(scheme)[0], curve) if scheme else curve
    model, first = (torch.tensor([model_cost * at(drafter_curve, r) / at(curve, rows)], dtype=torch.float32,
                                 device=models.device) for r in (rows, 2 * rows))
    return Prices(width, model, first, shared=True)


class PriceBook:
    """`prices` by the step's rows, each made once: a decoder's start makes its scheduler's
    eagerly (a host-to-device copy cannot be captured; a step graph reads the tensors made)."""

    def __init__(self, models: Models, width_cost: float | None, model_cost: float, n: int, drafter: int | None):
        self.models, self.width_cost, self.model_cost, self.n, self.drafter = models, width_cost, model_cost, n, drafter
        self.made = {}

    def __call__(self, rows: int) -> Prices:
        if rows not in self.made:
            self.made[rows] = prices(self.models, self.width_cost, self.model_cost, self.n, self.drafter, rows)
        return self.made[rows]


def cost_ratio(models: Models, drafter: int) -> float:
    """A drafter's forward cost relative to the target's: decoding at small batch streams the
    weights once per forward, so the ratio of the bytes streamed (a quantized drafter's packed
    weights). The ratio of parameter counts where a runner does not say its bytes, and where
    csd_engine's bf16 kernel runs the target: its kernels widen every weight to fp32 and cost
    more than their bytes (2-core AVX2 EPYC: the Qwen 0.5B's int8 one-token forward 0.31 of
    the 1.5B's, its bytes 0.16; the parameter price is what the strategies were tuned with there).
    A drafter quantized for float32 or float16 activations on the CPU runs torch's packed ops:
    the parameter ratio times their measured slowdown (quant.TORCH_CPU_PACKED_SLOWDOWN)."""
    d, t = models.drafters[drafter], models.target
    scheme = getattr(d, "quantize", None)
    if scheme and on_torch_cpu_ops(d.device, d.dtype):
        return d.num_params / t.num_params * TORCH_CPU_PACKED_SLOWDOWN[parse_scheme(scheme)[0]]
    if getattr(d, "weight_bytes", None) and getattr(t, "weight_bytes", None) and not on_bf16_kernel(models):
        return d.weight_bytes / t.weight_bytes
    return d.num_params / t.num_params
