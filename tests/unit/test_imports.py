"""The package's import graph: no cycles, and dependencies that run the right way.

The graph is read from the source with `ast`, so an import counts wherever it is
written: at module level, inside a function (where a cycle hides until the
function runs) or under `if TYPE_CHECKING:`. The layers:

    protocol   wire formats            imports nothing else of the project
    core       sans-IO rules           imports protocol
    _zmq       socket plumbing         imports protocol
    SDKs       engine, frontend,       never the server or the command line
               loadgen, launch, sim
    server     sockets and timers      never an SDK, the sim, the command line or
                                       the vLLM drop-in
    cli        the command line        anything

No module imports another module's private (underscore) names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = "coordinator"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

SDKS = ("coordinator.engine", "coordinator.frontend", "coordinator.loadgen",
        "coordinator.launch", "coordinator.sim")
# What the flat top level may hold: public SDKs, launch and vLLM modules, plumbing.
TOP_LEVEL = {"__init__", "__main__", "_zmq", "engine", "frontend", "frontend_support", "loadgen",
             "launch", "vllm_compat", "vllm_plugin"}
MAX_MODULE_LINES = 800
MAX_SERVER_MODULE_LINES = 500

Graph = Mapping[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports_of(name: str, path: Path, known: Iterable[str]) -> list[tuple[str, str | None]]:
    """Every `(module, imported name or None)` that `name` imports from the project."""
    known_set = set(known)
    package = name.split(".")[0]
    found: list[tuple[str, str | None]] = []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in known_set:
                    target = target.rpartition(".")[0]
                if target:
                    found.append((target, None))
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(name, path.name == "__init__.py", node.level, node.module)
                    if node.level else node.module or "")
            if base != package and not base.startswith(package + "."):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known_set:
                    found.append((submodule, None))
                else:
                    found.append((base, alias.name))
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = modules_of(root)
    return {name: {target for target, _ in imports_of(name, path, modules) if target != name}
            for name, path in modules.items()}


def find_cycle(graph: Graph) -> list[str] | None:
    """One import cycle as `[a, b, ..., a]`, or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: dict[str, int] = {}
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph.get(start, ())))]
        path.append(start)
        on_path[start] = 0
        while stack:
            node, todo = stack[-1]
            if not todo:
                stack.pop()
                path.pop()
                del on_path[node]
                done.add(node)
                continue
            nxt = todo.pop(0)
            if nxt in on_path:
                return [*path[on_path[nxt]:], nxt]
            if nxt in done:
                continue
            on_path[nxt] = len(path)
            path.append(nxt)
            stack.append((nxt, sorted(graph.get(nxt, ()))))
    return None


def _within(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layering_violations(graph: Graph) -> list[str]:
    """Every edge that breaks a layer rule of the module docstring."""
    problems: list[str] = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target == PACKAGE:
                allowed = True  # the package itself holds only __version__
            elif _within(importer, "coordinator.protocol"):
                allowed = _within(target, "coordinator.protocol")
            elif _within(importer, "coordinator.core"):
                allowed = _within(target, "coordinator.protocol", "coordinator.core")
            elif importer == "coordinator._zmq":
                allowed = _within(target, "coordinator.protocol")
            elif _within(importer, *SDKS):
                allowed = not _within(target, "coordinator.server", "coordinator.cli")
            elif _within(importer, "coordinator.server"):
                allowed = not _within(target, *SDKS, "coordinator.cli", "coordinator.vllm_compat",
                                      "coordinator.vllm_plugin")
            else:
                allowed = True
            if not allowed:
                problems.append(f"{importer} imports {target}")
    return problems


def private_imports(root: Path) -> list[str]:
    modules = modules_of(root)
    problems = []
    for name, path in modules.items():
        for target, imported in imports_of(name, path, modules):
            if imported is not None and imported.startswith("_") and not imported.startswith("__"):
                problems.append(f"{name} imports {target}.{imported}")
    return problems


# ---- the package ---------------------------------------------------------------------------


def test_the_graph_sees_the_whole_package() -> None:
    graph = import_graph(ROOT)
    assert {"coordinator.protocol.vllm", "coordinator.core.waves.table", "coordinator.server.app",
            "coordinator.cli", "coordinator.cli.serve", "coordinator.sim.engine",
            "coordinator._zmq"} <= set(graph)
    # Both forms of import are edges: `from a import module` and `import a.b as c`.
    assert "coordinator.protocol.frontend" in graph["coordinator.frontend"]
    assert "coordinator._zmq" in graph["coordinator.engine"]
    # An import inside a function is an edge too.
    assert "coordinator.server.run" in graph["coordinator.cli.serve"]


def test_no_import_cycles() -> None:
    assert find_cycle(import_graph(ROOT)) is None


def test_dependencies_run_the_right_way() -> None:
    assert layering_violations(import_graph(ROOT)) == []


def test_no_module_imports_another_modules_private_names() -> None:
    assert private_imports(ROOT) == []


def test_the_top_level_holds_only_sdks_launch_and_vllm_modules() -> None:
    assert {path.stem for path in ROOT.glob("*.py")} <= TOP_LEVEL
    assert {path.name for path in ROOT.iterdir() if path.is_dir()
            and (path / "__init__.py").exists()} == {"cli", "core", "protocol", "server", "sim"}


def test_no_module_is_over_800_lines_and_none_in_the_server_over_500() -> None:
    # The server only moves bytes; a long file there is a sign that a rule crept in.
    limits = {name: MAX_SERVER_MODULE_LINES if _within(name, "coordinator.server")
              else MAX_MODULE_LINES for name in modules_of(ROOT)}
    long = {name: n for name, path in modules_of(ROOT).items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > limits[name]}
    assert long == {}


# ---- the checker itself --------------------------------------------------------------------


def write_package(root: Path, files: Mapping[str, str]) -> Path:
    package = root / PACKAGE
    for relative, text in files.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return package


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    package = write_package(tmp_path, {
        "__init__.py": "",
        "cli.py": "from coordinator.top import run\n",
        "top.py": "def run():\n    from coordinator.cli import helper\n    return helper\n",
    })
    graph = import_graph(package)
    assert graph["coordinator.top"] == {"coordinator.cli"}
    assert find_cycle(graph) == ["coordinator.cli", "coordinator.top", "coordinator.cli"]


def test_relative_and_aliased_imports_are_resolved(tmp_path: Path) -> None:
    package = write_package(tmp_path, {
        "__init__.py": "",
        "protocol/__init__.py": "from . import vllm\n",
        "protocol/vllm.py": "from ..core import waves\n",
        "core/__init__.py": "",
        "core/waves.py": "import coordinator.protocol.vllm as v\nimport zmq\n",
    })
    graph = import_graph(package)
    assert graph["coordinator.protocol"] == {"coordinator.protocol.vllm"}
    assert graph["coordinator.protocol.vllm"] == {"coordinator.core.waves"}
    assert graph["coordinator.core.waves"] == {"coordinator.protocol.vllm"}
    assert find_cycle(graph) is not None
    assert layering_violations(graph) == [
        "coordinator.protocol.vllm imports coordinator.core.waves"]


@pytest.mark.parametrize(("importer", "target"), [
    ("coordinator.protocol.frontend", "coordinator.core.waves"),
    ("coordinator.protocol.vllm", "coordinator._zmq"),
    ("coordinator.core.waves", "coordinator.server.app"),
    ("coordinator.core.balancer", "coordinator._zmq"),
    ("coordinator._zmq", "coordinator.engine"),
    ("coordinator.engine", "coordinator.server.transport"),
    ("coordinator.launch", "coordinator.server.transport"),
    ("coordinator.frontend", "coordinator.cli.common"),
    ("coordinator.sim.engine", "coordinator.server.app"),
    ("coordinator.server.app", "coordinator.frontend"),
    ("coordinator.server.app", "coordinator.sim.request"),
    ("coordinator.server.config", "coordinator.cli.serve"),
    ("coordinator.server.run", "coordinator.vllm_compat"),
])
def test_each_layer_rule_catches_its_violation(importer: str, target: str) -> None:
    assert layering_violations({importer: {target}}) == [f"{importer} imports {target}"]


@pytest.mark.parametrize(("importer", "target"), [
    ("coordinator.protocol.engine_input", "coordinator.protocol.vllm"),
    ("coordinator.core.waves", "coordinator.protocol.identity"),
    ("coordinator._zmq", "coordinator.protocol.addresses"),
    ("coordinator.sim.engine", "coordinator.engine"),
    ("coordinator.loadgen", "coordinator.frontend"),
    ("coordinator.server.app", "coordinator.core.waves"),
    ("coordinator.server.curve", "coordinator._zmq"),
    ("coordinator.cli.serve", "coordinator.server.run"),
    ("coordinator.vllm_compat", "coordinator.cli"),
])
def test_allowed_edges_pass(importer: str, target: str) -> None:
    assert layering_violations({importer: {target}}) == []


def test_private_names_imported_across_modules_are_found(tmp_path: Path) -> None:
    package = write_package(tmp_path, {
        "__init__.py": "",
        "engine.py": "def _connect():\n    pass\n",
        "frontend.py": "def f():\n    from coordinator.engine import _connect\n",
        "sim.py": "from coordinator import __version__\n",
    })
    assert private_imports(package) == ["coordinator.frontend imports coordinator.engine._connect"]
