"""The OpenAI-compatible server end to end: `python -m csd_engine serve` in a subprocess on a tiny
random model folder (tests/serving/tiny_folder.py), driven by the official openai client and by
httpx. Every output is compared with offline Engine.generate on the same folders and strategy,
token for token."""
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from csd_engine import Engine, SamplingParams, Speculative
from tests.serving.tiny_folder import NAN_CHARACTER, write_folders

ROOT = Path(__file__).resolve().parents[2]
MAX_SEQ_LEN = 96
STRATEGY = ["--strategy", "speculative", "--k", "3"]
LETTERS = "".join(chr(c) for c in range(32, 126) if chr(c) != NAN_CHARACTER)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m csd_engine serve ...` on a free port of this machine, up once /health answers."""

    def __init__(self, log_dir: Path, *flags: str, max_seq_len: int = MAX_SEQ_LEN):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = log_dir / f"server-{port}.log"
        command = [sys.executable, "-m", "csd_engine", "serve", "--port", str(port), "--model-name", "tiny",
                   "--threads", "1", "--max-seq-len", str(max_seq_len), "--log-level", "warning", *flags]
        # As a user runs it: not in the Triton interpreter that conftest.py sets up for the kernels' tests.
        env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": str(ROOT)}
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, f"the server exited:\n{self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the server did not answer /health:\n{self.log.read_text()[-3000:]}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return write_folders(tmp_path_factory.mktemp("serve-models"))


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    target, drafter = folders
    running = Server(tmp_path_factory.mktemp("serve-logs"), "--target", target, "--drafter", drafter, *STRATEGY,
                     "--max-batch-size", "8", "--max-waiting", "64")
    yield running
    running.close()
    assert "Traceback" not in running.log.read_text(), running.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def offline(folders):
    """The server's models, strategy and verification backend (PyTorch's, as on a CPU outside the
    interpreter) in this process: the reference outputs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(folders[0], drafters=[folders[1]], max_batch_size=32, max_seq_len=MAX_SEQ_LEN,
                    verify_backend="torch")
    yield lambda prompts, params: engine.generate(prompts, params, strategy=Speculative(k=3))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(folders):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folders[0])


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse(lines) -> list[dict]:
    """The JSON payloads of server-sent events, checking the stream ends with [DONE]."""
    payloads = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_completions_equal_offline_generate(server, offline, tokenizer):
    """Non-streamed and streamed, text prompt and token-id prompt: the same text, tokens
    (`token_ids`) and log-probabilities as offline generate."""
    prompt = "The cache holds"
    [expected] = offline([prompt], SamplingParams(max_new_tokens=24, logprobs=True))
    c = client(server)
    done = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, logprobs=0)
    choice = done.choices[0]
    assert (choice.text, choice.token_ids, choice.finish_reason) == (expected.text, expected.token_ids, "length")
    assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in expected.token_ids]  # special ones too
    assert done.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"]) and done.usage.completion_tokens == 24
    assert done.model == "tiny" and done.object == "text_completion"

    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expected.text
    assert sum((ch.choices[0].token_ids for ch in chunks), []) == expected.token_ids
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    offsets = choice.logprobs.text_offset  # where each token starts in the text, streamed or not
    assert offsets == sorted(offsets) and all(0 <= o <= len(expected.text) for o in offsets)
    streamed = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True, logprobs=0)
    assert sum((ch.choices[0].logprobs.text_offset for ch in streamed if ch.choices[0].logprobs), []) == offsets

    by_ids = c.completions.create(model="tiny", prompt=tokenizer(prompt)["input_ids"], max_tokens=24, temperature=0)
    assert by_ids.choices[0].token_ids == expected.token_ids


def test_chat_completions_use_the_chat_template(server, offline, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a cache."}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    [expected] = offline([ids], SamplingParams(max_new_tokens=20))
    c = client(server)
    done = c.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert done.choices[0].message.role == "assistant" and done.choices[0].message.content == expected.text
    assert done.choices[0].token_ids == expected.token_ids and done.usage.prompt_tokens == len(ids)

    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, logprobs=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected.text
    tokens = sum((ch.choices[0].token_ids for ch in chunks if ch.choices), [])
    assert tokens == expected.token_ids
    assert sum(len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices) == 20
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(ch.usage is None for ch in chunks[:-1])

    # OpenAI's newer name for a system message, and content as text parts (joined by newlines)
    renamed = [{"role": "developer", "content": "Be brief."},
               {"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a cache."}]}]
    ids = list(tokenizer.apply_chat_template([messages[0], {"role": "user", "content": "Name\na cache."}],
                                             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    [expected] = offline([ids], SamplingParams(max_new_tokens=20))
    done = c.chat.completions.create(model="tiny", messages=renamed, max_tokens=20, temperature=0)
    assert done.choices[0].token_ids == expected.token_ids and done.usage.prompt_tokens == len(ids)


def test_32_concurrent_streams_each_equal_offline(server, offline):
    """32 streamed requests of different prompts and lengths at once (8 rows, so most wait for
    one): every stream finishes and adds up to its offline output."""
    rng = random.Random(0)
    prompts = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 30))) for _ in range(32)]
    lengths = [rng.randint(1, 40) for _ in range(32)]
    expected = offline(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])

    async def one(http, prompt, n):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            chunks = sse([line async for line in response.aiter_lines()])
        choices = [chunk["choices"][0] for chunk in chunks]
        return "".join(c["text"] for c in choices), sum((c["token_ids"] for c in choices), []), choices[-1]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(one(http, p, n) for p, n in zip(prompts, lengths)))
    for (text, tokens, last), want in zip(asyncio.run(main()), expected):
        assert (text, tokens, last["finish_reason"]) == (want.text, want.token_ids, "length")


def test_n_seeds_stop_strings_and_prompt_lists(server, offline):
    """n choices are n requests, seeded seed+i; a stop string ends a choice where offline generate
    ends it; a list of prompts gives their choices in order."""
    body = {"prompt": "abc", "max_tokens": 12, "temperature": 0.8, "top_k": 20, "seed": 5, "n": 3}
    choices = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    expected = offline(["abc"] * 3, [SamplingParams(temperature=0.8, top_k=20, max_new_tokens=12, seed=5 + i)
                                     for i in range(3)])
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["token_ids"] for c in choices] == [e.token_ids for e in expected]

    [greedy] = offline(["abc"], SamplingParams(max_new_tokens=30))
    stop = greedy.text[8:10]
    [cut] = offline(["abc"], SamplingParams(max_new_tokens=30, stop=stop))
    body = {"prompt": "abc", "max_tokens": 30, "temperature": 0, "stop": stop}
    [choice] = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (cut.text, cut.token_ids, "stop")

    body = {"prompt": ["abc", "xyz"], "max_tokens": 6, "temperature": 0, "n": 2}
    choices = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    expected = offline(["abc", "xyz"], SamplingParams(max_new_tokens=6))
    assert [c["token_ids"] for c in choices] == [e.token_ids for e in expected for _ in range(2)]


BAD = [  # (endpoint, body, status, the field named)
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "x", "top_k": 1.5}, 400, "top_k"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n"),
    # more completions at once than 8 rows and max_waiting=64 hold: refused before any is queued
    ("completions", {"prompt": "x", "n": 73}, 400, "n"),
    ("completions", {"prompt": ["x"] * 73}, 400, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 73}, 400, "n"),
    ("completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    # values the engine could not hold (int64 seeds, int32 top_k) or compute with (logits / 1e-40 overflow)
    ("completions", {"prompt": "x", "temperature": 1, "seed": 2 ** 63}, 400, "seed"),
    ("completions", {"prompt": "x", "temperature": 1, "seed": 2 ** 63 - 1, "n": 2}, 400, "seed"),  # seed + 1
    ("completions", {"prompt": "x", "temperature": 1, "top_k": 2 ** 31}, 400, "top_k"),
    ("completions", {"prompt": "x", "temperature": 1e-40}, 400, "temperature"),
    ("completions", {"prompt": "x", "logprobs": 3}, 400, "logprobs"),  # alternatives are not returned
    ("completions", {"prompt": "x", "echo": 0}, 400, "echo"),  # neutral in value but not in kind
    ("completions", {"prompt": "x", "best_of": True}, 400, "best_of"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"prompt": "x", "model": 5}, 400, "model"),
    ("completions", {"prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate
    ("completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("completions", {"prompt": "x", "stop": ["\ud800"]}, 400, "stop"),  # a lone surrogate (JSON's escape)
    ("completions", {"prompt": "x", "stop_token_ids": [1000]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "x", "logprobs": "yes"}, 400, "logprobs"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "x" * MAX_SEQ_LEN}, 400, "prompt"),
    ("completions", {"prompt": [1, 2, 1000]}, 400, "prompt"),
    ("completions", {"prompt": ["ok", ""]}, 400, "prompt[1]"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),  # only an assistant's may be null
    ("chat/completions", {"messages": [{"role": "system", "content": None}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": []}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "image_url": {
        "url": "http://x/cat.png"}}]}]}, 400, "messages"),  # not dropped: the part has a type and a text only
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * MAX_SEQ_LEN}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                          "max_completion_tokens": 3}, 400, "max_completion_tokens"),
]


def test_bad_requests_get_their_status_and_name_the_field(server):
    """Each bad request: its status and OpenAI's error body, the message naming the field; the
    server serves normally afterwards."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for endpoint, body, status, field in BAD:
            # json.dumps escapes what is not ASCII, as a client may: a lone surrogate too
            response = http.post(f"/v1/{endpoint}", content=json.dumps(body),
                                 headers={"content-type": "application/json"})
            error = response.json()["error"]
            assert (response.status_code, error["param"]) == (status, field), (body, error)
            assert field in error["message"] and error["type"] == "invalid_request_error", (body, error)
        for raw, words in (("nope", "not valid JSON"), ("[1]", "JSON object"), ("[" * 100000, "nested too deeply"),
                           ('{"prompt": "x", "max_tokens": 1' + "0" * 5000 + "}", "not valid JSON")):
            response = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert response.status_code == 400 and words in response.json()["error"]["message"]
        for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
            response = http.request(method, path)
            assert response.status_code == status and path in response.json()["error"]["message"]
        assert "max_seq_len=96" in http.post("/v1/completions", json={"prompt": "x" * MAX_SEQ_LEN}).text
        models = http.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny"] and http.get("/v1/models/tiny").json() == models["data"][0]
        response = http.get("/v1/models/org/other")
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
        # null is "not given" in OpenAI's API, for a field the server does not take too
        response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2, "tools": None, "response_format": None})
        assert response.status_code == 200, response.text
        response = http.post("/v1/completions", json={"prompt": "fine", "max_tokens": 3})
        assert response.status_code == 200 and len(response.json()["choices"][0]["token_ids"]) == 3


def test_a_failing_request_gets_500_alone(server, offline):
    """A prompt whose logits are NaN fails (500, naming the non-finite logits) while a request
    beside it completes normally, streamed or not; the server stays healthy."""
    [expected] = offline(["healthy"], SamplingParams(max_new_tokens=30))

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            bad = {"prompt": f"a{NAN_CHARACTER}b", "max_tokens": 30}
            good = {"prompt": "healthy", "max_tokens": 30, "temperature": 0}
            return await asyncio.gather(http.post("/v1/completions", json=bad),
                                        http.post("/v1/completions", json={**bad, "stream": True}),
                                        http.post("/v1/completions", json=good))
    bad, bad_streamed, good = asyncio.run(main())
    for response in (bad, bad_streamed):
        assert response.status_code == 500 and "non-finite logits" in response.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["choices"][0]["token_ids"] == expected.token_ids
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def scrape(url: str) -> dict:
    """/metrics as {(sample name, frozenset of labels but model_name): value}."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_what_was_served(server, offline):
    """After a few greedy requests, the counters grew by exactly what was served, speculation's
    counters by the offline requests' own counts; a failing request counts as an error."""
    prompts, lengths = ["one", "two two", "three 3 3"], [5, 7, 9]
    expected = offline(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    before = scrape(server.url)
    for prompt, n in zip(prompts, lengths):
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    after = scrape(server.url)

    def grew(name, **labels):
        key = (name, frozenset(labels.items()))
        return after[key] - before.get(key, 0)
    assert grew("vllm:request_success_total", finished_reason="length") == 3
    assert grew("vllm:request_success_total", finished_reason="error") == 0
    assert grew("vllm:generation_tokens_total") == sum(lengths)
    assert grew("vllm:prompt_tokens_total") == sum(map(len, prompts))
    assert grew("vllm:time_to_first_token_seconds_count") == grew("vllm:e2e_request_latency_seconds_count") == 3
    assert 1 <= grew("vllm:inter_token_latency_seconds_count") <= sum(lengths) - 3
    drafted, accepted = sum(e.metrics.drafted for e in expected), sum(e.metrics.accepted for e in expected)
    assert grew("vllm:spec_decode_num_draft_tokens_total") == drafted > 0
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert grew("vllm:spec_decode_num_drafts_total") == sum(e.metrics.drafted_per_position[0] for e in expected)
    positions = [k for k in after if k[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert len(positions) == 3 and sum(after[k] - before.get(k, 0) for k in positions) == accepted
    assert after[("vllm:num_requests_running", frozenset())] == after[("vllm:num_requests_waiting", frozenset())] == 0

    before = after
    failing = {"prompt": NAN_CHARACTER, "max_tokens": 3}
    assert httpx.post(server.url + "/v1/completions", json=failing, timeout=60).status_code == 500
    after = scrape(server.url)
    assert grew("vllm:request_success_total", finished_reason="error") == 1
    assert grew("vllm:prompt_tokens_total") == 1 and grew("vllm:generation_tokens_total") == 0


def test_a_client_that_goes_away_frees_the_row(folders, tmp_path):
    """One row and no queue: while a long stream runs, another request is refused (429). A client
    that closes its stream, or stops waiting for a non-streamed reply, aborts its request, and the
    next request is served at once. A request of n=2 can never fit one row and no queue: 400,
    and nothing of it ran."""
    server = Server(tmp_path, "--target", folders[0], "--max-batch-size", "1", "--max-waiting", "0",
                    max_seq_len=4096)
    long = {"prompt": "abc", "max_tokens": 4000, "temperature": 0}

    def served_soon(http) -> None:
        begin = time.monotonic()
        while (served := http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 429:
            assert time.monotonic() - begin < 10, "the row was not freed"
            time.sleep(0.02)
        assert served.status_code == 200
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
                assert response.status_code == 200
                lines = response.iter_lines()  # kept: a closed iterator closes the connection
                assert next(lines).startswith("data: ")
                refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert refused.status_code == 429 and "max_waiting=0" in refused.json()["error"]["message"]
            served_soon(http)
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=long, timeout=0.5)
            served_soon(http)
            refused = http.post("/v1/completions", json={**long, "n": 2})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
            counters = scrape(server.url)
            assert counters[("vllm:request_success_total", frozenset({("finished_reason", "abort")}))] == 2
            ended = sum(v for (name, _), v in counters.items() if name == "vllm:request_success_total")
            assert counters[("vllm:e2e_request_latency_seconds_count", frozenset())] == ended == 4  # aborts too
            assert counters[("vllm:generation_tokens_total", frozenset())] < 4000
    finally:
        server.close()
    assert "Traceback" not in server.log.read_text(), server.log.read_text()[-3000:]


def test_every_streamed_choice_opens_with_the_role_and_usage_counts_every_prompt(server, tokenizer):
    """n streamed chat choices: each one's first chunk names the assistant role. A completion of a
    list of prompts with n choices each: usage counts every prompt once and every choice's tokens."""
    chunks = list(client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=5, temperature=0, n=2, stream=True))
    firsts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice)
    assert sorted(firsts) == [0, 1] and all(f.delta.role == "assistant" for f in firsts.values())

    body = {"prompt": ["abc", "xyz xyz"], "max_tokens": 4, "temperature": 0, "n": 2}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in body["prompt"])
    completion_tokens = sum(len(c["token_ids"]) for c in response["choices"])
    assert response["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}


def test_an_api_error_pickles_and_copies_with_every_field():
    """A process pool or task queue carries errors by pickling them: every field comes back."""
    import copy
    import pickle

    from csd_engine.serving.server import APIError
    error = APIError(400, "top_k must be an int", param="top_k", code="bad_value")
    for back in (pickle.loads(pickle.dumps(error)), copy.deepcopy(error), copy.copy(error)):
        assert (back.status, back.message, back.param, back.kind, back.code, str(back)) == \
            (400, "top_k must be an int", "top_k", "invalid_request_error", "bad_value", "top_k must be an int")
