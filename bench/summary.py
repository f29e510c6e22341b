"""SUMMARY.md and summary.png from the JSON files in a results directory.

    python -m bench.summary [DIR]

Rebuilt after every run from whatever `<scenario>.json` files are present,
so a single-scenario run refreshes its rows and keeps the others.
"""

from __future__ import annotations

import os
import sys
import textwrap
from typing import Any

from bench import report


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and digits == 0 and abs(value) >= 100:
        return f"{value:,.0f}"
    if isinstance(value, (int, float)):
        return f"{value:,.{digits}f}"
    return str(value)


def _short_number(value: float, _position: object = None) -> str:
    """Axis labels: 500, 2k, 1.5M."""
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e3:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


def _ratio(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def _target(case: dict[str, Any], name: str) -> dict[str, Any]:
    return case.get("targets", {}).get(name, {})


class Table:
    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def add(self, metric: str, case: dict[str, Any], key: str, *, digits: int = 0,
            scale: float = 1.0, goal: str = "", met: bool | None = None,
            higher_is_better: bool = False) -> None:
        def median(name: str) -> float | None:
            value = _target(case, name).get("median", {}).get(key)
            return None if value is None else value * scale

        def cell(name: str) -> str:
            value = median(name)
            spread = _target(case, name).get("spread", {}).get(key)
            text = _fmt(value, digits)
            if value is not None and spread and spread[0] != spread[1]:
                text += f" ({_fmt(spread[0] * scale, digits)} to {_fmt(spread[1] * scale, digits)})"
            return text

        ours = median("ours")
        self.rows.append([
            metric, cell("ours"), cell("floor"),
            _ratio(report.ratio(ours, median("floor"))),
            cell("peer"), _ratio(report.ratio(ours, median("peer"))),
            _ratio(report.ratio(ours, median("ours-asyncio"))),
            goal, "" if met is None else ("met" if met else "**missed**"),
        ])
        del higher_is_better

    def add_values(self, metric: str, values: dict[str, Any], *, digits: int = 0,
                   goal: str = "", met: bool | None = None, floor_text: str = "") -> None:
        """One row from plain values; a value of 0 shows as `floor_text` if given."""
        def fmt(value: Any) -> str:
            return floor_text if floor_text and value == 0 else _fmt(value, digits)

        ours = values.get("ours") or None
        self.rows.append([
            metric, fmt(values.get("ours")), fmt(values.get("floor")),
            _ratio(report.ratio(ours, values.get("floor"))), fmt(values.get("peer")),
            _ratio(report.ratio(ours, values.get("peer"))),
            _ratio(report.ratio(ours, values.get("ours-asyncio"))), goal,
            "" if met is None else ("met" if met else "**missed**"),
        ])

    def add_cells(self, metric: str, ours: str, floor: str = "-", *, goal: str = "",
                  met: bool | None = None) -> None:
        """One row of ready-made text (values that are not medians of one key)."""
        self.rows.append([metric, ours, floor, "-", "-", "-", "-", goal,
                          "" if met is None else ("met" if met else "**missed**")])

    def markdown(self) -> str:
        header = ["Metric", "ours", "floor", "ours/floor", "peer", "ours/peer",
                  "uvloop/asyncio", "target", "result"]
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join(["---", *["---:"] * 6, "---", "---"]) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


def _met(data: dict[str, Any], name_start: str) -> bool | None:
    for check in data.get("checks", []):
        if check["name"].startswith(name_start):
            met = check.get("met")
            return None if met is None else bool(met)
    return None


def build_table(results: dict[str, dict[str, Any]]) -> Table:
    table = Table()
    wake = results.get("wake")
    if wake:
        for case in wake["cases"]:
            n = case["params"]["engines"]
            table.add(f"Wake latency p50, N={n} (µs)", case, "p50_us")
            goal = met = None
            if n == 64:
                goal = "≤ 1,000 and ≤ 1.5x floor"
                a, b = _met(wake, "wake p99 at N=64"), _met(wake, "wake p99 at N=64 vs floor")
                met = None if a is None and b is None else bool(a) and bool(b)
            table.add(f"Wake latency p99, N={n} (µs)", case, "p99_us", goal=goal or "",
                      met=met)
    first = results.get("first_request")
    if first:
        for case in first["cases"]:
            n = case["params"]["engines"]
            table.add(f"First request, request + wake p50, N={n} (µs)", case, "p50_us",
                      goal="≤ 1.15x floor", met=_met(first, f"first request p50 at N={n}"))
            table.add(f"First request, request + wake p99, N={n} (µs)", case, "p99_us")
    stats = results.get("stats")
    if stats:
        case = stats["cases"][0]
        values = {name: t.get("sustained_per_s") for name, t in case["targets"].items()}
        lowest = min(stats["parameters"]["ladder_per_s"])
        table.add_values(f"Stats ingest, sustained, {case['params']['engines']} engines "
                         "(msgs/s)", values, goal="≥ 100,000",
                         met=_met(stats, "stats ingest"), floor_text=f"< {lowest:,}")
        table.add("Publish interval p99 at that rate (ms)", case, "publish_p99_ms",
                  digits=1, goal="≤ 130", met=_met(stats, "publish p99"))
    dispatch = results.get("dispatch")
    if dispatch:
        case = dispatch["cases"][0]
        p = case["params"]
        table.add(f"Dispatch, {p['frontends']} frontends → {p['engines']} engines, 1 KB "
                  "(submits/s)", case, "submits_per_s", goal="≥ 0.8x floor",
                  met=_met(dispatch, "dispatch throughput vs floor"))
    handshake = results.get("handshake")
    if handshake:
        case = handshake["cases"][0]
        table.add(f"Handshake, {case['params']['engines']} engines all READY (ms)", case,
                  "all_ready_ms", goal="≤ 2,000", met=_met(handshake, "handshake"))
    cadence = results.get("cadence")
    if cadence:
        case = cadence["cases"][0]
        table.add("Publish interval p50 under saturating stats (ms)", case, "publish_p50_ms",
                  digits=1)
        table.add("Publish interval p99 under saturating stats (ms)", case, "publish_p99_ms",
                  digits=1, goal="≤ 130", met=_met(cadence, "publish p99"))
        table.add("Stats absorbed under saturation (msgs/s)", case, "absorbed_per_s",
                  goal="≥ 3x peer", met=_met(cadence, "stats absorbed under saturation"))
    rss = results.get("rss")
    if rss:
        case = rss["cases"][0]
        values = {name: t.get("rss_after_stats_mib") for name, t in case["targets"].items()}
        table.add_values(f"RSS after stats, N={case['params']['engines']} (MiB)", values,
                         digits=1, goal="≤ 80", met=_met(rss, "RSS"))
    scale = results.get("scale")
    if scale:
        _scale_rows(table, scale)
    flood = results.get("flood")
    if flood:
        case = flood["cases"][0]
        senders = case["params"]["senders"]
        table.add(f"Flood by {senders} processes: RSS peak (MiB)", case, "rss_peak_mib",
                  digits=1, goal="≤ 512", met=_met(flood, "RSS peak under a flood"))
        table.add(f"Flood by {senders} processes: longest publish gap (ms)", case,
                  "publish_max_ms", digits=1, goal="≤ 250",
                  met=_met(flood, "longest publish gap under a flood"))
        table.add(f"Flood by {senders} processes: publish interval p99 (ms)", case,
                  "publish_p99_ms", digits=1, goal="≤ 130",
                  met=_met(flood, "publish p99 under a flood"))
    cpu = results.get("cpu")
    if cpu:
        case = cpu["cases"][0]
        p = case["params"]
        load = (f"{p['engines']:,} ranks x {p['stats_per_rank_hz']:g} stats/s + "
                f"{p['submits_per_s']:,.0f} submits/s")
        table.add(f"CPU, {load} (% of one core)", case, "coordinator_cpu_pct", digits=1,
                  goal="< 15", met=_met(cpu, "coordinator CPU"))
        table.add("of which libzmq's I/O threads (% of one core)", case,
                  "zmq_threads_cpu_pct", digits=1)
        batched = _target(case, "floor-batched").get("median", {}).get("coordinator_cpu_pct")
        if batched is not None:
            values = {"ours": _target(case, "ours").get("median", {}).get(
                "coordinator_cpu_pct"), "floor": batched}
            table.add_values("CPU, same load, floor reading in 1 ms batches (% of one core)",
                             values, digits=1)
    return table


def _scale_rows(table: Table, scale: dict[str, Any]) -> None:
    case = scale["cases"][0]
    n = case["params"]["engines"]
    hz = scale["parameters"].get("stats_per_rank_hz")
    table.add(f"{n:,} ranks: handshake, all READY (ms)", case, "all_ready_ms",
              goal="≤ 1,000", met=_met(scale, f"handshake of {n} ranks"))
    table.add(f"{n:,} ranks: wake latency p50 (µs)", case, "wake_p50_us")
    table.add(f"{n:,} ranks: wake latency p99 (µs)", case, "wake_p99_us",
              goal="≤ 1.2x floor", met=_met(scale, f"wake p99 at N={n} vs floor"))
    table.add(f"{n:,} ranks: full publish (bytes)", case, "publish_bytes")
    table.add(f"{n:,} ranks: publish interval p99, stats at {hz:g}/s per rank (ms)", case,
              "publish_p99_ms", digits=1)
    table.add(f"{n:,} ranks: CPU, stats at {hz:g}/s per rank (% of one core)", case,
              "stats_cpu_pct", digits=1)
    table.add(f"{n:,} ranks: RSS after stats and wakes (MiB)", case, "rss_end_mib", digits=1,
              goal="≤ 150", met=_met(scale, f"RSS at N={n}"))
    fds = scale.get("file_descriptors") or {}
    for transport in ("ipc", "tcp"):
        entry = fds.get(transport)
        if not entry or entry.get("peak") is None:
            continue
        after = entry.get("after_handshake")
        text = f"{entry['peak']:,} / {'-' if after is None else f'{after:,}'}"
        limit = fds.get("usual_default_soft_limit", 1024)
        low = fds.get(f"{transport}_soft_limit_{limit}")
        served = None if not isinstance(low, dict) else low.get("handshake") == "complete"
        table.add_cells(f"{n:,} ranks: descriptors, handshake peak / after, {transport}", text,
                        goal=f"served when started under a soft limit of {limit:,}",
                        met=served)


def notes(results: dict[str, dict[str, Any]]) -> list[str]:
    """Lines under the table for what a row cannot say."""
    out: list[str] = []
    scale = results.get("scale")
    fds = (scale or {}).get("file_descriptors") or {}
    for key, entry in fds.items():
        if "_soft_limit_" not in key or not isinstance(entry, dict):
            continue
        transport = key.split("_", 1)[0]
        n = scale["cases"][0]["params"]["engines"] if scale else "?"
        limit = f"{entry.get('soft_limit'):,}"
        if entry.get("handshake") == "complete":
            out.append(f"- Under a soft RLIMIT_NOFILE of {limit}, over {transport}, our "
                       f"coordinator served all {n:,} ranks.")
            continue
        lines = [line.strip() for line in (entry.get("log_tail") or "").splitlines()
                 if line.strip()]
        tail = lines[-1][-200:] if lines else ""
        fate = ("exited" + (f" (`{tail}`)" if tail else "") if entry.get("alive") is False
                else "stayed up" + (f" (log: `{tail}`)" if tail else " and logged nothing"))
        out.append(f"- Under a soft RLIMIT_NOFILE of {limit} (the usual default), over "
                   f"{transport}, our coordinator did not serve {n:,} ranks: the handshake "
                   f"{entry.get('handshake')} and the process {fate}.")
    if fds.get("ranks_within_usual_soft_limit") is not None:
        out.append(f"- Descriptors grow by {fds['peak_per_rank']:g} per rank while ranks "
                   "handshake at once, so a soft limit of "
                   f"{fds['usual_default_soft_limit']:,} holds about "
                   f"{fds['ranks_within_usual_soft_limit']:,} ranks.")
    cpu = results.get("cpu")
    if cpu and "floor-batched" in cpu.get("targets", []):
        out.append("- *floor reading in 1 ms batches*: the floor process sleeping 1 ms after "
                   "each round of draining its sockets, so input gathers between wake-ups; "
                   "what coalesced reads could save in CPU, at up to 1 ms of latency.")
    return out


def machine_line(results: dict[str, dict[str, Any]]) -> tuple[str, str]:
    dates = sorted({data["date"][:10] for data in results.values()})
    any_result = next(iter(results.values()))
    m = any_result["machine"]
    modes = sorted({data["mode"] for data in results.values()})
    loads = [data.get("load_average_at_end", [None])[0] for data in results.values()]
    load_values = [x for x in loads if x is not None]
    load_text = (f"{min(load_values):.1f} to {max(load_values):.1f}" if load_values else
                 "unknown")
    text = (f"{m['cpu']}, {m['cores']} cores, Linux {m['kernel']}; Python {m['python']}, "
            f"pyzmq {m['pyzmq']} (libzmq {m['libzmq']}), msgspec {m['msgspec']}, "
            f"uvloop {m['uvloop']}; source {m.get('source', 'unknown')}; 1-minute load "
            f"average after each scenario {load_text} (other work on this machine)")
    return ", ".join(dates) + f" ({'/'.join(modes)} run)", text


def write_markdown(directory: str, results: dict[str, dict[str, Any]]) -> str:
    date, machine = machine_line(results)
    table = build_table(results)
    peers = sorted({str(data["peer"]) for data in results.values() if data.get("peer")})
    peer_text = (f"*peer* is {', '.join(peers)}, given with `--peer`" if peers else
                 "*peer* is a coordinator given with `--peer` (none in this run)")
    lines = [
        "# Benchmark summary",
        "",
        f"Date: {date}. Machine: {machine}.",
        "",
        "Medians over repetitions, with the spread (min to max) in brackets. *floor* is a "
        "process with the same sockets that forwards the same messages with no logic; "
        f"{peer_text}; *uvloop/asyncio* is our coordinator "
        "on uvloop divided by the same on plain asyncio. Latency ratios below 1 and "
        "throughput ratios above 1 favour the first named. Reproduce with "
        "`python -m bench` (full) or `python -m bench --quick`.",
        "",
        table.markdown(),
        "",
    ]
    extra = notes(results)
    if extra:
        lines += [*extra, ""]
    notes_missed = []
    for data in results.values():
        for check in data.get("checks", []):
            if check.get("met") is False:
                notes_missed.append(f"- {check['name']}: {_fmt(check['value'], 2)} "
                                    f"{check['unit']} (target {check['goal']})")
    if notes_missed:
        lines += ["Targets missed in this run:", "", *notes_missed, ""]
    path = os.path.join(directory, "SUMMARY.md")
    with open(path, "w") as handle:
        handle.write("\n".join(lines))
    return path


COLORS = {"ours": "tab:blue", "ours-asyncio": "tab:cyan", "floor": "tab:gray",
          "peer": "tab:red"}


def write_figure(directory: str, results: dict[str, dict[str, Any]]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'); no figure",
              file=sys.stderr)
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    quantiles = [i / 100 for i in range(101)]

    def cdf_panel(ax: Any, data: dict[str, Any] | None, key: str, title: str, xlabel: str,
                  case_filter: tuple[int, ...] | None = None, log: bool = True) -> None:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction")
        if not data:
            ax.text(0.5, 0.5, "not run", ha="center", transform=ax.transAxes)
            return
        styles = ["-", "--", ":", "-."]
        # Stop the axis a little past the largest p99.5: a single stall of a
        # neighbour's making should not squash every curve to the left edge.
        curves = [t[key] for case in data["cases"] for t in case["targets"].values()
                  if len(t.get(key) or []) == len(quantiles)]
        right = max(c[95] for c in curves) * 3 if curves else None
        left = min(c[1] for c in curves) / 2 if curves else None
        for c, case in enumerate(data["cases"]):
            engines = case["params"].get("engines")
            if case_filter and engines not in case_filter:
                continue
            for name, target in case["targets"].items():
                values = target.get(key)
                if not values:
                    continue
                ax.plot(values, quantiles, styles[c % len(styles)],
                        color=COLORS.get(name, "black"), label=f"{name} N={engines}")
        if log:
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(_short_number))
            ax.xaxis.set_minor_formatter(NullFormatter())
        if right is not None and left is not None and 0 < left < right:
            ax.set_xlim(left=left, right=right)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)

    wake = results.get("wake")
    scale = results.get("scale")
    if scale:
        # The many-rank wakes belong on the same axis as the others.
        wake = {"cases": [*(wake or {}).get("cases", []), *scale["cases"]]}
    cdf_panel(axes[0][0], wake, "cdf_us", "Wake latency (start_wave → all "
              "engines have START_DP_WAVE)", "µs (log; axis ends at 3x the largest p95)")
    cdf_panel(axes[0][1], results.get("first_request"), "cdf_us", "First request (submit → "
              "request + every wake delivered)", "µs (log; axis ends at 3x the largest p95)")
    cdf_panel(axes[1][0], results.get("cadence"), "cdf_ms", "Full-publish intervals under "
              "saturating stats (target p99 <= 130 ms)", "ms (log)")

    ax = axes[1][1]
    groups: list[tuple[str, dict[str, float]]] = []
    stats = results.get("stats")
    if stats:
        groups.append(("stats sustained\n(msgs/s)", {
            n: t.get("sustained_per_s") or 0 for n, t in stats["cases"][0]["targets"].items()}))
    cadence = results.get("cadence")
    if cadence:
        groups.append(("stats absorbed,\nsaturated (msgs/s)", {
            n: t["median"].get("absorbed_per_s") or 0
            for n, t in cadence["cases"][0]["targets"].items()}))
    dispatch = results.get("dispatch")
    if dispatch:
        groups.append(("dispatch\n(submits/s)", {
            n: t["median"].get("submits_per_s") or 0
            for n, t in dispatch["cases"][0]["targets"].items()}))
    names = [n for n in COLORS if any(n in g for _, g in groups)]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [g + i * width for g in range(len(groups))]
        ys = [values.get(name, 0) for _, values in groups]
        bars = ax.bar(xs, ys, width, color=COLORS[name], label=name)
        ax.bar_label(bars, labels=[f"{y / 1000:.0f}k" if y else "" for y in ys], fontsize=7)
    ax.set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([label for label, _ in groups], fontsize=8)
    ax.set_yscale("log")
    ax.set_title("Throughput", fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    if names:
        ax.legend(fontsize=7)
    date, machine = machine_line(results)
    fig.suptitle(f"dp-coordinator benchmarks, {date}\n{textwrap.fill(machine, 160)}",
                 fontsize=8)
    fig.tight_layout()
    path = os.path.join(directory, "summary.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_summary(directory: str, *, figure: bool = True) -> None:
    results = report.load_results(directory)
    if not results:
        return
    write_markdown(directory, results)
    if figure:
        write_figure(directory, results)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    directory = args[0] if args else os.path.join(os.path.dirname(__file__), "results")
    write_summary(directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
