"""The process's own metrics: memory, CPU, descriptors, start time, and the build.

``process_*`` are the standard Prometheus process metrics, read from /proc at each
scrape by prometheus-client's process collector (absent where /proc is not);
``dp_coordinator_build_info{version}`` is 1, labelled with this package's version,
so a dashboard can show which build answers and an upgrade shows as a new series.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from coordinator import __version__
from coordinator.server.metrics import PREFIX


class BuildInfoCollector:
    """``dp_coordinator_build_info{version="..."} 1``."""

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(f"{PREFIX}_build_info", "1, labelled with the version of "
                                 "dp-coordinator this process runs", labels=["version"])
        info.add_metric([__version__], 1.0)
        yield info


def register_process_metrics(registry: CollectorRegistry) -> None:
    """Add the process and build metrics to ``registry``."""
    ProcessCollector(registry=registry)
    registry.register(BuildInfoCollector())
