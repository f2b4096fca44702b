"""flows.runtime.ports and infra/free_port.py: services' ports come from below the kernel's ephemeral range."""
from __future__ import annotations

import random
import socket
import subprocess
import sys
from pathlib import Path

from flows.runtime import ports

INFRA = Path(__file__).resolve().parents[2] / "infra"


def test_the_printed_ports_are_below_the_ephemeral_range_and_free():
    low = ports.ephemeral_start()
    for _ in range(5):
        # the script as the start scripts run it: the system's python3 without the venv's site-packages (-S)
        port = int(subprocess.run([sys.executable, "-S", str(INFRA / "free_port.py")], capture_output=True,
                                  text=True, check=True, cwd="/").stdout)
        if low - ports.LOW >= ports.MIN_ROOM:
            assert ports.LOW <= port < low
        with socket.socket() as s:
            s.bind(("", port))  # nothing holds it


def test_a_bound_port_is_never_picked():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        assert not ports.bindable(taken)
        # a draw that always lands on the held port finds nothing: None, not the held port
        assert ports.pick(taken, taken + ports.MIN_ROOM, rng=_Always(taken)) is None


class _Always(random.Random):
    def __init__(self, value: int):
        super().__init__(0)
        self.value = value

    def randrange(self, *args, **kwargs) -> int:  # noqa: ARG002 - the one port every draw gives
        return self.value


def test_no_room_below_the_ephemeral_range_falls_back_to_the_kernels_choice(tmp_path):
    rng_file = tmp_path / "range"
    rng_file.write_text("1024\t65535\n")
    assert ports.ephemeral_start(str(rng_file)) == 1024
    assert ports.pick(ports.LOW, 1024) is None
    assert ports.ephemeral_start(str(tmp_path / "missing")) == 32768
    assert 0 < ports.any_port() < 65536


def test_every_start_script_takes_its_ports_from_it():
    for script in ("stack/start.sh", "radosgw/start.sh", "labelstudio/start.sh"):
        text = (INFRA / script).read_text()
        assert "free_port.py" in text, script
        assert 's.bind(("127.0.0.1", 0))' not in text and "bind((\"127.0.0.1\",0))" not in text, script


def test_cje_and_the_tests_take_their_services_ports_from_it():
    """`cje`'s local Prefect server (`launch_server`, `cje ui`) and the tests' Ray head and moto server."""
    import flows.runtime.prefect_server as prefect_server
    from tests import s3server
    from tests.flows import conftest

    assert prefect_server.free_port is ports.free_port
    assert s3server.free_port is ports.free_port
    assert conftest.free_port is ports.free_port
    low = ports.ephemeral_start()
    if low - ports.LOW >= ports.MIN_ROOM:
        assert all(ports.LOW <= ports.free_port() < low for _ in range(20))


def test_a_leased_port_is_not_drawn_again_until_its_lease_ends(tmp_path):
    now = 1_000_000 * ports.LEASE_S + 5.0
    assert ports.lease(25000, tmp_path, now)
    assert not ports.lease(25000, tmp_path, now + 1)  # the same window
    assert not ports.lease(25000, tmp_path, now + ports.LEASE_S)  # the next: the previous window's lease holds
    assert ports.lease(25001, tmp_path, now + ports.LEASE_S)
    later = now + 2 * ports.LEASE_S
    assert ports.lease(25000, tmp_path, later)  # two windows on: free again, and the old leases removed
    leases = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert leases == [f"25000.{int(later // ports.LEASE_S)}", f"25001.{int((now + ports.LEASE_S) // ports.LEASE_S)}"]
    # a draw that always lands on a leased port finds nothing
    ports.lease(26000, tmp_path)
    assert ports.pick(26000, 26000 + ports.MIN_ROOM, free=lambda p: True, rng=_Always(26000), leases=tmp_path) is None


def test_a_folder_that_cannot_be_written_leases_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert ports.lease(25000, blocker / "leases")
    assert ports.lease(25000, blocker / "leases")


_DRAWS = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from flows.runtime import ports
print(" ".join(str(ports.pick(24000, 25000, free=lambda p: True, leases=Path(sys.argv[2]))) for _ in range(50)))
"""


def test_draws_at_once_from_several_processes_never_share_a_port(tmp_path):
    """Eight processes drawing 50 ports each from 1,000 at once (two stacks' starts and the tests' servers do):
    400 distinct ports (without the leases ~400^2 / 2,000 = 80 pairs would share one)."""
    repo = str(INFRA.parent)
    procs = [subprocess.Popen([sys.executable, "-c", _DRAWS, repo, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True) for _ in range(8)]
    drawn = [int(p) for proc in procs for p in proc.communicate(timeout=120)[0].split()]
    assert all(proc.returncode == 0 for proc in procs)
    assert len(drawn) == 400 and len(set(drawn)) == 400
    assert all(24000 <= p < 25000 for p in drawn)
