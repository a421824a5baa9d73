"""The OpenAI-compatible HTTP server behind `csd-engine serve`: `build_app(async_engine, name)`.

    POST /v1/completions        prompt (text, token ids, or a list of either), stream as SSE
    POST /v1/chat/completions   messages through the tokenizer's chat template, stream as SSE
    GET  /v1/models, /health, /metrics (Prometheus text, vLLM's metric names)

Request fields are OpenAI's; extensions: `top_k`, `ignore_eos`, `stop_token_ids`. Each choice
(and each streamed chunk) carries `token_ids`, the tokens its text came from. `logprobs` returns
the chosen tokens' log-probabilities only, no alternatives, under the distribution the target
sampled from (tempered and filtered; the raw model's for greedy rows), where vLLM returns the
raw model's. Fields of OpenAI's API that this server does not implement are accepted at their
neutral value only (presence_penalty 0, echo false...); any other field is refused, so a
misspelt one is not silently ignored. A `developer` message is a system message for templates
that do not know the role. A response's completions (n per prompt) are queued all or none.

Errors have OpenAI's body, {"error": {"message", "type", "param", "code"}}, with a message
naming the field: 400 bad request (also more completions than rows + max_waiting), 404 unknown
model or path, 429 queue full, 500 a request that failed (non-finite logits: that request alone;
the server goes on), 503 once the engine has stopped. A client that disconnects aborts its
requests (their rows are freed at the next step). Prompts are tokenized beside the engine's
steps (AsyncEngine.tokenize), so a long one does not stall the others' streams.
"""
import asyncio
import contextlib
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from csd_engine.checks import is_int, is_number, is_unicode
from csd_engine.params import MAX_SEED, MAX_TOP_K, MIN_TEMPERATURE, SamplingParams
from csd_engine.scheduler import QueueFull, RequestOutput
from csd_engine.serving.async_engine import EngineStopped
from csd_engine.text import TextOffsets, token_bytes

log = logging.getLogger(__name__)

MAX_N = 128  # choices per request
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "logprobs", "stream",
                 "stream_options", "ignore_eos", "stop_token_ids", "user"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
# OpenAI fields not implemented, accepted at the value that means "off" (and of its type: echo 0 is refused)
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {}, "echo": False, "suffix": "",
           "best_of": 1}
ROLES = ("system", "developer", "user", "assistant")  # chat roles (no tools, so no "tool" messages)
# vLLM's bucket bounds, with finer ones below 10 ms for small models
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class APIError(Exception):
    """An error response: HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def __reduce__(self):  # pickle and copy rebuild it from every field, not from the message alone
        return type(self), (self.status, self.message, self.param, self.kind, self.code)


def _bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param)


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_neutral(value, neutral) -> bool:
    """`value` is `neutral` in value and kind (a penalty may be 0 or 0.0; best_of 1, not true)."""
    if isinstance(neutral, float):
        return is_number(value) and value == neutral
    return type(value) is type(neutral) and value == neutral


class Body:
    """A request's JSON object, read field by field; every refusal names its field."""

    def __init__(self, body, allowed: set[str]):
        if not isinstance(body, dict):
            raise _bad(None, f"the request body must be a JSON object, got {_show(body)}")
        # null is "not given" in OpenAI's API (clients send `"tools": null`): only a value is refused
        unknown = sorted(name for name in set(body) - allowed - set(NEUTRAL) if body[name] is not None)
        if unknown:
            raise _bad(unknown[0], f"unknown field {unknown[0]!r}; fields: {', '.join(sorted(allowed | set(NEUTRAL)))}")
        for name, neutral in NEUTRAL.items():
            if body.get(name) is not None and not _is_neutral(body[name], neutral):
                raise _bad(name, f"{name} is not supported: only {_show(neutral)} (or leaving it out), "
                                 f"got {_show(body[name])}")
        self.body = body

    def given(self, name: str) -> bool:
        return self.body.get(name) is not None

    def integer(self, name: str, default, low: int | None = None, high: int | None = None, extra: str = ""):
        value = self.body.get(name)
        if value is None:
            return default
        if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
            bounds = f" >= {low}" if high is None else f" in [{low}, {high}]"
            raise _bad(name, f"{name} must be an integer{bounds if low is not None else ''}{extra}, got {_show(value)}")
        return value

    def number(self, name: str, default: float, check, allowed: str) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if not is_number(value) or not check(value):
            raise _bad(name, f"{name} must be {allowed}, got {_show(value)}")
        return float(value)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise _bad(name, f"{name} must be true or false, got {_show(value)}")
        return value


def sampling_params(body: Body, chat: bool, vocab_size: int, max_seq_len: int) -> tuple[list[SamplingParams], bool]:
    """The request's SamplingParams, one per choice (`n`; seeds seed+i when seeded), and whether
    it asks for log-probabilities."""
    if chat and body.given("max_completion_tokens") and body.given("max_tokens"):
        raise _bad("max_completion_tokens", "give max_completion_tokens or max_tokens, not both")
    name = "max_completion_tokens" if chat and body.given("max_completion_tokens") else "max_tokens"
    # OpenAI's defaults: 16 tokens for a completion, the rest of the context for a chat reply.
    max_tokens = body.integer(name, max_seq_len if chat else 16, low=1)
    temperature = body.number("temperature", 1.0, lambda v: v == 0 or v >= MIN_TEMPERATURE,
                              f"0 (greedy) or a number >= {MIN_TEMPERATURE}")
    top_p = body.number("top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1] (1 = off)")
    top_k = body.integer("top_k", 0, low=-1, high=MAX_TOP_K, extra=" (0 or -1 = off)")
    n = body.integer("n", 1, low=1, high=MAX_N)
    seed = body.integer("seed", None, low=0, high=MAX_SEED - (n - 1),
                        extra=f" (choice i of n = {n} is seeded seed + i)" if n > 1 else "")
    stop = body.body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s and is_unicode(s)
                                                                    for s in stop)):
        raise _bad("stop", f"stop must be a non-empty string or a list of them (valid Unicode: no lone "
                           f"surrogates), got {_show(body.body['stop'])}")
    stop_ids = body.body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list)
                                 or not all(is_int(t) and 0 <= t < vocab_size for t in stop_ids)):
        raise _bad("stop_token_ids", f"stop_token_ids must be a list of token ids in [0, {vocab_size}), "
                                     f"got {_show(stop_ids)}")
    if chat:
        logprobs = body.boolean("logprobs")
        if body.body.get("top_logprobs") not in (None, 0):
            raise _bad("top_logprobs", f"top_logprobs must be 0: alternatives are not returned (logprobs: true gives "
                                       f"the chosen tokens' log-probabilities), got {_show(body.body['top_logprobs'])}")
    else:
        value = body.body.get("logprobs")
        if value is not None and not isinstance(value, bool) and not (is_int(value) and value == 0):
            raise _bad("logprobs", f"logprobs must be true, false or 0: alternatives are not returned (0 or true "
                                   f"gives the chosen tokens' log-probabilities), got {_show(value)}")
        logprobs = value is not None and value is not False
    ignore_eos = body.boolean("ignore_eos")
    if not body.boolean("stream") and body.given("stream_options"):
        raise _bad("stream_options", "stream_options is only allowed with stream: true")
    if body.given("stream_options"):
        options = body.body["stream_options"]
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad("stream_options", f'stream_options must be {{"include_usage": true or false}}, got {_show(options)}')
        Body(options, {"include_usage"}).boolean("include_usage")
    try:
        return [SamplingParams(temperature=temperature, top_k=max(top_k, 0), top_p=top_p, max_new_tokens=max_tokens,
                               seed=None if seed is None else seed + i, stop=stop, stop_token_ids=stop_ids,
                               ignore_eos=ignore_eos, logprobs=logprobs) for i in range(n)], logprobs
    except (ValueError, TypeError) as exc:  # the checks above name the field first; this is a fallback
        raise _bad(None, str(exc)) from None


def chat_messages(body: Body) -> list[dict]:
    """`messages` as the chat template takes them: role and text content. Text parts are joined
    by newlines (as vLLM joins them); only an assistant's content may be null or left out."""
    messages = body.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"messages must be a non-empty list of {{\"role\", \"content\"}} objects, "
                               f"got {_show(messages)}")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise _bad("messages", f"{where} must be an object whose role is one of {', '.join(ROLES)}, "
                                   f"got {_show(message)}")
        extra = sorted(set(message) - {"role", "content"})
        if extra:  # name, tool_calls, ...: refused rather than dropped
            raise _bad("messages", f"{where}.{extra[0]} is not supported: a message has a role and a content only")
        content = message.get("content")
        if isinstance(content, list):
            if not content or not all(isinstance(p, dict) and p.get("type") == "text"
                                      and isinstance(p.get("text"), str) for p in content):
                raise _bad("messages", f"{where}.content: a list must hold text parts ({{\"type\": \"text\", "
                                       f"\"text\": ...}}), at least one, got {_show(content)}")
            extra = next((f"[{j}].{sorted(set(p) - {'type', 'text'})[0]}" for j, p in enumerate(content)
                          if set(p) - {"type", "text"}), None)
            if extra:  # an image_url, cache_control...: refused rather than dropped
                raise _bad("messages", f"{where}.content{extra} is not supported: a text part has a type and a "
                                       "text only")
            content = "\n".join(p["text"] for p in content)
        elif content is None and message["role"] != "assistant":
            raise _bad("messages", f"{where}.content is required in a {message['role']} message (a string or a "
                                   "list of text parts)")
        elif content is not None and not isinstance(content, str):
            raise _bad("messages", f"{where}.content must be a string or a list of text parts, got {_show(content)}")
        if content and not is_unicode(content):
            raise _bad("messages", f"{where}.content is not valid Unicode text (it holds a lone surrogate)")
        out.append({"role": message["role"], "content": content or ""})
    return out


def completion_prompts(body: Body) -> list:
    """`prompt` as a list of prompts: text, token ids, or a list of either."""
    prompt = body.body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and all(is_int(t) for t in p)) for p in prompt):
        return prompt
    if prompt == [] or prompt == "":
        raise _bad("prompt", "prompt is empty")
    raise _bad("prompt", f"prompt must be a string, a list of token ids, or a list of either, got {_show(prompt)}")


class ServerMetrics:
    """/metrics: a registry of its own. Counters and gauges come from the engine's stats at each
    scrape (a request's tokens and drafts count once it finishes, aborted or not); the latency
    histograms are observed here, as the server hands increments out."""

    def __init__(self, async_engine, model_name: str):
        self.async_engine, self.model_name = async_engine, model_name
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from a request's arrival to its first token.",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's successive increments "
                             "(a speculative step hands out several tokens at once).", ["model_name"],
                             buckets=ITL_BUCKETS, registry=self.registry).labels(**labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from a request's arrival to its end.",
                             ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.registry.register(self)

    def collect(self):
        """The engine's counters and gauges (a custom collector of the registry)."""
        stats, name = self.async_engine.stats(), [self.model_name]

        def family(kind, metric, doc, value):
            f = kind(metric, doc, labels=["model_name"])
            f.add_metric(name, value)
            return f
        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in a row of the batch.", stats["running"])
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting for a row.", stats["waiting"])
        finished = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason (stop, length, "
                                       "abort, error).", labels=["model_name", "finished_reason"])
        for reason in ("stop", "length", "abort", "error"):
            finished.add_metric(name + [reason], stats["finished"].get(reason, 0))
        yield finished
        yield family(CounterMetricFamily, "vllm:prompt_tokens", "Prompt tokens prefilled.", stats["prompt_tokens"])
        yield family(CounterMetricFamily, "vllm:generation_tokens", "Tokens generated.", stats["generation_tokens"])
        yield family(CounterMetricFamily, "vllm:spec_decode_num_drafts", "Target reviews of at least one draft token.",
                     stats["drafts"])
        yield family(CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Draft tokens the target reviewed.",
                     stats["draft_tokens"])
        yield family(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
                     stats["accepted_tokens"])
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens the target "
                                           "accepted at each draft position (0 = first).",
                                           labels=["model_name", "position"])
        for position, accepted in enumerate(stats["accepted_per_position"]):
            per_position.add_metric(name + [str(position)], accepted)
        yield per_position


class _Server:
    """The routes' state: the engine, its tokenizer, the served name and the metrics."""

    def __init__(self, async_engine, model_name: str):
        self.engine, self.name = async_engine, model_name
        self.tokenizer = async_engine.engine.tokenizer
        self.max_seq_len = async_engine.engine.max_seq_len
        self.vocab_size = async_engine.engine.target.vocab_size
        self.created = int(time.time())
        self.metrics = ServerMetrics(async_engine, model_name)

    # -- requests --------------------------------------------------------------------------------
    def read(self, body, chat: bool) -> tuple[Body, list[SamplingParams], bool]:
        body = Body(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        model = body.body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("model", f"model must be a string, got {_show(model)}")
        if model is not None and model != self.name:
            raise APIError(404, f"model {model!r} not found; this server serves {self.name!r}", "model",
                           code="model_not_found")
        if body.given("user") and not isinstance(body.body["user"], str):
            raise _bad("user", f"user must be a string, got {_show(body.body['user'])}")
        params, logprobs = sampling_params(body, chat, self.vocab_size, self.max_seq_len)
        return body, params, logprobs

    async def encode(self, prompt, param: str) -> list[int]:
        try:
            return await self.engine.encode(prompt)
        except ValueError as exc:  # the engine's message begins "prompt ..."
            message = str(exc)
            if param != "prompt":
                message = param + message[len("prompt"):] if param.startswith("prompt[") else f"{param}: the {message}"
            raise _bad(param, message) from None

    async def chat_prompt(self, messages: list[dict]) -> list[int]:
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise _bad("messages", f"model {self.name!r} has no chat template: use /v1/completions")

        if "developer" not in str(tokenizer.chat_template):  # OpenAI's newer name for system, unknown to most templates
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]

        def render():
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
        try:
            ids = await self.engine.tokenize(render)
        except Exception as exc:  # the template's own refusals (jinja's raise_exception, say)
            raise _bad("messages", f"the chat template refused the messages: {exc}") from None
        return await self.encode(list(ids), "messages")

    async def track(self, stream, start: float):
        """One engine request's increments, timed from `start` for the latency histograms; a
        request whose client left first ends (aborted) when its stream is closed."""
        last, first, ended = start, True, False
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    now = time.perf_counter()
                    if out.token_ids:
                        (self.metrics.ttft if first else self.metrics.itl).observe(now - last)
                        first, last = False, now
                    if out.finished:
                        self.metrics.e2e.observe(now - start)
                        ended = True
                    yield out
        finally:
            if not ended:
                self.metrics.e2e.observe(time.perf_counter() - start)

    async def start(self, prompts: list[list[int]], params: list[SamplingParams], param: str, arrival: float):
        """Submit every (prompt, choice) pair at once, all or none, and wait for each one's first
        increment, so that a refusal (429) or a failure in the first step (500) is the whole
        response's status. Returns the streams and their first increments; on an error every
        stream is aborted. `param`: the field a response too large for the server is blamed on;
        `arrival`: when the request came (perf_counter), where its latencies start."""
        requests = [(ids, p) for ids in prompts for p in params]
        limit = self.engine.rows + self.engine.max_waiting if self.engine.max_waiting is not None else None
        if limit is not None and len(requests) > limit:
            raise _bad(param, f"{param}: {len(prompts)} prompt(s) x n={len(params)} are {len(requests)} completions "
                              f"at once, more than this server holds ({limit}: {self.engine.rows} rows and "
                              f"max_waiting={self.engine.max_waiting})")
        submitted = await self.engine.submit(requests)
        streams = [self.track(s, arrival) for s in submitted]
        tasks = [asyncio.ensure_future(anext(s)) for s in streams]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if t.exception() is not None]
            if failed:
                raise failed[0].exception()
            firsts = [t.result() for t in tasks]
            for out in firsts:
                if out.finish_reason == "error":
                    raise APIError(500, out.error or "the request failed", kind="server_error")
            return streams, firsts
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in submitted:
                await stream.aclose()  # aborts its request
            raise

    # -- responses -------------------------------------------------------------------------------
    def token_texts(self, ids: list[int]) -> tuple[list[str], list[bytes]]:
        """Each token decoded alone (U+FFFD for part of a character) and its own bytes."""
        if self.tokenizer is None:
            return [str(t) for t in ids], [str(t).encode() for t in ids]
        return [self.tokenizer.decode([t]) for t in ids], token_bytes(self.tokenizer, ids)

    def completion_logprobs(self, out: RequestOutput, offsets: TextOffsets) -> dict:
        """Each token as decoded alone, its log-probability, and the character where it starts
        (or completes a character begun before it) in the choice's text: `offsets` carries the
        choice's text over its chunks."""
        tokens, pieces = self.token_texts(out.token_ids)
        return {"tokens": tokens, "token_logprobs": out.logprobs, "top_logprobs": None,
                "text_offset": offsets.starts(pieces)}

    def chat_logprobs(self, out: RequestOutput) -> dict:
        tokens, pieces = self.token_texts(out.token_ids)
        return {"content": [{"token": t, "logprob": lp, "bytes": list(b), "top_logprobs": []}
                            for t, b, lp in zip(tokens, pieces, out.logprobs)]}

    @staticmethod
    def usage(prompts: list[list[int]], completion_tokens: int) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def respond(self, chat: bool, prompts, params, logprobs: bool, stream: bool, include_usage: bool,
                      arrival: float):
        streams, firsts = await self.start(prompts, params, "n" if len(params) > 1 or chat else "prompt", arrival)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.name, "system_fingerprint": None}
        if stream:
            events = self.events(chat, head, streams, firsts, prompts, logprobs, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        results = [None] * len(streams)
        async with contextlib.aclosing(_merge(streams, firsts)) as merged:
            async for index, out in merged:
                if isinstance(out, BaseException):
                    raise out
                if out.finish_reason == "error":  # the other choices are aborted
                    raise APIError(500, out.error or "the request failed", kind="server_error")
                if out.finished:
                    results[index] = out.result
        choices = []
        for index, result in enumerate(results):
            choice = {"index": index, "finish_reason": result.finish_reason, "token_ids": result.token_ids}
            whole = RequestOutput(head["id"], result.token_ids, result.text, result.logprobs or [])
            if chat:
                choice["message"] = {"role": "assistant", "content": result.text or ""}
                choice["logprobs"] = self.chat_logprobs(whole) if logprobs else None
            else:
                choice["text"] = result.text or ""  # no tokenizer: token_ids only
                choice["logprobs"] = self.completion_logprobs(whole, TextOffsets()) if logprobs else None
            choices.append(choice)
        usage = self.usage(prompts, sum(len(r.token_ids) for r in results))
        return JSONResponse({**head, "choices": choices, "usage": usage})

    async def events(self, chat, head, streams, firsts, prompts, logprobs, include_usage):
        """The server-sent events of a streamed response: one chunk per increment."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        if include_usage:  # OpenAI's chunks then carry usage, null until the last one
            head["usage"] = None
        offsets = [TextOffsets() for _ in streams]  # per choice: its text so far (completions' text_offset)
        completion_tokens = 0
        async with contextlib.aclosing(_merge(streams, firsts)) as merged:
            async for index, out in merged:
                if isinstance(out, BaseException):
                    yield _event(_as_api_error(out).body())
                    continue
                if out.finish_reason == "error":
                    yield _event(APIError(500, out.error or "the request failed", kind="server_error").body())
                    continue
                completion_tokens += len(out.token_ids)
                choice = {"index": index, "finish_reason": out.finish_reason if out.finished else None,
                          "token_ids": out.token_ids}
                with_logprobs = logprobs and out.logprobs
                if chat:
                    choice["delta"] = {"content": out.text} if out.text else {}
                    if out is firsts[index]:
                        choice["delta"] = {"role": "assistant", **choice["delta"]}
                    choice["logprobs"] = self.chat_logprobs(out) if with_logprobs else None
                else:
                    choice["text"] = out.text or ""
                    choice["logprobs"] = None
                    if with_logprobs:
                        choice["logprobs"] = self.completion_logprobs(out, offsets[index])
                yield _event({**head, "choices": [choice]})
        if include_usage:
            yield _event({**head, "choices": [], "usage": self.usage(prompts, completion_tokens)})
        yield "data: [DONE]\n\n"


async def _merge(streams, firsts):
    """(choice index, increment) pairs of every stream as they come, each stream's first
    increment first; an exception a stream raised comes as the pair's second item."""
    pending = asyncio.Queue()
    for index, out in enumerate(firsts):
        pending.put_nowait((index, out))

    async def pump(index, stream, done):
        """Each stream is driven (and closed: its request aborted if unfinished) by its own task."""
        try:
            if not done:
                async for out in stream:
                    pending.put_nowait((index, out))
        except Exception as exc:
            pending.put_nowait((index, exc))
        finally:
            await stream.aclose()
        pending.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s, f.finished)) for i, (s, f) in enumerate(zip(streams, firsts))]
    try:
        left = len(streams)
        while left:
            index, out = await pending.get()
            if out is None:
                left -= 1
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), kind="rate_limit_error", code="queue_full")
    if isinstance(exc, EngineStopped):
        return APIError(503, str(exc), kind="server_error", code="engine_stopped")
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc))
    log.error("request failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")


async def _json_body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer too long to convert
        raise _bad(None, f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise _bad(None, "the request body is nested too deeply") from None


async def _unless_disconnected(request: Request, work):
    """Await `work`, cancelling it (so its requests are aborted) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its clean-up (aborting its requests) runs to the end
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it
    return task.result()


def build_app(async_engine, model_name: str) -> FastAPI:
    """The FastAPI app serving `async_engine` under the name `model_name`."""
    server = _Server(async_engine, model_name)
    app = FastAPI(title="csd_engine", summary="OpenAI-compatible speculative decoding server")
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        error = _as_api_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # unknown path (404), method (405)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                     kind=kind).body(), status_code=exc.status_code, headers=exc.headers)

    async def generate(raw, chat: bool, arrival: float):
        try:
            body, params, logprobs = server.read(raw, chat)
            if chat:
                prompts = [await server.chat_prompt(chat_messages(body))]
            else:
                raw = completion_prompts(body)
                prompts = [await server.encode(p, "prompt" if len(raw) == 1 else f"prompt[{i}]")
                           for i, p in enumerate(raw)]
            stream = body.boolean("stream")
            include_usage = stream and (body.body.get("stream_options") or {}).get("include_usage") is True
            return await server.respond(chat, prompts, params, logprobs, stream, include_usage, arrival)
        except (QueueFull, EngineStopped, ValueError, TypeError) as exc:
            raise _as_api_error(exc) from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        return await _unless_disconnected(request, generate(await _json_body(request), False, arrival))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        return await _unless_disconnected(request, generate(await _json_body(request), True, arrival))

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": server.created, "owned_by": "csd_engine",
                "max_model_len": server.max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):  # a name may hold slashes (a hub id, a folder)
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} not found; this server serves {model_name!r}", "model",
                           code="model_not_found")
        return model_card()

    @app.get("/health")
    async def health():
        if async_engine.error is not None:
            return JSONResponse({"status": "stopped", "error": async_engine.error}, status_code=503)
        stats = async_engine.stats()
        return {"status": "ok", "running": stats["running"], "waiting": stats["waiting"]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
