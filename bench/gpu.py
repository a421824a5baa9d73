"""GPU measurements in one run (under 9 minutes on one H100), one table per section
(--sections picks some):

* verify: chain verification (kernels/verify.py `verify`): launched and graph-replayed time,
  logits bytes / graph time against a 1 GiB device-to-device copy's bandwidth (the yardstick)
  for B in {1, 8, 64}, k in {4, 8}, V in {32000, 151936}, greedy and sampling;
* attention: kernels/attention.py `cache_attention` against the native runner's SDPA path for
  contexts 512..8192, batch 1 and 8, n = 1 and 5; mag: MaG's proposal kernel (kernels/mag.py)
  at the same batches and contexts;
* autoregressive: tokens/s of a Llama-2-7B-shaped model with random bf16 weights, batch 1: the
  engine (SDPA, Triton attention, CUDA graphs) against the weight-bandwidth floor and
  transformers' generate with a static cache (eager);
* step_split: per strategy (chain, cascade, the self-tuning ones; batch 1 and 8, greedy and
  sampling) tokens/s and where a step's time goes: target forward, drafter forwards,
  verification, everything else. Synthetic agreement: the drafter is the target's first
  layers (sharing its embeddings, final norm and lm_head); the target's later layers write
  into the residual stream through output projections scaled by --residual-scale;
* step_profile: each strategy's GPU kernel time per step by category and its costliest kernels;
* forward_profile: one target forward (n = 1 and 5) with and without the fused kernels;
* quantized_drafter: the drafter's forward with int8 / int4 weights against bf16;
* batch_invariance: what Engine(batch_invariant=True) costs and how far a row's logits move;
* pearl: Pearl against Speculative, and how much of a round running both sides at once hides;
* transformers_compiled: transformers' generate with a static cache and its automatic
  torch.compile (last: the compile takes minutes; skipped when less than COMPILE_BUDGET_S is left).

Run on the device (from the repository root):

    CSD_NO_EXTENSION=1 python3 -m pip install -q --no-build-isolation --no-deps -e .
    PYTHONUNBUFFERED=1 python3 bench/gpu.py --out $OUT 2>&1 | tee $OUT/gpu.log

and here, as a smoke test with tiny shapes on the CPU (Triton interpreter; about 40 s: few
shapes and tokens, batch 2, one strategy of each kind in step_split and step_profile):

    python bench/gpu.py --dry-run

Every section catches its own failure (printed, recorded) so the others still run, and
<out>/gpu-YYYYmmdd-HHMMSS.json (gpu-dry-run-...) is rewritten after each section; its
step-split picture is drawn beside it at the end (bench/plot.py). --budget-s is checked before
each section: once it is spent, the sections left are skipped, and recorded as such.
"""
import contextlib
import os
import sys
import time
import traceback
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property

if __package__ in (None, ""):  # run as `python bench/gpu.py`: make the `bench` package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__" and "--dry-run" in sys.argv:  # Triton reads this when the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before importing them); not when another script imports us

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import csd_engine  # noqa: E402
from bench import harness  # noqa: E402
from bench.common import Stopwatch, instrumented, print_table, sync, wall_s  # noqa: E402
from bench.harness import progress  # noqa: E402
from csd_engine.drafters.mag import MaG  # noqa: E402
from csd_engine.kernels.attention import cache_attention  # noqa: E402
from csd_engine.kernels.mag import mag_propose  # noqa: E402
from csd_engine.kernels.verify import verify  # noqa: E402
from csd_engine.models.graphs import GraphedRunner  # noqa: E402
from csd_engine.models.llama import LlamaRunner  # noqa: E402
from csd_engine.kernels.mask import attention_mask  # noqa: E402
from csd_engine.models.runner import ForwardBatch  # noqa: E402

DTYPE = torch.bfloat16
COMPILE_BUDGET_S = 220  # seconds the compiled transformers run needs (compile + two generates)
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5)
# the dry run's: one KV head and two layers halve what Triton's interpreter runs per step
TINY_LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-5)


@dataclass(frozen=True)
class Sizes:
    verify_batches: tuple = (1, 8, 64)
    verify_ks: tuple = (4, 8)
    vocabs: tuple = (32000, 151936)
    contexts: tuple = (512, 1024, 2048, 4096, 8192)
    attention_batches: tuple = (1, 8)
    attention_ns: tuple = (1, 5)
    heads: int = 32  # Llama-2-7B: 32 query and 32 KV heads of 128
    head_dim: int = 128
    model: dict = field(default_factory=lambda: LLAMA2_7B)
    drafter_layers: int = 2
    prompt_tokens: int = 64
    new_tokens: int = 128
    max_seq_len: int = 1024
    copy_bytes: int = 1 << 30
    batch: int = 8  # the wide batch of step_split's graphs, quantized_drafter and batch_invariance
    strategies: tuple | None = None  # the names step_split and step_profile run (None: all of them)


# The dry run proves every section runs in Triton's interpreter, where a kernel launch costs
# milliseconds: few shapes and tokens, batch 2, and of step_split's and step_profile's strategies
# one of each code path (plain; K-matrix cascade: chain verification, MaG; self-tuning tree; sampling).
DRY_RUN = Sizes(verify_batches=(1, 2), verify_ks=(2,), vocabs=(96,), contexts=(64,), attention_batches=(1, 2),
                attention_ns=(1, 3), heads=2, head_dim=16, model=TINY_LLAMA, drafter_layers=1, prompt_tokens=6,
                new_tokens=4, max_seq_len=64, copy_bytes=1 << 20, batch=2,
                strategies=("autoregressive", "cascade K=[[4,2],[0,4]] l=2, MaG",
                            "Cascade.auto(tree=(3, 2)), MaG",
                            "cascade K=[[4,2],[0,4]] l=2, MaG, T=0.8 top-k 50 top-p 0.95",  # step_split's
                            "cascade, T=0.8 top-k 50 top-p 0.95"))  # step_profile's


def chosen(sizes: Sizes, strategies: list[tuple]) -> list[tuple]:
    """The (name, ...) entries of `strategies` that `sizes.strategies` names (all when None)."""
    return [entry for entry in strategies if sizes.strategies is None or entry[0] in sizes.strategies]


def graph_ms(fn, device: torch.device) -> float:
    """Median milliseconds per call replayed from a CUDA graph: the kernels' own time, without
    the host's launch overhead (what the engine's graphed runner pays)."""
    if device.type == "cuda":
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return time_ms(fn, device)


def time_ms(fn, device: torch.device) -> float:
    """Median milliseconds per call: triton's do_bench on CUDA (it flushes the L2 cache before
    every call, so bandwidths are DRAM bandwidths); on the CPU (dry run: the number means
    nothing, Triton's interpreter is slow) one plain call."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    return harness.repeat(fn, 1, warmup=0)[1].median * 1e3



# -- 1. copy bandwidth ----------------------------------------------------------------------------
def copy_bandwidth(sizes: Sizes, device: torch.device) -> dict:
    src = torch.empty(sizes.copy_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return {"bytes": sizes.copy_bytes, "ms": ms, "gb_per_s": 2 * sizes.copy_bytes / ms / 1e6}


# -- 2. chain verification kernel -----------------------------------------------------------------
def bench_verify(sizes: Sizes, device: torch.device, copy_gb_per_s: float) -> list[dict]:
    rows = []
    for vocab in sizes.vocabs:
        for batch in sizes.verify_batches:
            for k in sizes.verify_ks:
                logits = 3 * torch.randn(batch, k + 1, vocab, device=device)
                drafts = logits[:, :k].argmax(-1)  # greedy rows accept all k and emit the bonus
                num_drafts = torch.full((batch,), k, dtype=torch.int64, device=device)
                # filtered rows search their top-k / top-p cut-off (kernels/sampling.py's row_cutoff)
                for mode, temperature, top_k, top_p in (("greedy", 0.0, 0, 1.0), ("sampling", 1.0, 0, 1.0),
                                                        ("top-k 50 top-p 0.95", 1.0, 50, 0.95),
                                                        ("top-p 0.95", 1.0, 0, 0.95)):
                    args = dict(temperature=torch.full((batch,), temperature, device=device),
                                top_k=torch.full((batch,), top_k, dtype=torch.int32, device=device),
                                top_p=torch.full((batch,), top_p, device=device),
                                seed=torch.randint(0, 2**31, (batch,), device=device),
                                offset=torch.zeros(batch, dtype=torch.int64, device=device))
                    # greedy as the engine calls it: the all_greedy hint skips the emit-split launch
                    call = lambda: verify(logits, drafts, num_drafts, None, **args,  # noqa: E731
                                          all_greedy=mode == "greedy")
                    ms, replay_ms = time_ms(call, device), graph_ms(call, device)
                    gb_per_s = logits.numel() * 4 / replay_ms / 1e6
                    rows.append(dict(vocab=vocab, batch=batch, k=k, mode=mode, us=ms * 1e3, graph_us=replay_ms * 1e3,
                                     gb_per_s=gb_per_s, of_copy=gb_per_s / copy_gb_per_s))
                progress(f"verify V={vocab} B={batch} k={k}: " + " / ".join(f"{r['us']:.1f}" for r in rows[-4:]) + " us")
    return rows


# -- 3. attention kernel against SDPA -------------------------------------------------------------
def bench_attention(sizes: Sizes, device: torch.device, copy_gb_per_s: float) -> list[dict]:
    """Every case uses one cache of capacity max(contexts) + 256, as an engine allocates it
    once; both sides see `context` keys per row (cache length context - n, plus the n new)."""
    rows = []
    capacity = max(sizes.contexts) + 256
    heads, dim = sizes.heads, sizes.head_dim
    for batch in sizes.attention_batches:
        k_cache = torch.randn(batch, heads, capacity, dim, device=device, dtype=DTYPE)
        v_cache = torch.randn_like(k_cache)
        for n in sizes.attention_ns:
            for context in sizes.contexts:
                q = torch.randn(batch, n, heads, dim, device=device, dtype=DTYPE)
                lengths = torch.full((batch,), context - n, dtype=torch.int64, device=device)
                mask = attention_mask(lengths, n, context, None)  # built once per forward in the runner

                def sdpa():
                    return F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :, :context],
                                                          v_cache[:, :, :context], attn_mask=mask).transpose(1, 2)

                def triton_kernel():
                    return cache_attention(q, k_cache, v_cache, lengths)

                error = (triton_kernel().float() - sdpa().float()).abs().max().item()
                triton_ms, sdpa_ms = time_ms(triton_kernel, device), time_ms(sdpa, device)
                triton_graph_ms, sdpa_graph_ms = graph_ms(triton_kernel, device), graph_ms(sdpa, device)
                kv_bytes = 2 * batch * heads * context * dim * k_cache.element_size()
                rows.append(dict(batch=batch, n=n, context=context, triton_us=triton_ms * 1e3, sdpa_us=sdpa_ms * 1e3,
                                 speedup=sdpa_ms / triton_ms, triton_graph_us=triton_graph_ms * 1e3,
                                 sdpa_graph_us=sdpa_graph_ms * 1e3, graph_speedup=sdpa_graph_ms / triton_graph_ms,
                                 triton_gb_per_s=kv_bytes / triton_graph_ms / 1e6,
                                 of_copy=kv_bytes / triton_graph_ms / 1e6 / copy_gb_per_s, max_abs_diff=error))
                progress(f"attention B={batch} n={n} ctx={context}: triton {triton_ms * 1e3:.1f} us, "
                         f"sdpa {sdpa_ms * 1e3:.1f} us")
    return rows


# -- 3b. MaG's proposal kernel --------------------------------------------------------------------
def bench_mag(sizes: Sizes, device: torch.device) -> list[dict]:
    """One MaG proposal (kernels/mag.py, the default MaG: matches up to 32 tokens, no bigram table)
    over a buffer of random tokens `context` long with a repeated tail, so the search runs to the
    end and finds a match: what each of a cascade step's MaG calls costs the GPU."""
    rows = []
    for batch in sizes.attention_batches:
        for context in sizes.contexts:
            tokens = torch.randint(0, sizes.model["vocab_size"], (batch, context + 64), device=device)
            tokens[:, context - 8:context] = tokens[:, 100 % context:100 % context + 8]  # a match
            end = torch.full((batch,), context, dtype=torch.int64, device=device)
            for m in (4, 16):
                call = lambda: mag_propose(tokens, end, end, m, context, None, None, 1, 32, 0.5, True, 1)  # noqa: E731
                ms, replay_ms = time_ms(call, device), graph_ms(call, device)
                rows.append(dict(batch=batch, context=context, m=m, us=ms * 1e3, graph_us=replay_ms * 1e3))
            progress(f"MaG B={batch} ctx={context}: " + " / ".join(f"{r['graph_us']:.1f}" for r in rows[-2:]) + " us")
    return rows


# -- models with random weights -------------------------------------------------------------------
def random_llama(shape: dict, layers: int, device: torch.device) -> LlamaForCausalLM:
    """A Llama of the given shape with transformers' random initialisation, built directly on
    the device in bf16 (no float32 copy, no host round trip)."""
    config = LlamaConfig(**{**shape, "num_hidden_layers": layers}, tie_word_embeddings=False)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(saved)
    model.config.eos_token_id = model.generation_config.eos_token_id = None  # generate every asked token
    return model.eval()


class Models:
    """The target, its drafter and their native runners, built once, on first use."""

    def __init__(self, sizes: Sizes, device: torch.device, residual_scale: float, fused: bool = True):
        self.sizes, self.device, self.residual_scale = sizes, device, residual_scale
        self.fused = fused and device.type == "cuda"

    @cached_property
    def target(self) -> LlamaForCausalLM:
        progress("building the target (random bf16 weights on the device)")
        model = random_llama(self.sizes.model, self.sizes.model["num_hidden_layers"], self.device)
        with torch.no_grad():  # layers past the drafter's only nudge the residual stream (section 5)
            for layer in model.model.layers[self.sizes.drafter_layers:]:
                layer.self_attn.o_proj.weight.mul_(self.residual_scale)
                layer.mlp.down_proj.weight.mul_(self.residual_scale)
        return model

    @cached_property
    def target_runner(self) -> LlamaRunner:
        return LlamaRunner(self.target, self.device, DTYPE, fused=self.fused)

    @cached_property
    def drafter(self) -> LlamaForCausalLM:
        drafter = random_llama(self.sizes.model, self.sizes.drafter_layers, self.device)
        drafter.load_state_dict(self.target.state_dict(), strict=False)  # the target's first layers, head, norms
        return drafter

    @cached_property
    def drafter_runner(self) -> LlamaRunner:
        return LlamaRunner(self.drafter, self.device, DTYPE, fused=self.fused)

    @property
    def weight_bytes(self) -> int:
        """Bytes a decoding step reads: every weight but the embedding table (one row of it)."""
        embed = self.target.model.embed_tokens.weight
        return (self.target_runner.num_params - embed.numel()) * embed.element_size()

    def prompt(self) -> list[int]:
        return torch.randint(0, self.sizes.model["vocab_size"], (self.sizes.prompt_tokens,)).tolist()


def engine_for(target, drafters, models: Models, cuda_graphs: bool | str = False, batch: int = 1) -> csd_engine.Engine:
    return csd_engine.Engine(target, drafters=drafters, dtype=DTYPE, device=models.device, max_batch_size=batch,
                             max_seq_len=models.sizes.max_seq_len, cuda_graphs=cuda_graphs)


# -- 4. autoregressive tokens/s -------------------------------------------------------------------
def bench_autoregressive(models: Models, copy_gb_per_s: float) -> dict:
    sizes, device = models.sizes, models.device
    prompt, n = models.prompt(), sizes.new_tokens
    params = csd_engine.SamplingParams(max_new_tokens=n, ignore_eos=True)
    runner = models.target_runner
    rows, outputs = [], {}

    def measure(label, generate):
        generate()  # warm-up: kernels compile, graphs are captured
        outputs[label], seconds = wall_s(generate, device)
        rows.append(dict(method=label, tokens_per_s=n / seconds, ms_per_token=seconds / n * 1e3))
        progress(f"{label}: {n / seconds:.1f} tokens/s")

    for backend in ("sdpa", "triton"):
        runner.attention_backend = backend
        engine = engine_for(runner, [], models)
        measure(f"csd_engine eager, {backend} attention", lambda: engine.generate([prompt], params)[0].token_ids)
    for fused in (models.fused, not models.fused) if device.type == "cuda" else (models.fused,):
        runner.fused = fused  # both norm / RoPE paths, end to end
        try:
            engine = engine_for(GraphedRunner(runner), [], models)
            measure("csd_engine CUDA graphs, triton attention" + (", fused kernels" if fused else ""),
                    lambda: engine.generate([prompt], params)[0].token_ids)
        finally:
            runner.fused = models.fused
    measure("transformers generate, static cache (eager)", lambda: hf_generate(models, prompt, compiled=False))
    floor_ms = models.weight_bytes / copy_gb_per_s / 1e6
    rows.append(dict(method="bandwidth floor (weight bytes / copy bandwidth)", tokens_per_s=1e3 / floor_ms,
                     ms_per_token=floor_ms))
    for row in rows:
        row["of_floor"] = floor_ms / row["ms_per_token"]
    reference = outputs["csd_engine eager, triton attention"]
    same = {label: tokens == reference for label, tokens in outputs.items()}
    plain = "csd_engine CUDA graphs, triton attention"
    fused = outputs.get(plain + ", fused kernels")
    return {"rows": rows, "same_tokens_as_eager_triton": same, "weight_bytes": models.weight_bytes,
            "prompt_tokens": len(prompt), "new_tokens": n,
            "fused_divergence": None if fused is None else divergence(models, prompt, outputs[plain], fused)}


def divergence(models: Models, prompt: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where two greedy outputs first differ, and how close the two chosen tokens were there
    under transformers' bf16 forward: a gap within the logits' bf16 spacing is a near-tie that
    any change of rounding order may flip, not a difference in the math."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None
    ids = torch.tensor([prompt + a[:i]], device=models.device)
    with torch.no_grad():
        logits = models.target(ids).logits[0, -1].float()
    top2 = logits.topk(2).values
    scale = float(logits.abs().max())
    return {"position": i, "tokens": [a[i], b[i]], "logit_gap": float(logits[a[i]] - logits[b[i]]),
            "top2_gap": float(top2[0] - top2[1]), "max_abs_logit": scale,
            "bf16_spacing_at_max": 2.0 ** (int(torch.tensor(scale).log2().floor()) - 7)}


def hf_generate(models: Models, prompt: list[int], compiled: bool) -> list[int]:
    ids = torch.tensor([prompt], device=models.device)
    n = models.sizes.new_tokens
    with torch.inference_mode():
        out = models.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, cache_implementation="static", disable_compile=not compiled,
                                     pad_token_id=0)
    return out[0, len(prompt):].tolist()


# -- 5. time split of a speculative step ----------------------------------------------------------
def bench_step_split(models: Models, graphs: bool, on_row=lambda rows: None) -> list[dict]:
    """Per strategy and variant, tokens/s and where a step's time goes; `on_row(rows)` after each
    row (the JSON keeps what a run cut short measured)."""
    sizes, device = models.sizes, models.device
    prompt = models.prompt()
    params = csd_engine.SamplingParams(max_new_tokens=sizes.new_tokens, ignore_eos=True)
    strategies = chosen(sizes, [
        ("autoregressive", csd_engine.Autoregressive(), False), ("chain k=4", csd_engine.Speculative(k=4), False),
        ("cascade K=[[4,2],[0,4]] l=2, MaG", csd_engine.Cascade(k_matrix=((4, 2), (0, 4)), lenience=2.0, mag_tokens=4),
         True),
        # per-row draft lengths chosen every step on the device (issue 17) beside the fixed ones
        ("Speculative.auto()", csd_engine.Speculative.auto(), False),
        ("Cascade.auto(), MaG", csd_engine.Cascade.auto(), True),
        # each row chooses the top-level tree where its siblings pay for their width (nearly free here)
        ("Cascade.auto(tree=(3, 2)), MaG", csd_engine.Cascade.auto(tree=(3, 2)), True)])
    rows = []

    def so_far(more):
        on_row(rows + more)

    if graphs:  # one graph per step at batch 1 and 8 first, issue 11's comparison: kept if a time limit cuts the run
        rows += step_graph_rows(models, strategies, prompt, params, batches=(1, sizes.batch), on_row=so_far)
    for variant in ("CUDA graphs", "eager, sdpa") if graphs else ("eager, sdpa",):
        for name, strategy, with_mag in strategies:
            target, drafter = models.target_runner, models.drafter_runner
            target.attention_backend = drafter.attention_backend = "sdpa"
            if variant == "CUDA graphs":
                target, drafter = GraphedRunner(target), GraphedRunner(drafter)
            engine = engine_for(target, [drafter] + ([MaG()] if with_mag else []), models)
            engine.generate([prompt], params, strategy=strategy)  # warm-up
            result, seconds = wall_s(lambda: engine.generate([prompt], params, strategy=strategy)[0], device)
            stopwatch = Stopwatch(device)
            with instrumented(engine, stopwatch):
                timed, timed_seconds = wall_s(lambda: engine.generate([prompt], params, strategy=strategy)[0], device)
            steps = timed.metrics.target_forwards
            split = {part: s / steps * 1e3 for part, s in stopwatch.seconds.items()}
            rows.append(dict(strategy=name, variant=variant, tokens_per_s=result.metrics.new_tokens / seconds,
                             ms_per_step=seconds / result.metrics.target_forwards * 1e3,
                             mean_accepted=result.metrics.mean_accepted_tokens,
                             acceptance=result.metrics.accepted / max(result.metrics.drafted, 1),
                             timed_ms_per_step=timed_seconds / steps * 1e3,
                             target_ms=split.get("target", 0.0), drafters_ms=split.get("drafters", 0.0),
                             verify_ms=split.get("verify", 0.0), sample_ms=split.get("sample", 0.0),
                             mag_ms=split.get("mag", 0.0),
                             other_ms=timed_seconds / steps * 1e3 - sum(split.values())))
            progress(f"split {name}, {variant}: {rows[-1]['ms_per_step']:.2f} ms/step")
            on_row(rows)
    if graphs:
        # sampling with top-k / top-p: the steps that launch the most (emitted distributions, q)
        sampling = csd_engine.SamplingParams(max_new_tokens=sizes.new_tokens, ignore_eos=True, temperature=0.8,
                                             top_k=50, top_p=0.95, seed=1)
        sampled = chosen(sizes, [(f"{name}, T=0.8 top-k 50 top-p 0.95", strategy, with_mag)
                                 for name, strategy, with_mag in strategies if name.startswith(("chain", "cascade"))])
        rows += step_graph_rows(models, sampled, prompt, sampling, batches=(1,), on_row=so_far)
    return rows


def step_graph_rows(models: Models, strategies, prompt, params, batches=(1, 8), on_row=lambda rows: None) -> list[dict]:
    """Engine(cuda_graphs="step"): each whole step replays one CUDA graph (no split: a graph's
    parts are not timed apart), at each of `batches` (distinct prompts). Its tokens must equal an
    eager engine's on the same (Triton) attention (seeded when sampling). Graphs live as long as their scheduler
    (a server's one): the two warm-up batches and the timed one share it, so the timed batch
    measures replays only (its `captured_while_timed` says whether any key was new there)."""
    rows = []
    for batch in batches:
        prompts = [prompt] + [models.prompt() for _ in range(batch - 1)]
        for name, strategy, with_mag in strategies:
            target, drafter = models.target_runner, models.drafter_runner
            row = dict(strategy=name, variant="one graph per step" if batch == 1 else f"one graph per step, batch {batch}")
            try:  # the reference runs the attention kernel the graphs run (SDPA rounds differently)
                target.attention_backend = drafter.attention_backend = "triton"
                eager = engine_for(target, [drafter] + ([MaG()] if with_mag else []), models, batch=batch)
                reference = [r.token_ids for r in eager.generate(prompts, params, strategy=strategy)]
                engine = engine_for(target, [drafter] + ([MaG()] if with_mag else []), models, cuda_graphs="step",
                                    batch=batch)
                with engine.scheduler(strategy, rows=batch) as scheduler:
                    def one_batch():
                        ids = [scheduler.add(p, params) for p in prompts]
                        done = {}
                        while scheduler.has_unfinished():
                            done.update((out.request_id, out.result) for out in scheduler.step() if out.finished)
                        return [done[i] for i in ids]

                    # Warm-up: a step key runs eagerly on its first visit and is captured on its second, so
                    # a key visited once per batch (the first step's, a rare draft length) is captured in
                    # the second batch. Two batches: the timed one only replays (a capture in it runs
                    # the whole step's Python and instantiates a graph, spread over the timed steps).
                    one_batch()
                    one_batch()
                    graphs = scheduler.step_graphs.graphs if scheduler.step_graphs else {}
                    before = len(graphs)
                    results, seconds = wall_s(one_batch, models.device)
                    row["graphs"] = len(graphs)
                    row["captured_while_timed"] = len(graphs) - before
                forwards = max(r.metrics.target_forwards for r in results)
                row.update(tokens_per_s=sum(r.metrics.new_tokens for r in results) / seconds,
                           ms_per_step=seconds / forwards * 1e3,
                           mean_accepted=sum(r.metrics.mean_accepted_tokens for r in results) / batch,
                           drafted_per_step=sum(r.metrics.drafted / r.metrics.target_forwards for r in results) / batch,
                           same_tokens_as_eager=[r.token_ids for r in results] == reference)
                progress(f"step graphs {name}, batch {batch}: {row['ms_per_step']:.2f} ms/step, "
                         f"same tokens: {row['same_tokens_as_eager']}")
            except Exception as error:  # noqa: BLE001 - recorded, the other rows still run
                row["error"] = f"{type(error).__name__}: {error}"[:500]
                progress(f"step graphs {name}, batch {batch}: FAILED {row['error']}")
            finally:
                target.attention_backend = drafter.attention_backend = "sdpa"
            rows.append(row)
            on_row(rows)
    return rows


# -- 6. where a target forward's GPU time goes ------------------------------------------------------
def kernel_category(name: str) -> str:
    lowered = name.lower()
    if any(name in lowered for name in ("_stats_kernel", "_position_kernel", "_emit_split_kernel", "_emit_kernel",
                                         "_tree_verify_kernel", "_emitted_sums_kernel", "_emitted_write_kernel")):
        return "verify"  # kernels/verify.py's four, tree_verify.py's one, emitted.py's two
    if "_mag_kernel" in lowered:
        return "mag"
    if "attention" in lowered or "attn" in lowered or "flash" in lowered or "fmha" in lowered:
        return "attention"
    if "rmsnorm" in lowered or "rope" in lowered:
        return "norm_rope"
    if any(word in lowered for word in ("gemm", "gemv", "nvjet", "cutlass", "cublas", "sm90_xmma", "matmul")):
        return "matmul"
    return "other"


def bench_forward_profile(models: Models, copy_gb_per_s: float) -> list[dict]:
    """One target forward of n new tokens (n = 1: decoding, n = 5: a chain of 4 drafts) at a
    512-token context, with the runner's PyTorch norms / RoPE and with the fused kernels: its
    time replayed from a CUDA graph, launched eagerly, its GPU kernel time by category
    (torch.profiler, eager, Triton attention), and the weight-bandwidth floor."""
    from torch.profiler import ProfilerActivity, profile
    sizes, device, runner = models.sizes, models.device, models.target_runner
    context = min(512, sizes.max_seq_len // 2)
    floor_ms = models.weight_bytes / copy_gb_per_s / 1e6
    on_gpu = device.type == "cuda"
    rows = []
    for fused in (False, True) if on_gpu else (False,):
        runner.fused = fused
        graphed = GraphedRunner(runner)
        graphed.allocate(1, sizes.max_seq_len + 256)
        for n in (1, 5):
            ids = torch.randint(0, sizes.model["vocab_size"], (1, n), device=device)

            def forward(r=graphed, ids=ids, n=n):
                r.cache.lengths.fill_(context)
                return r(ForwardBatch.chain(ids, r.cache.lengths, context + n))

            forward()  # capture
            replay_ms = time_ms(forward, device)
            eager = lambda: forward(runner)  # noqa: E731
            eager_ms = time_ms(eager, device)
            with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    eager()
                sync(device)
            by_category, kernels = defaultdict(float), 0
            for event in prof.key_averages():
                if not on_gpu:  # dry run: the CPU ops stand in for kernels
                    by_category[kernel_category(event.key)] += event.self_cpu_time_total / 5 / 1e3
                    kernels += event.count
                elif event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
                    by_category[kernel_category(event.key)] += event.self_device_time_total / 5 / 1e3
                    kernels += event.count
            busy = sum(by_category.values())
            rows.append(dict(path="fused" if fused else "pytorch", n=n, context=context, graph_ms=replay_ms,
                             eager_ms=eager_ms, kernel_ms=busy, matmul_ms=by_category["matmul"],
                             attention_ms=by_category["attention"], norm_rope_ms=by_category["norm_rope"],
                             other_ms=by_category["other"], kernels=kernels // 5, floor_ms=floor_ms,
                             of_floor=floor_ms / replay_ms))
            progress(f"forward {rows[-1]['path']} n={n}: graph {replay_ms:.2f} ms, kernels {busy:.2f} ms")
    runner.fused = models.fused
    return rows


def bench_step_profile(models: Models) -> list[dict]:
    """Each strategy's GPU kernel time per step by category (torch.profiler over one eager
    generate's decoding steps, the prefill left out, with the Triton attention: the kernels a
    step graph replays), its kernels per
    step, and its five costliest kernels outside the model forwards. A step graph costs about
    the kernel time plus a few microseconds per kernel, so this says what the cascade's step
    adds to the chain's and where."""
    from torch.profiler import ProfilerActivity, profile
    device = models.device
    on_gpu = device.type == "cuda"
    prompt = models.prompt()
    greedy = csd_engine.SamplingParams(max_new_tokens=min(64, models.sizes.new_tokens), ignore_eos=True)
    sampling = replace(greedy, temperature=0.8, top_k=50, top_p=0.95, seed=1)
    cascade = csd_engine.Cascade(k_matrix=((4, 2), (0, 4)), lenience=2.0, mag_tokens=4)
    strategies = chosen(models.sizes, [
        ("autoregressive", csd_engine.Autoregressive(), False, greedy),
        ("chain k=4", csd_engine.Speculative(k=4), False, greedy),
        ("cascade K=[[4,2],[0,4]] l=2, MaG", cascade, True, greedy),
        ("Speculative.auto()", csd_engine.Speculative.auto(), False, greedy),
        ("Cascade.auto(), MaG", csd_engine.Cascade.auto(), True, greedy),
        # top-k / top-p: the chain's sampling step cost 4.2 ms more than its greedy one (H200 run 7)
        ("autoregressive, T=0.8 top-k 50 top-p 0.95", csd_engine.Autoregressive(), False, sampling),
        ("chain k=4, T=0.8 top-k 50 top-p 0.95", csd_engine.Speculative(k=4), False, sampling),
        ("cascade, T=0.8 top-k 50 top-p 0.95", cascade, True, sampling)])
    target, drafter = models.target_runner, models.drafter_runner
    rows = []
    try:
        target.attention_backend = drafter.attention_backend = "triton"
        for name, strategy, with_mag, params in strategies:
            engine = engine_for(target, [drafter] + ([MaG()] if with_mag else []), models)
            engine.generate([prompt], params, strategy=strategy)  # warm-up: Triton compiles
            with engine.scheduler(strategy, rows=1) as scheduler:
                scheduler.add(prompt, params)
                scheduler.step()  # the prefill and the first step, outside the profile: decoding steps only
                before = scheduler.state.metrics.target_forwards
                sync(device)
                with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
                    while scheduler.has_unfinished():
                        scheduler.step()
                    sync(device)
                steps = max(scheduler.state.metrics.target_forwards - before, 1)
            by_category, kernels, outside = defaultdict(float), 0, []
            for event in prof.key_averages():
                if on_gpu and (event.device_type != torch.autograd.DeviceType.CUDA or event.self_device_time_total <= 0):
                    continue
                us = (event.self_device_time_total if on_gpu else event.self_cpu_time_total) / steps
                category = kernel_category(event.key)
                by_category[category] += us / 1e3
                kernels += event.count
                if category not in ("matmul", "attention", "norm_rope"):
                    outside.append((us, event.count / steps, event.key))
            outside.sort(reverse=True)
            rows.append(dict(strategy=name, steps=steps, kernels_per_step=kernels / steps,
                             kernel_ms_per_step=sum(by_category.values()),
                             **{f"{c}_ms": by_category[c] for c in ("matmul", "attention", "norm_rope", "verify", "mag",
                                                                     "other")},
                             top_other=[dict(kernel=k[:120], us_per_step=us, per_step=n) for us, n, k in outside[:5]]))
            progress(f"step profile {name}: {rows[-1]['kernels_per_step']:.0f} kernels, "
                     f"{rows[-1]['kernel_ms_per_step']:.2f} ms per step")
    finally:
        target.attention_backend = drafter.attention_backend = "sdpa"
    return rows


def bench_quantized_drafter(models: Models) -> list[dict]:
    """The drafter's forward with weight-only quantized projections and head (models/quant.py:
    torch's int8 / int4 packed-weight ops on CUDA) against bf16: graph-replayed ms for 1 and 5
    new tokens at batch 1 and `sizes.batch` (8), 512-token context, and the greedy agreement of its logits."""
    sizes, device = models.sizes, models.device
    context = min(512, sizes.max_seq_len // 2)
    rows, reference = [], {}
    int4 = "int4" if sizes.model["hidden_size"] % 128 == 0 else "int4g32"  # the dry run's 64-wide rows: groups of 32
    for scheme in ("bf16", "int8", int4):
        try:
            runner = LlamaRunner(models.drafter, device, DTYPE, fused=models.fused,
                                 quantize=None if scheme == "bf16" else scheme)
        except Exception as error:  # noqa: BLE001 - an op missing on this device is a result
            rows.append(dict(scheme=scheme, error=f"{type(error).__name__}: {error}"[:300]))
            progress(f"drafter {scheme}: FAILED {rows[-1]['error']}")
            continue
        graphed = GraphedRunner(runner)
        graphed.allocate(sizes.batch, sizes.max_seq_len + 256)
        for batch in (1, sizes.batch):
            graphed.use_rows(batch)
            for n in (1, 5):
                torch.manual_seed(batch * 10 + n)
                ids = torch.randint(0, sizes.model["vocab_size"], (batch, n), device=device)

                def forward(r=graphed, ids=ids, n=n):
                    r.cache.lengths.fill_(context)
                    return r(ForwardBatch.chain(ids, r.cache.lengths, context + n))

                logits = forward().float()  # capture
                ms = time_ms(forward, device)
                base = reference.setdefault((batch, n), (ms, logits.argmax(-1)))
                rows.append(dict(scheme=scheme, batch=batch, n=n, context=context, graph_ms=ms,
                                 x_bf16=ms / base[0], argmax_agrees=float((logits.argmax(-1) == base[1]).float().mean())))
                progress(f"drafter {scheme} batch {batch} n={n}: {ms:.3f} ms")
        del graphed, runner
    return rows


def bench_batch_invariance(models: Models) -> list[dict]:
    """What Engine(batch_invariant=True) costs and buys: one target forward (CUDA graph) at batch
    1 and `sizes.batch` (8), n = 1 and 5, default runner vs batch-invariant, and how far row 0's
    logits move between the two batches (0 = invariant)."""
    sizes, device, runner = models.sizes, models.device, models.target_runner
    context = min(512, sizes.max_seq_len // 2)
    saved = runner.row_block, runner.attention_backend
    rows = []
    for mode in ("default", "invariant"):
        if mode == "invariant":
            runner.make_batch_invariant()
        graphed = GraphedRunner(runner)  # switches the runner to the Triton attention
        graphed.allocate(sizes.batch, sizes.max_seq_len + 256)
        for n in (1, 5):
            ids = torch.randint(0, sizes.model["vocab_size"], (sizes.batch, n), device=device)
            logits = {}
            for batch in (1, sizes.batch):
                def forward(r=graphed, b=batch, ids=ids, n=n):
                    r.use_rows(b)
                    r.cache.lengths.fill_(context)
                    return r(ForwardBatch.chain(ids[:b], r.cache.lengths, context + n))

                logits[batch] = forward()[0].float()
                rows.append(dict(mode=mode, batch=batch, n=n, context=context, graph_ms=time_ms(forward, device)))
            moved = (logits[1] - logits[sizes.batch]).abs().max().item()
            for row in rows[-2:]:
                row["row0_logit_change"] = moved
            progress(f"batch invariance {mode} n={n}: {rows[-2]['graph_ms']:.2f} / {rows[-1]['graph_ms']:.2f} ms, "
                     f"row 0 moved {moved:.3g}")
    runner.row_block, runner.attention_backend = saved
    return rows


# -- 7. PEARL on one GPU: drafter and target on two streams -----------------------------------------
def bench_pearl(models: Models, gamma: int = 4) -> list[dict]:
    """Pearl(gamma) against Speculative(k=gamma) with the same synthetic drafter, eager and with
    CUDA graphs. Per round: one target forward of gamma tokens and gamma drafter steps, each timed
    alone ('sequential': their sum) and both at once as PEARL runs them ('concurrent': the drafter
    in a worker thread, on a side stream on CUDA); 'overlap' is the share of the shorter side that
    running them at once hid, (sequential - concurrent) / min(target, drafter steps): 1 hidden
    whole, 0 (or below, when contention costs more) not at all. A round of either strategy also
    verifies and does the engine's own work, which ms/round includes."""
    sizes, device = models.sizes, models.device
    prompt = models.prompt()
    params = csd_engine.SamplingParams(max_new_tokens=sizes.new_tokens, ignore_eos=True)
    rows = []
    # Triton's interpreter (dry run) is not thread-safe: the graphed runners' Triton attention
    # cannot run in PEARL's drafter thread there.
    for variant in ("eager, sdpa", "CUDA graphs") if device.type == "cuda" else ("eager, sdpa",):
        target, drafter = models.target_runner, models.drafter_runner
        target.attention_backend = drafter.attention_backend = "sdpa"
        if variant == "CUDA graphs":
            target, drafter = GraphedRunner(target), GraphedRunner(drafter)
        engine = engine_for(target, [drafter], models)
        alone, forwards = {}, {}
        for name, runner, n in (("target", target, gamma), ("drafter", drafter, 1)):
            ids = torch.randint(0, sizes.model["vocab_size"], (1, n), device=device)

            def forward(r=runner, ids=ids, n=n):
                r.cache.lengths.fill_(sizes.prompt_tokens + 32)
                return r(ForwardBatch.chain(ids, r.cache.lengths, sizes.prompt_tokens + 32 + n))

            forward()
            alone[name], forwards[name] = time_ms(forward, device), forward
        sequential = alone["target"] + gamma * alone["drafter"]
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="bench-pearl") as pool:
                both = concurrently(forwards["target"], lambda: [forwards["drafter"]() for _ in range(gamma)], pool,
                                    device)
                both()
                concurrent = time_ms(both, device)
        except Exception as error:  # noqa: BLE001 - the strategies' rows below still run
            concurrent = None
            progress(f"PEARL {variant}: the concurrent forwards FAILED ({type(error).__name__}: {error})")
        for name, strategy in (("Speculative k=%d" % gamma, csd_engine.Speculative(k=gamma)),
                               ("Pearl gamma=%d" % gamma, csd_engine.Pearl(gamma=gamma, overlap=True))):
            engine.generate([prompt], params, strategy=strategy)  # warm-up, graph capture
            result, seconds = wall_s(lambda: engine.generate([prompt], params, strategy=strategy)[0], device)
            m = result.metrics
            round_ms = seconds / m.target_forwards * 1e3
            row = dict(variant=variant, strategy=name, tokens_per_s=m.new_tokens / seconds, mean_accepted=m.mean_accepted_tokens,
                       ms_per_round=round_ms, target_alone_ms=alone["target"], drafter_steps_ms=gamma * alone["drafter"],
                       sequential_ms=sequential,
                       wait_target_ms=m.wait_time_s.get("target", 0.0) / m.target_forwards * 1e3,
                       wait_drafter_ms=m.wait_time_s.get("drafter", 0.0) / m.target_forwards * 1e3)
            if name.startswith("Pearl") and concurrent is not None:
                row["concurrent_ms"] = concurrent
                row["overlap"] = (sequential - concurrent) / min(alone["target"], gamma * alone["drafter"])
            rows.append(row)
            progress(f"{name}, {variant}: {row['tokens_per_s']:.1f} tokens/s, {round_ms:.2f} ms/round")
    return rows


def concurrently(here, there, pool: ThreadPoolExecutor, device: torch.device):
    """A call that runs `there` in `pool`'s worker thread (on a side stream on CUDA, which waits
    for the main stream first and is waited for at the end) while `here` runs in this one, and
    returns once both are done: how PEARL runs a round's target forward and drafter steps."""
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def in_worker():
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            there()

    def both():
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        job = pool.submit(in_worker)
        try:
            here()
        finally:
            job.result()
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)

    return both


# -- driver ---------------------------------------------------------------------------------------
class Report:
    """Sections run in order; each failure is printed and recorded, and the JSON is rewritten
    after every section so a run cut short still leaves its results. Once --budget-s is spent
    (checked before each section), the sections left are skipped, each recorded as such."""

    def __init__(self, args, header: dict):
        self.args, self.path = args, harness.record_path("gpu", args)
        self.payload = {**header, "sections": {}}
        self.start = time.perf_counter()

    def left_s(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.start)

    def skip(self, section: str, why: str) -> dict:
        """Records `section` as skipped, saying why; the result print_section passes over."""
        print(f"\n{section}: skipped ({why})")
        result = {"skipped": why}
        self.payload["sections"][section] = result
        harness.write_record(self.path, self.payload, self.args)
        return result

    def run(self, section: str, fn, needs_s: float = 0.0):
        """fn()'s result (or its error) recorded as `section`, unless less than `needs_s` seconds
        of --budget-s are left (none left: every section is skipped)."""
        left = self.left_s()
        if left <= needs_s:
            spent = self.args.budget_s - left
            return self.skip(section, f"--budget-s {self.args.budget_s:g}: {spent:.0f} s spent"
                             + (f", and it needs {needs_s:.0f} s" if needs_s else ""))
        progress(f"== {section}")
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001  one section's failure must not lose the others
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"\n{section}: FAILED ({result['error']})")
        self.payload["sections"][section] = result
        harness.write_record(self.path, self.payload, self.args)
        return result

    def partial(self, section: str, rows: list) -> None:
        """Record a section's rows so far: a run cut short by its time limit keeps them."""
        self.payload["sections"][section] = rows
        harness.write_record(self.path, self.payload, self.args)


def print_section(title: str, result, columns) -> None:
    if isinstance(result, dict) and ("error" in result or "skipped" in result):
        return
    rows = result["rows"] if isinstance(result, dict) else result
    print(f"\n{title}")
    print_table(rows, columns)


SECTIONS = ("verify", "attention", "mag", "autoregressive", "step_split", "step_profile", "forward_profile", "quantized_drafter",
            "batch_invariance", "pearl", "transformers_compiled")


def main(argv=None):
    ap = harness.parser(__doc__)  # --dry-run: tiny shapes on the CPU (Triton interpreter)
    ap.add_argument("--residual-scale", type=harness.non_negative_float, default=0.05,
                    help="factor >= 0 on the output projections of the target's layers past the drafter's: how "
                         "far the target strays from its drafter (0: the target equals its drafter; 1: unscaled "
                         "random layers, little agreement; default 0.05)")
    ap.add_argument("--unfused", action="store_true",
                    help="native runners with plain PyTorch RMSNorm / RoPE instead of the fused kernels (the CUDA "
                         "default); autoregressive and forward_profile always time both")
    ap.add_argument("--budget-s", type=harness.positive_float, default=500.0,
                    help="seconds the whole run may take, checked before each section: once spent, the sections "
                         f"left are skipped (recorded as such); transformers_compiled needs {COMPILE_BUDGET_S} s "
                         "of it left (default 500)")
    ap.add_argument("--sections", type=harness.names(SECTIONS), default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)} (default all; the copy bandwidth "
                         "always runs)")
    args = ap.parse_args(argv)
    harness.start(args)
    wanted = set(args.sections)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the CPU smoke test")
    sizes = DRY_RUN if args.dry_run else Sizes()
    header = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
              "sizes": asdict(sizes), "fused_kernels": not args.unfused and device.type == "cuda"}
    print(f"device={header['device']} " + " ".join(f"{k}={v}" for k, v in harness.versions().items()))
    report = Report(args, header)
    run_sections(args, wanted, sizes, device, report)
    harness.finish(report.path, args)


def run_sections(args, wanted: set, sizes: Sizes, device: torch.device, report: Report) -> None:
    copy = report.run("copy_bandwidth", lambda: copy_bandwidth(sizes, device))
    copy_gb_per_s = copy.get("gb_per_s", float("nan"))
    print(f"\ncopy bandwidth: {copy_gb_per_s:.0f} GB/s (bytes read + written per second, {sizes.copy_bytes >> 20} MiB)")

    if "verify" in wanted:
        verify_rows = report.run("verify_kernel", lambda: bench_verify(sizes, device, copy_gb_per_s))
        print_section("chain verification kernel: 'us' launched from Python, 'graph us' replayed from a CUDA graph "
                      "(the kernels' own time); GB/s: logits bytes read / graph time (of_copy: fraction of the "
                      "copy bandwidth)", verify_rows,
                      [("vocab", "V", "d"), ("batch", "B", "d"), ("k", "k", "d"), ("mode", "mode", "s"),
                       ("us", "us", ".1f"), ("graph_us", "graph us", ".1f"), ("gb_per_s", "GB/s", ".0f"),
                       ("of_copy", "of copy", ".2f")])

    if "attention" in wanted:
        attention_rows = report.run("attention_kernel", lambda: bench_attention(sizes, device, copy_gb_per_s))
        print_section(f"attention, {sizes.heads} heads x {sizes.head_dim}, bf16: Triton cache_attention vs the runner's "
                      "SDPA path; 'us': launched from Python, 'graph us': replayed from a CUDA graph "
                      "(GB/s: K and V bytes / graph time)", attention_rows,
                      [("batch", "B", "d"), ("n", "n", "d"), ("context", "context", "d"),
                       ("triton_us", "triton us", ".1f"), ("sdpa_us", "sdpa us", ".1f"), ("speedup", "speedup", ".2f"),
                       ("triton_graph_us", "triton graph us", ".1f"), ("sdpa_graph_us", "sdpa graph us", ".1f"),
                       ("graph_speedup", "graph speedup", ".2f"), ("triton_gb_per_s", "triton GB/s", ".0f"),
                       ("of_copy", "of copy", ".2f"), ("max_abs_diff", "max diff", ".1e")])

    if "mag" in wanted:
        mag_rows = report.run("mag_kernel", lambda: bench_mag(sizes, device))
        print_section("MaG's proposal kernel (max_match 32, one match per row): 'us' launched from Python, "
                      "'graph us' replayed from a CUDA graph (what a step graph pays per MaG call)", mag_rows,
                      [("batch", "B", "d"), ("context", "context", "d"), ("m", "m", "d"), ("us", "us", ".1f"),
                       ("graph_us", "graph us", ".1f")])

    models = Models(sizes, device, args.residual_scale, fused=not args.unfused)
    shape = "tiny" if args.dry_run else "Llama-2-7B"
    if "forward_profile" in wanted:
        profile_rows = report.run("forward_profile", lambda: bench_forward_profile(models, copy_gb_per_s))
        print_section(f"one {shape}-shaped target forward, batch 1: CUDA-graph replay vs eager launch, and the eager "
                      "run's GPU kernel time by category (torch.profiler)", profile_rows,
                      [("path", "norms/rope", "s"), ("n", "n", "d"), ("context", "context", "d"),
                       ("graph_ms", "graph ms", ".2f"),
                       ("eager_ms", "eager ms", ".2f"), ("kernel_ms", "kernels ms", ".2f"),
                       ("matmul_ms", "matmul", ".2f"), ("attention_ms", "attention", ".2f"),
                       ("norm_rope_ms", "norm+rope kernels", ".2f"), ("other_ms", "other", ".2f"),
                       ("kernels", "kernels", "d"), ("floor_ms", "floor ms", ".2f"), ("of_floor", "of floor", ".2f")])

    if "quantized_drafter" in wanted:
        quantized = report.run("quantized_drafter", lambda: bench_quantized_drafter(models))
        print_section(f"the drafter ({sizes.drafter_layers} {shape} layers + head) with weight-only quantized "
                      "projections and head vs bf16: one forward replayed from a CUDA graph", quantized,
                      [("scheme", "scheme", "s"), ("batch", "B", "d"), ("n", "n", "d"), ("graph_ms", "graph ms", ".3f"),
                       ("x_bf16", "x bf16", ".2f"), ("argmax_agrees", "argmax = bf16", ".2f")])

    if "batch_invariance" in wanted:
        invariance = report.run("batch_invariance", lambda: bench_batch_invariance(models))
        print_section(f"Engine(batch_invariant=True): one {shape}-shaped target forward (CUDA graph) vs the default "
                      f"runner, and how far row 0's logits move between batch 1 and batch {sizes.batch} (0: invariant)",
                      invariance,
                      [("mode", "mode", "s"), ("batch", "B", "d"), ("n", "n", "d"), ("context", "context", "d"),
                       ("graph_ms", "graph ms", ".2f"), ("row0_logit_change", "row 0 change", ".2g")])

    ar = None
    if "autoregressive" in wanted:
        ar = report.run("autoregressive", lambda: bench_autoregressive(models, copy_gb_per_s))
        print_section(f"autoregressive, {shape}-shaped random bf16 weights, batch 1, greedy, {sizes.prompt_tokens}-token "
                      f"prompt + {sizes.new_tokens} tokens (wall time of the whole call, prefill included)", ar,
                      [("method", "method", "s"), ("tokens_per_s", "tokens/s", ".1f"), ("ms_per_token", "ms/token", ".2f"),
                       ("of_floor", "of floor", ".2f")])
        if isinstance(ar, dict) and "same_tokens_as_eager_triton" in ar:
            print(f"same tokens as eager triton: {ar['same_tokens_as_eager_triton']}")
            print(f"graphed plain vs fused, first differing token: {ar['fused_divergence']}")

    if "step_split" in wanted:
        graphs_work = ar is None or (isinstance(ar, dict) and "rows" in ar)
        split = report.run("step_split", lambda: bench_step_split(
            models, graphs=graphs_work, on_row=lambda rows: report.partial("step_split", rows)))
        print_section(f"time split per step (ms). Drafter: the target's first {sizes.drafter_layers} layers with its "
                      f"embeddings, norm and head; the target's other layers scaled by {args.residual_scale} "
                      "(synthetic agreement). Split columns come from a second run with a device sync around each "
                      "timed call (timed ms/step); ms/step is the run without them", split,
                      [("strategy", "strategy", "s"), ("variant", "variant", "s"), ("tokens_per_s", "tokens/s", ".1f"),
                       ("ms_per_step", "ms/step", ".2f"), ("mean_accepted", "MAT", ".2f"),
                       ("acceptance", "accept", ".2f"), ("timed_ms_per_step", "timed ms/step", ".2f"),
                       ("target_ms", "target", ".2f"), ("drafters_ms", "drafters", ".2f"), ("verify_ms", "verify", ".2f"),
                       ("sample_ms", "sample", ".2f"), ("mag_ms", "MaG", ".2f"), ("other_ms", "other", ".2f"),
                       ("graphs", "graphs", "d"), ("captured_while_timed", "captured timed", "d"),
                       ("drafted_per_step", "drafted", ".2f"),
                       ("same_tokens_as_eager", "= eager", "")])

    if "step_profile" in wanted:
        step_profile = report.run("step_profile", lambda: bench_step_profile(models))
        print_section(f"GPU kernel time per step (ms; torch.profiler, one eager generate, batch 1, {shape}-shaped "
                      "pair, Triton attention: the kernels a step graph replays)", step_profile,
                      [("strategy", "strategy", "s"), ("kernels_per_step", "kernels", ".0f"),
                       ("kernel_ms_per_step", "kernel ms", ".2f"), ("matmul_ms", "matmul", ".2f"),
                       ("attention_ms", "attention", ".2f"), ("norm_rope_ms", "norm+rope", ".2f"),
                       ("verify_ms", "verify", ".3f"), ("mag_ms", "MaG", ".3f"), ("other_ms", "other", ".3f")])
        for row in step_profile if isinstance(step_profile, list) else []:
            top = "; ".join(f"{t['kernel'][:60]} {t['us_per_step']:.1f} us ({t['per_step']:.1f}x)" for t in row["top_other"])
            print(f"  {row['strategy']}: {top}")

    if "pearl" in wanted:
        pearl = report.run("pearl", lambda: bench_pearl(models))
        print_section("PEARL on one GPU (drafter on a side stream, same synthetic drafter) vs Speculative; per round: "
                      "the target forward and the drafter's steps timed alone, their sum (sequential), both at once "
                      "as PEARL runs them (concurrent), and the share of the shorter side that running them at once "
                      "hid (overlap: 1 whole, 0 or below none); ms/round also holds the verification and the "
                      "engine's own work", pearl,
                      [("variant", "variant", "s"), ("strategy", "strategy", "s"), ("tokens_per_s", "tokens/s", ".1f"),
                       ("mean_accepted", "MAT", ".2f"), ("ms_per_round", "ms/round", ".2f"),
                       ("target_alone_ms", "target", ".2f"), ("drafter_steps_ms", "drafter steps", ".2f"),
                       ("sequential_ms", "sequential", ".2f"), ("concurrent_ms", "concurrent", ".2f"),
                       ("overlap", "overlap", ".2f"),
                       ("wait_target_ms", "target waits", ".2f"), ("wait_drafter_ms", "drafter waits", ".2f")])

    if "transformers_compiled" not in wanted:
        return
    if device.type != "cuda":
        report.skip("transformers_compiled", "no CUDA")
        return

    def compiled_generate():
        prompt, n = models.prompt(), sizes.new_tokens
        hf_generate(models, prompt, compiled=True)  # warm-up: compiles
        _, seconds = wall_s(lambda: hf_generate(models, prompt, compiled=True), device)
        return [dict(method="transformers generate, static cache + torch.compile", tokens_per_s=n / seconds,
                     ms_per_token=seconds / n * 1e3)]

    compiled = report.run("transformers_compiled", compiled_generate, needs_s=COMPILE_BUDGET_S)
    print_section("transformers generate with its automatic torch.compile (same model and prompt length)", compiled,
                  [("method", "method", "s"), ("tokens_per_s", "tokens/s", ".1f"), ("ms_per_token", "ms/token", ".2f")])


if __name__ == "__main__":
    harness.run(main)
