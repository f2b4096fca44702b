"""Exit codes of the `cje` command (documented in docs/cli.md; sysexits where one fits).

0 success; 1 a gate failed (an audit failed, a level was refused, `cje gate` said no);
2 bad input (a file, column, row or setting; the message names it); 64 usage error (the command
line itself); 69 a service unavailable (object storage, Prefect, Ray, a labelling tool).
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_USAGE = 64
EXIT_UNAVAILABLE = 69
