"""Flows that check their parameters before Prefect creates (and stores) a flow run.

Prefect writes a flow run's parameters to its database (and shows them in the UI) when the run
is created, before the flow's body runs, and validates them only then; a check inside the body
comes too late.  A flow made with `checked_flow` checks its call's parameters first:

1. every string parameter (and strings inside lists, mappings and pydantic models) with
   `flows.uris.check_uri`, so ``evaluate(logs_uri="s3://KEY:SECRET@bucket/logs")`` raises
   `CJEInputError` without the secret reaching Prefect;
2. the types, with Prefect's own validation of the flow's signature (``validate_parameters=True``);
3. the flow's own ``check`` (a function of the validated parameters, no I/O), e.g. the window,
   names and engine options of the `evaluate` flow.

Any failure raises `CJEInputError` and no flow run is created.  (Declared evaluations are checked
already when ``evaluations.yaml`` is loaded; this covers direct calls from Python.)  Runs created
by a deployment's schedule are validated by Prefect in the run, from the declared, already
validated configuration.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable

from prefect.exceptions import ParameterTypeError
from prefect.flows import Flow
from prefect.utilities.callables import get_call_parameters
from pydantic import BaseModel

from cje_engine.errors import CJEInputError
from flows.uris import check_uri
from flows.runtime.timeouts import flow_timeout

#: A flow's own parameter check: validated parameters -> None, raising `CJEInputError`.
ParameterCheck = Callable[[dict[str, Any]], None]


def refuse_credentials(parameters: dict[str, Any], path: str = "") -> None:
    """Raise `CJEInputError` when any string among ``parameters`` is a URI with credentials."""
    for key, value in parameters.items():
        where = f"{path}{key}"
        if isinstance(value, BaseModel):
            value = value.model_dump()
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, str) and key == "webhook_url":
            # A receiver's URL carries its token in the path or query (Slack, Teams...): no rule can tell
            # it from the address, so only user-info is refused here; keep such URLs in CJE_WEBHOOK_URL.
            check_uri(value.split("?", 1)[0], where)
        elif isinstance(value, str):
            check_uri(value, where)
        elif isinstance(value, dict):
            refuse_credentials(value, f"{where}.")
        elif isinstance(value, (list, tuple)):
            refuse_credentials({str(i): v for i, v in enumerate(value)}, f"{where}.")


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


class CheckedFlow(Flow):
    """A Prefect `Flow` whose call checks its parameters before a flow run exists (module docstring)."""

    def __init__(self, fn: Callable, *, check: ParameterCheck | None = None, **options: Any) -> None:
        super().__init__(fn=fn, **options)
        self.check = check

    def check_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """The three checks of the module docstring; returns the validated parameters."""
        refuse_credentials(parameters)
        if self.should_validate_parameters:
            try:
                with _quiet(logging.getLogger("prefect.flows")):  # it logs the error itself; we raise it
                    parameters = self.validate_parameters(parameters)
            except ParameterTypeError as exc:
                detail = " ".join(str(exc).split())
                raise CJEInputError(f"parameters of the {self.name!r} flow: {detail}") from None
        if self.check is not None:
            self.check(parameters)
        return parameters

    def __call__(self, *args: Any, **kwargs: Any):  # noqa: D102 - see Flow.__call__
        call_kwargs = {k: v for k, v in kwargs.items() if k not in ("return_state", "wait_for")}
        self.check_parameters(get_call_parameters(self.fn, args, call_kwargs))
        return super().__call__(*args, **kwargs)


def checked_flow(*, check: ParameterCheck | None = None, **options: Any) -> Callable[[Callable], CheckedFlow]:
    """``@flow(**options)`` making a `CheckedFlow` with the flow's own ``check``; its
    ``timeout_seconds`` defaults to `flows.runtime.timeouts.flow_timeout` (``CJE_FLOW_TIMEOUT``)."""

    def decorate(fn: Callable) -> CheckedFlow:
        return CheckedFlow(fn=fn, check=check, **{"timeout_seconds": flow_timeout(), **options})

    return decorate


__all__ = ["CheckedFlow", "ParameterCheck", "checked_flow", "refuse_credentials"]
