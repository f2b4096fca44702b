"""Flows that refuse credentials in their parameters before Prefect stores them.

Prefect writes a flow run's parameters to its database (and shows them in the UI) when the run
is created, before the flow's body runs; a check inside the body comes too late.  A flow made
with `checked_flow` checks every string parameter (and strings inside lists and mappings) with
`flows.config.check_uri` first, so ``evaluate(logs_uri="s3://KEY:SECRET@bucket/logs")`` raises
`CJEInputError` without the secret reaching Prefect.  (Declared evaluations are checked already
when ``evaluations.yaml`` is loaded; this covers direct calls from Python.)
"""
from __future__ import annotations

from typing import Any, Callable

from prefect.flows import Flow
from prefect.utilities.callables import get_call_parameters

from flows.config import check_uri


def refuse_credentials(parameters: dict[str, Any], path: str = "") -> None:
    """Raise `CJEInputError` when any string among ``parameters`` is a URI with credentials."""
    for key, value in parameters.items():
        where = f"{path}{key}"
        if isinstance(value, str):
            check_uri(value, where)
        elif isinstance(value, dict):
            refuse_credentials(value, f"{where}.")
        elif isinstance(value, (list, tuple)):
            refuse_credentials({str(i): v for i, v in enumerate(value)}, f"{where}.")


class CheckedFlow(Flow):
    """A Prefect `Flow` whose call refuses credentials in its parameters (`refuse_credentials`)."""

    def __call__(self, *args: Any, **kwargs: Any):  # noqa: D102 - see Flow.__call__
        call_kwargs = {k: v for k, v in kwargs.items() if k not in ("return_state", "wait_for")}
        refuse_credentials(get_call_parameters(self.fn, args, call_kwargs))
        return super().__call__(*args, **kwargs)


def checked_flow(**options: Any) -> Callable[[Callable], CheckedFlow]:
    """``@flow(**options)`` making a `CheckedFlow`."""

    def decorate(fn: Callable) -> CheckedFlow:
        return CheckedFlow(fn=fn, **options)

    return decorate


__all__ = ["CheckedFlow", "checked_flow", "refuse_credentials"]
