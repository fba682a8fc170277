"""The tables kvctl prints for people: status (the tier, then one row per model), the entry
list, one entry's header. Pure: dicts and records in, text out. Every cell and value goes
through terminal.printable as the table is laid out (columns, fields): a name a client chose
reaches the terminal with its control characters escaped, whichever row shows it."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvd_protocol.entry import EntryHeader
from kvd_protocol.messages import EntrySummary

from kvd.identity_names import DIGEST_SHOWN
from kvd.ops.terminal import printable


def size(n: float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def ago(seconds: float | None, now: float) -> str:
    """A moment as how long ago it was: 42s, 7m, 3h, 2d; '-' for never."""
    if not seconds:
        return "-"
    elapsed = max(0.0, now - seconds)
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if elapsed >= length:
            return f"{elapsed / length:.0f}{unit}"
    return f"{elapsed:.0f}s"


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def model_name(row: Mapping[str, Any]) -> str:
    """An identity, from its row of the status, as people know it: its name
    (kvd.identity_names); from a daemon that names none, its model id (and namespace), else
    its digest."""
    if row.get("name"):
        return str(row["name"])
    name = str(row.get("model_id") or row["identity"])
    namespace = row.get("namespace")
    return f"{name} [{namespace}]" if namespace else name


def short_digest(digest: str) -> str:
    """The first digits of a digest, as many as `--identity` usually needs."""
    return digest[:DIGEST_SHOWN]


def _ratio(hits: int, misses: int) -> str:
    lookups = hits + misses
    return f"{100 * hits / lookups:.1f}%" if lookups else "-"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _percentiles(summary: Mapping[str, Any] | None) -> str:
    found = summary or {}
    return "/".join(_ms(found.get(p)) for p in ("p50", "p95", "p99"))


REASONS_SHOWN = 3  # miss reasons named on a row, the most frequent first


def top_reasons(by_reason: Mapping[str, int] | None, shown: int = REASONS_SHOWN) -> str:
    """The most frequent miss reasons, with their counts: "no entry 3, kv differs 1"."""
    ranked = sorted((by_reason or {}).items(), key=lambda item: (-item[1], item[0]))
    named = [f"{reason} {count:,}" for reason, count in ranked[:shown] if count]
    more = sum(count for _, count in ranked[shown:])
    return ", ".join(named) + (f", other {more:,}" if more else "") if named else "-"


def _lookups(status: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Hits, misses and the hit rate among them; the lookups the engines' memory served as
    well (engine-held: not misses of the tier), from a daemon that counts them apart; and
    the misses' most frequent reasons."""
    hits, misses = status["hits"], status["misses"]
    text = f"{hits:,} hits, {misses:,} misses ({_ratio(hits, misses)})"
    held = status.get("engine_held")
    if held is not None:
        text += f"; {held:,} engine-held (the engine's memory had as much)"
    rows = [("lookups", text)]
    if "misses_by_reason" in status:
        rows.append(("misses", top_reasons(status["misses_by_reason"])))
    return rows


def _seconds(value: float) -> str:
    """Seconds for people: 0.42 s, 12.3 s, 4.5 min, 2.1 h."""
    for unit, length in (("h", 3600), ("min", 60)):
        if value >= length * 2:
            return f"{value / length:,.1f} {unit}"
    return f"{value:.2f} s" if value < 10 else f"{value:,.1f} s"


def _prefill_saved(status: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The prefill the restores saved, since start and in 24 h, and what of it is an
    estimate; no row from a daemon that does not count it."""
    if "prefill_saved_s" not in status:
        return []
    text = (
        f"{_seconds(status['prefill_saved_s'])} since start, "
        f"{_seconds(status['prefill_saved_s_24h'])} in 24 h: restored tokens x each model's "
        "measured prefill cost"
    )
    estimated = status["prefill_saved_estimated_s"]
    if estimated:
        text += (
            f"; {_seconds(estimated)} of it estimated (models no engine measured: at the "
            "others' mean cost, else 1 ms a token)"
        )
    return [("prefill saved", text)]


# Prefill saved since start and in 24 h, each with the part of it that is an estimate.
SAVED_KEYS = (
    ("prefill_saved_s", "prefill_saved_estimated_s"),
    ("prefill_saved_s_24h", "prefill_saved_estimated_s_24h"),
)


def _saved_cell(identity: Mapping[str, Any]) -> str:
    """An identity's prefill saved in seconds, since start and in 24 h; `~` before a figure
    that holds an estimate."""
    if "prefill_saved_s" not in identity:
        return "-"
    return "/".join(
        ("~" if identity[estimated] else "") + f"{identity[total]:,.2f}"
        for total, estimated in SAVED_KEYS
    )


def _shared(status: Mapping[str, Any]) -> str:
    """Shared blocks: how much more the tier would hold without them, and what they saved."""
    blocks = status.get("blocks")
    if blocks is None:  # an older daemon
        return "-"
    return (
        f"{status['dedup_ratio']:.2f}x ({size(status['logical_bytes'])} of entries in "
        f"{size(status['unique_bytes'])}); {blocks['count']} blocks, {size(blocks['bytes'])}; "
        f"{size(status['dedup_saved_bytes'])} not written"
    )


DROPPING_SHOWN = 3  # identities named on the engine drops line, the most dropped first


def _engine_drops(status: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The snapshots engines dropped unsent (their backlogs full), and which identities did;
    no row from a daemon that does not count them."""
    if "engine_dropped" not in status:
        return []
    count = status["engine_dropped"]
    if not count:
        return [("engine drops", "none")]
    dropping = sorted(
        (i for i in status["identities"] if i.get("engine_dropped")),
        key=lambda i: -i["engine_dropped"],
    )
    named = [f"{model_name(i)} {i['engine_dropped']:,}" for i in dropping[:DROPPING_SHOWN]]
    more = len(dropping) - DROPPING_SHOWN
    text = f"{count:,} snapshots ({size(status['engine_dropped_bytes'])}) dropped unsent"
    if named:
        text += ": " + ", ".join(named) + (f" and {more} more" if more > 0 else "")
    return [("engine drops", text)]


def _prefill_checkpoints(status: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The prefill checkpoints held and what lookups got from them; no row from a daemon
    that does not count them."""
    figures = status.get("prefill_checkpoints")
    if figures is None:
        return []
    if not figures["entries"] and not figures["hits"]:
        return [("prefill checkpoints", "none")]
    return [
        (
            "prefill checkpoints",
            f"{figures['entries']:,} ({size(figures['bytes'])}); {figures['hits']:,} hits, "
            f"{figures['restored_tokens']:,} prompt tokens restored from them",
        )
    ]


def _remote(status: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The remote tier's health, uploads and fetches; no row without one."""
    remote = status.get("remote")
    if remote is None:
        return []
    state = remote["state"]
    if state != "ok" and remote["last_error"]:
        state += f" ({remote['last_error']})"
    where = remote["url"] + (f" at {remote['endpoint']}" if remote["endpoint"] else "")
    gbps = remote["restore_gbps_p50"]
    return [
        ("remote", f"{state}; {where}"),
        (
            "uploads",
            f"{remote['pending_uploads']} pending ({size(remote['pending_bytes'])}, "
            f"{remote['upload_policy']}); {remote['uploaded_blocks']:,} blocks "
            f"({size(remote['uploaded_bytes'])}) sent, {remote['already_there_blocks']:,} "
            f"there already; {remote['upload_drops']:,} dropped "
            f"({size(remote['upload_dropped_bytes'])})",
        ),
        *_upload_journal(remote),
        (
            "downloads",
            f"{remote['downloaded_blocks']:,} blocks ({size(remote['downloaded_bytes'])}); "
            f"{remote['hits']:,} hits, {remote['misses']:,} misses; restore "
            + ("-" if gbps is None else f"{gbps:.2f} GB/s")
            + " p50",
        ),
    ]


def _upload_journal(remote: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The upload journal: what it holds, what the start found in it, its problem if any
    (no row from a daemon without one)."""
    if "journal_uploads" not in remote:
        return []
    text = (
        f"{remote['journal_uploads']:,} uploads ({size(remote['journal_bytes'])}); from "
        f"before the restart {remote['restart_uploads']:,}: {remote['restart_reoffered']:,} "
        f"offered again, {remote['restart_gone']:,} gone"
    )
    if remote["journal_problem"]:
        text += f"; {remote['journal_problem']}"
    return [("upload journal", text)]


def columns(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Aligned columns of printable cells: the first left ones flush left, the others flush
    right."""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(header), *map(line, rows)]


def fields(rows: Sequence[tuple[str, str]]) -> list[str]:
    """One line per (name, value), the values aligned and printable."""
    width = max(len(name) for name, _ in rows)
    return [f"{name:<{width}}  {printable(value)}" for name, value in rows]


def format_status(status: Mapping[str, Any], rates: Mapping[str, float] | None = None) -> str:
    """The tier, the queue, then one row per model; rates (per second, from --watch) too."""
    wb = status["writeback"]
    daemon = status["daemon"]
    rows = [
        ("daemon", f"pid {daemon['pid']}, kvd {daemon['version']}, up {daemon['uptime_s']:.0f} s"),
        ("memory", size(daemon["rss_bytes"])),
        ("tier", daemon.get("dir", "")),
        ("entries", _entries(status)),
        ("bytes", f"{size(status['bytes'])} of {size(status['max_bytes'])} cap"),
        (
            "disk free",
            f"{size(status['disk_free_bytes'])} (floor {size(status['min_free_bytes'])})",
        ),
        *_lookups(status),
        ("restored", _restored(status)),
        *_prefill_saved(status),
        (
            "written",
            f"{size(status['bytes_written'])} since start, "
            f"{size(status.get('bytes_written_24h', 0))} in 24 h",
        ),
        ("shared", _shared(status)),
        *_prefill_checkpoints(status),
        *_engine_drops(status),
        ("evictions", str(status["evictions"])),
        ("retained", size(status.get("retained_bytes", 0))),
        ("quarantined", str(status["quarantined"])),
        (
            "write-behind",
            f"{wb['pending_count']} pending ({size(wb['pending_bytes'])} of "
            f"{size(wb['max_bytes'])}, {wb['policy']}); {wb['stored']} stored, "
            f"{wb['dropped']} dropped, {wb['failed']} failed",
        ),
        *_remote(status),
    ]
    if rates is not None:
        rows.append(
            (
                "per second",
                f"{rates['hits']:.1f} hits, {rates['engine_held']:.1f} engine-held, "
                f"{rates['misses']:.1f} misses, "
                f"{rates['tokens_restored']:,.0f} tokens restored, "
                f"{size(rates['bytes_written'])} written",
            )
        )
    lines = fields(rows)
    if status["identities"]:
        header = ["identity", "digest", "entries", "bytes", "hits", "engine-held", "misses"]
        header += ["hit %", "saved s start/24h", "restore ms p50/p95/p99", "tokens restored"]
        header += ["written", "top misses"]
        table = []
        for i in status["identities"]:
            table.append(
                [
                    model_name(i),
                    short_digest(i["identity"]),
                    str(i["entries"]),
                    size(i["bytes"]),
                    str(i.get("hits", 0)),
                    str(i.get("engine_held", "-")),
                    str(i.get("misses", 0)),
                    _ratio(i.get("hits", 0), i.get("misses", 0)),
                    _saved_cell(i),
                    _percentiles(i.get("restore_ms")),
                    f"{i.get('tokens_restored', 0):,}",
                    size(i.get("bytes_written", 0)),
                    top_reasons(i.get("misses_by_reason"), 2),
                ]
            )
        lines += ["", *columns(header, table, left=2)]
        lines.append(
            "hit %: hits of hits and misses; saved s: restored tokens x measured prefill cost "
            "(~: holds an estimate); restore ms: from buckets, within 12%"
        )
    left_out = status.get("identities_left_out", 0)  # absent from an older daemon's
    if left_out:
        lines.append(
            f"... and {left_out:,} more identities, not listed (the status lists those with "
            "the most bytes, then the most recently seen)"
        )
    if status["clients"]:
        lines += ["", *_clients(status)]
    return "\n".join(lines)


def _clients(status: Mapping[str, Any]) -> list[str]:
    """One row per client process: its name and pid, and the models it serves (the identities
    its lookups and puts named last) from a daemon that says them."""
    names = {i["identity"]: model_name(i) for i in status["identities"]}
    rows = []
    for client in status["clients"]:
        served = client.get("identities")
        models = (
            "-"
            if not served
            else ", ".join(names.get(digest, short_digest(digest)) for digest in served)
        )
        rows.append([client["name"] or "-", models, str(client["pid"])])
    return columns(["client", "serves", "pid"], rows, left=2)


def _entries(status: Mapping[str, Any]) -> str:
    """The tier's entries, and the identities (a tenant's status has its own only)."""
    identities = _identity_count(status)
    if status.get("tenant"):
        return f"{status['entries']} in the tier; {identities} identities of yours"
    return f"{status['entries']} in {identities} identities"


def _restored(status: Mapping[str, Any]) -> str:
    """Tokens restored, and the restores' latency (bucket estimates), when the daemon says."""
    text = f"{status.get('tokens_restored', 0):,} prompt tokens not computed"
    if status.get("restores") and "restore_ms" in status:
        text += (
            f" in {status['restores']:,} restores, ms p50/p95/p99 "
            f"{_percentiles(status.get('restore_ms'))} (estimated from buckets, within 12%)"
        )
    return text


def _identity_count(status: Mapping[str, Any]) -> int:
    """The identities with entries or traffic: those listed and those left out."""
    return len(status["identities"]) + int(status.get("identities_left_out", 0))


RATE_KEYS = ("hits", "engine_held", "misses", "tokens_restored", "bytes_written")


def rates(before: Mapping[str, Any], after: Mapping[str, Any], seconds: float) -> dict[str, float]:
    """What grew per second between two status reports."""
    return {key: (after.get(key, 0) - before.get(key, 0)) / seconds for key in RATE_KEYS}


SORTS = {
    "used": lambda e: -(e.used or 0.0),
    "age": lambda e: -e.created,
    "tokens": lambda e: -e.tokens,
    "bytes": lambda e: -e.bytes,
    "id": lambda e: e.id,
}


def format_list(
    entries: Sequence[EntrySummary], names: Mapping[str, str], sort: str, now: float
) -> str:
    """One row per entry: its model, size, age and last use; sorted by SORTS[sort]."""
    header = [
        "entry",
        "identity",
        "tokens",
        "bytes",
        "age",
        "last use",
        "leases",
        "retained",
        "kind",
        "state",
    ]
    rows = [
        [
            e.id,
            names.get(e.identity, e.identity),
            f"{e.tokens:,}",
            size(e.bytes),
            ago(e.created, now),
            ago(e.used, now),
            str(e.leases),
            retained_for(e, now),
            _kind(e),
            "durable" if e.durable else "pending",
        ]
        for e in sorted(entries, key=SORTS[sort])
    ]
    return "\n".join(columns(header, rows, left=2))


def retained_for(entry: EntrySummary, now: float) -> str:
    """How much longer the entry's retention lasts and its priority ("2h p0"); '-' for none."""
    if entry.retained_until is None:
        return "-"
    return f"{ago(now, entry.retained_until)} p{entry.retention_priority}"


def _kind(entry: EntrySummary) -> str:
    """How a lookup may use the entry: cut to a shorter prefix, or only whole; a prefill
    checkpoint (whole only) is named as such."""
    if entry.prefill_checkpoint:
        return "prefill checkpoint"
    return "trimmable" if entry.trimmable else "exact"


def format_entry(summary: EntrySummary, header: EntryHeader, name: str, path: str) -> str:
    """One entry: what it is for, what it holds, where its bytes are."""
    identity = header.identity
    now = time.time()
    rows = [
        ("entry", summary.id),
        ("name", name),
        ("identity", summary.identity),
        ("model id", identity.model_id),
        ("traits", identity.traits or "-"),
        ("namespace", identity.namespace or "-"),
        ("config", identity.config_fingerprint),
        ("tokenizer", identity.tokenizer_hash),
        ("codec", identity.codec_id),
        ("runtime", identity.runtime),
        ("tokens", f"{header.token_count:,} (may be trimmed to {header.min_reuse})"),
        (
            "created",
            f"{_when(header.created)} ({ago(header.created, now)} ago)",
        ),
        ("last use", ago(summary.used, now) + (" ago" if summary.used else "")),
        ("leases", str(summary.leases)),
        ("retained", retained_for(summary, now)),
        ("state", "durable" if summary.durable else "pending"),
        ("file", f"{path} ({size(header.file_size)})"),
    ]
    if header.block_hashes:
        tail = header.token_count - len(header.block_hashes) * header.block_tokens
        rows.append(
            (
                "blocks",
                f"{len(header.block_hashes)} shared blocks of {header.block_tokens} tokens, "
                f"from {header.block_hashes[0].hex()}; {tail} tokens in the file",
            )
        )
    if header.prefill_checkpoint:
        rows.append(("kind", "prefill checkpoint: served whole, to prompts that hold all of it"))
    if header.checkpoint is not None:
        rows.append(
            (
                "checkpoint",
                f"{header.checkpoint.key}, {header.checkpoint.generated_tokens} generated",
            )
        )
    lines = fields(rows)
    table = []
    for number, layer in enumerate(header.layers):
        for slot in layer.slots:
            shape = "x".join(map(str, slot.shape))
            trim = "trimmable" if layer.trimmable else "exact"
            table.append(
                [
                    str(number),
                    layer.kind,
                    trim,
                    slot.dtype,
                    shape,
                    size(slot.nbytes),
                    slot.checksum.hex(),
                ]
            )
    lines += [
        "",
        *columns(["layer", "kind", "trim", "dtype", "shape", "bytes", "xxh3-64"], table, left=0),
    ]
    return "\n".join(lines)
