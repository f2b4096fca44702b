"""Notifications: alarms, refused levels, failed audits and new label requests reach people.

Channels are notifiers behind one protocol (`Notifier`: a ``name`` and ``send``), kept in a registry
(`register`, `get`, `names`); `notify` hands each message to every registered notifier (or the ``channels``
it is given).  Two are built in, both best effort (a notification must never break the run that sends it):

* **webhook**: ``POST`` of ``{"kind": kind, "payload": payload, "ts": "<ISO-8601 UTC>"}`` as JSON
  to ``webhook_url`` or the environment variable ``CJE_WEBHOOK_URL``.  Connection errors,
  timeouts, HTTP 429 and 5xx are retried with exponential backoff (bounded); other 4xx
  answers are not retried (the receiver rejected the message).  Failures are logged and
  returned, never raised.  Only ``http``/``https`` URLs are used, never one whose host is or
  resolves to a link-local or cloud metadata address (`flows.uris.check_webhook_url`; the
  configuration refuses them at load, this is checked again before each send, also for
  ``CJE_WEBHOOK_URL``); redirects are not followed (a 3xx answer is a failed delivery).
* **Prefect event** ``cje.<kind>`` (``prefect.events.emit_event``) when a Prefect API is
  configured (``PREFECT_API_URL`` or an active temporary setting), so that Prefect
  automations can route it (e-mail, Slack, ...).  The event's resource is
  ``cje.evaluation.<evaluation>`` when the payload names an evaluation, else ``cje.service``.

Kinds: ``label_request``, ``drift_alarm``, ``level_refused``, ``audit_failed``, ``regression_alarm``.

A new channel (Slack, e-mail, a queue) is a class with ``name``, ``configured`` and ``send`` in its own
module and one `register` call; docs/label-requests.md, "Adding a notifier".

`notify_result` sends ``level_refused`` / ``audit_failed`` for a published result.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

from cje_engine.errors import CJEInputError
from cje_engine.registry import Registry
from flows.uris import check_webhook_url, forbidden_address, literal_ip

log = logging.getLogger(__name__)

KINDS = ("label_request", "drift_alarm", "level_refused", "audit_failed", "regression_alarm")
ENV_WEBHOOK = "CJE_WEBHOOK_URL"
#: Attempts per webhook delivery and the first backoff (doubled after each failure).
DEFAULT_ATTEMPTS = 3
DEFAULT_BACKOFF = 0.5
DEFAULT_TIMEOUT = 5.0


def _jsonable(obj: Any) -> Any:
    """Plain JSON data (NaN/inf -> None, unknown objects -> str)."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    try:  # numpy scalars
        item = obj.item()
        if isinstance(item, (int, float, bool, str)):
            return _jsonable(item)
    except Exception:  # noqa: BLE001
        pass
    return str(obj)


def redact_url(url: str) -> str:
    """The URL without user-info, query and fragment (webhook URLs often carry tokens there)."""
    try:
        p = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    host = p.hostname or ""
    if p.port:
        host = f"{host}:{p.port}"
    return urlunsplit((p.scheme, host, p.path, "", ""))


def _api_configured() -> bool:
    try:
        from prefect.settings import get_current_settings

        return bool(get_current_settings().api.url)
    except Exception:  # noqa: BLE001 - prefect missing or misconfigured: no events
        return False


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: a receiver could send the POST (and its body) anywhere, e.g. to a
    metadata endpoint the URL check refused; the 3xx answer is returned as an `HTTPError`."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def refuse_webhook(url: str) -> str | None:
    """Why ``url`` may not be posted to (`check_webhook_url`, then every address its host resolves to),
    or None.  A name that does not resolve is left to the delivery (a retried connection error)."""
    try:
        check_webhook_url(url, "webhook URL")
    except CJEInputError as exc:
        return exc.detail
    host = urlsplit(url).hostname or ""
    if literal_ip(host) is not None:
        return None
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return None
    for info in infos:
        try:
            why = forbidden_address(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]))
        except ValueError:
            continue
        if why:
            return f"webhook URL host {host!r} resolves to {why}; refused"
    return None


def _post(url: str, body: bytes, attempts: int, timeout: float, backoff: float) -> dict:
    out: dict[str, Any] = {"url": redact_url(url), "delivered": False, "status": None, "attempts": 0, "error": None}
    refused = refuse_webhook(url)
    if refused:
        out["error"] = refused
        log.warning("webhook %s not used: %s", out["url"], refused)
        return out
    delay = backoff
    for attempt in range(1, max(1, attempts) + 1):
        out["attempts"] = attempt
        retry = True
        try:
            req = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "User-Agent": "cje-notify"})
            with _OPENER.open(req, timeout=timeout) as resp:  # noqa: S310 - checked URL, no redirects
                out["status"] = int(resp.status)
                out["delivered"] = 200 <= resp.status < 300
                out["error"] = None
                return out
        except urllib.error.HTTPError as exc:
            out["status"] = int(exc.code)
            out["error"] = f"HTTP {exc.code}" + (" (a redirect; not followed)" if 300 <= exc.code < 400 else "")
            retry = exc.code == 429 or exc.code >= 500
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            out["error"] = f"{type(exc).__name__}: {reason}"
            retry = not isinstance(exc, ValueError)  # ValueError: malformed URL, retrying is useless
        if not retry or attempt >= attempts:
            break
        time.sleep(delay)
        delay *= 2
    log.warning("webhook %s not delivered after %d attempt(s): %s", out["url"], out["attempts"], out["error"])
    return out


def _emit(kind: str, payload: dict, ts: datetime) -> dict:
    out: dict[str, Any] = {"emitted": False, "event": f"cje.{kind}", "id": None, "error": None}
    if not _api_configured():
        out["error"] = "no Prefect API configured"
        return out
    try:
        from prefect.events import emit_event

        evaluation = payload.get("evaluation")
        resource = ({"prefect.resource.id": f"cje.evaluation.{evaluation}", "prefect.resource.name": str(evaluation)}
                    if evaluation else {"prefect.resource.id": "cje.service", "prefect.resource.name": "cje"})
        event = emit_event(event=f"cje.{kind}", resource=resource, occurred=ts, payload=payload)
        if event is not None:
            out.update(emitted=True, id=str(event.id))
        else:
            out["error"] = "Prefect did not emit the event (events disabled for this client)"
    except Exception as exc:  # noqa: BLE001 - never into the caller
        out["error"] = f"{type(exc).__name__}: {exc}"
        log.warning("Prefect event cje.%s not emitted: %s", kind, out["error"])
    return out


# --------------------------------------------------------------------------------------
# notifiers: the protocol, the built-in channels and the registry


@dataclass(frozen=True)
class Message:
    """One notification: its kind (one of `KINDS`), JSON-ready payload and time (UTC)."""

    kind: str
    payload: Mapping[str, Any]
    ts: datetime

    def body(self) -> bytes:
        """``{"kind", "payload", "ts"}`` as JSON (what the webhook posts)."""
        return json.dumps({"kind": self.kind, "payload": self.payload, "ts": self.ts.isoformat()},
                          allow_nan=False).encode("utf-8")


@dataclass(frozen=True)
class NotifySettings:
    """What the channels need to send: the webhook receiver and delivery bounds, plus ``extra`` settings
    of other notifiers (by their own keys)."""

    webhook_url: str | None = None
    attempts: int = DEFAULT_ATTEMPTS
    timeout: float = DEFAULT_TIMEOUT
    backoff: float = DEFAULT_BACKOFF
    extra: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Notifier(Protocol):
    """A notification channel.

    Attributes
    ----------
    name : str
        Its key in `notify`'s outcome and in ``channels`` (``webhook``, ``event``, ...).
    """

    name: str

    def configured(self, settings: NotifySettings) -> bool:
        """Whether this channel is set up (its outcome counts towards ``ok``)."""

    def send(self, message: Message, settings: NotifySettings) -> dict | None:
        """Deliver ``message``; a record with ``delivered`` (or ``emitted``) and ``error``, or None when
        nothing was tried.  Never raises (`notify` also guards it)."""


class WebhookNotifier:
    """POST to ``settings.webhook_url`` or ``$CJE_WEBHOOK_URL`` (checked, retried, no redirects)."""

    name = "webhook"

    def _url(self, settings: NotifySettings) -> str | None:
        return settings.webhook_url or os.environ.get(ENV_WEBHOOK) or None

    def configured(self, settings: NotifySettings) -> bool:
        """A receiver URL is given or in the environment."""
        return self._url(settings) is not None

    def send(self, message: Message, settings: NotifySettings) -> dict | None:
        """`_post` of the message body; None without a URL."""
        url = self._url(settings)
        if not url:
            return None
        return _post(url, message.body(), int(settings.attempts), float(settings.timeout), float(settings.backoff))


class PrefectEventNotifier:
    """A Prefect event ``cje.<kind>`` when a Prefect API is configured (automations route it)."""

    name = "event"

    def configured(self, settings: NotifySettings) -> bool:
        """A Prefect API is configured."""
        return _api_configured()

    def send(self, message: Message, settings: NotifySettings) -> dict | None:
        """`_emit` of the message (a record saying "no Prefect API configured" when there is none)."""
        return _emit(message.kind, dict(message.payload), message.ts)


def _check_notifier(notifier: Any) -> None:
    name = getattr(notifier, "name", None)
    if not isinstance(name, str) or not name or name in ("kind", "ts", "ok", "error"):
        raise ValueError(f"notifier name {name!r}: a non-empty string, not a key of notify's outcome")
    if not isinstance(notifier, Notifier) or not callable(getattr(notifier, "configured", None)):
        raise TypeError(f"notifier {name!r} lacks configured/send (flows.integrations.notify.Notifier)")


#: The family (`cje_engine.registry.Registry`); the functions below are its public face.
NOTIFIERS: Registry[Notifier] = Registry("notifier", check=_check_notifier)


def register(notifier: Notifier, *, replace: bool = False) -> Notifier:
    """Add a notification channel; every later `notify` hands it each message.

    Raises
    ------
    ValueError, TypeError
        A name taken (unless ``replace``) or an object that is not a `Notifier`.
    """
    return NOTIFIERS.register(notifier, replace=replace)


def unregister(name: str) -> None:
    """Remove a notifier (tests register toys and remove them again)."""
    NOTIFIERS.unregister(name)


def names() -> tuple[str, ...]:
    """The registered notifiers, in registration order."""
    return NOTIFIERS.names()


def get(name: str) -> Notifier:
    """The registered notifier ``name``; `CJEInputError` naming the choices (and the closest) otherwise."""
    return NOTIFIERS.get(name)


for _notifier in (WebhookNotifier(), PrefectEventNotifier()):
    register(_notifier, replace=True)


def _delivered(record: Mapping[str, Any]) -> bool:
    return bool(record.get("delivered", record.get("emitted")))


def notify(kind: str, payload: dict, *, webhook_url: str | None = None, attempts: int = DEFAULT_ATTEMPTS,
           timeout: float = DEFAULT_TIMEOUT, backoff: float = DEFAULT_BACKOFF,
           channels: Sequence[str] | None = None, extra: Mapping[str, Any] | None = None) -> dict:
    """Send one notification through every registered notifier (by default: webhook if configured,
    Prefect event if an API is set).

    Parameters
    ----------
    kind : str
        One of `KINDS`.
    payload : dict
        JSON-ready details (NaN becomes null, other objects their ``str``).
    webhook_url : str, optional
        Receiver; default ``$CJE_WEBHOOK_URL``; none: no webhook.
    attempts, timeout, backoff
        Webhook delivery: tries, seconds per try, first pause between tries (doubling).
    channels : sequence of str, optional
        Only these notifiers (`names`); default all.
    extra : mapping, optional
        Settings of other notifiers (`NotifySettings.extra`).

    Returns
    -------
    dict
        ``{"kind", "ts", "ok", "error"}`` and one record (or None) per notifier under its name
        (``"webhook"``, ``"event"``, ...); ``ok`` is true when every configured channel succeeded.
        Never raises.
    """
    ts = datetime.now(timezone.utc)
    chosen = names() if channels is None else tuple(channels)
    out: dict[str, Any] = {"kind": kind, "ts": ts.isoformat(), "ok": False, **{n: None for n in chosen},
                           "error": None}
    try:
        if kind not in KINDS:
            out["error"] = f"unknown notification kind {kind!r}; expected one of {', '.join(KINDS)}"
            log.error("%s", out["error"])
            return out
        notifiers = [get(n) for n in chosen]
        message = Message(kind, _jsonable(dict(payload or {})), ts)
        settings = NotifySettings(webhook_url, attempts, timeout, backoff, dict(extra or {}))
        used = []
        for n in notifiers:
            try:
                out[n.name] = n.send(message, settings)
            except Exception as exc:  # noqa: BLE001 - one channel's fault never stops the others
                out[n.name] = {"delivered": False, "error": f"{type(exc).__name__}: {exc}"}
                log.warning("notifier %s failed on %s: %s", n.name, kind, out[n.name]["error"])
            if out[n.name] is not None and n.configured(settings):
                used.append(out[n.name])
        out["ok"] = bool(used) and all(_delivered(r) for r in used)
        if not used:
            out["error"] = "no channel configured (no webhook URL, no Prefect API)"
            log.info("notification %s not sent: %s", kind, out["error"])
    except Exception as exc:  # noqa: BLE001 - a notification never breaks the caller
        out["error"] = f"{type(exc).__name__}: {exc}"
        log.warning("notification %s failed: %s", kind, out["error"])
    return out


def notify_result(result: Mapping[str, Any], *, evaluation: str, window: str, path: str | None = None,
                  webhook_url: str | None = None, **kwargs: Any) -> list[dict]:
    """``level_refused`` for every refused policy and ``audit_failed`` for every failed audit.

    ``result`` is a result dict (``docs/result-schema.md``).  Returns the `notify` outcomes.
    """
    sent = []
    for name, p in (result.get("policies") or {}).items():
        common = {"evaluation": evaluation, "window": window, "policy": name, "result_path": path}
        if p.get("level_claim") == "refused":
            sent.append(notify("level_refused", {**common, "refusal_reasons": p.get("refusal_reasons") or [],
                                                 "basis": p.get("basis_code")}, webhook_url=webhook_url, **kwargs))
        audit = p.get("audit") or {}
        if audit.get("verdict") == "fail":
            sent.append(notify("audit_failed", {**common, "reason": audit.get("reason"),
                                                "residual_mean": audit.get("residual_mean"), "se": audit.get("se"),
                                                "n_labels": audit.get("n_labels"),
                                                "level_claim": p.get("level_claim"), "basis": p.get("basis_code")},
                               webhook_url=webhook_url, **kwargs))
    return sent


__all__ = ["notify", "notify_result", "KINDS", "redact_url", "Notifier", "Message", "NotifySettings",
           "WebhookNotifier", "PrefectEventNotifier", "register", "unregister", "get", "names"]
