"""The randomized hostile-client run (bench/hostile.py), short, and what it found, each alone.

The run's kinds on by default are the lies the daemon withstands; a kind left off is one it
is not meant to withstand (a client's word on identities is trusted) or a known break whose
fix is not in yet (bench/hostile_kinds.py KINDS says which). The run is seeded: a failure
names its seed, and `bench/hostile.py --seed N --seconds S` replays it.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from daemon_e2e import IDENTITY, RawPeer, entry, plan_for
from daemon_process import Daemon, socket_folder
from kvd_client.entry_io import tensor_views, write_entry
from kvd_protocol import messages as m

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import hostile  # bench/ is not a package
import hostile_kinds

SECONDS = float(os.environ.get("KVD_HOSTILE_SECONDS", "8"))
SEED = int(os.environ.get("KVD_HOSTILE_SEED", "1"))


@pytest.mark.hostile_run
def test_hostile_clients_never_harm_the_daemon_nor_honest_entries(tmp_path: Path) -> None:
    """Lying clients of every kind on by default, beside honest ones: the daemon stays up,
    its counts equal the directory, every honest entry listed restores exactly, SIGTERM ends
    it with 0, and it logs no error it should not."""
    kinds = hostile_kinds.chosen_kinds("default")
    result = hostile.run(tmp_path, SECONDS, SEED, hostile=4, honest=1, kinds=kinds)
    hostile.print_table(result, SECONDS, SEED, kinds)
    assert not result.problems, f"seed {SEED}: {result.problems}"
    assert result.exit_code == 0
    assert sum(result.shared.tally.requests.values()) >= len(kinds)  # the lies were told
    assert result.final["exact"] > 0  # and honest entries were there to harm


def test_invalid_puts_quarantined_side_by_side_log_no_error(tmp_path: Path) -> None:
    """Puts whose files fail validation at commit (cut short), committed from many
    connections at once under a
    quarantine cap that every new file overflows: each quarantine trims the folder while the
    others list it. A file gone between one's listing and its look is no failure: no
    quarantine_failed error (daemon.check), and the daemon goes on."""
    flags = ["--quarantine-max-bytes", "1"]
    with socket_folder() as sockets:
        daemon = Daemon(
            tmp_path / "tier", os.path.join(sockets, "kvd.sock"), tmp_path / "log", flags
        )
        daemon.start()
        codes: list[str] = []

        def liar(number: int) -> None:
            with RawPeer(daemon.socket_path) as peer:
                for round_ in range(25):
                    tokens = [number * 1000 + round_ * 10 + i for i in range(1, 9)]
                    layers, tensors = entry(len(tokens), round_)
                    plan = plan_for(IDENTITY, tokens, layers)
                    reply = peer.call(
                        m.PutBegin(
                            id=peer.next_id(),
                            identity=IDENTITY,
                            tokens=plan.header.tokens,
                            size=plan.file_size,
                        )
                    )
                    assert isinstance(reply, m.PutBeginReply), reply
                    assert reply.fd is not None, reply
                    try:
                        write_entry(reply.fd, plan, tensor_views(plan, tensors))
                        os.ftruncate(reply.fd, plan.file_size // 2)  # refused at commit
                    finally:
                        os.close(reply.fd)
                    answer = peer.call(m.PutCommit(id=peer.next_id(), put=reply.put))
                    codes.append(answer.code.value if isinstance(answer, m.ErrorReply) else "ok")

        threads = [threading.Thread(target=liar, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(codes) == 8 * 25
        assert daemon.stop() == 0
    daemon.check()  # no quarantine_failed
    assert len(os.listdir(tmp_path / "tier" / "quarantine")) <= 1
