"""Generic runner: any `AutoModelForCausalLM` behind the same interface as the native one.

It is the compatibility path (GPT-2, or architectures the native runner lacks), not the fast
one: each row keeps a transformers `DynamicCache`, cropped to the row's committed length
before every forward (rollback), and rows run one after another because the caches have
different lengths. Trees work through a 4-D attention mask where the model's attention depends
on a token's position only through `position_ids` (`tree_limit` says why not otherwise).
"""
import contextlib

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from csd_engine.models.cache import CommittedLengths
from csd_engine.models.runner import ForwardBatch, Runner, attention_window, position_limit, without_autocast


class _Lengths(CommittedLengths):
    """Committed length per row, mirrored as a tensor so strategies treat both runners alike;
    `move` edits the rows' transformers caches directly."""

    def __init__(self, batch, device, caches: list[DynamicCache]):
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=device)
        self.caches = caches

    @property
    def batch(self):
        return self.lengths.shape[0]

    @torch.inference_mode()  # the layers' tensors were made by inference-mode forwards
    def move(self, src_slots, dst_slots):
        """Copy entries of every layer from src to dst slots ([B, M] each), as KVCache.move.
        Slot = position in the row's cache, which only full-attention layers keep."""
        for row, cache in enumerate(self.caches):
            src, dst = src_slots[row], dst_slots[row]
            for layer in cache.layers:
                if not isinstance(layer, DynamicLayer) or layer.is_sliding:
                    raise ValueError(f"tree compaction needs full-attention cache layers; this model has "
                                     f"{type(layer).__name__}: use chain strategies with it")
                layer.keys[:, :, dst] = layer.keys[:, :, src]  # the right side is a copy: overlaps are safe
                layer.values[:, :, dst] = layer.values[:, :, src]


class HFRunner(Runner):
    def __init__(self, hf_model, device):
        self.model = hf_model  # the caller's, maybe: run in eval mode by _plainly, which restores its modes
        self.device = torch.device(device)
        self.vocab_size = hf_model.config.vocab_size
        self.num_params = sum(p.numel() for p in hf_model.parameters())
        self.attention_window = attention_window(hf_model.config)
        self.position_limit = position_limit(hf_model)
        self.trained_positions = getattr(hf_model.config, "max_position_embeddings", None)
        self.caches: list[DynamicCache] = []
        with self._plainly():
            self._check_forwards()
            self.tree_limit = self._tree_limit()

    @torch.inference_mode()
    def _check_forwards(self) -> None:
        """Refuse, by name, a model that cannot run here exactly, checked on three tokens in the
        form a verification forward takes (a transformers cache, a 4-D additive mask, explicit
        positions): the forward must run; the first token's logits must not depend on the tokens
        after it (the mask is taken as causal masking, in any dtype); and in float32, where
        rounding cannot hide a difference, its logits must be those of three one-token forwards
        over the cache; and after the cache is cropped back to two tokens (a rejected draft's
        rollback), the third token's logits must be what they were. Architectures without a KV
        cache, with state a crop cannot roll back (recurrent or convolution layers), or that read
        the mask otherwise, fail here instead of decoding wrongly."""
        name = f"model_type {getattr(self.model.config, 'model_type', type(self.model).__name__)!r}"
        ids = (torch.arange(1, 4, device=self.device) % self.vocab_size)[None]
        changed = torch.cat([ids[:, :1], (ids[:, 1:] + 3) % self.vocab_size], 1)  # the same first token only

        def new_cache():
            return DynamicCache(config=self.model.config)
        try:
            whole = self._forward_from(new_cache(), ids, 0)
            later = self._forward_from(new_cache(), changed, 0)
            cache = new_cache()
            steps = torch.cat([self._forward_from(cache, ids[:, i:i + 1], i) for i in range(3)], 1)
        except Exception as exc:
            raise ValueError(f"{name} cannot run on csd_engine's generic runner: a forward over a cached prefix "
                             f"with explicit positions and a 4-D additive attention mask failed "
                             f"({type(exc).__name__}: {exc}); it runs models whose attention takes those (most "
                             "decoders with rotary or learned positions), not attention biases built in the model "
                             "(ALiBi) or state-space layers") from exc
        tolerance = 1e-3 * (1.0 + float(steps.abs().max()))
        leak = float((whole[:, 0] - later[:, 0]).abs().max())
        if not leak <= tolerance:  # NaN fails too
            raise ValueError(f"{name} cannot run on csd_engine's generic runner exactly: a token's logits change "
                             f"with the tokens after it (by {leak:.3g}), so its attention does not take the runner's "
                             "4-D mask as causal masking and a verification would not be plain decoding")
        error = float((whole - steps).abs().max())
        if self.model.dtype == torch.float32 and not error <= tolerance:
            raise ValueError(f"{name} cannot run on csd_engine's generic runner exactly: one three-token forward "
                             f"gives other logits than three one-token forwards over its cache (by {error:.3g})")
        try:
            cache.crop(-1)
            again = self._forward_from(cache, ids[:, 2:], 2)
        except Exception as exc:
            raise ValueError(f"{name} cannot run on csd_engine's generic runner: its cache cannot be cut back to a "
                             f"shorter prefix, which every rejected draft needs (a layer that keeps a recurrent or "
                             f"convolution state? {type(exc).__name__}: {exc})") from exc
        moved = float((again - steps[:, 2:]).abs().max())
        if not moved <= tolerance:
            raise ValueError(f"{name} cannot run on csd_engine's generic runner exactly: after its cache is cut back "
                             f"by one token, the token fed again gets other logits (by {moved:.3g}), so a rejected "
                             "draft would leave state behind (a recurrent or convolution layer)")

    @torch.inference_mode()
    def _tree_limit(self) -> str | None:
        """Why this model cannot verify token trees exactly (Staged, a cascade's top-level tree), or
        None. A tree's node sits at a cache slot past its position (a sibling's slot), which the
        model must not see: its attention may depend on position only through `position_ids`.
        Refused: sliding-window or non-attention cache layers (tree compaction moves keys between
        slots); a local window masked by slot (GPT-Neo's `window_size`); a model whose logits do
        not move when a token's position does (ALiBi's slot-distance biases, MPT's: bit for bit,
        so in any dtype); and, in float32 where rounding cannot hide it, a sibling whose logits
        change when the two siblings of a tree swap slots."""
        config = self.model.config
        layers = DynamicCache(config=config).layers
        if any(not isinstance(layer, DynamicLayer) or layer.is_sliding for layer in layers):
            return "its cache has sliding-window or non-attention layers, whose keys tree compaction cannot move"
        if getattr(config, "window_size", None) and "local" in (getattr(config, "attention_layers", None) or ()):
            return (f"its local attention layers (window_size {config.window_size}) mask keys by cache slot, and a "
                    "tree node's slot is not its position")
        ids = (torch.arange(1, 6, device=self.device) % self.vocab_size)[None]
        moved = [self._forward_from(DynamicCache(config=config), ids[:, :3], 0,
                                    torch.tensor([[0, 1, last]], device=self.device))[0, 2] for last in (2, 3)]
        if torch.equal(*moved):
            return ("its logits do not change with a token's position_ids (positions come from cache slots, as with "
                    "ALiBi), and a tree node's slot is not its position")
        if self.model.dtype != torch.float32:
            return None
        sibling = []
        for order in ((0, 1), (1, 0)):  # the siblings ids[3], ids[4] in either slot after their parent
            cache = DynamicCache(config=config)
            self._forward_from(cache, ids[:, :2], 0)
            nodes = ids[:, [2, 3 + order[0], 3 + order[1]]]  # the parent, then the siblings
            sees = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # each its parent and itself
            logits = self._forward_from(cache, nodes, 2, torch.tensor([[2, 3, 3]], device=self.device), sees)
            sibling.append(logits[0, 1 + order.index(0)])  # ids[3]'s logits, wherever it sat
        gap = float((sibling[0] - sibling[1]).abs().max())
        if not gap <= 1e-3 * (1.0 + float(sibling[0].abs().max())):
            return (f"a tree node's logits depend on the cache slot it sits in, not only on its position (by {gap:.3g} "
                    "when two siblings swap slots)")
        return None

    def _forward_from(self, cache: DynamicCache, ids: torch.Tensor, start: int, positions: torch.Tensor | None = None,
                      new_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Float logits of one row's `ids` [1, n] after the `start` tokens `cache` holds, at
        `positions` (default start..start+n-1); the new tokens see each other as `new_mask`
        [n, n] says (a tree's), causally by default."""
        n = ids.shape[1]
        seen = torch.ones(n, start + n, dtype=torch.bool, device=self.device)
        seen[:, start:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril() if new_mask is None \
            else new_mask.to(self.device)
        if positions is None:
            positions = start + torch.arange(n, device=self.device)[None]
        return self.model(input_ids=ids, position_ids=positions, attention_mask=self._additive(seen),
                          past_key_values=cache, use_cache=True, return_dict=True).logits.float()

    @contextlib.contextmanager
    def _plainly(self):
        """The model as plain decoding runs it: in eval mode (no dropout), with a caller's
        autocast off. The model may be the caller's own, in training: its modules' modes are
        put back afterwards."""
        training = [m for m in self.model.modules() if m.training] if self.model.training else []
        try:
            with without_autocast(self.device):
                for m in training:
                    m.training = False
                yield
        finally:
            for m in training:
                m.training = True

    def allocate(self, batch: int, capacity: int) -> None:
        self.caches = [DynamicCache(config=self.model.config) for _ in range(batch)]
        self.cache = _Lengths(batch, self.device, self.caches)

    def use_rows(self, batch: int) -> None:
        self.allocate(batch, capacity=0)  # caches grow as they fill: fresh ones cost nothing

    @torch.inference_mode()
    def prefill(self, rows: slice, ids: torch.Tensor, start: int = 0) -> None:
        with self._plainly():
            self._prefill(rows, ids, start)

    def _prefill(self, rows: slice, ids: torch.Tensor, start: int) -> None:
        for i, row in enumerate(range(*rows.indices(len(self.caches)))):
            if start == 0:
                self.caches[row] = DynamicCache(config=self.model.config)
            cache = self.caches[row]
            if cache.get_seq_length() > start:
                cache.crop(start - cache.get_seq_length())  # a count from the end: transformers deprecates lengths
            self.cache.lengths[row] = start
            if not ids.shape[1]:
                continue
            positions = start + torch.arange(ids.shape[1], device=self.device)[None, :]
            self.model(input_ids=ids[i:i + 1].to(self.device), position_ids=positions, past_key_values=cache,
                       use_cache=True, return_dict=True)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        with self._plainly():
            return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        lengths = self.cache.lengths.tolist()
        out = []
        for row, cache in enumerate(self.caches):
            keep = lengths[row]
            extra = cache.get_seq_length() - keep
            if extra > 0:
                cache.crop(-extra)
            tree = None if batch.tree_mask is None else batch.tree_mask[row]
            out.append(self._forward_from(cache, batch.input_ids[row:row + 1], keep, batch.positions[row:row + 1], tree))
        return torch.cat(out) if batch.need_logits else None

    def _additive(self, seen: torch.Tensor) -> torch.Tensor:
        """[1, 1, n, keys] mask to add to the attention scores: 0 where a query sees a key, the
        dtype's minimum elsewhere. Additive, not boolean: some architectures (MPT, XGLM...) read
        a boolean mask as the keys to hide, or add it as 0 / 1, and decode wrongly with one."""
        dtype = self.model.dtype
        mask = torch.zeros(seen.shape, dtype=dtype, device=self.device).masked_fill_(~seen, torch.finfo(dtype).min)
        return mask[None, None]
