"""Pluggable judge scorers: ask a judge to score anchors (prompt, response) again.

`JudgeScorer` is the interface the drift flow needs: ``score(items) -> list[float]``, one score
per item, in order, NaN for an item the judge could not score. `OpenAIChatScorer` implements it
over HTTP for any OpenAI-compatible ``/v1/chat/completions`` endpoint (OpenAI, vLLM, llama.cpp
server, Ollama, LiteLLM, ...), with the standard library only (``urllib.request``).

Behaviour of `OpenAIChatScorer`:

* one chat request per item, ``concurrency`` at a time (threads), results in input order;
* 429 and 5xx answers, timeouts and refused/reset connections are retried up to
  ``max_retries`` times with exponential backoff and jitter (a ``Retry-After`` header in seconds
  is honoured, capped at ``max_backoff``); when the retries are exhausted `ScorerError` is raised:
  a judge endpoint that cannot be reached must fail the look, not thin it out silently;
* other 4xx answers (401, 400, 404, ...) raise `ScorerError` at once;
* a reply without a usable number (not JSON, no ``choices[0].message.content``, no number in the
  text, or outside ``score_range``) is asked again up to ``max_retries`` times, then gives NaN
  (``on_unparseable="nan"``, default) or raises (``"raise"``);
* the API key is read from the environment variable named by ``api_key_env`` at request time.
  It is sent only in the ``Authorization`` header and never appears in ``repr``, logs or error
  messages (any text from the server is scrubbed of it before use).
"""
from __future__ import annotations

import http.client
import json
import logging
import math
import os
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, runtime_checkable

from cje_engine.errors import CJEInputError

log = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = "You are a careful evaluator of AI assistant responses."
DEFAULT_PROMPT_TEMPLATE = (
    "Rate the quality of the assistant's response to the user's prompt on a scale from 0 to 1, "
    "where 0 is useless and 1 is excellent.\n\n[Prompt]\n{prompt}\n\n[Response]\n{response}\n\n"
    "Answer with the number only."
)
RETRY_STATUS = (408, 409, 425, 429, 500, 502, 503, 504)
_NUMBER_RE = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_MAX_BODY = 1 << 20
#: Keys accepted by `OpenAIChatScorer.from_config` (flow parameters and evaluations.yaml).
CONFIG_KEYS = ("base_url", "model", "api_key_env", "prompt_template", "system_prompt", "score_pattern",
               "score_range", "timeout", "max_retries", "backoff", "max_backoff", "concurrency",
               "temperature", "max_tokens", "on_unparseable")


@runtime_checkable
class JudgeScorer(Protocol):
    """Anything that scores items ``{"anchor_id", "prompt", "response"}``.

    ``score`` returns one float per item in the same order (NaN = could not be scored).
    """

    def score(self, items: list[dict]) -> list[float]:
        """One judge score per item."""


class ScorerError(RuntimeError):
    """The judge endpoint failed (after retries where the failure looked transient)."""


class _Unparseable(Exception):
    pass


class _Transient(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def parse_score(text: str) -> float:
    """The score in a judge reply: ``{"score": x}`` JSON, else the first number in the text.

    Raises ``ValueError`` when there is none.
    """
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            doc = json.loads(stripped)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("score"), (int, float)) and not isinstance(
                doc.get("score"), bool):
            return float(doc["score"])
    m = _NUMBER_RE.search(text)
    if m is None:
        raise ValueError("no number in the reply")
    return float(m.group(0))


def pattern_parser(pattern: str) -> Callable[[str], float]:
    """A parser taking the first group (or the whole match) of a regular expression."""
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise CJEInputError(f"score_pattern {pattern!r} is not a valid regular expression: {exc}",
                            column="score_pattern") from None

    def parse(text: str) -> float:
        m = rx.search(text)
        if m is None:
            raise ValueError(f"reply does not match {pattern!r}")
        return float(m.group(1) if rx.groups else m.group(0))

    return parse


def chat_endpoint(base_url: str) -> str:
    """``.../v1/chat/completions`` from a base URL with or without ``/v1``."""
    if not isinstance(base_url, str) or not re.match(r"^https?://[^/\s]+", base_url):
        raise CJEInputError(f"base_url {base_url!r} must be an http(s) URL such as http://127.0.0.1:8000/v1",
                            column="base_url")
    url = base_url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


class OpenAIChatScorer:
    """Judge scores from an OpenAI-compatible chat completions endpoint.

    Parameters
    ----------
    base_url : str
        E.g. ``https://api.openai.com/v1`` or ``http://127.0.0.1:8000`` (``/v1`` added if missing).
    model : str
    api_key_env : str or None
        Environment variable holding the API key (default ``OPENAI_API_KEY``); unset or None
        sends no ``Authorization`` header (local servers).
    prompt_template : str
        User message; ``{prompt}`` and ``{response}`` are replaced (other braces are left alone).
    system_prompt : str or None
    score_parser : callable, optional
        ``reply text -> float`` (raise ``ValueError`` when there is no score); default `parse_score`.
    score_range : (lo, hi), optional
        Scores outside are treated as unparseable replies.
    timeout : float
        Seconds per request.
    max_retries : int
        Extra attempts per item for transient failures and unparseable replies.
    backoff, max_backoff : float
        First backoff in seconds (doubling, with jitter) and its cap.
    concurrency : int
        Requests in flight at once.
    temperature : float, optional
        Sent when given; a drift monitor wants the judge's usual sampling (fresh noise per look).
    max_tokens : int, optional
    on_unparseable : {"nan", "raise"}

    Attributes
    ----------
    stats_ : dict
        ``requests``, ``retries``, ``unparseable`` (items given NaN) of this scorer so far.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str | None = "OPENAI_API_KEY",
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        score_parser: Callable[[str], float] | None = None,
        score_range: tuple[float, float] | None = None,
        timeout: float = 60.0,
        max_retries: int = 4,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        concurrency: int = 4,
        temperature: float | None = None,
        max_tokens: int | None = None,
        on_unparseable: str = "nan",
    ) -> None:
        self.endpoint = chat_endpoint(base_url)
        if not isinstance(model, str) or not model:
            raise CJEInputError("model must be a non-empty string", column="model")
        if not isinstance(prompt_template, str) or "{response}" not in prompt_template:
            raise CJEInputError("prompt_template must contain {response} (and usually {prompt})",
                                column="prompt_template")
        if on_unparseable not in ("nan", "raise"):
            raise CJEInputError(f"on_unparseable must be 'nan' or 'raise', got {on_unparseable!r}",
                                column="on_unparseable")
        for name, value, low in (("timeout", timeout, 0.0), ("backoff", backoff, 0.0),
                                 ("max_backoff", max_backoff, 0.0)):
            if not isinstance(value, (int, float)) or not value >= low or (name == "timeout" and value == 0):
                raise CJEInputError(f"{name} must be a positive number of seconds, got {value!r}", column=name)
        if not isinstance(max_retries, int) or max_retries < 0:
            raise CJEInputError(f"max_retries must be an integer >= 0, got {max_retries!r}", column="max_retries")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise CJEInputError(f"concurrency must be an integer >= 1, got {concurrency!r}", column="concurrency")
        if score_range is not None:
            if len(score_range) != 2 or not float(score_range[0]) < float(score_range[1]):
                raise CJEInputError(f"score_range must be [low, high] with low < high, got {score_range!r}",
                                    column="score_range")
            score_range = (float(score_range[0]), float(score_range[1]))
        self.base_url = base_url
        self.model = model
        self.api_key_env = api_key_env
        self.prompt_template = prompt_template
        self.system_prompt = system_prompt
        self.score_parser = score_parser or parse_score
        self.score_range = score_range
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.concurrency = int(concurrency)
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.on_unparseable = on_unparseable
        self.stats_ = {"requests": 0, "retries": 0, "unparseable": 0}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: dict) -> "OpenAIChatScorer":
        """Build from plain settings (flow parameter / YAML); ``score_pattern`` sets a regex parser."""
        if not isinstance(config, dict):
            raise CJEInputError(f"scorer config must be a mapping, got {type(config).__name__}", source="scorer")
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise CJEInputError(f"unknown scorer setting(s) {unknown}; expected some of {list(CONFIG_KEYS)}",
                                source="scorer")
        for req in ("base_url", "model"):
            if not config.get(req):
                raise CJEInputError(f"scorer config needs {req!r}", source="scorer", column=req)
        kw = {k: v for k, v in config.items() if k != "score_pattern"}
        if config.get("score_pattern"):
            kw["score_parser"] = pattern_parser(str(config["score_pattern"]))
        if kw.get("score_range") is not None:
            kw["score_range"] = tuple(kw["score_range"])
        return cls(**kw)

    def __repr__(self) -> str:
        return (f"OpenAIChatScorer(endpoint={self.endpoint!r}, model={self.model!r}, "
                f"api_key_env={self.api_key_env!r}, concurrency={self.concurrency})")

    # -- plumbing -------------------------------------------------------------------------

    def _key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def _scrub(self, text: str) -> str:
        key = self._key()
        if key and len(key) >= 4:
            text = text.replace(key, "***")
        return text

    def _count(self, name: str) -> None:
        with self._lock:
            self.stats_[name] += 1

    def _message(self, item: dict) -> str:
        if not isinstance(item, dict) or "response" not in item:
            raise CJEInputError("each item must be a mapping with 'response' (and usually 'prompt')",
                                source="scorer items")
        return (self.prompt_template.replace("{prompt}", str(item.get("prompt", "")))
                .replace("{response}", str(item["response"])))

    def _request(self, item: dict) -> str:
        """One HTTP round trip; returns the reply content."""
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": self._message(item)})
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = int(self.max_tokens)
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = self._key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.endpoint, data=json.dumps(body).encode("utf-8"), headers=headers,
                                     method="POST")
        self._count("requests")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310 - http(s) checked
                raw = resp.read(_MAX_BODY)
        except urllib.error.HTTPError as exc:
            detail = self._scrub(" ".join(exc.read(2000).decode("utf-8", "replace").split())[:300])
            where = f"judge endpoint {self.endpoint} answered HTTP {exc.code}"
            if exc.code in RETRY_STATUS:
                raise _Transient(f"{where}: {detail}", _retry_after(exc.headers.get("Retry-After"))) from None
            hint = f" (is ${self.api_key_env} set?)" if exc.code in (401, 403) and self.api_key_env else ""
            raise ScorerError(f"{where}{hint}: {detail}") from None
        except (TimeoutError, socket.timeout):
            raise _Transient(f"judge endpoint {self.endpoint} did not answer within {self.timeout:g} s") from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise _Transient(f"judge endpoint {self.endpoint} did not answer within {self.timeout:g} s") from None
            raise _Transient(f"judge endpoint {self.endpoint} unreachable: {self._scrub(str(reason))}") from None
        except (ConnectionError, http.client.HTTPException) as exc:
            raise _Transient(f"judge endpoint {self.endpoint} connection failed: "
                             f"{type(exc).__name__}: {self._scrub(str(exc))[:200]}") from None
        try:
            doc = json.loads(raw)
            content = doc["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Unparseable(f"reply is not a chat completion: {self._scrub(raw[:200].decode('utf-8', 'replace'))!r}")
        if not isinstance(content, str):
            raise _Unparseable(f"reply content is {type(content).__name__}, expected text")
        return content

    def _parse(self, content: str) -> float:
        try:
            value = float(self.score_parser(content))
        except (ValueError, TypeError) as exc:
            raise _Unparseable(f"no score in reply {self._scrub(content[:200])!r}: {exc}") from None
        if not math.isfinite(value):
            raise _Unparseable(f"score {value!r} in reply is not finite")
        if self.score_range is not None and not self.score_range[0] <= value <= self.score_range[1]:
            raise _Unparseable(f"score {value!r} is outside {list(self.score_range)}")
        return value

    def _sleep(self, attempt: int, retry_after: float | None) -> None:
        delay = self.backoff * 2 ** attempt * (0.5 + random.random())
        if retry_after is not None:
            delay = max(delay, retry_after)
        time.sleep(min(self.max_backoff, delay))

    # -- public ---------------------------------------------------------------------------

    def score_one(self, item: dict) -> float:
        """Score one item (see the class docstring for retries and failures)."""
        ident = item.get("anchor_id", "?") if isinstance(item, dict) else "?"
        last = ""
        for attempt in range(self.max_retries + 1):
            try:
                return self._parse(self._request(item))
            except _Transient as exc:
                last = str(exc)
                if attempt == self.max_retries:
                    raise ScorerError(f"item {ident!r}: {last} (gave up after {attempt + 1} attempt(s))") from None
                self._count("retries")
                log.warning("item %r: %s; retrying (%d/%d)", ident, last, attempt + 1, self.max_retries)
                self._sleep(attempt, exc.retry_after)
            except _Unparseable as exc:
                last = str(exc)
                if attempt == self.max_retries:
                    break
                self._count("retries")
                log.warning("item %r: %s; asking again (%d/%d)", ident, last, attempt + 1, self.max_retries)
                self._sleep(attempt, None)
        if self.on_unparseable == "raise":
            raise ScorerError(f"item {ident!r}: {last} (after {self.max_retries + 1} attempt(s))")
        self._count("unparseable")
        log.warning("item %r: no usable score after %d attempt(s): %s", ident, self.max_retries + 1, last)
        return float("nan")

    def score(self, items: list[dict]) -> list[float]:
        """One score per item, in order (NaN where no usable score came back)."""
        items = list(items)
        if not items:
            return []
        if self.concurrency == 1 or len(items) == 1:
            return [self.score_one(it) for it in items]
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, len(items)), thread_name_prefix="cje-judge")
        try:
            futures = [pool.submit(self.score_one, it) for it in items]
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


__all__ = ["JudgeScorer", "OpenAIChatScorer", "ScorerError", "parse_score", "pattern_parser", "chat_endpoint",
           "DEFAULT_PROMPT_TEMPLATE", "CONFIG_KEYS"]
