"""Label Studio over its REST API: push a label request as tasks, pull the annotations back.

Endpoints used (Label Studio 1.23): ``POST /api/projects/`` (create), ``GET /api/projects/<id>/``,
``POST /api/projects/<id>/import`` (a JSON list of tasks), ``GET /api/tasks?project=<id>`` (paged),
``GET /api/projects/<id>/export?exportType=JSON`` (annotated tasks with their annotations),
``POST /api/tasks/<id>/annotations/`` (what a labeller's submit does; used by tests) and
``DELETE /api/tasks/<id>/``.

Authentication: the token comes from the environment (``LABEL_STUDIO_API_KEY`` by default) and is
never printed, logged or stored.  A personal access token (the current kind: a JWT refresh token)
is exchanged at ``POST /api/token/refresh/`` for a short-lived access token sent as
``Authorization: Bearer ...`` (refreshed once on a 401); a legacy token is sent as
``Authorization: Token ...``.

Failures: the server unreachable raises `LabelStudioUnavailable` (exit 69); a rejected token
raises `LabelStudioAuthError` and a missing project or a refused request `CJEInputError` (exit 2);
messages name the URL and the project, never the token.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

import httpx

from cje_engine.errors import CJEInputError

log = logging.getLogger(__name__)

TOKEN_ENV = "LABEL_STUDIO_API_KEY"
PUSHED = "label_requests/_pushed"


class LabelStudioUnavailable(RuntimeError):
    """The Label Studio server does not answer."""


class LabelStudioAuthError(CJEInputError):
    """Label Studio rejected the token."""


def _is_jwt(token: str) -> bool:
    return token.count(".") == 2


class LabelStudio:
    """A small client of one Label Studio server.

    Parameters
    ----------
    url : str
        Base URL, e.g. ``http://127.0.0.1:8080``.
    token_env : str
        Environment variable holding the token (personal access token or legacy token).
    timeout : float
        Seconds per HTTP request.
    """

    def __init__(self, url: str, token_env: str = TOKEN_ENV, timeout: float = 30.0) -> None:
        self.url = str(url).rstrip("/")
        self.token_env = token_env
        token = os.environ.get(token_env, "").strip()
        if not token:
            raise CJEInputError(f"no Label Studio token: set the environment variable {token_env} (a personal "
                                "access token from Account & Settings, or a legacy token)")
        self._token = token
        self._access: str | None = None
        self._http = httpx.Client(timeout=timeout, follow_redirects=True)

    def __repr__(self) -> str:
        return f"LabelStudio({self.url!r}, token from ${self.token_env})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "LabelStudio":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- transport
    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return self._http.request(method, f"{self.url}{path}", **kw)
        except httpx.HTTPError as exc:  # connection refused, timeout, DNS...
            raise LabelStudioUnavailable(f"Label Studio at {self.url} is not reachable ({type(exc).__name__}: "
                                         f"{exc}); is it running? (tests: bash infra/labelstudio/start.sh)") from None

    def _auth(self, refresh: bool = False) -> dict[str, str]:
        if not _is_jwt(self._token):
            return {"Authorization": f"Token {self._token}"}
        if self._access is None or refresh:
            r = self._send("POST", "/api/token/refresh/", json={"refresh": self._token})
            if r.status_code in (400, 401, 403):
                raise LabelStudioAuthError(f"Label Studio at {self.url} rejected the personal access token in "
                                           f"${self.token_env} (HTTP {r.status_code}: {_detail(r)}); create a new "
                                           "one under Account & Settings")
            _check(r, self.url, "token refresh")
            self._access = r.json()["access"]
        return {"Authorization": f"Bearer {self._access}"}

    def request(self, method: str, path: str, *, what: str, **kw: Any) -> Any:
        """One API call; JSON body of the answer (None when empty)."""
        r = self._send(method, path, headers=self._auth(), **kw)
        if r.status_code == 401 and _is_jwt(self._token):  # access token expired: refresh once
            r = self._send(method, path, headers=self._auth(refresh=True), **kw)
        if r.status_code in (401, 403):
            raise LabelStudioAuthError(f"Label Studio at {self.url} rejected the token in ${self.token_env} "
                                       f"(HTTP {r.status_code}: {_detail(r)}) during {what}")
        _check(r, self.url, what)
        return r.json() if r.content else None

    # -- API
    def create_project(self, title: str, label_config: str, description: str = "") -> int:
        out = self.request("POST", "/api/projects/", what="project creation",
                           json={"title": title, "label_config": label_config, "description": description})
        return int(out["id"])

    def project(self, project: int) -> dict:
        return self.request("GET", f"/api/projects/{int(project)}/", what=f"reading project {project}")

    def import_tasks(self, project: int, tasks: Sequence[Mapping]) -> int:
        out = self.request("POST", f"/api/projects/{int(project)}/import", what=f"task import into project {project}",
                           json=list(tasks))
        return int(out.get("task_count", 0))

    def tasks(self, project: int, page_size: int = 500) -> list[dict]:
        """Every task of the project (all pages)."""
        out, page = [], 1
        while True:
            got = self.request("GET", "/api/tasks", what=f"listing tasks of project {project}",
                               params={"project": int(project), "page": page, "page_size": page_size})
            batch = got.get("tasks", []) if isinstance(got, Mapping) else got
            out += batch
            total = got.get("total") if isinstance(got, Mapping) else None
            if not batch or len(batch) < page_size or (total is not None and len(out) >= int(total)):
                return out
            page += 1

    def export(self, project: int) -> list[dict]:
        """The project's annotated tasks with their annotations (Label Studio JSON export)."""
        return self.request("GET", f"/api/projects/{int(project)}/export", what=f"export of project {project}",
                            params={"exportType": "JSON"})

    def annotate(self, task_id: int, result: list[dict], **extra: Any) -> dict:
        return self.request("POST", f"/api/tasks/{int(task_id)}/annotations/", what=f"annotating task {task_id}",
                            json={"result": result, **extra})

    def delete_task(self, task_id: int) -> None:
        self.request("DELETE", f"/api/tasks/{int(task_id)}/", what=f"deleting task {task_id}")


def _detail(r: httpx.Response) -> str:
    try:
        d = r.json()
        return str(d.get("detail") or d.get("validation_errors") or d)[:300]
    except ValueError:
        return r.text[:200]


def _check(r: httpx.Response, url: str, what: str) -> None:
    if r.status_code == 404:
        raise CJEInputError(f"Label Studio at {url}: not found during {what} ({_detail(r)})")
    if r.status_code >= 500:
        raise LabelStudioUnavailable(f"Label Studio at {url} failed during {what} (HTTP {r.status_code})")
    if r.status_code >= 400:
        raise CJEInputError(f"Label Studio at {url} refused {what} (HTTP {r.status_code}: {_detail(r)})")


def number_result(value: float, from_name: str = "oracle_label", to_name: str = "response") -> list[dict]:
    """An annotation ``result`` for the ``Number`` control of `flows.label_requests.exports.label_studio_config`."""
    return [{"from_name": from_name, "to_name": to_name, "type": "number", "value": {"number": value}}]


# --------------------------------------------------------------------------------------
# push and pull


def pushed_key(request_id: str, project: int, when: str) -> str:
    stamp = when.replace("-", "").replace(":", "").replace("+0000", "Z").split(".")[0]
    return f"{PUSHED}/{request_id}/label-studio-{int(project)}-{stamp}.json"


def push_request(client: LabelStudio, project: int, manifest: Mapping, tasks: Sequence[Mapping],
                 st: Any | None = None) -> dict:
    """Import a request's tasks into a project (idempotent) and record which task holds which item.

    Tasks already in the project for the same (request, item) are not imported again.  With a
    requests storage ``st`` a create-only record ``label_requests/_pushed/<request_id>/label-studio-
    <project>-<time>.json`` keeps ``{item_id: task_id}`` (later pulls use it to notice tasks deleted in the tool).
    """
    client.project(project)  # a clear error for a missing project before anything is imported
    rid = manifest["request_id"]

    def mine() -> dict[str, int]:
        return {str(t["data"]["response_id"]): int(t["id"]) for t in client.tasks(project)
                if (t.get("data") or {}).get("cje_request_id") == rid and "response_id" in (t.get("data") or {})}

    before = mine()
    fresh = [t for t in tasks if str(t["data"]["response_id"]) not in before]
    if fresh:
        client.import_tasks(project, fresh)
    after = mine()
    missing = sorted({str(t["data"]["response_id"]) for t in tasks} - set(after))
    if missing:
        raise CJEInputError(f"Label Studio project {project} at {client.url} did not create tasks for {missing[:3]}")
    record = {"request_id": rid, "tool": "label-studio", "url": client.url, "project": int(project),
              "tasks": after, "pushed_at": datetime.now(timezone.utc).isoformat()}
    if st is not None and fresh:
        st.put_if_absent(pushed_key(rid, project, record["pushed_at"]), json.dumps(record, indent=1,
                                                                                 sort_keys=True).encode())
    log.info("request %s: %d task(s) imported into Label Studio project %d (%d there already)", rid, len(fresh),
             project, len(before))
    return {"request_id": rid, "project": int(project), "imported": len(fresh), "already": len(before),
            "tasks": after}


def pushed_tasks(st: Any, request_id: str | None = None) -> dict[str, dict]:
    """``item_id -> {"request_id", "project", "task_id"}`` from the push records (latest push wins)."""
    out: dict[str, dict] = {}
    prefix = f"{PUSHED}/{request_id}/" if request_id else f"{PUSHED}/"
    for info in sorted(st.list(prefix), key=lambda i: i.key):
        try:
            rec = json.loads(st.read_bytes(info.key))
        except ValueError:
            continue
        for item, task_id in (rec.get("tasks") or {}).items():
            out[item] = {"request_id": rec.get("request_id"), "project": rec.get("project"), "task_id": task_id}
    return out


def pull_project(client: LabelStudio, project: int, pushed: Mapping[str, Mapping] | None = None) -> dict:
    """The project's export plus what the tool no longer has.

    Returns ``{"export": [...], "deleted": [item ids pushed to this project whose task is gone],
    "n_tasks": int}``.
    """
    client.project(project)
    export = client.export(project)
    present = {str((t.get("data") or {}).get("response_id")) for t in client.tasks(project)}
    deleted = sorted(item for item, rec in (pushed or {}).items()
                     if int(rec.get("project") or -1) == int(project) and item not in present)
    if deleted:
        log.warning("%d pushed task(s) are no longer in Label Studio project %d (deleted in the tool?): %s", len(deleted),
                    project, deleted[:5])
    return {"export": export, "deleted": deleted, "n_tasks": len(present)}


__all__ = ["LabelStudio", "LabelStudioUnavailable", "LabelStudioAuthError", "push_request", "pull_project",
           "pushed_tasks", "number_result", "TOKEN_ENV"]
