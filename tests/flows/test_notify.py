"""flows.integrations.notify against a real local HTTP receiver (stdlib http.server in a thread)."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flows.integrations.notify import KINDS, notify, notify_result, redact_url
from tests.ports import refused_port


class Receiver:
    """A webhook receiver on 127.0.0.1 that records JSON bodies; can fail the first N posts."""

    def __init__(self, fail_first: int = 0, fail_status: int = 503) -> None:
        self.messages: list[dict] = []
        self.hits = 0
        self.fail_first = fail_first
        self.fail_status = fail_status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.hits += 1
                if outer.hits <= outer.fail_first:
                    self.send_response(outer.fail_status)
                    self.end_headers()
                    return
                outer.messages.append({"path": self.path, "content_type": self.headers.get("Content-Type"),
                                       "body": json.loads(body)})
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):  # keep test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook?token=s3cr3t-token"

    def kinds(self) -> list[str]:
        return [m["body"]["kind"] for m in self.messages]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_webhook_posts_kind_payload_and_timestamp(receiver, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    out = notify("label_request", {"evaluation": "e", "n_labels": 12, "bad": float("nan")}, webhook_url=receiver.url)
    assert out["ok"] is True and out["webhook"]["delivered"] is True and out["webhook"]["status"] == 204
    assert len(receiver.messages) == 1
    msg = receiver.messages[0]
    assert msg["content_type"] == "application/json"
    assert msg["body"]["kind"] == "label_request"
    assert msg["body"]["payload"] == {"evaluation": "e", "n_labels": 12, "bad": None}  # NaN -> null
    assert msg["body"]["ts"] == out["ts"]
    # the token in the query string never reaches the returned record
    assert "s3cr3t" not in json.dumps(out)


def test_env_webhook_used_when_no_url_given(receiver, monkeypatch):
    monkeypatch.setenv("CJE_WEBHOOK_URL", receiver.url)
    out = notify("drift_alarm", {"look": 3})
    assert out["webhook"]["delivered"] and receiver.kinds() == ["drift_alarm"]


def test_retries_on_server_errors_then_delivers(monkeypatch):
    r = Receiver(fail_first=2, fail_status=503)
    try:
        out = notify("audit_failed", {"policy": "p"}, webhook_url=r.url, attempts=3, backoff=0.01)
        assert out["webhook"]["delivered"] and out["webhook"]["attempts"] == 3
        assert r.hits == 3 and r.kinds() == ["audit_failed"]
    finally:
        r.close()


def test_client_error_is_not_retried_and_not_raised():
    r = Receiver(fail_first=10, fail_status=400)
    try:
        out = notify("audit_failed", {"policy": "p"}, webhook_url=r.url, attempts=3, backoff=0.01)
        assert out["ok"] is False and out["webhook"]["status"] == 400 and out["webhook"]["attempts"] == 1
        assert r.hits == 1
    finally:
        r.close()


def test_receiver_down_never_raises_and_is_bounded():
    # The event channel's first look at Prefect's settings imports Prefect (13 s at load 11 on 2 cores, 0.04 s
    # for the same call afterwards): imported before the clock starts, the bound is on notify's own work.
    import prefect.settings  # noqa: F401

    with refused_port() as port:  # held: no other process can start listening there meanwhile
        t0 = time.perf_counter()
        out = notify("level_refused", {"policy": "p"}, webhook_url=f"http://127.0.0.1:{port}/hook", attempts=3,
                     backoff=0.01, timeout=1)
    assert out["ok"] is False and out["webhook"]["delivered"] is False
    assert out["webhook"]["attempts"] == 3 and "Connection" in out["webhook"]["error"]
    assert time.perf_counter() - t0 < 5  # connection refused is immediate; 3 tries + 0.03 s of backoff


def test_bad_inputs_are_reported_not_raised(receiver):
    out = notify("not_a_kind", {}, webhook_url=receiver.url)
    assert out["ok"] is False and "unknown notification kind" in out["error"] and receiver.hits == 0
    out = notify("label_request", {"x": 1}, webhook_url="not a url")
    assert out["ok"] is False and out["webhook"]["attempts"] == 0  # malformed URL: refused, never tried
    assert "http:// or https://" in out["webhook"]["error"]


def test_no_channel_configured(monkeypatch):
    monkeypatch.delenv("CJE_WEBHOOK_URL", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: None}):
        out = notify("label_request", {"x": 1})
    assert out["ok"] is False and out["webhook"] is None and "no channel" in out["error"]
    assert out["event"]["emitted"] is False


def test_redact_url_drops_credentials_and_query():
    assert redact_url("https://user:pw@hooks.example/x/y?token=abc#f") == "https://hooks.example/x/y"


def test_notify_result_sends_refusals_and_failed_audits(receiver):
    result = {"policies": {
        "a": {"level_claim": "ok", "audit": {"verdict": "pass"}},
        "b": {"level_claim": "refused", "refusal_reasons": ["the transport audit failed"], "basis_code": "plug_in",
              "audit": {"verdict": "fail", "reason": "mean residual -0.3", "residual_mean": -0.3, "se": 0.05,
                        "n_labels": 5}},
        "c": {"level_claim": "refused", "refusal_reasons": ["limited calibration support"],
              "audit": {"verdict": "inconclusive"}},
    }}
    sent = notify_result(result, evaluation="ev", window="w", path="/r", webhook_url=receiver.url)
    assert [s["kind"] for s in sent] == ["level_refused", "audit_failed", "level_refused"]
    bodies = [m["body"] for m in receiver.messages]
    assert [(b["kind"], b["payload"]["policy"]) for b in bodies] == [
        ("level_refused", "b"), ("audit_failed", "b"), ("level_refused", "c")]
    assert bodies[0]["payload"]["refusal_reasons"] == ["the transport audit failed"]
    assert bodies[1]["payload"]["residual_mean"] == -0.3


def test_prefect_event_reaches_the_server(prefect_server, monkeypatch):
    """With a Prefect API configured the notification is also a Prefect event ``cje.<kind>``."""
    monkeypatch.delenv("CJE_WEBHOOK_URL", raising=False)
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter
    from prefect.events.worker import EventsWorker

    out = notify("drift_alarm", {"evaluation": "ev-notify", "look": 7})
    assert out["event"]["emitted"] is True and out["ok"] is True
    EventsWorker.drain_all()
    found = []
    deadline = time.monotonic() + 120  # bounds a hang only: the server ingests events later on a loaded machine
    while time.monotonic() < deadline and not found:
        with get_client(sync_client=True) as client:
            resp = client.request("POST", "/events/filter", json={
                "filter": EventFilter(event=EventNameFilter(name=["cje.drift_alarm"])).model_dump(mode="json"),
                "limit": 50})
        found = [e for e in resp.json()["events"] if e["id"] == out["event"]["id"]]
        if not found:
            time.sleep(0.5)
    assert found, "the event did not reach the Prefect server in 120 s"
    assert found[0]["resource"]["prefect.resource.id"] == "cje.evaluation.ev-notify"
    assert found[0]["payload"] == {"evaluation": "ev-notify", "look": 7}


def test_kinds_are_the_contract():
    assert set(KINDS) == {"label_request", "drift_alarm", "level_refused", "audit_failed", "regression_alarm"}


# ------------------------------------------------------------------------------ webhook URLs that are refused

REFUSED_WEBHOOKS = ["file:///etc/passwd", "gopher://127.0.0.1:70/_x", "ftp://127.0.0.1/hook",
                    "http://169.254.169.254/latest/meta-data/", "http://169.254.10.1/hook", "http://[fe80::1]/hook",
                    "http://[fd00:ec2::254]/latest/meta-data/", "http://[::ffff:169.254.169.254]/",
                    "http://2852039166/latest", "http://0xa9.0xfe.0xa9.0xfe/", "http://metadata.google.internal/x",
                    "javascript:alert(1)", "http:///no-host"]


@pytest.mark.parametrize("url", REFUSED_WEBHOOKS)
def test_webhook_urls_are_refused_at_config_load(tmp_path, url):
    """Issue 25: webhook URLs accepted file://, gopher://, ftp://, link-local and cloud-metadata addresses.
    Now the configuration refuses them at load, naming the file and the key; loopback stays allowed."""
    import yaml

    from cje_engine.errors import CJEInputError
    from flows.runtime.schedules import load_evaluations

    f = tmp_path / "ev.yaml"
    entry = {"name": "a", "logs_uri": "logs", "label_requests": {"webhook_url": url}}
    f.write_text(yaml.safe_dump({"evaluations": [entry]}))
    with pytest.raises(CJEInputError, match="label_requests.webhook_url") as err:
        load_evaluations(f)
    msg = str(err.value)
    assert str(f) in msg and ("refused" in msg or "no host" in msg) and "\n" not in msg
    entry["label_requests"]["webhook_url"] = "http://127.0.0.1:9/hook?token=x"
    f.write_text(yaml.safe_dump({"evaluations": [entry]}))
    assert load_evaluations(f)["a"].label_requests["webhook_url"].startswith("http://127.0.0.1")


def test_a_metadata_webhook_is_exit_2_naming_file_and_key(tmp_path):
    """The same through `cje run`: exit 2, one line naming the file and the key, before anything starts."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    f = tmp_path / "ev.yaml"
    f.write_text("evaluations:\n  - name: a\n    logs_uri: logs\n    label_requests:\n"
                 "      webhook_url: http://169.254.169.254/latest/meta-data/iam\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_URL")}
    r = subprocess.run([str(Path(sys.executable).with_name("cje")), "run", "a", "--config", str(f)],
                       cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("config: ")]
    assert len(lines) == 1 and str(f) in lines[0] and "label_requests.webhook_url" in lines[0], r.stderr
    assert "cloud metadata" in lines[0] and "Traceback" not in r.stderr


def test_request_and_drift_settings_refuse_such_webhooks():
    from cje_engine.errors import CJEInputError
    from flows.label_requests.config import RequestConfig
    from flows.pipelines.drift_config import settings_from

    with pytest.raises(CJEInputError, match="webhook_url .*link-local"):
        RequestConfig.from_dict({"webhook_url": "http://[fe80::1%25eth0]/x"})
    with pytest.raises(CJEInputError, match="webhook_url"):
        settings_from({"set_name": "s", "anchors_uri": "/tmp/a", "webhook_url": "gopher://127.0.0.1/"})
    assert RequestConfig.from_dict({"webhook_url": "https://hooks.example.com/T/1"}).webhook_url


def test_notify_refuses_such_a_url_and_a_name_resolving_to_one(monkeypatch):
    """Also at send time (CJE_WEBHOOK_URL never passes the configuration): nothing is contacted."""
    import flows.integrations.notify as notify_module

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("CJE_WEBHOOK_URL", "file:///etc/passwd")
    out = notify("label_request", {"n": 1})
    assert out["ok"] is False and out["webhook"]["attempts"] == 0 and "http:// or https://" in out["webhook"]["error"]
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if host == "hooks.example.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.169.254", 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(notify_module.socket, "getaddrinfo", resolve)
    out = notify("label_request", {"n": 1}, webhook_url="http://hooks.example.test/hook")
    assert out["webhook"]["attempts"] == 0 and "resolves to a cloud metadata address" in out["webhook"]["error"]


def test_redirects_are_not_followed(monkeypatch, receiver):
    """A receiver answering 302 (to another local server) is a failed delivery; the POST is not re-sent."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    target = receiver.url

    class Redirect(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server API
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(302)
            self.send_header("Location", target)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = notify("label_request", {"n": 1}, webhook_url=f"http://127.0.0.1:{server.server_address[1]}/hook",
                     backoff=0.01)
    finally:
        server.shutdown()
        server.server_close()
    assert out["webhook"]["delivered"] is False and out["webhook"]["status"] == 302
    assert out["webhook"]["attempts"] == 1 and "not followed" in out["webhook"]["error"]
    assert receiver.hits == 0 and receiver.messages == []


# ------------------------------------------------------------------------------ notifiers as a registry


class ToyNotifier:
    """A channel registered by a test: keeps what it receives (``fail``: raises instead)."""

    def __init__(self, name: str = "toy", fail: bool = False) -> None:
        self.name = name
        self.fail = fail
        self.got: list = []

    def configured(self, settings) -> bool:
        return True

    def send(self, message, settings) -> dict:
        if self.fail:
            raise RuntimeError("toy channel broke")
        self.got.append((message.kind, dict(message.payload), settings.extra.get("toy_room")))
        return {"delivered": True, "error": None}


@pytest.fixture
def toy():
    from flows.integrations import notify as notify_module

    tool = notify_module.register(ToyNotifier())
    yield tool
    notify_module.unregister(tool.name)


def test_the_builtin_notifiers_are_registered():
    from flows.integrations.notify import names

    assert names()[:2] == ("webhook", "event")


def test_a_notifier_registered_in_a_test_receives_every_event_beside_the_webhook(toy, receiver, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    out = notify("label_request", {"request_id": "lr-1", "x": float("nan")}, webhook_url=receiver.url,
                 extra={"toy_room": "#labels"})
    assert out["ok"] is True and out["toy"] == {"delivered": True, "error": None} and out["webhook"]["delivered"]
    assert toy.got == [("label_request", {"request_id": "lr-1", "x": None}, "#labels")]  # JSON-ready payload
    assert receiver.kinds() == ["label_request"]
    # the audit path (`notify_result`) reaches it too, without any other file naming it
    notify_result({"policies": {"b": {"level_claim": "refused", "audit": {"verdict": "fail"}}}}, evaluation="ev",
                  window="w", webhook_url=receiver.url)
    assert [k for k, _, _ in toy.got] == ["label_request", "level_refused", "audit_failed"]
    assert toy.got[1][1]["policy"] == "b" and toy.got[1][1]["evaluation"] == "ev"


def test_a_broken_notifier_neither_raises_nor_stops_the_others(receiver, monkeypatch):
    from flows.integrations import notify as notify_module

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    notify_module.register(ToyNotifier("broken", fail=True))
    try:
        out = notify("drift_alarm", {"n": 1}, webhook_url=receiver.url)
    finally:
        notify_module.unregister("broken")
    assert out["ok"] is False and "toy channel broke" in out["broken"]["error"]
    assert out["webhook"]["delivered"] and receiver.kinds() == ["drift_alarm"]


def test_channels_choose_notifiers_and_unknown_ones_are_named(toy, receiver):
    out = notify("label_request", {"n": 1}, webhook_url=receiver.url, channels=["toy"])
    assert out["ok"] is True and len(toy.got) == 1 and receiver.hits == 0 and "webhook" not in out
    out = notify("label_request", {"n": 1}, webhook_url=receiver.url, channels=["webhok"])
    assert out["ok"] is False and "unknown notifier 'webhok'" in out["error"]
    assert "did you mean 'webhook'" in out["error"]
    assert receiver.hits == 0 and len(toy.got) == 1


def test_registering_a_notifier_checks_its_name_and_protocol(toy):
    from flows.integrations.notify import register

    with pytest.raises(ValueError, match="already registered"):
        register(ToyNotifier())
    with pytest.raises(ValueError, match="not a key"):
        register(ToyNotifier("ok"))
    with pytest.raises(TypeError, match="lacks configured/send"):
        register(type("NoSend", (), {"name": "nosend"})())


def test_every_registered_notifier_follows_the_protocol(monkeypatch):
    """Conformance: each notifier says whether it is configured and returns None (nothing tried) or a record
    with its delivery flag and error; unconfigured, no notifier claims a delivery."""
    from datetime import datetime, timezone

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.integrations.notify import Message, Notifier, NotifySettings, get, names

    monkeypatch.delenv("CJE_WEBHOOK_URL", raising=False)
    message = Message("label_request", {"n": 1}, datetime.now(timezone.utc))
    with temporary_settings(updates={PREFECT_API_URL: None}):
        for name in names():
            n = get(name)
            assert isinstance(n, Notifier) and n.name == name
            assert n.configured(NotifySettings()) is False
            record = n.send(message, NotifySettings())
            assert record is None or (not record.get("delivered", record.get("emitted")) and "error" in record)
