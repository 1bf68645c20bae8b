"""``lta metrics watch``: the training telemetry of running workers, as a table refreshed in place.

Scrapes the Prometheus endpoints that ``lta train --metrics-port PORT`` (or a loop using
``hostlib.torch_ext.metrics.PrometheusExporter``) serves, and shows one row per worker: steps, tokens/s,
step and comm time, the share of chunks renormalized from a partial count and of chunks that fell
back, and the age of the oldest parameter copy. The values are the workers' EWMAs.

    lta metrics watch 127.0.0.1:9100-9103            # workers 0..3 of lta train --metrics-port 9100
    lta metrics watch http://h1:9100/metrics,http://h2:9100/metrics --interval 2
    lta metrics watch 127.0.0.1:9100 --count 1 --json

A target is ``HOST:PORT``, ``HOST:FIRST-LAST`` (a port range) or a URL; several are separated by
commas or spaces. An endpoint that does not answer is listed under the table with the reason.
"""

from __future__ import annotations

import argparse
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from hostlib import argtypes
from hostlib.errors import LtaError, UsageError
from lta.cliparse import LtaRawHelpFormatter, plain_text
from lta.jsonout import emit

SCHEMA = "lta.metrics.watch/1"
MAX_TARGETS = 1024
# Columns: (heading, metric, scale, format)
COLUMNS = (
    ("steps", "lta_steps_total", 1.0, "{:.0f}"),
    ("tokens/s", "lta_tokens_per_second", 1.0, "{:.0f}"),
    ("step ms", "lta_step_seconds", 1000.0, "{:.1f}"),
    ("comm ms", "lta_comm_seconds", 1000.0, "{:.1f}"),
    ("partial %", "lta_chunks_partial_ratio", 100.0, "{:.1f}"),
    ("fallback %", "lta_chunks_fallback_ratio", 100.0, "{:.1f}"),
    ("stale", "lta_staleness_steps", 1.0, "{:.1f}"),
)


def parse_targets(texts: list[str]) -> list[str]:
    """Metrics URLs from ``HOST:PORT``, ``HOST:FIRST-LAST`` or URL items (comma or space separated)."""
    urls: list[str] = []
    for text in texts:
        for item in (part.strip() for part in text.split(",")):
            if item:
                urls += _expand(item)
    if not urls:
        raise UsageError("name at least one endpoint (HOST:PORT, HOST:FIRST-LAST or URL)")
    if len(urls) > MAX_TARGETS:
        raise UsageError(f"{len(urls)} endpoints; at most {MAX_TARGETS}")
    return urls


def _expand(item: str) -> list[str]:
    has_scheme = "://" in item
    parts = urllib.parse.urlsplit(item if has_scheme else f"http://{item}")
    host, _, ports = parts.netloc.rpartition(":")
    if parts.scheme not in ("http", "https") or not host or not ports:
        raise UsageError(f"{item!r} is not HOST:PORT, HOST:FIRST-LAST or an http URL")
    first_text, _, last_text = ports.partition("-")
    try:
        first = argtypes.port(first_text)
        last = argtypes.port(last_text) if last_text else first
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{item!r}: {exc}") from None
    if last < first or last - first >= MAX_TARGETS:
        raise UsageError(f"{item!r}: port range must go up, {MAX_TARGETS} ports at most")
    path = parts.path or "/metrics"
    return [
        urllib.parse.urlunsplit((parts.scheme, f"{host}:{p}", path, parts.query, ""))
        for p in range(first, last + 1)
    ]


@dataclass
class Scrape:
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per (job, worker), with "url"
    errors: list[dict[str, str]] = field(default_factory=list)  # {"url", "error"}


def scrape(urls: list[str], timeout_s: float = 2.0) -> Scrape:
    """Fetch every endpoint; each ``lta_*`` sample lands in the row of its (job, worker) labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out = Scrape()
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                text = response.read().decode("utf-8", "replace")
            families = list(text_string_to_metric_families(text))
        except (OSError, ValueError) as exc:  # refused, timed out, HTTP error, not the text format
            reason = getattr(exc, "reason", None) or exc
            out.errors.append({"url": url, "error": str(reason)})
            continue
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for family in families:
            for sample in family.samples:
                if not sample.name.startswith("lta_"):
                    continue
                key = (sample.labels.get("job", ""), sample.labels.get("worker", ""))
                row = rows.setdefault(key, {"url": url, "job": key[0], "worker": key[1]})
                row[sample.name] = sample.value
        if not rows:
            out.errors.append({"url": url, "error": "no lta_* metrics yet (has the worker started a run?)"})
        out.rows += rows.values()
    out.rows.sort(key=lambda r: (r["job"], int(r["worker"]) if r["worker"].isdigit() else 0, r["url"]))
    return out


def _cell(row: dict[str, Any], metric: str, scale: float, fmt: str) -> str:
    value = row.get(metric)
    return "-" if value is None else fmt.format(value * scale)


def table(result: Scrape, title: str) -> Any:
    """A rich Table of the scrape, one row per worker."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for heading in ("job", "worker", *(c[0] for c in COLUMNS)):
        t.add_column(heading, justify="left" if heading == "job" else "right")
    for row in result.rows:
        t.add_row(row["job"], row["worker"], *(_cell(row, *c[1:]) for c in COLUMNS))
    return t


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "metrics",
        help="training telemetry from the workers' Prometheus endpoints",
        description=plain_text(__doc__),
        formatter_class=LtaRawHelpFormatter,
    )
    sub = p.add_subparsers(dest="metrics_command", metavar="COMMAND")
    p.set_defaults(func=lambda args: p.print_help() or 2)
    watch = sub.add_parser(
        "watch",
        help="a refreshing table of every worker's telemetry",
        description=plain_text(__doc__),
        formatter_class=LtaRawHelpFormatter,
    )
    watch.add_argument("targets", nargs="+", metavar="TARGET", help="HOST:PORT, HOST:FIRST-LAST or URL")
    watch.add_argument(
        "--interval", type=argtypes.positive_float, default=1.0, help="seconds between scrapes"
    )
    watch.add_argument(
        "--count", type=argtypes.nonnegative_int, default=0, help="stop after this many scrapes (0: never)"
    )
    watch.add_argument("--timeout", type=argtypes.positive_float, default=2.0, help="seconds per endpoint")
    watch.add_argument("--json", action="store_true", help="one JSON document per scrape on stdout")
    watch.set_defaults(func=run_watch)


def run_watch(args: argparse.Namespace) -> int:
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    urls = parse_targets(args.targets)
    console = Console()
    if not console.is_terminal:  # a pipe or a log: no 80-column squeeze of the headings
        console = Console(width=200)
    live = None
    if console.is_terminal and not args.json:
        live = Live(console=console, auto_refresh=False)
        live.start()
    answered = 0
    scrapes = 0
    try:
        while True:
            result = scrape(urls, args.timeout)
            scrapes += 1
            answered += len(urls) - len(result.errors)
            if args.json:
                emit(SCHEMA, {"time": time.time(), "rows": result.rows, "errors": result.errors})
            else:
                title = f"lta metrics {time.strftime('%H:%M:%S')}  {len(urls)} endpoint(s), EWMA values"
                notes = [Text(f"unreachable: {e['url']} ({e['error']})") for e in result.errors]
                view = Group(table(result, title), *notes)
                if live is not None:
                    live.update(view, refresh=True)
                else:
                    console.print(view)
            if args.count and scrapes >= args.count:
                break
            time.sleep(args.interval)
    finally:
        if live is not None:
            live.stop()
    if answered == 0:
        shown = ", ".join(urls[:4]) + (" ..." if len(urls) > 4 else "")
        raise LtaError(f"no endpoint answered ({shown}); is the training running?")
    return 0
