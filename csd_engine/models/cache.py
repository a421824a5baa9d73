"""Static KV cache: allocated once, written by slot, rolled back by a length update.

Layout per layer: `[max_batch, kv_heads, max_seq_len + headroom, head_dim]`, so that a
row's keys are one contiguous `[kv_heads, S, head_dim]` block that attention reads up to
that row's valid length. `lengths[b]` is how many leading slots of row `b` are committed;
a forward writes its new tokens at slots `lengths[b] .. lengths[b] + n - 1` and does not
move `lengths`: the strategy commits what it accepted with `advance`, and rejected entries
are simply overwritten by the next write.
"""
from dataclasses import dataclass

import torch


class CommittedLengths:
    """What a cache of either runner commits: `lengths` [batch] int64, slots kept per row."""
    lengths: torch.Tensor

    def reset(self, lengths: torch.Tensor | None = None) -> None:
        """Forget every row (or set explicit committed lengths)."""
        if lengths is None:
            self.lengths.zero_()
        else:
            self.lengths.copy_(lengths)

    def advance(self, n: torch.Tensor) -> None:
        """Commit `n[b]` more slots of each row (n may be 0 for finished rows)."""
        self.lengths += n

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep only the first `lengths[b]` slots of each row: a length update, no copy."""
        torch.minimum(self.lengths, lengths, out=self.lengths)


@dataclass
class KVCache(CommittedLengths):
    k: torch.Tensor  # [layers, batch, kv_heads, capacity, head_dim]
    v: torch.Tensor
    lengths: torch.Tensor  # [batch] int64, committed slots per row

    @classmethod
    def allocate(cls, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device) -> "KVCache":
        shape = (layers, batch, kv_heads, capacity, head_dim)
        return cls(k=torch.zeros(shape, dtype=dtype, device=device),
                   v=torch.zeros(shape, dtype=dtype, device=device),
                   lengths=torch.zeros(batch, dtype=torch.int64, device=device))

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def rows(self, b: int) -> "KVCache":
        """A view of the first `b` rows: a smaller batch reuses the preallocated buffers."""
        return KVCache(self.k[:, :b], self.v[:, :b], self.lengths[:b])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new entries. slots: [B, N] int64; k, v: [B, N, kv_heads, head_dim]."""
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None]
        self.k[layer][rows, :, slots] = k
        self.v[layer][rows, :, slots] = v

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy entries of every layer from src to dst slots, all rows at once ([B, M] each).
        Used after tree verification to make the accepted path contiguous."""
        rows = torch.arange(src_slots.shape[0], device=src_slots.device)[:, None]
        for buf in (self.k, self.v):
            # [layers, B, M, kv_heads, head_dim] gathered before any write, so overlaps are safe.
            moved = buf[:, rows, :, src_slots]
            buf[:, rows, :, dst_slots] = moved
