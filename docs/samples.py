"""The sample outputs of docs/operations.md, made anew by a real run.

A daemon in a temporary folder, kvd-mlx-lm-server processes of one tiny model folder (built
on the spot, random weights) - plain, and with an 8-bit KV cache - each configuration
answering three turns of one conversation (the first two on one process, the second from its
memory; the third on a new process, restored from kvd), then the kvctl commands whose output
docs/operations.md shows. Each block between `<!-- sample: NAME -->` and
`<!-- /sample -->` there is replaced by the command and what it printed; the temporary
folder is shown as $TMP.

    .venv/bin/python docs/samples.py [--write docs/operations.md]

Without --write, the blocks are printed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "server")]

from daemon_process import Daemon, running_daemon  # noqa: E402 - after the path
from http_servers import chat, http_server  # noqa: E402
from model_folders import build_model_folder, words  # noqa: E402

MODEL_NAME = "Llama-tiny"  # the folder's name: the model as the server names it
SERVERS = {"plain": (), "8-bit KV": ("--kv-bits", "8", "--kv-group-size", "32")}
METRICS_SHOWN = (
    "^kvd_(entries|bytes|hits|engine_held|misses|prefill_saved_seconds"
    "|identity_(hits|engine_held|misses|prefill_saved_seconds|restore_duration_seconds_count))"
)
SAMPLE = re.compile(r"(<!-- sample: (?P<name>[\w-]+) -->\n).*?(<!-- /sample -->)", re.DOTALL)


def conversation(logs: Path, daemon: Daemon, model: Path, extra: tuple[str, ...]) -> None:
    """Three turns of one conversation: two on a server process (the second from its own
    memory), the third on a new one, which restores the second turn from kvd."""
    messages = [
        {"role": "system", "content": words(300, seed=1)},
        {"role": "user", "content": words(200, seed=2)},
    ]
    for process, turns in enumerate((2, 1)):
        log = logs.with_suffix(f".{process}.log")
        with http_server(model, log, kvd_socket=daemon.socket_path, extra=extra) as server:
            for turn in range(turns):
                answer = chat(server, messages, stream=False)
                messages += [
                    {"role": "assistant", "content": answer.text},
                    {"role": "user", "content": words(40, seed=3 + process + turn)},
                ]
            server.stop()  # SIGTERM: the snapshots still waiting are sent first


def kvctl_output(daemon: Daemon, tmp: Path) -> Callable[..., str]:
    def run(*args: str, grep: str = "") -> str:
        done = subprocess.run(
            [sys.executable, "-m", "kvd.ops.kvctl", "--socket", daemon.socket_path, *args],
            capture_output=True,
            text=True,
            check=True,
        )
        lines = [line for line in done.stdout.splitlines() if re.match(grep, line)]
        shown = " ".join(args) + (f" | grep -E '{grep}'" if grep else "")
        text = "\n".join([f"$ kvctl {shown}", *lines])
        return text.replace(str(tmp), "$TMP")

    return run


def samples() -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="kvd-samples-") as scratch:
        tmp = Path(scratch)
        model = build_model_folder(tmp / MODEL_NAME, seed=0)
        with running_daemon(tmp) as daemon:
            for i, extra in enumerate(SERVERS.values()):
                conversation(tmp / f"server-{i}", daemon, model, extra)
            kvctl = kvctl_output(daemon, tmp)
            listed = kvctl("list", "--json")
            first_entry = re.search(r'"id": "([0-9a-f]+)"', listed)
            assert first_entry is not None, f"no entry listed: {listed}"
            return {
                "status": kvctl("status"),
                "list": kvctl("list"),
                "show": kvctl("show", first_entry.group(1)),
                "metrics": kvctl("metrics", grep=METRICS_SHOWN),
            }


def written(document: str, blocks: dict[str, str]) -> str:
    """document with each sample block replaced; raises KeyError for a block not made."""

    def block(match: re.Match[str]) -> str:
        return f"{match.group(1)}```text\n{blocks[match.group('name')]}\n```\n{match.group(3)}"

    return SAMPLE.sub(block, document)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--write", type=Path, help="replace the sample blocks of this file")
    args = parser.parse_args()
    blocks = samples()
    if args.write is None:
        for name, text in blocks.items():
            print(f"<!-- sample: {name} -->\n{text}\n")
        return
    args.write.write_text(written(args.write.read_text(), blocks))


if __name__ == "__main__":
    main()
