"""Records -> rows: the one place the policy, prompt, judge and label of every importer are chosen.

`map_records` applies an `ImportMapping` to the `SourceRecord` stream of an importer and yields
`ImportedRow` objects, counting in the `ImportReport` what it could not map (per reason, with the first
record numbers). Without ``--judge-from`` the judge is the one score name the source marks as a judge's
(``origin="judge"``; a source that does not say, the one score name there is); a second such name seen
later is an error asking for ``--judge-from`` (nothing is written: the writer only publishes at the end).
Without ``--label-from`` the label is the one score name marked as a person's, if any.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Iterable, Iterator

from cje_engine.errors import CJEInputError

from flows.integrations.importers.base import (HUMAN, JUDGE, UNKNOWN, ImportedRow, ImportMapping, ImportReport, Note,
                                               Score, SourceRecord, number, text_id)

log = logging.getLogger(__name__)

NO_POLICY = "no policy"
NO_PROMPT = "no prompt id"
NO_RESPONSE_ID = "no response id"
NO_TS = "no timestamp"
NO_JUDGE = "no judge score"
LABEL_WITHOUT_JUDGE = "label without judge score"
JUDGE_NOT_NUMERIC = "judge score not numeric"
LABEL_NOT_NUMERIC = "label not numeric"


class _Picker:
    """Chooses one score of a record for the judge or the label, by selector or by origin."""

    def __init__(self, role: str, selector: Any, origins: tuple[str, ...], flag: str) -> None:
        self.role = role
        self.selector = selector
        self.score_names = selector.names("score") if selector is not None else ()
        self.origins = origins
        self.flag = flag
        self.chosen: str | None = None  # the auto-chosen name

        # selector terms, parsed once: (kind is "score", name, "KIND:NAME" key)
        self.terms = [(k.split(":", 1)[0] == "score", k.split(":", 1)[1], k)
                      for keys in selector.alternatives for k in keys] if selector is not None else []

    def pick(self, rec: SourceRecord, report: ImportReport,
             exclude: str | None = None) -> tuple[str, Any, tuple[float, float] | None] | None:
        """``(name, raw value, declared scale)`` of the chosen score (never the one named ``exclude``), or None."""
        if self.selector is not None:
            for is_score, name, key in self.terms:
                if is_score:
                    s = _find(rec.scores, name, report)
                    if s is not None:
                        return s.name, s.value, s.scale
                else:
                    v = rec.fields.get(key)
                    if v is not None:
                        return name, v, None
            return None
        hit = None
        chosen = self.chosen
        for s in rec.scores:
            if s.origin not in self.origins or s.name == exclude:
                continue
            if chosen is None:
                chosen = self.chosen = s.name
                log.info("%s: %r (the first %s score of the source; choose another with %s)", self.role, chosen,
                         "/".join(self.origins), self.flag)
            if s.name != chosen:
                hint = " (and name a person's score with --label-from score:NAME)" if self.role == "judge" else ""
                raise CJEInputError(f"record {rec.position}: the source has several scores that could be the "
                                    f"{self.role} ({[chosen, s.name]}); choose the {self.role} with {self.flag} "
                                    f"score:NAME{hint}", option=self.flag.lstrip("-").replace("-", "_"))
            if hit is None:
                hit = s
            else:
                report.notes[f"several scores named {chosen!r} on one record: kept the first"] += 1
        return (hit.name, hit.value, hit.scale) if hit is not None else None


def _find(scores: list[Score], name: str, report: ImportReport) -> Score | None:
    hit = None
    for s in scores:
        if s.name == name:
            if hit is None:
                hit = s
            else:
                report.notes[f"several scores named {name!r} on one record: kept the first"] += 1
                break
    return hit


def map_records(records: Iterable[SourceRecord | Note], mapping: ImportMapping, report: ImportReport) -> Iterator[ImportedRow]:
    """Apply ``mapping`` to ``records``; rows out, what could not be mapped counted in ``report``.

    Parameters
    ----------
    records : iterable of SourceRecord
        An importer's stream.
    mapping : ImportMapping
        The selectors.
    report : ImportReport
        Filled as the stream is consumed (records, mapped, skipped, policies, judges, labels, ranges).

    Yields
    ------
    ImportedRow

    Raises
    ------
    CJEInputError
        Several judge (or human) score names and no selector to choose one.
    """
    # A source that does not say who scored: its scores are judges' unless --label-from names them.
    judge = _Picker("judge", mapping.judge, (JUDGE, UNKNOWN), "--judge-from")
    label = _Picker("label", mapping.label, (HUMAN,), "--label-from")
    jlo = jhi = llo = lhi = None
    for rec in records:
        if isinstance(rec, Note):
            report.notes[rec.text] += rec.count
            continue
        report.records += 1
        pos = rec.position
        policy = mapping.policy.resolve(rec.fields)
        if policy is None:
            report.skip(NO_POLICY, pos, f"none of {mapping.policy.text}")
            continue
        prompt_id = mapping.prompt.resolve(rec.fields)
        if prompt_id is None and rec.prompt:
            prompt_id = text_id(rec.prompt)
        if prompt_id is None:
            report.skip(NO_PROMPT, pos, f"none of {mapping.prompt.text} and no prompt text")
            continue
        if not rec.response_id:
            report.skip(NO_RESPONSE_ID, pos)
            continue
        if rec.ts is None:
            report.skip(NO_TS, pos)
            continue
        lab = label.pick(rec, report)
        jud = judge.pick(rec, report, exclude=lab[0] if lab is not None else None)
        if jud is None:
            report.skip(LABEL_WITHOUT_JUDGE if lab is not None else NO_JUDGE, pos,
                        f"scores {[s.name for s in rec.scores]}" if rec.scores else "no scores")
            continue
        jname, jraw, jscale = jud
        jval = number(jraw)
        if jval is None:
            report.skip(JUDGE_NOT_NUMERIC, pos, f"{jname} = {str(jraw)[:40]!r}")
            continue
        lval = None
        if lab is not None:
            lval = number(lab[1])
            if lval is None:
                report.skip(LABEL_NOT_NUMERIC, pos, f"{lab[0]} = {str(lab[1])[:40]!r}")
                continue
            report.labels[lab[0]] += 1
            if lab[2] is not None and report.label_scale is None:
                report.label_scale = (float(lab[2][0]), float(lab[2][1]))
            llo = lval if llo is None or lval < llo else llo
            lhi = lval if lhi is None or lval > lhi else lhi
        if len(rec.scores) > 1 + (lab is not None):
            used = (jname, lab[0] if lab is not None else jname)
            for s in rec.scores:
                if s.name not in used:
                    report.unused_scores[s.name] += 1
        if jscale is not None:
            if report.judge_scale is not None and report.judge_scale != jscale:
                report.notes[f"judge scale differs between records ({report.judge_scale} vs {jscale})"] += 1
            report.judge_scale = report.judge_scale or (float(jscale[0]), float(jscale[1]))
        jlo = jval if jlo is None or jval < jlo else jlo
        jhi = jval if jhi is None or jval > jhi else jhi
        report.mapped += 1
        report.policies[policy] += 1
        report.judges[jname] += 1
        yield ImportedRow(prompt_id=prompt_id, policy=policy, response_id=rec.response_id, judge_score=jval,
                          ts=rec.ts, judge_name=jname, judge_scale=jscale, oracle_label=lval, prompt=rec.prompt,
                          response=rec.response, source_record=pos,
                          extra=json.dumps(rec.extra, sort_keys=True, default=str) if rec.extra else None)
        report.judge_range = (jlo, jhi)  # type: ignore[assignment]
        if llo is not None:
            report.label_range = (llo, lhi)  # type: ignore[assignment]
