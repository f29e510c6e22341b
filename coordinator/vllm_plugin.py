"""vLLM general plugin: make vLLM's launcher start dp-coordinator instead of its own.

Registered under the entry point group ``vllm.general_plugins`` as
``dp_coordinator``. vLLM calls `register` in every process it starts (the
launcher, API servers, engine cores, workers), usually several times. It does
nothing unless ``DP_COORDINATOR_REPLACE=1`` is set; then, for a targeted vLLM
version, it rebinds the name ``DPCoordinator`` to
`coordinator.vllm_compat.DPCoordinatorProcess`:

* in ``vllm.v1.engine.coordinator``, where the class is defined, so a module
  that imports the name later gets ours;
* in ``vllm.v1.engine.utils`` if that module is already imported: it copied the
  name at import time, and its ``launch_core_engines`` is the only place vLLM
  0.33 constructs a coordinator.

``vllm.v1.engine.core_client`` and ``vllm.v1.utils`` name the class only in
type annotations and are left alone.

Targeted versions: vLLM 0.33.x releases (``0.33.N``, with an optional
``.postN`` or ``+local`` suffix). The launcher surface and every byte were
checked against 0.33.0. Anything else (other minor versions, release
candidates, ``.dev`` builds of the main branch) is refused with a warning and
vLLM is left untouched: older front-ends unpack two-element count rows, and
newer launchers may use the coordinator differently.

This module imports nothing from vLLM (and nothing heavy) at import time.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
from typing import Final

__all__ = [
    "ENABLE_ENV",
    "ENTRY_POINT_NAME",
    "PATCHED_MODULES",
    "TARGETED_RELEASES",
    "is_targeted_version",
    "register",
]

log = logging.getLogger("coordinator.vllm_plugin")

ENABLE_ENV: Final = "DP_COORDINATOR_REPLACE"
ENTRY_POINT_NAME: Final = "dp_coordinator"
"""The plugin's name; list it in VLLM_PLUGINS if that variable restricts plugins."""

TARGETED_RELEASES: Final = frozenset({(0, 33)})
"""(major, minor) of the vLLM releases this plugin patches."""

DEFINING_MODULE: Final = "vllm.v1.engine.coordinator"
LAUNCHER_MODULE: Final = "vllm.v1.engine.utils"
PATCHED_MODULES: Final = (DEFINING_MODULE, LAUNCHER_MODULE)
CLASS_NAME: Final = "DPCoordinator"

_RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?(?:\+[0-9A-Za-z.]+)?")
_TRUE = frozenset({"1", "true", "yes", "on"})


def is_targeted_version(version: object) -> bool:
    """True for a final vLLM release whose (major, minor) is in `TARGETED_RELEASES`."""
    if not isinstance(version, str):
        return False
    match = _RELEASE.fullmatch(version.strip())
    if match is None:
        return False
    return (int(match.group(1)), int(match.group(2))) in TARGETED_RELEASES


def _enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "").strip().lower() in _TRUE


def register() -> None:
    """The plugin entry point vLLM calls; a no-op unless DP_COORDINATOR_REPLACE=1."""
    if not _enabled():
        return
    try:
        import vllm
    except ImportError:
        log.warning("%s is set but vLLM is not importable here; nothing to replace",
                    ENABLE_ENV)
        return
    version = getattr(vllm, "__version__", None)
    if not is_targeted_version(version):
        targets = ", ".join(f"{a}.{b}.x" for a, b in sorted(TARGETED_RELEASES))
        log.warning(
            "%s=1 ignored: vLLM %s is not a version dp-coordinator targets (%s); vLLM keeps "
            "its own DP coordinator", ENABLE_ENV, version, targets,
        )
        return
    try:
        defining = importlib.import_module(DEFINING_MODULE)
    except Exception as exc:  # a broken vLLM install must not break vLLM further
        log.warning("%s=1 ignored: cannot import %s (%s); vLLM keeps its own DP coordinator",
                    ENABLE_ENV, DEFINING_MODULE, exc)
        return
    original = getattr(defining, CLASS_NAME, None)
    if original is None:
        log.warning("%s=1 ignored: %s has no %s; vLLM keeps its own DP coordinator",
                    ENABLE_ENV, DEFINING_MODULE, CLASS_NAME)
        return

    from coordinator.vllm_compat import DPCoordinatorProcess

    patched = []
    for name in PATCHED_MODULES:
        module = sys.modules.get(name)
        if module is None or getattr(module, CLASS_NAME, None) is DPCoordinatorProcess:
            continue
        if getattr(module, CLASS_NAME, None) is None:
            continue  # partly imported, or a layout we do not know: leave it alone
        setattr(module, CLASS_NAME, DPCoordinatorProcess)
        patched.append(name)
    if patched:
        log.info("vLLM %s will run dp-coordinator as its DP coordinator (patched %s.%s)",
                 version, " and ".join(patched), CLASS_NAME)
