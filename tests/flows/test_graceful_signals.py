"""`flows.runtime.watchdog.graceful_sigterm`: the stop signals of the long-running commands (`cje ui`,
`cje run`, `cje serve`) end them through their ``finally`` blocks, also when the process was started
with SIGINT ignored (a background job of a non-interactive shell: the CI rehearsal found `cje ui`
deaf to SIGINT that way)."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from .conftest import REPO

SCRIPT = """
import signal, sys, time
from flows.runtime.watchdog import graceful_sigterm
with graceful_sigterm():
    try:
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
        code = 7
    except SystemExit as exc:
        print("terminated", exc.code, flush=True)
        code = 8
print("after", signal.getsignal(signal.SIGINT) is signal.SIG_IGN, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
      flush=True)
sys.exit(code)
"""


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig,code,line", [(signal.SIGINT, 7, "interrupted True"), (signal.SIGTERM, 8, "terminated 143")])
def test_stop_signals_work_when_sigint_was_ignored_at_start(sig, code, line):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            preexec_fn=_ignore_sigint)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, out
    # the handler is the block's only: afterwards SIGINT is ignored again, as the parent asked
    assert out.splitlines() == [line, "after True True"], out
