"""`atom serve` end to end: the official `openai` client against a real uvicorn on loopback.

One engine (the bundled SmolLM2, float32 on CPU: the session's `smollm2_engine`) and one server
for the whole module; a second uvicorn on the same AsyncEngine checks API keys. Requests keep
max_tokens small: a decode step of this model takes ~0.1-0.5 s on a busy 2-core CPU.
"""

from __future__ import annotations

import asyncio
import json
import socket
from http.client import HTTPConnection
from urllib.parse import urlsplit

import openai
import pytest

from atom_engine.server.api_server import build_app
from atom_engine.testing import http, serve, wait_idle

MODEL = "smollm2-test"
MAX_MODEL_LEN = 1024
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    assert smollm2_engine.max_model_len == MAX_MODEL_LEN
    return smollm2_engine


@pytest.fixture(scope="module")
def profiler_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("profile")


@pytest.fixture(scope="module")
def server(engine, profiler_dir):
    server = serve(build_app(engine, MODEL, None, profiler_dir=str(profiler_dir)), engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


@pytest.fixture(scope="module")
def greedy(client):
    """The greedy 8-token completion of PROMPT (shared by several tests)."""
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)


# -- completions ------------------------------------------------------------------------------


def test_completion(client, engine, greedy):
    num_prompt = len(engine.engine.tokenize(PROMPT))
    assert greedy.object == "text_completion" and greedy.model == MODEL
    (choice,) = greedy.choices
    assert choice.text and choice.finish_reason == "length" and choice.index == 0
    assert greedy.usage.prompt_tokens == num_prompt
    assert greedy.usage.completion_tokens == 8
    assert greedy.usage.total_tokens == num_prompt + 8
    assert "Paris" in choice.text


def test_completion_stream_matches(client, greedy):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == greedy.usage
    assert len({c.id for c in chunks}) == 1


def test_completion_token_prompts_and_echo(client, engine, greedy):
    ids = engine.engine.tokenize(PROMPT)
    expected = PROMPT + greedy.choices[0].text
    for prompt in ([PROMPT, PROMPT], [ids, ids]):
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True
        )
        assert [c.text for c in out.choices] == [expected, expected]
        assert [c.index for c in out.choices] == [0, 1]
        assert out.usage.prompt_tokens == 2 * len(ids) and out.usage.completion_tokens == 16
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == greedy.choices[0].text


def test_completion_logprobs(client, engine, greedy):
    ids = engine.engine.tokenize(PROMPT)
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    lp = out.choices[0].logprobs
    n = len(ids) + 3
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    # Greedy: each generated token is its position's most likely one.
    generated = zip(lp.tokens[-3:], lp.token_logprobs[-3:], lp.top_logprobs[-3:], strict=True)
    for token, logprob, top in generated:
        assert top[token] == logprob == max(top.values())
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert greedy.choices[0].text.startswith("".join(lp.tokens[len(ids) :]))

    # Streamed, the chunks' log-probs and text add up to the same thing.
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            logprobs=2,
            echo=True,
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(s, name) for s in streamed), []) == getattr(lp, name), name


def test_n_and_seed(client):
    def sample(seed, n=1):
        out = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=n, seed=seed
        )
        assert [c.index for c in out.choices] == list(range(n))
        assert out.usage.completion_tokens == sum(6 for _ in range(n))
        return [c.text for c in out.choices]

    pair = sample(1234, n=2)
    assert pair[0] != pair[1]  # choice i samples with seed + i
    assert sample(1234) == pair[:1]  # same seed, same text
    assert sample(99) != pair[:1]


def test_stop_string(client, greedy):
    full = greedy.choices[0].text  # " Paris.\n\nThe answer..." (greedy, deterministic)
    stop = full.strip()[1:4]
    at = full.index(stop)
    assert at > 0
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == full[:at]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra.get("stop_reason") == stop


# -- chat -------------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_and_stream(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = out.choices[0]
    assert out.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 6
    content = choice.logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == entry.top_logprobs[0].logprob <= 0
        assert entry.bytes == list(entry.token.encode())

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage == out.usage and all(
        c.object == "chat.completion.chunk" for c in chunks
    )


def test_chat_n_stream(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=1.0, seed=7, n=2, stream=True
    )
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"} and all(texts.values())


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"suffix": "x"}, "suffix"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"extra_body": {"min_tokens": 5}, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_completion_params(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
    error = info.value.body
    assert info.value.status_code == 400
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == 400 and param in error["message"]


def test_bad_chat_params(client):
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    for kwargs, param in (
        ({"n": 10**6}, "n"),
        ({"seed": 2**70}, "seed"),
        ({"extra_body": {"chat_template_kwargs": {"tokenize": False}}}, "messages"),
        ({"messages": [{"role": "user", "content": image}]}, "messages"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto
        ({"temperature": -1}, "temperature"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=True
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, **kwargs})
        assert info.value.body["param"] == param, (kwargs, info.value.body)


def test_prompt_too_long(client):
    long_prompt = "hello " * 300  # ~300 tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=900)
    message = info.value.body["message"]
    assert "900" in message and str(MAX_MODEL_LEN) in message and "tokens" in message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello " * 1200, max_tokens=1)
    assert str(MAX_MODEL_LEN) in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):  # token ids outside the vocabulary
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=1)


def test_malformed_and_invalid_bodies(server):
    for body in (b"{not json", b'{"prompt": 5}', b"[]", b'{"model": "x"}'):
        r = http("POST", server.url + "/v1/completions", body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    r = http("GET", server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_unknown_model(client, engine):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-5", prompt=PROMPT, max_tokens=1)
    assert info.value.body["type"] == "NotFoundError" and "gpt-5" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=MESSAGES, max_tokens=1)
    # The model path is accepted as a name too.
    out = client.completions.create(model=engine.model_path, prompt=PROMPT, max_tokens=1)
    assert out.usage.completion_tokens == 1


def test_api_key(engine):
    keyed = serve(build_app(engine, MODEL, api_key="sekrit"), engine)
    try:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = http("GET", keyed.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
        with pytest.raises(openai.AuthenticationError):
            keyed.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        ok = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in ok.models.list()] == [MODEL]
        assert http("GET", keyed.url + "/health").status_code == 200  # only /v1 is guarded
        # No profiler directory on this app: profiling is refused.
        assert http("POST", keyed.url + "/start_profile").status_code == 400
    finally:
        keyed.stop()


# -- endpoints --------------------------------------------------------------------------------


def test_models_health_version(client, server, engine):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.owned_by == "atom"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert http("GET", server.url + "/health").status_code == 200
    assert http("GET", server.url + "/version").json()["version"]


def test_metrics(server, greedy):
    text = http("GET", server.url + "/metrics").text
    for name in (
        'atom:request_success_total{finished_reason="length"}',
        "atom:prompt_tokens_total",
        "atom:generation_tokens_total",
        "atom:time_to_first_token_seconds_bucket",
        "atom:time_per_output_token_seconds_bucket",
        "atom:e2e_request_latency_seconds_count",
        "atom:num_requests_running",
        "atom:num_requests_waiting",
        "atom:kv_cache_usage_perc",
        "atom:prefix_cache_hit_rate",
    ):
        assert name in text, name
    generated = next(
        line for line in text.splitlines() if line.startswith("atom:generation_tokens_total")
    )
    assert float(generated.split()[-1]) >= 8


def test_profile(server, profiler_dir):
    assert http("POST", server.url + "/stop_profile").status_code == 400  # not running
    r = http("POST", server.url + "/start_profile")
    assert r.status_code == 200, r.text
    assert http("POST", server.url + "/start_profile").status_code == 400
    server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert http("POST", server.url + "/stop_profile").status_code == 200
    assert list(profiler_dir.glob("*.json*")), "no trace written"


# -- concurrency and disconnects --------------------------------------------------------------


def test_concurrent_clients(server, greedy):
    prompts = [PROMPT, "The capital of Germany is", "1, 2, 3, 4,", "Hello, my name is"]

    async def one(i: int):
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600
        )
        prompt = prompts[i % len(prompts)]
        if i % 2:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=3, temperature=0, stream=True
            )
            text, finish = "", None
            async for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        else:
            out = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=3, temperature=0
            )
            text, finish = out.choices[0].text, out.choices[0].finish_reason
            assert out.usage.completion_tokens == 3
        await client.close()
        return prompt, text, finish

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(run_all())
    by_prompt: dict[str, set[str]] = {}
    for prompt, text, finish in results:
        assert finish == "length" and text
        by_prompt.setdefault(prompt, set()).add(text)
    # Greedy: every client with the same prompt gets the same text, whatever its batch.
    assert all(len(texts) == 1 for texts in by_prompt.values()), by_prompt
    assert greedy.choices[0].text.startswith(by_prompt[PROMPT].pop())
    wait_idle(server.engine)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_disconnect_aborts(server, endpoint):
    wait_idle(server.engine)
    body = {"model": MODEL, "max_tokens": 500, "stream": True, "ignore_eos": True}
    if endpoint == "completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = MESSAGES
    connection = HTTPConnection(urlsplit(server.url).netloc, timeout=120)
    connection.request(
        "POST", f"/v1/{endpoint}", json.dumps(body), {"content-type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200
    lines = [response.fp.readline().decode() for _ in range(8)]
    data = [line for line in lines if line.startswith("data")]
    assert data and json.loads(data[0][6:])["id"]
    connection.sock.shutdown(socket.SHUT_RDWR)  # hang up mid-stream
    connection.close()
    wait_idle(server.engine, timeout=30)  # aborted: no running request, KV blocks all free
    out = server.client(timeout=120).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert out.choices[0].finish_reason == "length"
