"""Numbers in, files out: percentiles, machine description, JSON, the figure, SUMMARY.md."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Iterable, Sequence
from importlib import metadata
from typing import Any

QUANTILES = (50, 90, 99, 99.9)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile `q` (0..100) of already sorted values."""
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return float(sorted_values[lo] * (1 - frac) + sorted_values[hi] * frac)


def latency_stats(values_us: Iterable[float]) -> dict[str, float]:
    """p50/p90/p99/p99.9/max/mean of one repetition's latencies (microseconds)."""
    data = sorted(values_us)
    out: dict[str, float] = {"n": len(data)}
    for q in QUANTILES:
        out[f"p{q:g}_us"] = round(percentile(data, q), 1)
    out["max_us"] = round(data[-1], 1) if data else math.nan
    out["mean_us"] = round(statistics.fmean(data), 1) if data else math.nan
    return out


def cdf(values: Iterable[float], points: int = 101) -> list[float]:
    """The values at `points` evenly spaced quantiles, for plotting a CDF compactly."""
    data = sorted(values)
    if not data:
        return []
    return [round(percentile(data, 100.0 * i / (points - 1)), 2) for i in range(points)]


def median_and_spread(reps: Sequence[dict[str, Any]]) -> tuple[dict[str, float],
                                                               dict[str, list[float]]]:
    """Median over repetitions of every numeric key, and [min, max] as the spread."""
    keys = [k for k, v in reps[0].items() if isinstance(v, (int, float))] if reps else []
    median: dict[str, float] = {}
    spread: dict[str, list[float]] = {}
    for key in keys:
        values = [float(r[key]) for r in reps
                  if isinstance(r.get(key), (int, float)) and not math.isnan(float(r[key]))]
        if not values:
            continue
        median[key] = round(statistics.median(values), 3)
        spread[key] = [round(min(values), 3), round(max(values), 3)]
    return median, spread


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, 3)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, Any]:
    """What these numbers were measured on."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import zmq

        libzmq = zmq.zmq_version()
        pyzmq = zmq.__version__
    except ImportError:
        libzmq = pyzmq = "not installed"
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "pyzmq": pyzmq,
        "libzmq": libzmq,
        "msgspec": _version("msgspec"),
        "uvloop": _version("uvloop"),
        "dp_coordinator": _version("dp-coordinator"),
        "source": _source_revision(),
        "load_average_at_start": [round(x, 2) for x in load],
    }


def _source_revision() -> str:
    """`git describe` of the tree the coordinator runs from ("-dirty": uncommitted edits)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=1, sort_keys=False, allow_nan=False,
                  default=_json_default)
        handle.write("\n")
    os.replace(tmp, path)


def _json_default(value: object) -> object:
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def clean(value: Any) -> Any:
    """NaN/inf become None so the JSON stays strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def load_results(directory: str) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    if not os.path.isdir(directory):
        return results
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as handle:
                data = json.load(handle)
            if isinstance(data, dict) and "scenario" in data:
                results[data["scenario"]] = data
    return results
