"""The server's contract with clients: one request never fails another.

Hostile and malformed requests get a 4xx naming their field while streaming victims complete with
their full text, and the keep-alive connection that carried them serves the next request; a
request the engine itself fails ends alone (500); rejections and /health never wait for the
engine; fields are honoured or refused, never ignored.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.client import HTTPConnection

import openai
import pytest

from atom_engine import EngineConfig
from atom_engine.server.api_server import build_app
from atom_engine.server.async_engine import AsyncEngine
from atom_engine.testing import http, serve, wait_idle

MODEL = "smollm2-test"
MAX_MODEL_LEN = 512
VOCAB = 49152
VICTIM_TOKENS = 24
VICTIMS = [
    ("completions", {"prompt": "The capital of France is"}),
    ("completions", {"prompt": "1, 2, 3, 4,"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Name three colors."}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Count to ten."}]}),
]


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(
        dtype="float32",
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        cpu_kv_cache_space=0.1,
        max_num_batched_tokens=256,
    )
    engine = AsyncEngine.from_config(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    server = serve(build_app(engine, MODEL, None, max_request_body_bytes=1 << 20), engine)
    yield server
    server.stop()


async def _stream(client: openai.AsyncOpenAI, endpoint: str, body: dict) -> tuple[str, str]:
    """(text, finish reason) of one streamed request (the client raises on an error)."""
    common = {"model": MODEL, "max_tokens": VICTIM_TOKENS, "temperature": 0, "stream": True,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    text, finish = "", None
    if endpoint == "completions":
        stream = await client.completions.create(**common, **body)
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    else:
        stream = await client.chat.completions.create(**common, **body)
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)


def _victims_alone(server) -> list[str]:
    async def run():
        async with _client(server) as client:
            return [await _stream(client, e, b) for e, b in VICTIMS]

    return [text for text, _ in asyncio.run(run())]


@pytest.fixture(scope="module")
def victim_texts(server):
    """Each victim's greedy text when it runs alone: what it must get under attack too."""
    return _victims_alone(server)


def _attack(server, victim_texts, attacks) -> list:
    """Run the four streaming victims; once they stream, send `attacks(connection)` (a function
    using one keep-alive HTTPConnection, returning its results) from a thread. Checks that every
    victim completed with its full text; returns what `attacks` returned."""
    results: dict = {}

    async def run():
        async with _client(server) as client:
            victims = [asyncio.create_task(_stream(client, e, b)) for e, b in VICTIMS]
            while server.engine.stats().num_running < len(VICTIMS):
                await asyncio.sleep(0.05)

            def attack():
                connection = HTTPConnection(server.netloc, timeout=300)
                try:
                    results["value"] = attacks(connection)
                finally:
                    connection.close()

            await asyncio.to_thread(attack)
            return await asyncio.gather(*victims)

    outcomes = asyncio.run(run())
    for (text, finish), expected in zip(outcomes, victim_texts, strict=True):
        assert finish == "length" and text == expected
    wait_idle(server.engine)
    return results["value"]


def _post(connection: HTTPConnection, path: str, body: bytes | str | dict, headers=None):
    if isinstance(body, dict):
        body = json.dumps(body)
    connection.request("POST", path, body, {"content-type": "application/json", **(headers or {})})
    response = connection.getresponse()
    return response.status, response.read().decode()


# (endpoint, raw JSON body, the field a 400 must name). Each one once failed the whole batch,
# answered 500, or was accepted and silently ignored.
_CHAT = '"messages": [{"role": "user", "content": "hi"}]'
HOSTILE = [
    ("completions", '{"prompt": "hi", "max_tokens": 4, "top_k": 9223372036854775808, '
     '"temperature": 1.0}', "top_k"),
    ("completions", '{"prompt": "hi", "max_tokens": 4, "stop_token_ids": [49152], '
     '"min_tokens": 2}', "stop_token_ids"),
    ("chat/completions",
     f'{{{_CHAT}, "max_tokens": 4, "stop_token_ids": [49152], "min_tokens": 2}}',
     "stop_token_ids"),
    ("completions", '{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ("completions", '{"prompt": "hi", "top_p": NaN}', "top_p"),
    ("completions", '{"prompt": "hi", "repetition_penalty": 1e300}', "repetition_penalty"),
    ("completions", '{"prompt": "abc\\ud800"}', "prompt"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "abc\\ud800"}]}',
     "messages"),
    ("completions", '{"prompt": "hi", "stop": ["\\udc00"]}', "stop"),
    ("completions", '{"prompt": [49152]}', "prompt"),
    ("completions", '{"prompt": [-1]}', "prompt"),
    ("completions", '{"prompt": [[false]]}', "prompt"),
    ("completions", '{"prompt": [[]]}', "prompt"),
    ("completions", '{"prompt": []}', "prompt"),
    ("completions", '{"prompt": "hi", "max_tokens": "3"}', "max_tokens"),
    ("completions", '{"prompt": "hi", "n": "2"}', "n"),
    ("completions", '{"prompt": "hi", "stream": "yes"}', "stream"),
    ("completions", '{"prompt": "hi", "max_tokens": 99999999999999999999999}', "max_tokens"),
    ("completions", '{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    ("completions", '{"prompt": "hi", "logprobs": 21}', "logprobs"),
    ("completions", '{"prompt": "hi", "min_tokens": -1}', "min_tokens"),
    ("completions", '{"prompt": "hi", "stream_options": {"include_usage": true}}',
     "stream_options"),
    ("completions", '{"prompt": "hi", "allowed_token_ids": [49152]}', "allowed_token_ids"),
    ("completions", '{"prompt": "hi", "allowed_token_ids": []}', "allowed_token_ids"),
    ("completions", '{"prompt": "hi", "guided_json": {"type": "object"}}', "guided_json"),
    ("completions", '{"prompt": "hi", "guided_choice": ["a", "b"]}', "guided_choice"),
    ("completions", '{"prompt": "hi", "structured_outputs": {"regex": "(a+"}}',
     "structured_outputs"),
    ("completions", '{"prompt": "hi", "structured_outputs": {"json": {"type": "nope"}}}',
     "structured_outputs"),
    ("completions", '{"prompt": "hi", "response_format": {"type": "json_schema"}}',
     "response_format"),
    ("completions", '{"prompt": "hi", "use_beam_search": true}', "use_beam_search"),
    ("completions", '{"prompt": "hi", "logits_processors": ["x"]}', "logits_processors"),
    ("completions", '{"prompt": "hi", "no_such_field": 1}', "no_such_field"),
    ("completions", '{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    ("completions", '{"prompt": "hi ' + "hi " * 1200 + '"}', "prompt"),
    ("chat/completions", f'{{{_CHAT}, "functions": [{{"name": "f"}}]}}', "functions"),
    ("chat/completions", f'{{{_CHAT}, "parallel_tool_calls": "yes"}}', "parallel_tool_calls"),
    ("chat/completions", f'{{{_CHAT}, "tool_choice": "required"}}', "tool_choice"),
    ("chat/completions", f'{{{_CHAT}, "chat_template": "{{% if %}}"}}', "messages"),
    ("chat/completions", f'{{{_CHAT}, "stream": true, "prompt_logprobs": 1}}',
     "prompt_logprobs"),
    ("chat/completions", '{"messages": [{"role": "user", "content": 5}]}', "messages"),
    # A template that renders a 200 MB prompt is refused before tokenizing it; one that renders
    # nothing is an empty prompt.
    ("chat/completions", f'{{{_CHAT}, "chat_template": "{{{{ messages[0].content * 10**8 }}}}"}}',
     "messages"),
    ("chat/completions", f'{{{_CHAT}, "chat_template": "{{{{ \'\'.__class__ }}}}"}}',
     "messages"),
    ("chat/completions", '{"messages": "hi"}', "messages"),
]  # fmt: skip


def test_hostile_requests_fail_alone(server, victim_texts):
    """Every hostile request gets a 400 naming its field while four streams complete with their
    full text; one keep-alive connection carries all of them, then a good request."""

    def attacks(connection):
        answers = [_post(connection, f"/v1/{e}", body) for e, body, _ in HOSTILE]
        good = _post(connection, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        return answers, good

    answers, good = _attack(server, victim_texts, attacks)
    for (endpoint, body, param), (status, text) in zip(HOSTILE, answers, strict=True):
        error = json.loads(text)["error"]
        assert status == 400, (endpoint, body[:100], status, text[:300])
        assert error["param"] == param and error["code"] == 400, (body[:100], error)
        assert error["message"], body
    status, text = good
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2


def test_oversize_and_broken_bodies(server, victim_texts):
    """A body over the limit is refused (413) before it is read; broken JSON and wrong content
    types are 400s; none touches the victims or the connection."""

    def attacks(connection):
        big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
        answers = [
            _post(connection, "/v1/completions", b"{not json"),
            _post(connection, "/v1/completions", b"[1, 2]"),
            _post(connection, "/v1/chat/completions", b"null"),
            _post(connection, "/v1/completions", b'{"prompt": "hi"}', {"content-type": "x/y"}),
        ]
        too_big = _post(connection, "/v1/chat/completions", big)
        return answers, too_big

    answers, (status, text) = _attack(server, victim_texts, attacks)
    for code, body in answers:
        assert code == 400 and json.loads(body)["error"]["code"] == 400, body
    assert status == 413 and "limit" in json.loads(text)["error"]["message"]

    # A chunked body (no declared length) is cut off at the limit too.
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    connection = HTTPConnection(server.netloc, timeout=60)
    connection.request(
        "POST",
        "/v1/completions",
        chunks(),
        {"content-type": "application/json"},
        encode_chunked=True,
    )
    response = connection.getresponse()
    assert response.status == 413, response.read()
    connection.close()


def _fail_runs_of(llm_engine, seed: int, where: str) -> None:
    """Make every forward (or post-processing) of a request with this seed raise."""
    if where == "run":
        run, launch = llm_engine.runner.run, llm_engine.runner.launch

        def check(batch):
            if any(s.params.seed == seed for s in batch.seqs):
                raise RuntimeError(f"injected fault of seed {seed}")

        llm_engine.runner.run = lambda batch: (check(batch), run(batch))[1]
        llm_engine.runner.launch = lambda batch, prev: (check(batch), launch(batch, prev))[1]
    else:
        append = llm_engine.post.append_token

        def failing_append(seq, token_id, info):
            if seq.params.seed == seed:
                raise RuntimeError(f"injected fault of seed {seed}")
            append(seq, token_id, info)

        llm_engine.post.append_token = failing_append


@pytest.mark.parametrize("where", ["run", "postprocess"])
def test_engine_failure_fails_only_its_request(server, victim_texts, where):
    """A request the engine fails on (its forward or post-processing raises, every time) ends
    alone: 500 (or an error event when streaming); the victims complete, the connection
    serves the next request and the engine runs on."""
    seed = 4242
    asyncio.run(server.engine.call(lambda e: _fail_runs_of(e, seed, where)))
    try:

        def attacks(connection):
            body = {"prompt": "hi", "max_tokens": 3, "seed": seed, "temperature": 1.0}
            failed = _post(connection, "/v1/completions", body)
            streamed = _post(connection, "/v1/completions", {**body, "stream": True})
            good = _post(connection, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            return failed, streamed, good

        failed, streamed, good = _attack(server, victim_texts, attacks)
    finally:

        def restore(llm_engine):
            for name in ("run", "launch"):
                llm_engine.runner.__dict__.pop(name, None)
            llm_engine.post.__dict__.pop("append_token", None)

        asyncio.run(server.engine.call(restore))
    status, text = failed
    assert status == 500 and "injected fault" in json.loads(text)["error"]["message"]
    status, text = streamed
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert "injected fault" in json.loads(events[-2])["error"]["message"]
    status, text = good
    assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "length"
    assert server.engine.is_running


def test_rejections_and_health_never_wait_for_the_engine(server):
    """With the engine thread busy (held inside a call, as a long prefill step holds it),
    /health, /v1/models and requests that can never run are answered; the engine then serves a
    request that was queued meanwhile."""
    release, entered = threading.Event(), threading.Event()

    def hold(_engine):
        entered.set()
        release.wait(120)

    async def busy_engine():
        return await server.engine.call(hold)

    holder = threading.Thread(target=lambda: asyncio.run(busy_engine()), daemon=True)
    holder.start()
    queued: dict = {}

    def queue_one():
        queued["answer"] = http(
            "POST",
            server.url + "/v1/completions",
            json.dumps({"prompt": "hi", "max_tokens": 1}).encode(),
        )

    queued_thread = threading.Thread(target=queue_one, daemon=True)
    try:
        assert entered.wait(30)
        assert http("GET", server.url + "/health").status_code == 200
        assert http("GET", server.url + "/v1/models").status_code == 200
        too_long = {"prompt": "hello " * 2000, "max_tokens": 1}
        response = http("POST", server.url + "/v1/completions", json.dumps(too_long).encode())
        assert response.status_code == 400 and "max_model_len" in response.text
        chat = {"messages": [{"role": "user", "content": "hi " * 600}], "max_tokens": 1}
        response = http("POST", server.url + "/v1/chat/completions", json.dumps(chat).encode())
        assert response.status_code == 400, response.text
        assert _declare_huge_body(server) == 413
        assert http("GET", server.url + "/health").status_code == 200
        queued_thread.start()
        assert not release.is_set()  # all of the above while the engine was held
    finally:
        release.set()
    holder.join(60)
    queued_thread.join(120)
    assert queued["answer"].status_code == 200
    wait_idle(server.engine)


def _declare_huge_body(server) -> int:
    """The status of a request declaring a 1 GiB body (none of which is sent)."""
    connection = HTTPConnection(server.netloc, timeout=30)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("content-type", "application/json")
    connection.putheader("content-length", str(1 << 30))
    connection.endheaders()
    status = connection.getresponse().status
    connection.close()
    return status


def test_api_key_with_non_ascii_header(engine):
    keyed = serve(build_app(engine, MODEL, api_key="sekrit"), engine)
    try:
        for value in ("Bearer s\u00e9krit", "Bearer \u00ff\u00fe", "B\u00e9arer sekrit"):
            connection = HTTPConnection(keyed.netloc, timeout=30)
            connection.putrequest("GET", "/v1/models")
            connection.putheader("Authorization", value.encode("latin-1"))
            connection.endheaders()
            response = connection.getresponse()
            assert response.status == 401, response.read()
            connection.close()
        ok = http("GET", keyed.url + "/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
    finally:
        keyed.stop()
