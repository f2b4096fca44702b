"""Notifications: alarms, refused levels, failed audits and new label requests reach people.

Two channels, both best effort (a notification must never break the run that sends it):

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

Kinds: ``label_request``, ``drift_alarm``, ``level_refused``, ``audit_failed``.

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
from datetime import datetime, timezone
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

from cje_engine.errors import CJEInputError
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


def notify(kind: str, payload: dict, *, webhook_url: str | None = None, attempts: int = DEFAULT_ATTEMPTS,
           timeout: float = DEFAULT_TIMEOUT, backoff: float = DEFAULT_BACKOFF) -> dict:
    """Send one notification by webhook (if configured) and as a Prefect event (if an API is set).

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

    Returns
    -------
    dict
        ``{"kind", "ts", "ok", "webhook": {...} | None, "event": {...}, "error"}``; ``ok`` is
        true when every configured channel succeeded.  Never raises.
    """
    ts = datetime.now(timezone.utc)
    out: dict[str, Any] = {"kind": kind, "ts": ts.isoformat(), "ok": False, "webhook": None, "event": None,
                           "error": None}
    try:
        if kind not in KINDS:
            out["error"] = f"unknown notification kind {kind!r}; expected one of {', '.join(KINDS)}"
            log.error("%s", out["error"])
            return out
        data = _jsonable(dict(payload or {}))
        url = webhook_url or os.environ.get(ENV_WEBHOOK) or None
        if url:
            body = json.dumps({"kind": kind, "payload": data, "ts": out["ts"]}, allow_nan=False).encode("utf-8")
            out["webhook"] = _post(url, body, int(attempts), float(timeout), float(backoff))
        out["event"] = _emit(kind, data, ts)
        channels = [c for c in (out["webhook"], out["event"] if out["event"]["error"] != "no Prefect API configured"
                                else None) if c is not None]
        out["ok"] = bool(channels) and all(c.get("delivered", c.get("emitted")) for c in channels)
        if not channels:
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


__all__ = ["notify", "notify_result", "KINDS", "redact_url"]
