"""Exit codes of the `cje` command (documented in docs/cli.md; sysexits where one fits).

=====  ==========================  ==================================================================
code   name                        when
=====  ==========================  ==================================================================
0      EXIT_OK                     success
1      EXIT_GATE_FAILED            a gate failed: an audit failed, a level was refused (`cje evaluate`,
                                   `cje run`), a drift monitor is in alarm (`cje drift`; ``--exit-zero``
                                   turns these off), or `cje gate` said no
2      EXIT_BAD_INPUT              bad input: a file, column, row or setting (the message names it)
64     EXIT_USAGE                  usage error: the command line itself (sysexits EX_USAGE)
69     EXIT_UNAVAILABLE            a service unavailable: object storage, Prefect, Ray, a labelling
                                   tool (sysexits EX_UNAVAILABLE)
70     EXIT_INTERNAL               an unexpected internal error, a bug (sysexits EX_SOFTWARE)
130    EXIT_INTERRUPTED            interrupted (Ctrl-C)
=====  ==========================  ==================================================================
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_USAGE = 64
EXIT_UNAVAILABLE = 69
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130

#: (code, name, meaning) for the generated docs/cli.md.
EXIT_CODES: tuple[tuple[int, str, str], ...] = (
    (EXIT_OK, "ok", "success"),
    (EXIT_GATE_FAILED, "gate failed", "an audit failed or a level was refused (`cje evaluate`, `cje run`), a drift "
                                      "monitor is in alarm (`cje drift`; `--exit-zero` turns these off), or "
                                      "`cje gate` said no"),
    (EXIT_BAD_INPUT, "bad input", "a file, column, row or setting is wrong; the one-line message names it"),
    (EXIT_USAGE, "usage error", "the command line itself (unknown flag, missing argument; sysexits EX_USAGE)"),
    (EXIT_UNAVAILABLE, "service unavailable", "object storage, Prefect, Ray or a labelling tool could not be "
                                              "reached (sysexits EX_UNAVAILABLE)"),
    (EXIT_INTERNAL, "internal error", "an unexpected error (a bug): run with `-v` for the traceback "
                                      "(sysexits EX_SOFTWARE)"),
    (EXIT_INTERRUPTED, "interrupted", "Ctrl-C"),
)


class ServiceUnavailable(Exception):
    """A service (object storage, Prefect, Ray, a labelling tool) could not be reached: exit 69."""
