"""Label Studio, the first server-backed labelling tool: tasks out (file or push), annotations back (pull).

Format: a JSON list of tasks ``{"data": {response_id, texts, cje_* metadata}, "meta": {...}}`` plus a
labeling config (`label_studio_config`: the texts and a required ``Number`` control ``oracle_label``
bounded by the label scale); answers come back as a Label Studio JSON export (`parse_label_studio`).

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

Failures: the server unreachable raises `LabelStudioUnavailable` (a `ToolUnavailable`: exit 69); a rejected
token raises `LabelStudioAuthError` and a missing project or a refused request `CJEInputError` (exit 2);
messages name the URL and the project, never the token.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

import httpx

from cje_engine.errors import CJEInputError

from flows.integrations.labelling.base import (ANSWER, DEFAULT_TEXT_COLUMNS, Answers, Destination, ExportOptions,
                                               PullResult, PushResult, ToolStatus, ToolUnavailable, add_answers,
                                               answer_number, item_meta, pulled_status)

log = logging.getLogger(__name__)

TOKEN_ENV = "LABEL_STUDIO_API_KEY"
PUSHED = "label_requests/_pushed"


class LabelStudioUnavailable(ToolUnavailable):
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
        """Close the HTTP connections."""
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
        """Create a project with a labeling config; its id."""
        out = self.request("POST", "/api/projects/", what="project creation",
                           json={"title": title, "label_config": label_config, "description": description})
        return int(out["id"])

    def project(self, project: int) -> dict:
        """The project (`CJEInputError` when it does not exist)."""
        return self.request("GET", f"/api/projects/{int(project)}/", what=f"reading project {project}")

    def import_tasks(self, project: int, tasks: Sequence[Mapping]) -> int:
        """Import tasks into the project; the number the server reports."""
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
        """Submit an annotation on a task (what a labeller's submit does)."""
        return self.request("POST", f"/api/tasks/{int(task_id)}/annotations/", what=f"annotating task {task_id}",
                            json={"result": result, **extra})

    def delete_task(self, task_id: int) -> None:
        """Delete a task."""
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
    """An annotation ``result`` for the ``Number`` control of `label_studio_config`."""
    return [{"from_name": from_name, "to_name": to_name, "type": "number", "value": {"number": value}}]


# --------------------------------------------------------------------------------------
# push and pull


def pushed_key(request_id: str, project: int, when: str) -> str:
    """Key of a push record: ``label_requests/_pushed/<request>/label-studio-<project>-<time>.json``."""
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


# --------------------------------------------------------------------------------------
# format: tasks and labeling config out, a JSON export back


def label_studio_config(label_scale: Sequence[float], text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS,
                        show_judge_score: bool = False) -> str:
    """A Label Studio labeling config: the texts, and a required ``Number`` control ``oracle_label``."""
    lo, hi = float(label_scale[0]), float(label_scale[1])
    step = "1" if lo.is_integer() and hi.is_integer() and hi - lo >= 2 else "0.01"
    parts = ["<View>"]
    for c in text_columns:
        parts += [f'  <Header value="{c}"/>', f'  <Text name="{c}" value="${c}"/>']
    if show_judge_score:
        parts += ['  <Header value="judge score"/>', '  <Text name="judge_score" value="$judge_score"/>']
    parts += [f'  <Header value="oracle label ({lo:g} to {hi:g})"/>',
              f'  <Number name="{ANSWER}" toName="{text_columns[-1]}" min="{lo:g}" max="{hi:g}" step="{step}" '
              'required="true"/>', "</View>"]
    return "\n".join(parts)


def to_label_studio(items: Sequence[Mapping], text_columns: Sequence[str] = DEFAULT_TEXT_COLUMNS) -> list[dict]:
    """Label Studio tasks (``[{"data": {...}, "meta": {...}}]``): ``data`` holds the id, texts and metadata."""
    tasks = []
    for i in items:
        data = {"response_id": i["item_id"], **{c: i.get(c) for c in text_columns}}
        meta = item_meta(i, text_columns)
        data.update({f"cje_{k}": v for k, v in meta.items() if k != "label_scale"})
        if "judge_score" in i:
            data["judge_score"] = i["judge_score"]
        tasks.append({"data": data, "meta": meta})
    return tasks


def parse_label_studio(doc: Any, source: str, answer_field: str = ANSWER,
                       id_field: str = "response_id") -> Answers:
    """Answers of a Label Studio JSON export (a list of tasks with ``data`` and ``annotations``; each
    annotation's ``result`` holds ``{"from_name", "type", "value"}``).  Cancelled (skipped) annotations and
    annotations without the answer are ignored and counted; equal answers count once; answers that
    disagree are an error (`flows.integrations.labelling.base.add_answers`)."""
    if isinstance(doc, Mapping) and "tasks" in doc:
        doc = doc["tasks"]
    if not isinstance(doc, list):
        raise CJEInputError("a Label Studio JSON export is a list of tasks", source=source)
    out, seen = Answers(), {}
    for n, task in enumerate(doc):
        data = task.get("data") if isinstance(task, Mapping) else None
        if not isinstance(data, Mapping) or data.get(id_field) in (None, ""):
            raise CJEInputError(f"task {n} (id {task.get('id') if isinstance(task, Mapping) else '?'}) has no "
                                f"data.{id_field}: not a task pushed by cje", source=source)
        item = str(data[id_field])
        out.task_ids[item] = task.get("id")
        values = []
        for ann in task.get("annotations") or []:
            if ann.get("was_cancelled"):
                out.ignored["cancelled"] = out.ignored.get("cancelled", 0) + 1
                continue
            where = f"task {task.get('id')} ({id_field} {item!r}), annotation {ann.get('id')}"
            got = [r for r in ann.get("result") or [] if r.get("from_name") == answer_field]
            if not got:
                out.ignored["without_answer"] = out.ignored.get("without_answer", 0) + 1
                continue
            values.append((answer_number(got[0].get("value"), where, source), where))
        add_answers(out, seen, item, values, source)
    return out


def _project_id(project: Any) -> int:
    try:
        return int(str(project).strip())
    except ValueError:
        raise CJEInputError(f"Label Studio project {project!r} is not a project id (a whole number, e.g. 12)") from None


class LabelStudioTool:
    """Label Studio as a `flows.integrations.labelling.base.LabellingTool` with a server (push and pull)."""

    name = "label-studio"
    suffix = ".json"
    title = "Label Studio"
    help = "Label Studio tasks and labeling config, push and pull over its REST API"
    answers_format = "label-studio"
    token_env = TOKEN_ENV

    def outputs(self, dest: Path) -> list[Path]:
        """The tasks file and ``<dest>.label_config.xml``."""
        return [Path(dest), Path(dest).with_suffix(".label_config.xml")]

    def export(self, items: Sequence[Mapping], dest: Path, options: ExportOptions) -> dict[Path, bytes]:
        """Tasks as a JSON list, and the labeling config beside them."""
        tasks, config = self.outputs(dest)
        return {tasks: json.dumps(to_label_studio(items, options.text_columns), indent=1).encode(),
                config: label_studio_config(options.label_scale, options.text_columns,
                                            options.include_judge_score).encode("utf-8")}

    def answered(self, files: Mapping[Path, bytes], answers: Mapping[str, float]) -> bytes:
        """The project's JSON export once each answered task has a submitted ``Number`` annotation."""
        tasks = json.loads(next(iter(files.values())))
        out = []
        for n, t in enumerate(tasks, start=1):
            item = str(t["data"]["response_id"])
            anns = [{"id": n, "result": number_result(answers[item])}] if item in answers else []
            out.append(dict(t, id=n, annotations=anns))
        return json.dumps(out, indent=1).encode()

    def detects(self, first: Mapping) -> bool:
        """A task: ``data`` and ``annotations`` (or a task ``id``)."""
        return "data" in first and ("annotations" in first or "id" in first)

    def parse(self, doc: Any, source: str, answer_field: str = ANSWER, id_field: str = "response_id") -> Answers:
        """`parse_label_studio`."""
        return parse_label_studio(doc, source, answer_field, id_field)

    def push(self, items: Sequence[Mapping], manifest: Mapping, dest: Destination, options: ExportOptions,
             storage: Any | None = None) -> PushResult:
        """`push_request` into ``dest.project`` (or a new project titled ``dest.new_project`` with the
        request's labeling config)."""
        tasks = to_label_studio(items, options.text_columns)
        with LabelStudio(dest.url, token_env=dest.token_env or self.token_env) as client:
            if dest.project is not None:
                project = _project_id(dest.project)
            else:
                title = dest.new_project or f"cje {manifest['request_id']}"
                project = client.create_project(title, label_studio_config(
                    options.label_scale, options.text_columns, options.include_judge_score),
                    description=dest.description)
            out = push_request(client, project, manifest, tasks, st=storage)
        return PushResult(project=str(out["project"]), imported=out["imported"], already=out["already"],
                          tasks=out["tasks"])

    def pull(self, dest: Destination, storage: Any | None = None) -> PullResult:
        """`pull_project` of ``dest.project`` (tasks deleted in the tool named from the push records)."""
        project = _project_id(dest.project)
        with LabelStudio(dest.url, token_env=dest.token_env or self.token_env) as client:
            got = pull_project(client, project, pushed_tasks(storage) if storage is not None else None)
        return PullResult(document=json.dumps(got["export"], indent=1).encode(), suffix=".json",
                          deleted=tuple(got["deleted"]), n_tasks=got["n_tasks"])

    def status(self, dest: Destination, storage: Any | None = None) -> ToolStatus:
        """The project's items: pushed (the push records in ``storage`` for this project, else the tasks there
        plus those deleted), answered (a submitted ``oracle_label``), unanswered, deleted in the tool."""
        project = _project_id(dest.project)
        pushed = None
        if storage is not None:
            mine = [i for i, r in pushed_tasks(storage).items() if int(r.get("project") or -1) == project]
            pushed = len(mine) or None
        return pulled_status(self, dest, storage, pushed)


__all__ = ["LabelStudio", "LabelStudioTool", "LabelStudioUnavailable", "LabelStudioAuthError", "push_request",
           "pull_project", "pushed_tasks", "number_result", "label_studio_config", "to_label_studio",
           "parse_label_studio", "TOKEN_ENV"]
