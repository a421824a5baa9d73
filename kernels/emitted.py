"""The distribution a chain review emitted its tokens from (docs/algorithms.md, lenience): what a
cascade's level above uses as the proposal q of those tokens.

Per row b and position j <= num_accepted[b], with p_j the reviewer's processed distribution
(rebuilt from the review's lse and threshold) and l_b the row's lenience:
* sampling row, drafted position: e_j = a_j + (1 - sum a_j) norm(r_j), a_j = min(q_j, l_b p_j),
  r_j = max(0, p_j - a_j), norm(r_j) = r_j / sum r_j (p_j where that sum is 0);
* sampling row, the bonus position: e_j = p_j;
* greedy row: one-hot of the token emitted at j.
Zeros past num_accepted[b].

Kernel: two launches of (row x position, vocabulary block) programs, grids from shapes only
(no host reads, CUDA-graph capturable): `_emitted_sums_kernel` stores each block's sums of a
and r, `_emitted_write_kernel` adds up its row's block sums in block order and writes e. The
PyTorch reference `emitted_distribution_ref` is the same rule in ~45 tensor ops, each a kernel
launch on a GPU.
"""
import torch
import triton
import triton.language as tl

from .sampling import (MAX_BLOCK_V, lenience_args, lenience_rows, load_p, load_q, one_hot, probs_ref, residual_parts,
                       residual_ref, row_lenience)
from .verify import VerifyResult, check_inputs


@triton.jit
def _block(logits_ptr, stride_lb, stride_lj, q_ptr, stride_qb, stride_qj, draft_tokens_ptr, stride_db,
           num_drafts_ptr, temperature_ptr, lenience_ptr, lenience_value, threshold_ptr, lse_ptr, row, j, K, V, start,
           HAS_Q: tl.constexpr, PER_ROW_LENIENCE: tl.constexpr, BLOCK_V: tl.constexpr):
    """One vocabulary block of p_j, a_j and r_j, and the row's facts (sampling, drafted, token)."""
    temperature = tl.load(temperature_ptr + row)
    sampling = temperature > 0
    divisor = tl.where(sampling, temperature, 1.0)
    drafted = j < tl.load(num_drafts_ptr + row)  # num_drafts <= K: never past the drafts
    token = tl.load(draft_tokens_ptr + row * stride_db + j, mask=drafted, other=-1)
    threshold = tl.load(threshold_ptr + row * (K + 1) + j)
    lse = tl.load(lse_ptr + row * (K + 1) + j)
    offs, in_row, _, _, p = load_p(logits_ptr + row * stride_lb + j * stride_lj, start, V, divisor, threshold, lse,
                                   BLOCK_V)
    q = load_q(q_ptr + row * stride_qb + j * stride_qj, offs, in_row, drafted, token, HAS_Q)
    a, r = residual_parts(p, q, row_lenience(lenience_ptr, lenience_value, row, PER_ROW_LENIENCE))
    return offs, in_row, p, a, r, sampling, drafted, token


@triton.jit
def _emitted_sums_kernel(logits_ptr, stride_lb, stride_lj, q_ptr, stride_qb, stride_qj, draft_tokens_ptr, stride_db,
                 num_drafts_ptr, temperature_ptr, lenience_ptr, lenience_value, threshold_ptr, lse_ptr, sums_ptr, K, V,
                 BLOCKS, HAS_Q: tl.constexpr, PER_ROW_LENIENCE: tl.constexpr, BLOCK_V: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # row * (K + 1) + j; int64: row * stride_lb can pass 2**31
    block = tl.program_id(1)
    row, j = pid // (K + 1), pid % (K + 1)
    _, _, _, a, r, _, _, _ = _block(logits_ptr, stride_lb, stride_lj, q_ptr, stride_qb, stride_qj, draft_tokens_ptr,
                                    stride_db, num_drafts_ptr, temperature_ptr, lenience_ptr, lenience_value,
                                    threshold_ptr, lse_ptr, row, j, K, V, block * BLOCK_V, HAS_Q, PER_ROW_LENIENCE,
                                    BLOCK_V)
    out = sums_ptr + (pid * BLOCKS + block) * 2
    tl.store(out, tl.sum(a, 0))
    tl.store(out + 1, tl.sum(r, 0))


@triton.jit
def _emitted_write_kernel(logits_ptr, stride_lb, stride_lj, q_ptr, stride_qb, stride_qj, draft_tokens_ptr, stride_db,
                  num_drafts_ptr, temperature_ptr, lenience_ptr, lenience_value, threshold_ptr, lse_ptr, sums_ptr,
                  accepted_ptr, next_token_ptr, out_ptr, K, V, BLOCKS, HAS_Q: tl.constexpr,
                  PER_ROW_LENIENCE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCKS_POW2: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    row, j = pid // (K + 1), pid % (K + 1)
    offs, in_row, p, a, r, sampling, drafted, token = _block(
        logits_ptr, stride_lb, stride_lj, q_ptr, stride_qb, stride_qj, draft_tokens_ptr, stride_db, num_drafts_ptr,
        temperature_ptr, lenience_ptr, lenience_value, threshold_ptr, lse_ptr, row, j, K, V, block * BLOCK_V, HAS_Q,
        PER_ROW_LENIENCE, BLOCK_V)
    blocks = tl.arange(0, BLOCKS_POW2)
    sums = sums_ptr + (pid * BLOCKS + blocks) * 2
    accepted_mass = tl.sum(tl.load(sums, mask=blocks < BLOCKS, other=0.0), 0)
    residual_mass = tl.sum(tl.load(sums + 1, mask=blocks < BLOCKS, other=0.0), 0)
    norm = tl.where(residual_mass > 0, r / tl.where(residual_mass > 0, residual_mass, 1.0), p)
    e = tl.where(drafted, a + (1 - accepted_mass) * norm, p)  # a sampling row
    accepted = tl.load(accepted_ptr + row)
    emitted = tl.where(j < accepted, token, tl.load(next_token_ptr + row))  # a greedy row's token at j
    e = tl.where(sampling, e, tl.where(offs == emitted, 1.0, 0.0))
    e = tl.where(j <= accepted, e, 0.0)
    tl.store(out_ptr + pid * V + offs, e, mask=in_row)


def emitted_distribution(logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                         draft_probs: torch.Tensor | None, temperature: torch.Tensor, top_k: torch.Tensor,
                         top_p: torch.Tensor, lenience: float | torch.Tensor, result: VerifyResult, *,
                         check_values: bool = True) -> torch.Tensor:
    """[B, k+1, V] float32 e (module docstring) in two launches; arguments as in
    `emitted_distribution_ref` (top_k / top_p are already in result's threshold)."""
    check_inputs(logits, draft_tokens, num_drafts, draft_probs, temperature, top_k, top_p, lenience,
                  check_values=check_values)
    batch, positions, vocab = logits.shape
    device = logits.device
    logits = logits if logits.stride(2) == 1 else logits.contiguous()
    has_q = draft_probs is not None
    q = draft_probs if not has_q or draft_probs.stride(2) == 1 else draft_probs.contiguous()
    q = q if has_q else logits  # a placeholder pointer, never read
    # read with stride 1 along positions, and the per-row vectors as dense [B] arrays
    draft_tokens = draft_tokens.contiguous() if draft_tokens.numel() else \
        torch.zeros(batch, 1, dtype=torch.int64, device=device)
    num_drafts = num_drafts.contiguous()
    block_v = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    blocks = triton.cdiv(vocab, block_v)
    sums = torch.empty(batch * positions, blocks, 2, dtype=torch.float32, device=device)
    *lenience_ptr_value, per_row = lenience_args(lenience, result.lse)
    out = torch.empty(batch, positions, vocab, dtype=torch.float32, device=device)
    rows = (logits, logits.stride(0), logits.stride(1), q, q.stride(0), q.stride(1), draft_tokens,
            draft_tokens.stride(0), num_drafts, temperature.float().contiguous(), *lenience_ptr_value,
            result.threshold.contiguous(), result.lse.contiguous())
    grid = (batch * positions, blocks)
    _emitted_sums_kernel[grid](*rows, sums, positions - 1, vocab, blocks, HAS_Q=has_q, PER_ROW_LENIENCE=per_row,
                               BLOCK_V=block_v)
    _emitted_write_kernel[grid](*rows, sums, result.num_accepted.contiguous(), result.next_token.contiguous(), out,
                                positions - 1, vocab, blocks,
                        HAS_Q=has_q, PER_ROW_LENIENCE=per_row, BLOCK_V=block_v,
                        BLOCKS_POW2=triton.next_power_of_2(blocks))
    return out


def normalised_residual(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """norm(r): the residual over its mass ([R, V]); `fallback` (p) where it vanished."""
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass, fallback)


def emitted_distribution_ref(logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                             draft_probs: torch.Tensor | None, temperature: torch.Tensor, top_k: torch.Tensor,
                             top_p: torch.Tensor, lenience: float | torch.Tensor, result: VerifyResult, *,
                             check_values: bool = True) -> torch.Tensor:
    """[B, k+1, V] float32: the distribution of the token `result` emitted at each position j <=
    num_accepted[b] (zeros beyond), the proposal the level above must use for it (module
    docstring); p_j is rebuilt from result.lse and result.threshold, l is the row's lenience (a
    float or [B]). No host reads with check_values=False."""
    check_inputs(logits, draft_tokens, num_drafts, draft_probs, temperature, top_k, top_p, lenience,
                  check_values=check_values)
    batch, positions, vocab = logits.shape
    device = logits.device
    lenience = lenience_rows(lenience, batch, device)[:, None, None]
    sampling = temperature > 0
    divisor = torch.where(sampling, temperature.float(), 1.0)[:, None, None]
    # every position at once ([B, k+1, V]): a fixed ~45 ops per call, not per position
    p = probs_ref(logits.float() / divisor, result.threshold, result.lse)
    drafted = torch.arange(positions - 1, device=device) < num_drafts[:, None]  # [B, k]
    tokens = torch.where(drafted, draft_tokens.long(), 0)
    q = draft_probs[:, :positions - 1].float() if draft_probs is not None else one_hot(tokens, vocab)
    accepted_part, residual = residual_ref(p[:, :-1], q, lenience)
    r = normalised_residual(residual, p[:, :-1])
    at_drafts = torch.where(drafted[..., None], accepted_part + (1 - accepted_part.sum(-1, keepdim=True)) * r,
                            p[:, :-1])
    e = torch.cat([at_drafts, p[:, -1:]], 1)
    position = torch.arange(positions, device=device)
    accepted = result.num_accepted[:, None]
    emitted_token = torch.where(position[:-1] < accepted, tokens, result.next_token[:, None])
    greedy_e = one_hot(torch.cat([emitted_token, result.next_token[:, None]], 1), vocab)
    e = torch.where(sampling[:, None, None], e, greedy_e)
    return torch.where((position <= accepted)[..., None], e, 0.0)
