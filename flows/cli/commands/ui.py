"""`cje ui`: a persistent local Prefect server with its UI, the service's console.

    cje ui [--data ./cje-data] [--port 4200]

Starts ``prefect server start`` on 127.0.0.1 with the UI on and its SQLite database under
``DATA/prefect/`` (kept between runs), records it in a state file
(`flows.runtime.prefect_server.ui_state_file`: URL, PID) and stays in the foreground until
Ctrl-C or SIGTERM.  While it runs, every other `cje` command without ``PREFECT_API_URL`` finds
it there and uses it instead of starting a throw-away server, so their flow runs, logs and
artifacts stay browsable at the printed address.  Nothing is left running after it stops.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from flows.cli.exits import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE

log = logging.getLogger(__name__)

#: Prefect's usual UI port, used when it is free.
DEFAULT_PORT = 4200


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``cje ui`` to the `cje` parser."""
    p = sub.add_parser("ui", help="run a persistent local Prefect server with its UI; other cje commands use it "
                                  "while it runs, so their flow runs, logs and artifacts persist")
    p.add_argument("--data", default="cje-data", help="data folder; the database goes to DATA/prefect (default ./cje-data)")
    p.add_argument("--port", type=int, help=f"port on 127.0.0.1 (default {DEFAULT_PORT} when free, else any free port)")
    p.set_defaults(handler=cmd_ui)


def cmd_ui(ns: argparse.Namespace) -> int:
    """Run the server until interrupted; returns the exit code."""
    from flows.runtime.ports import bindable, free_port
    from flows.runtime.prefect_server import (clear_ui_state, launch_server, running_ui, stop_server,
                                              wait_healthy, write_ui_state)
    from flows.runtime.watchdog import graceful_sigterm

    if os.environ.get("PREFECT_API_URL"):
        sys.stderr.write(f"cje ui: PREFECT_API_URL is set ({os.environ['PREFECT_API_URL']}); cje uses that server: "
                         "open its own UI, or unset the variable\n")
        return EXIT_USAGE
    state = running_ui()
    if state is not None:
        sys.stdout.write(f"cje ui is already running (pid {state['pid']}): {state['ui_url']}\n")
        return EXIT_OK
    data = Path(ns.data).resolve()
    port = ns.port or (DEFAULT_PORT if bindable(DEFAULT_PORT) else free_port())
    ui_url = f"http://127.0.0.1:{port}/"
    with graceful_sigterm():
        server = launch_server(home=data / "prefect", port=port,
                               extra_env={"PREFECT_UI_ENABLED": "true", "PREFECT_UI_API_URL": f"{ui_url}api"})
        try:
            wait_healthy(server)
            write_ui_state(server, ui_url, data)
            sys.stdout.write(f"Prefect UI of the CJE service: {ui_url}\n"
                             f"database: {data / 'prefect' / 'prefect.db'}\n"
                             "other cje commands use this server while it runs; Ctrl-C stops it\n")
            sys.stdout.flush()
            while server.process.poll() is None:
                time.sleep(1.0)
            sys.stderr.write(f"cje ui: the Prefect server exited with code {server.process.returncode}; "
                             f"see {server.log_path}\n")
            return EXIT_UNAVAILABLE
        except RuntimeError as exc:  # did not become healthy (wait_healthy stopped it)
            sys.stderr.write(f"cje ui: {exc}\n")
            return EXIT_UNAVAILABLE
        except KeyboardInterrupt:
            return EXIT_OK
        except SystemExit as exc:  # SIGTERM (graceful_sigterm)
            return EXIT_OK if exc.code == 143 else int(exc.code or 0)
        finally:
            clear_ui_state(server.pid)
            stop_server(server)
