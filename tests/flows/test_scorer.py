"""`flows.integrations.scorer.OpenAIChatScorer` against a local OpenAI-compatible server started here.

The server (stdlib ``http.server`` in a thread on 127.0.0.1) imitates ``/v1/chat/completions``
and follows a per-item script of answers: ``ok``, HTTP 429 (with Retry-After), 500, 401,
malformed JSON, a reply without a number, a reply that arrives after the client's timeout.
No internet is used.
"""
from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cje_engine.errors import CJEInputError
from flows.integrations.scorer import JudgeScorer, OpenAIChatScorer, ScorerError, chat_endpoint, parse_score

KEY = "sk-test-judge-key-never-shown-0123456789"


class FakeJudge:
    """A local chat-completions endpoint.

    ``scores`` maps an item's response text to the score the judge gives; ``scripts`` maps a
    response text to the answers of successive attempts (the last one repeats).
    """

    def __init__(self, scores: dict[str, float] | None = None, scripts: dict[str, list[str]] | None = None,
                 retry_after: float = 0.0, slow_seconds: float = 1.0) -> None:
        self.scores = dict(scores or {})
        self.scripts = dict(scripts or {})
        self.retry_after = retry_after
        self.slow_seconds = slow_seconds
        self.requests: list[dict] = []
        self.attempts: dict[str, int] = {}
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.handle(self, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _send(self, h, status: int, payload: bytes, headers: dict | None = None) -> None:
        try:
            h.send_response(status)
            for k, v in (headers or {}).items():
                h.send_header(k, v)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
        except OSError:  # the client gave up (timeout)
            pass

    def handle(self, h, body: dict) -> None:
        user = body["messages"][-1]["content"]
        m = re.search(r"\[Response\]\n(.*?)\n", user, re.S)
        response = m.group(1) if m else user
        with self.lock:
            n = self.attempts.get(response, 0)
            self.attempts[response] = n + 1
            self.requests.append({"path": h.path, "auth": h.headers.get("Authorization"), "body": body,
                                  "response": response})
        script = self.scripts.get(response, ["ok"])
        action = script[min(n, len(script) - 1)]

        def completion(text: str) -> bytes:
            return json.dumps({"id": "x", "object": "chat.completion", "model": body["model"],
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                            "finish_reason": "stop"}]}).encode()

        if action == "ok":
            self._send(h, 200, completion(f"Score: {self.scores.get(response, 0.5)}"))
        elif action == "429":
            self._send(h, 429, b'{"error": {"message": "rate limited"}}', {"Retry-After": str(self.retry_after)})
        elif action == "500":
            # a careless server echoing the credentials it got: the client must scrub them
            self._send(h, 500, json.dumps({"error": f"boom for {h.headers.get('Authorization')}"}).encode())
        elif action == "401":
            self._send(h, 401, json.dumps({"error": f"bad key {h.headers.get('Authorization')}"}).encode())
        elif action == "badjson":
            self._send(h, 200, b"{not json")
        elif action == "nochoices":
            self._send(h, 200, b'{"object": "chat.completion"}')
        elif action == "words":
            self._send(h, 200, completion("I would rather not say."))
        elif action == "slow":
            time.sleep(self.slow_seconds)
            self._send(h, 200, completion(f"Score: {self.scores.get(response, 0.5)}"))
        else:  # pragma: no cover - test bug
            raise AssertionError(action)


@pytest.fixture
def judge():
    servers = []

    def make(**kwargs) -> FakeJudge:
        s = FakeJudge(**kwargs)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("CJE_TEST_JUDGE_KEY", KEY)
    return "CJE_TEST_JUDGE_KEY"


def _items(n: int) -> list[dict]:
    return [{"anchor_id": f"a{i:03d}", "prompt": f"question {i}", "response": f"answer-{i}"} for i in range(n)]


def _fast(server: FakeJudge, api_key: str, **kw) -> OpenAIChatScorer:
    opts = dict(api_key_env=api_key, timeout=0.5, max_retries=2, backoff=0.01, max_backoff=0.5, concurrency=4)
    opts.update(kw)
    return OpenAIChatScorer(server.base_url, "judge-model", **opts)


def test_round_trip_with_retries_malformed_replies_and_timeouts(judge, api_key, caplog):
    items = _items(12)
    truth = {it["response"]: round(0.1 * (i % 11), 1) for i, it in enumerate(items)}
    scripts = {"answer-1": ["429", "ok"], "answer-2": ["500", "500", "ok"], "answer-3": ["badjson", "ok"],
               "answer-4": ["nochoices", "ok"], "answer-5": ["words", "ok"], "answer-6": ["slow", "ok"],
               "answer-7": ["words"]}  # never a number: NaN after 3 attempts
    server = judge(scores=truth, scripts=scripts, slow_seconds=1.5)
    scorer = _fast(server, api_key)
    assert isinstance(scorer, JudgeScorer)
    with caplog.at_level(logging.DEBUG):
        got = scorer.score(items)
    for i, it in enumerate(items):
        if it["response"] == "answer-7":
            assert math.isnan(got[i])
        else:
            assert got[i] == truth[it["response"]], it
    # attempts: one per item plus the scripted failures (answer-7: 1 + max_retries)
    expected_attempts = {f"answer-{i}": 1 for i in range(12)}
    expected_attempts.update({"answer-1": 2, "answer-2": 3, "answer-3": 2, "answer-4": 2, "answer-5": 2,
                              "answer-6": 2, "answer-7": 3})
    assert server.attempts == expected_attempts
    n_requests = sum(expected_attempts.values())
    # every request beyond an item's first is a retry
    assert scorer.stats_ == {"requests": n_requests, "retries": n_requests - len(items), "unparseable": 1}
    req = server.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == f"Bearer {KEY}"
    assert req["body"]["model"] == "judge-model" and req["body"]["messages"][0]["role"] == "system"
    assert "question" in req["body"]["messages"][-1]["content"]
    # the echoed key of the 500 answers never reaches logs
    assert KEY not in caplog.text and "***" in caplog.text


def test_retry_after_is_honoured(judge, api_key):
    server = judge(scores={"answer-0": 0.3}, scripts={"answer-0": ["429", "ok"]}, retry_after=0.4)
    t0 = time.perf_counter()
    assert _fast(server, api_key, backoff=0.001).score(_items(1)) == [0.3]
    assert time.perf_counter() - t0 >= 0.4


def test_exhausted_server_errors_raise_without_the_key(judge, api_key, caplog):
    server = judge(scripts={"answer-0": ["500"]})
    with caplog.at_level(logging.DEBUG), pytest.raises(ScorerError) as err:
        _fast(server, api_key).score(_items(3))
    msg = str(err.value)
    assert "HTTP 500" in msg and "'a000'" in msg and "3 attempt(s)" in msg and server.base_url in msg
    assert KEY not in msg and KEY not in caplog.text and KEY not in repr(err.value.__cause__)
    assert server.attempts["answer-0"] == 3


def test_unauthorized_fails_at_once_with_a_hint(judge, api_key):
    server = judge(scripts={"answer-0": ["401"]})
    with pytest.raises(ScorerError) as err:
        _fast(server, api_key, concurrency=1).score(_items(1))
    assert "HTTP 401" in str(err.value) and "$CJE_TEST_JUDGE_KEY" in str(err.value)
    assert KEY not in str(err.value)
    assert server.attempts == {"answer-0": 1}  # not retried


def test_timeouts_exhausted_and_unreachable_endpoint(judge, api_key):
    server = judge(scripts={"answer-0": ["slow"]}, slow_seconds=1.0)
    with pytest.raises(ScorerError, match="did not answer within 0.2 s"):
        _fast(server, api_key, timeout=0.2, max_retries=1).score(_items(1))
    assert server.attempts["answer-0"] == 2
    dead = judge()
    url = dead.base_url
    dead.close()
    with pytest.raises(ScorerError, match="unreachable|connection failed"):
        OpenAIChatScorer(url, "m", api_key_env=api_key, max_retries=1, backoff=0.01).score(_items(1))


def test_unparseable_can_raise_and_range_is_checked(judge, api_key):
    server = judge(scores={"answer-0": 7.0, "answer-1": 0.4}, scripts={"answer-2": ["words"]})
    scorer = _fast(server, api_key, score_range=(0.0, 1.0), max_retries=1)
    got = scorer.score(_items(2))
    assert math.isnan(got[0]) and got[1] == 0.4  # 7.0 is outside [0, 1]
    with pytest.raises(ScorerError, match="no score in reply"):
        _fast(server, api_key, on_unparseable="raise", max_retries=0).score([_items(3)[2]])


def test_no_key_sends_no_authorization(judge, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server = judge(scores={"answer-0": 0.9})
    assert OpenAIChatScorer(server.base_url, "m").score(_items(1)) == [0.9]
    assert server.requests[0]["auth"] is None


def test_parsers_config_and_repr(api_key):
    assert parse_score('{"score": 0.75}') == 0.75
    assert parse_score("Rating: 8/10") == 8.0
    assert parse_score("  -0.5e-1 ") == -0.05
    with pytest.raises(ValueError):
        parse_score("none")
    sc = OpenAIChatScorer.from_config({"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": api_key,
                                       "score_pattern": r"(\d+)/10"})
    assert sc.score_parser("I give 3/10, then 9") == 3.0
    assert KEY not in repr(sc) and "CJE_TEST_JUDGE_KEY" in repr(sc)
    assert chat_endpoint("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_endpoint("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_endpoint("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"
    for bad, col in (({"base_url": "http://h", "model": "m", "apikey": "x"}, None),
                     ({"model": "m"}, "base_url"),
                     ({"base_url": "ftp://h", "model": "m"}, "base_url"),
                     ({"base_url": "http://h", "model": "m", "concurrency": 0}, "concurrency"),
                     ({"base_url": "http://h", "model": "m", "prompt_template": "no slot"}, "prompt_template"),
                     ({"base_url": "http://h", "model": "m", "score_pattern": "("}, "score_pattern")):
        with pytest.raises(CJEInputError) as err:
            OpenAIChatScorer.from_config(bad)
        assert err.value.column == col
