"""vLLM's own Python modules (0.29.0 to 0.33.0), taken unmodified from pinned wheels.

    python -m tools.vllm_wheel fetch                   # download (or reuse) and verify 0.33.0
    python -m tools.vllm_wheel fetch --version 0.29.0  # another pinned release
    python -m tools.vllm_wheel fetch --version all     # every pinned release
    python -m tools.vllm_wheel fetch --wheel FILE      # fill the cache from a wheel on disk
    python -m tools.vllm_wheel check                   # import vLLM's coordinator with stubs

Tests and benchmarks that must run vLLM's code (its coordinator loop, its
client's socket handling, its KV event structs) use this module; vllm is never
a dependency and none of its code is committed. Each pinned release's wheel
(300-340 MB) is fetched on demand with `pip download --no-deps vllm==<v>` into
a git-ignored cache of its own (`.cache/vllm-<v>/` at the repository root,
`$DP_VLLM_CACHE_ROOT/vllm-<v>/`, or `$DP_VLLM_CACHE` for the default 0.33.0),
checked against its pinned sha256 (`PINNED_WHEELS`, PyPI's published digests),
and only the `.py` files asked for are extracted. With the cache filled
nothing touches the network. Every function that reads the wheel takes
`version=` (default `VLLM_VERSION`, 0.33.0). A helper module an older release
does not have (`OPTIONAL_MODULES`) is stubbed for that release rather than
failing the import.

`vllm_modules()` (a context manager) and `install()` make the chosen vLLM
modules importable: each module named in `real` runs from the wheel's own
source, and everything else it imports is stubbed. Stubbed are every other
`vllm.*` module (the config tree, platforms, torch utilities, multimodal
inputs...) and heavy third-party packages (torch, numpy, pydantic,
cloudpickle, ...). A stub module hands out a placeholder class for any
attribute, so class definitions, type annotations, decorators and
`isinstance` checks at import time work; code that really calls torch fails
loudly, which is the point: only code paths that need no tensors can be run.
Two third-party functions on vLLM's socket path (`psutil.virtual_memory`,
`urllib3.util.parse_url`) get small faithful stand-ins when the real packages
are not installed, because `make_zmq_socket` acts on their results. A caller
can give its own stand-ins too (`stand_ins`, module name -> attributes): such
a module is served with those attributes (any other attribute is a
placeholder), even where it would otherwise run from source. Compatibility
tests use that to give vLLM's code exactly the few collaborators it calls
(a config class the publisher builds, a multimodal dataclass with vLLM's
field order) and to run nothing of vLLM's but the module under test.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
"""The version used when a caller names none (the newest supported release)."""

# sha256 of each supported release's x86_64 wheel, as PyPI lists it. Only .py
# files are extracted, so the x86_64 wheel serves every machine; asking pip for
# this platform keeps each pin valid on any architecture.
PINNED_WHEELS: dict[str, str] = {
    "0.29.0": "09d48617fc2be9c6cdcd5db480651ab0d84817b257204f2cc2e3ecbb70bbb635",
    "0.30.0": "ef52ee58c410ead0b8afb190838fa4cbcb52075596f67862a03859d984966ac4",
    "0.31.0": "39132b433967f0962d03d8a5f633b9bee6b32708f566c7d5637b79f8d0ef3433",
    "0.32.0": "5e2ecdc5b0baf72921c288486417ca82778456a448e4fe60b62ee43c0dfc8611",
    "0.33.0": "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
}
VERSIONS = tuple(PINNED_WHEELS)
"""Every pinned release, oldest first."""
WHEEL_PLATFORM = "manylinux_2_28_x86_64"
WHEEL_NAME = f"vllm-{VLLM_VERSION}-cp38-abi3-{WHEEL_PLATFORM}.whl"
WHEEL_SHA256 = PINNED_WHEELS[VLLM_VERSION]
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = REPO_ROOT / ".cache" / f"vllm-{VLLM_VERSION}"
CACHE_ENV = "DP_VLLM_CACHE"
"""One directory for the default version's wheel (kept for existing set-ups)."""
CACHE_ROOT_ENV = "DP_VLLM_CACHE_ROOT"
"""A directory holding `vllm-<version>/` for every version."""
DOWNLOAD_TIMEOUT_S = 1800.0
ABSENT_FILE = ".absent"
"""In `<cache>/src`: modules a version's wheel does not have, one a line."""

# vLLM modules that run from the wheel's source whenever vLLM's coordinator
# plane is imported: the wire structs and their decoder, the socket factory,
# logging and environment switches. Everything else under vllm.* is stubbed.
# A module an older release lacks (uvicorn_logging before 0.32) is stubbed
# for that release instead (`optional`).
COORDINATOR_REAL = (
    "vllm.envs",
    "vllm.logger",
    "vllm.logging_utils",
    "vllm.logging_utils.formatter",
    "vllm.logging_utils.lazy",
    "vllm.logging_utils.log_time",
    "vllm.logging_utils.torch_tensor",
    "vllm.logging_utils.uvicorn_logging",
    "vllm.utils.network_utils",
    "vllm.v1.engine",
    "vllm.v1.engine.coordinator",
    "vllm.v1.metrics.stats",
    "vllm.v1.serial_utils",
)
OPTIONAL_MODULES = frozenset({
    "vllm.logging_utils.torch_tensor",
    "vllm.logging_utils.uvicorn_logging",
    "vllm.logging_utils.log_time",
    "vllm.v1.pool.late_interaction",
})
"""Helpers some releases lack: skipped (stubbed) for those, never a reason to skip a test."""

# Add these to `real` to decode vLLM's KV cache events (`ExternalBlockHash` is
# a type alias there, which a stub class cannot stand in for).
KV_EVENTS_REAL = (*COORDINATOR_REAL, "vllm.distributed.kv_events",
                  "vllm.v1.core.kv_cache_utils")

# Third-party packages that are stubbed unless already imported: too heavy to
# install for a benchmark, and (but for the two below) on no code path that runs.
HEAVY_PACKAGES = frozenset({
    "torch", "numpy", "cloudpickle", "pydantic", "pydantic_core", "psutil", "urllib3",
    "transformers", "triton", "ray", "PIL", "huggingface_hub", "tokenizers", "safetensors",
    "fastapi", "starlette", "uvicorn", "openai", "aiohttp", "regex", "cbor2", "setproctitle",
    "xxhash", "blake3", "einops", "scipy", "cachetools", "opentelemetry",
})
# Of those, these are used for real when installed, and otherwise get stand-ins
# that behave, since vLLM's socket factory acts on what they return.
SHIMMED_PACKAGES = ("psutil", "urllib3")


class WheelUnavailable(RuntimeError):
    """The pinned vLLM wheel is neither in the cache nor downloadable; says why."""


class ModuleNotInWheel(LookupError):
    """A module asked for is not in this release's wheel (and is not optional).

    Not a `WheelUnavailable`: a test that catches that to skip must fail here,
    since the release lacks what the test runs.
    """


# ---- the wheel --------------------------------------------------------------------------


def check_version(version: str) -> str:
    """`version` if it is pinned; otherwise `WheelUnavailable` naming the pinned ones."""
    if version not in PINNED_WHEELS:
        raise WheelUnavailable(f"vllm {version} is not pinned here; pinned: "
                               f"{', '.join(VERSIONS)}")
    return version


def wheel_name(version: str = VLLM_VERSION) -> str:
    return f"vllm-{check_version(version)}-cp38-abi3-{WHEEL_PLATFORM}.whl"


def cache_dir(path: str | os.PathLike[str] | None = None, *,
              version: str = VLLM_VERSION) -> Path:
    """`path`, else `$DP_VLLM_CACHE` (default version only), else
    `$DP_VLLM_CACHE_ROOT/vllm-<version>`, else `.cache/vllm-<version>`."""
    check_version(version)
    if path is not None:
        return Path(path)
    env = os.environ.get(CACHE_ENV)
    if env and version == VLLM_VERSION:
        return Path(env)
    root = os.environ.get(CACHE_ROOT_ENV)
    base = Path(root) if root else REPO_ROOT / ".cache"
    return base / f"vllm-{version}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _stamp(path: Path, version: str) -> str:
    st = path.stat()
    return f"{PINNED_WHEELS[version]} {st.st_size} {st.st_mtime_ns}\n"


def _verified(wheel: Path, version: str) -> bool:
    """True if `wheel` matches the pinned sha256 (hashed once, then remembered)."""
    stamp_file = wheel.with_name(wheel.name + ".verified")
    if not wheel.is_file():
        return False
    with contextlib.suppress(OSError):
        if stamp_file.read_text() == _stamp(wheel, version):
            return True
    if _sha256(wheel) != PINNED_WHEELS[version]:
        return False
    stamp_file.write_text(_stamp(wheel, version))
    return True


def _adopt(source: Path, cache: Path, version: str = VLLM_VERSION) -> Path:
    """Check `source` against the pin and place it in the cache (atomically)."""
    got = _sha256(source)
    if got != PINNED_WHEELS[check_version(version)]:
        raise WheelUnavailable(
            f"{source} is not the pinned vllm {version} wheel: sha256 {got}, "
            f"expected {PINNED_WHEELS[version]}")
    name = wheel_name(version)
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / name
    partial = cache / f".{name}.{os.getpid()}.part"
    try:
        os.link(source, partial)
    except OSError:
        shutil.copyfile(source, partial)
    os.replace(partial, target)
    (cache / (name + ".verified")).write_text(_stamp(target, version))
    return target


def _download(cache: Path, timeout_s: float, version: str) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    name = wheel_name(version)
    with tempfile.TemporaryDirectory(prefix="download-", dir=cache) as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--platform", WHEEL_PLATFORM, "--dest", tmp, "--progress-bar", "off",
            f"vllm=={version}",
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True,
                                    timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise WheelUnavailable(
                f"downloading vllm=={version} took longer than {timeout_s:.0f} s; "
                f"{_offline_hint(cache, version)}") from None
        except OSError as exc:
            raise WheelUnavailable(f"could not run pip ({exc}); "
                                   f"{_offline_hint(cache, version)}") from None
        if result.returncode != 0:
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-6:])
            raise WheelUnavailable(
                f"`pip download --no-deps vllm=={version}` failed (exit "
                f"{result.returncode}); no network or no index? "
                f"{_offline_hint(cache, version)}\npip said:\n{tail}")
        got = Path(tmp) / name
        if not got.is_file():
            names = ", ".join(sorted(os.listdir(tmp))) or "nothing"
            raise WheelUnavailable(f"pip downloaded {names}, not {name}")
        return _adopt(got, cache, version)


def _offline_hint(cache: Path, version: str = VLLM_VERSION) -> str:
    return (f"to work offline, put {wheel_name(version)} (sha256 {PINNED_WHEELS[version]}) "
            f"in {cache} or run `python -m tools.vllm_wheel fetch --version {version} "
            f"--wheel FILE`")


def ensure_wheel(cache: str | os.PathLike[str] | None = None, *, download: bool = True,
                 timeout_s: float = DOWNLOAD_TIMEOUT_S, version: str = VLLM_VERSION) -> Path:
    """The verified wheel of `version` in its cache, downloading it first if needed."""
    where = cache_dir(cache, version=version)
    wheel = where / wheel_name(version)
    if wheel.is_file():
        if _verified(wheel, version):
            return wheel
        bad = wheel.with_name(wheel.name + ".bad")
        os.replace(wheel, bad)
        if not download:
            raise WheelUnavailable(f"{wheel} does not match the pinned sha256 (moved to {bad})")
    if not download:
        raise WheelUnavailable(f"no vllm {version} wheel in {where}; "
                               f"{_offline_hint(where, version)}")
    return _download(where, timeout_s, version)


def source_root(cache: str | os.PathLike[str] | None = None, *,
                version: str = VLLM_VERSION) -> Path:
    """Where extracted vLLM sources live: `<cache>/src` (holds the `vllm` package)."""
    return cache_dir(cache, version=version) / "src"


def module_member(name: str, members: set[str]) -> str | None:
    """The wheel member that holds module `name` (`a/b.py` or `a/b/__init__.py`)."""
    base = name.replace(".", "/")
    for candidate in (f"{base}/__init__.py", f"{base}.py"):
        if candidate in members:
            return candidate
    return None


def absent(root: Path) -> frozenset[str]:
    """Optional modules found missing from the wheel whose sources are under `root`."""
    with contextlib.suppress(OSError):
        return frozenset((root / ABSENT_FILE).read_text().split())
    return frozenset()


def extract(modules: Iterable[str], cache: str | os.PathLike[str] | None = None, *,
            download: bool = True, timeout_s: float = DOWNLOAD_TIMEOUT_S,
            version: str = VLLM_VERSION) -> Path:
    """Extract the source files of `modules` (dotted names) and return the source root.

    Files already extracted are kept; the wheel is opened only when one is
    missing, so a filled cache needs neither the network nor the wheel's
    300-odd MB read. A module in `OPTIONAL_MODULES` that this version's wheel
    lacks is noted in `<root>/.absent` (and then stubbed); any other missing
    module raises `ModuleNotInWheel`.
    """
    root = source_root(cache, version=version)
    wanted = list(dict.fromkeys(modules))
    gone = absent(root)
    missing = [m for m in wanted if m not in gone and _extracted(root, m) is None]
    if not missing:
        return root
    wheel = ensure_wheel(cache, download=download, timeout_s=timeout_s, version=version)
    lacking: list[str] = []
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
        for name in missing:
            member = module_member(name, members)
            if member is None:
                if name in OPTIONAL_MODULES:
                    lacking.append(name)
                    continue
                raise ModuleNotInWheel(f"module {name} is not in {wheel.name}")
            target = root / member
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.part")
            partial.write_bytes(archive.read(member))
            os.replace(partial, target)
    if lacking:
        root.mkdir(parents=True, exist_ok=True)
        partial = root / f".{ABSENT_FILE}.{os.getpid()}.part"
        partial.write_text("".join(f"{name}\n" for name in sorted({*gone, *lacking})))
        os.replace(partial, root / ABSENT_FILE)
    return root


def _extracted(root: Path, name: str) -> Path | None:
    base = root / name.replace(".", "/")
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


# ---- stubs ------------------------------------------------------------------------------


class _StubMeta(type):
    """Placeholder classes: any attribute is another placeholder, calls and indexing pass."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        sub = _stub_class(name, f"{cls.__module__}", f"{cls.__qualname__}.{name}")
        setattr(cls, name, sub)
        return sub

    def __getitem__(cls, _item: Any) -> Any:
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # Used bare as a decorator (`@torch.inference_mode`): keep the function.
        if len(args) == 1 and not kwargs and isinstance(args[0], (types.FunctionType, type)):
            return args[0]
        return super().__call__(*args, **kwargs)


class Stub(metaclass=_StubMeta):
    """An instance of a placeholder class: accepts anything, means nothing."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Stub()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Called as a decorator factory's result (`@torch.compile(...)`): keep the function.
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return Stub()

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __enter__(self) -> Stub:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def __bool__(self) -> bool:
        return False


def _stub_class(name: str, module: str, qualname: str | None = None) -> type:
    cls = _StubMeta(name, (Stub,), {"__module__": module, "__qualname__": qualname or name})
    return cls


class StubModule(types.ModuleType):
    """A module whose every attribute is a placeholder class, made on first use."""

    __stub__ = True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_class(name, self.__name__)
        setattr(self, name, value)
        return value


def _virtual_memory() -> Any:
    """`psutil.virtual_memory()`'s total and available, from /proc/meminfo."""
    fields: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                fields[key] = int(parts[0]) * 1024
    total = fields.get("MemTotal", 0)
    return types.SimpleNamespace(total=total, available=fields.get("MemAvailable", total))


def _parse_url(url: str) -> Any:
    """`urllib3.util.parse_url()`'s scheme, hostname and port, for zmq endpoints."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname
    if host and ":" in host:
        host = f"[{host}]"  # urllib3 keeps IPv6 brackets; vLLM strips them itself
    return types.SimpleNamespace(scheme=parts.scheme or None, hostname=host,
                                 host=host, port=parts.port)


def _shim(name: str) -> types.ModuleType | None:
    """A behaving stand-in for the few third-party calls on vLLM's socket path."""
    if name == "psutil":
        module = StubModule(name)
        module.virtual_memory = _virtual_memory  # type: ignore[attr-defined]
        return module
    if name == "urllib3.util":
        module = StubModule(name)
        module.parse_url = _parse_url  # type: ignore[attr-defined]
        return module
    return None


def _real_package_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class _StubLoader(importlib.abc.Loader):
    def __init__(self, shim: types.ModuleType | None = None) -> None:
        self.shim = shim

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = self.shim or StubModule(spec.name)
        module.__path__ = []  # a package, so any submodule can be stubbed too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


StandIns = Mapping[str, Mapping[str, Any]]


def _stand_in(name: str, attributes: Mapping[str, Any]) -> types.ModuleType:
    module = StubModule(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


class VllmFinder(importlib.abc.MetaPathFinder):
    """Serves `vllm.*` from extracted sources (names in `real`) or stubs, and stubs heavy deps.

    A module named in `stand_ins` is served as a placeholder module carrying
    the given attributes instead, whether it is a vLLM module or not (one
    already imported, such as a real numpy, is left alone).
    """

    def __init__(self, root: Path, real: Iterable[str], heavy: Iterable[str],
                 stand_ins: StandIns | None = None) -> None:
        self.root = root
        self.real = set(real)
        self.heavy = set(heavy)
        self.stand_ins = dict(stand_ins or {})
        self.stubbed: list[str] = []
        self.absent = absent(root)
        self.keep_real = {name for name in SHIMMED_PACKAGES
                          if name in self.heavy and _real_package_available(name)}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        attributes = self.stand_ins.get(fullname)
        if attributes is not None:
            self.stubbed.append(fullname)
            return importlib.machinery.ModuleSpec(
                fullname, _StubLoader(_stand_in(fullname, attributes)), is_package=True)
        if top == "vllm":
            if fullname in self.real and fullname not in self.absent:
                file = _extracted(self.root, fullname)
                if file is None:
                    raise ImportError(f"{fullname} was not extracted from the vLLM wheel",
                                      name=fullname)
                package = [str(file.parent)] if file.name == "__init__.py" else None
                return importlib.util.spec_from_file_location(
                    fullname, file, submodule_search_locations=package)
        elif top not in self.heavy or top in self.keep_real:
            return None
        self.stubbed.append(fullname)
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(_shim(fullname)),
                                              is_package=True)


def install(real: Sequence[str] = COORDINATOR_REAL, *,
            cache: str | os.PathLike[str] | None = None, download: bool = True,
            heavy: Iterable[str] = HEAVY_PACKAGES,
            stand_ins: StandIns | None = None, version: str = VLLM_VERSION) -> VllmFinder:
    """Make `real` importable from the wheel in this process, for good (e.g. a peer process).

    Raises `WheelUnavailable` if the wheel can be neither found nor fetched.
    Already imported heavy packages (numpy brought in by matplotlib, say) are
    left as they are; stubs replace only what is not loaded.
    """
    root = extract([name for name in real if name not in (stand_ins or {})], cache,
                   download=download, version=version)
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm."):
            del sys.modules[name]
    finder = VllmFinder(root, real, heavy, stand_ins)
    sys.meta_path.insert(0, finder)
    importlib.invalidate_caches()
    return finder


@contextlib.contextmanager
def vllm_modules(*wanted: str, real: Sequence[str] = COORDINATOR_REAL,
                 cache: str | os.PathLike[str] | None = None, download: bool = True,
                 heavy: Iterable[str] = HEAVY_PACKAGES, stand_ins: StandIns | None = None,
                 version: str = VLLM_VERSION) -> Iterator[dict[str, types.ModuleType]]:
    """Import `wanted` (dotted names, each also run from source) with everything else stubbed.

        with vllm_modules("vllm.v1.engine.coordinator") as mods:
            proc = mods["vllm.v1.engine.coordinator"].DPCoordinatorProc

        # Only vLLM's KV event module runs; its config class is the caller's.
        with vllm_modules("vllm.distributed.kv_events", real=(),
                          stand_ins={"vllm.config.kv_events": {"KVEventsConfig": Config}}):
            ...

    On exit the import system is as it was: the finder is removed, vLLM's
    modules and the stubs are dropped from `sys.modules` and whatever they
    shadowed is put back; objects the caller kept stay usable.
    """
    before = {name: module for name, module in sys.modules.items()
              if name == "vllm" or name.startswith("vllm.")}
    finder = install(tuple(dict.fromkeys((*real, *wanted))), cache=cache,
                     download=download, heavy=heavy, stand_ins=stand_ins, version=version)
    try:
        yield {name: importlib.import_module(name) for name in wanted}
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        for name in list(sys.modules):
            if name == "vllm" or name.startswith("vllm.") or name in finder.stubbed:
                del sys.modules[name]
        sys.modules.update(before)


def load(*wanted: str, real: Sequence[str] = (), stand_ins: StandIns | None = None,
         cache: str | os.PathLike[str] | None = None, download: bool = True,
         version: str = VLLM_VERSION) -> dict[str, types.ModuleType]:
    """`wanted` imported as `vllm_modules` does, with the import system restored at once.

    Only `wanted` (and `real`) run from the wheel. The returned modules keep
    working: they hold their own references to the stand-ins and stubs.
    Raises `WheelUnavailable` if the wheel can be neither found nor fetched.
    """
    with vllm_modules(*wanted, real=real, stand_ins=stand_ins, cache=cache,
                      download=download, version=version) as modules:
        return modules


# ---- command line -----------------------------------------------------------------------


def _check(cache: str | None, download: bool, version: str) -> int:
    with vllm_modules("vllm.v1.engine.coordinator", cache=cache, download=download,
                      version=version) as mods:
        proc = mods["vllm.v1.engine.coordinator"].DPCoordinatorProc
        print(f"vLLM {version}: {proc.__module__}.{proc.__qualname__} imported from "
              f"{mods['vllm.v1.engine.coordinator'].__file__}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.vllm_wheel",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("command", choices=("fetch", "check", "path"))
    parser.add_argument("--version", default=None, action="append", dest="versions",
                        help=f"a pinned vLLM release ({', '.join(VERSIONS)}; default "
                        f"{VLLM_VERSION}); repeat for several, or 'all'")
    parser.add_argument("--cache", default=None, help=f"cache directory of one version "
                        f"(default ${CACHE_ENV} for {VLLM_VERSION}, else "
                        f"${CACHE_ROOT_ENV}/vllm-<version>, else .cache/vllm-<version>)")
    parser.add_argument("--wheel", default=None, metavar="FILE",
                        help="fill the cache from this wheel file instead of downloading")
    parser.add_argument("--offline", action="store_true", help="never download")
    args = parser.parse_args(argv)
    chosen = args.versions or [VLLM_VERSION]
    versions = list(VERSIONS) if "all" in chosen else list(dict.fromkeys(chosen))
    try:
        for version in versions:
            check_version(version)
        if (args.wheel or args.cache) and len(versions) != 1:
            raise WheelUnavailable("--wheel and --cache take exactly one --version")
        for version in versions:
            if args.wheel:
                print(_adopt(Path(args.wheel), cache_dir(args.cache, version=version),
                             version))
            elif args.command == "fetch":
                print(ensure_wheel(args.cache, download=not args.offline, version=version))
            elif args.command == "path":
                print(cache_dir(args.cache, version=version))
            else:
                _check(args.cache, not args.offline, version)
        return 0
    except WheelUnavailable as exc:
        print(f"vllm wheel unavailable: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "COORDINATOR_REAL", "HEAVY_PACKAGES", "KV_EVENTS_REAL", "OPTIONAL_MODULES",
    "PINNED_WHEELS", "VERSIONS", "VLLM_VERSION", "WHEEL_NAME", "WHEEL_SHA256",
    "ModuleNotInWheel", "Stub", "StubModule", "VllmFinder", "WheelUnavailable", "absent",
    "cache_dir", "check_version", "ensure_wheel", "extract", "install", "load", "source_root",
    "vllm_modules", "wheel_name",
]
