"""vLLM 0.33.0's own Python modules, taken unmodified from its pinned wheel.

    python -m tools.vllm_wheel fetch                 # download (or reuse) and verify the wheel
    python -m tools.vllm_wheel fetch --wheel FILE    # fill the cache from a wheel already on disk
    python -m tools.vllm_wheel check                 # import vLLM's coordinator with stubs; exit 0

Tests and benchmarks that must run vLLM's code (its coordinator loop, its
client's socket handling, its KV event structs) use this module; vllm is never
a dependency and none of its code is committed. The wheel (336 MB) is fetched
once with `pip download --no-deps vllm==0.33.0` into a git-ignored cache
(`.cache/vllm-0.33.0/` at the repository root, or `$DP_VLLM_CACHE`), checked
against a pinned sha256, and only the `.py` files asked for are extracted.
With the cache filled nothing touches the network.

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
WHEEL_NAME = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
# Only .py files are extracted, so the x86_64 wheel serves every machine; asking
# pip for this platform keeps the sha256 pin valid on any architecture.
WHEEL_PLATFORM = "manylinux_2_28_x86_64"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = REPO_ROOT / ".cache" / f"vllm-{VLLM_VERSION}"
CACHE_ENV = "DP_VLLM_CACHE"
DOWNLOAD_TIMEOUT_S = 1800.0

# vLLM modules that run from the wheel's source whenever vLLM's coordinator
# plane is imported: the wire structs and their decoder, the socket factory,
# logging and environment switches. Everything else under vllm.* is stubbed.
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


# ---- the wheel --------------------------------------------------------------------------


def cache_dir(path: str | os.PathLike[str] | None = None) -> Path:
    if path is not None:
        return Path(path)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else DEFAULT_CACHE


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{WHEEL_SHA256} {st.st_size} {st.st_mtime_ns}\n"


def _verified(wheel: Path) -> bool:
    """True if `wheel` matches the pinned sha256 (hashed once, then remembered)."""
    stamp_file = wheel.with_name(wheel.name + ".verified")
    if not wheel.is_file():
        return False
    with contextlib.suppress(OSError):
        if stamp_file.read_text() == _stamp(wheel):
            return True
    if _sha256(wheel) != WHEEL_SHA256:
        return False
    stamp_file.write_text(_stamp(wheel))
    return True


def _adopt(source: Path, cache: Path) -> Path:
    """Check `source` against the pin and place it in the cache (atomically)."""
    got = _sha256(source)
    if got != WHEEL_SHA256:
        raise WheelUnavailable(
            f"{source} is not the pinned vllm {VLLM_VERSION} wheel: sha256 {got}, "
            f"expected {WHEEL_SHA256}")
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / WHEEL_NAME
    partial = cache / f".{WHEEL_NAME}.{os.getpid()}.part"
    try:
        os.link(source, partial)
    except OSError:
        shutil.copyfile(source, partial)
    os.replace(partial, target)
    (cache / (WHEEL_NAME + ".verified")).write_text(_stamp(target))
    return target


def _download(cache: Path, timeout_s: float) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="download-", dir=cache) as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--platform", WHEEL_PLATFORM, "--dest", tmp, "--progress-bar", "off",
            f"vllm=={VLLM_VERSION}",
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True,
                                    timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise WheelUnavailable(
                f"downloading vllm=={VLLM_VERSION} took longer than {timeout_s:.0f} s; "
                f"{_offline_hint(cache)}") from None
        except OSError as exc:
            raise WheelUnavailable(f"could not run pip ({exc}); {_offline_hint(cache)}"
                                   ) from None
        if result.returncode != 0:
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-6:])
            raise WheelUnavailable(
                f"`pip download --no-deps vllm=={VLLM_VERSION}` failed (exit "
                f"{result.returncode}); no network or no index? {_offline_hint(cache)}\n"
                f"pip said:\n{tail}")
        got = Path(tmp) / WHEEL_NAME
        if not got.is_file():
            names = ", ".join(sorted(os.listdir(tmp))) or "nothing"
            raise WheelUnavailable(f"pip downloaded {names}, not {WHEEL_NAME}")
        return _adopt(got, cache)


def _offline_hint(cache: Path) -> str:
    return (f"to work offline, put {WHEEL_NAME} (sha256 {WHEEL_SHA256}) in {cache} or run "
            f"`python -m tools.vllm_wheel fetch --wheel FILE`")


def ensure_wheel(cache: str | os.PathLike[str] | None = None, *, download: bool = True,
                 timeout_s: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """The verified wheel in the cache, downloading it first if needed."""
    where = cache_dir(cache)
    wheel = where / WHEEL_NAME
    if wheel.is_file():
        if _verified(wheel):
            return wheel
        bad = wheel.with_name(wheel.name + ".bad")
        os.replace(wheel, bad)
        if not download:
            raise WheelUnavailable(f"{wheel} does not match the pinned sha256 (moved to {bad})")
    if not download:
        raise WheelUnavailable(f"no vllm {VLLM_VERSION} wheel in {where}; "
                               f"{_offline_hint(where)}")
    return _download(where, timeout_s)


def source_root(cache: str | os.PathLike[str] | None = None) -> Path:
    """Where extracted vLLM sources live: `<cache>/src` (holds the `vllm` package)."""
    return cache_dir(cache) / "src"


def module_member(name: str, members: set[str]) -> str | None:
    """The wheel member that holds module `name` (`a/b.py` or `a/b/__init__.py`)."""
    base = name.replace(".", "/")
    for candidate in (f"{base}/__init__.py", f"{base}.py"):
        if candidate in members:
            return candidate
    return None


def extract(modules: Iterable[str], cache: str | os.PathLike[str] | None = None, *,
            download: bool = True, timeout_s: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Extract the source files of `modules` (dotted names) and return the source root.

    Files already extracted are kept; the wheel is opened only when one is
    missing, so a filled cache needs neither the network nor the wheel's
    336 MB read.
    """
    root = source_root(cache)
    wanted = list(dict.fromkeys(modules))
    missing = [m for m in wanted if _extracted(root, m) is None]
    if not missing:
        return root
    wheel = ensure_wheel(cache, download=download, timeout_s=timeout_s)
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
        for name in missing:
            member = module_member(name, members)
            if member is None:
                raise WheelUnavailable(f"module {name} is not in {WHEEL_NAME}")
            target = root / member
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.part")
            partial.write_bytes(archive.read(member))
            os.replace(partial, target)
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
            if fullname in self.real:
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
            stand_ins: StandIns | None = None) -> VllmFinder:
    """Make `real` importable from the wheel in this process, for good (e.g. a peer process).

    Raises `WheelUnavailable` if the wheel can be neither found nor fetched.
    Already imported heavy packages (numpy brought in by matplotlib, say) are
    left as they are; stubs replace only what is not loaded.
    """
    root = extract([name for name in real if name not in (stand_ins or {})], cache,
                   download=download)
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
                 heavy: Iterable[str] = HEAVY_PACKAGES,
                 stand_ins: StandIns | None = None) -> Iterator[dict[str, types.ModuleType]]:
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
                     download=download, heavy=heavy, stand_ins=stand_ins)
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
         cache: str | os.PathLike[str] | None = None,
         download: bool = True) -> dict[str, types.ModuleType]:
    """`wanted` imported as `vllm_modules` does, with the import system restored at once.

    Only `wanted` (and `real`) run from the wheel. The returned modules keep
    working: they hold their own references to the stand-ins and stubs.
    Raises `WheelUnavailable` if the wheel can be neither found nor fetched.
    """
    with vllm_modules(*wanted, real=real, stand_ins=stand_ins, cache=cache,
                      download=download) as modules:
        return modules


# ---- command line -----------------------------------------------------------------------


def _check(cache: str | None, download: bool) -> int:
    with vllm_modules("vllm.v1.engine.coordinator", cache=cache, download=download) as mods:
        proc = mods["vllm.v1.engine.coordinator"].DPCoordinatorProc
        print(f"vLLM {VLLM_VERSION}: {proc.__module__}.{proc.__qualname__} imported from "
              f"{mods['vllm.v1.engine.coordinator'].__file__}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.vllm_wheel",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("command", choices=("fetch", "check", "path"))
    parser.add_argument("--cache", default=None, help=f"cache directory (default ${CACHE_ENV} "
                        f"or {DEFAULT_CACHE})")
    parser.add_argument("--wheel", default=None, metavar="FILE",
                        help="fill the cache from this wheel file instead of downloading")
    parser.add_argument("--offline", action="store_true", help="never download")
    args = parser.parse_args(argv)
    try:
        if args.wheel:
            print(_adopt(Path(args.wheel), cache_dir(args.cache)))
            return 0
        if args.command == "fetch":
            print(ensure_wheel(args.cache, download=not args.offline))
            return 0
        if args.command == "path":
            print(cache_dir(args.cache))
            return 0
        return _check(args.cache, not args.offline)
    except WheelUnavailable as exc:
        print(f"vllm wheel unavailable: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "COORDINATOR_REAL", "HEAVY_PACKAGES", "KV_EVENTS_REAL", "VLLM_VERSION", "WHEEL_NAME",
    "WHEEL_SHA256", "Stub", "StubModule", "VllmFinder", "WheelUnavailable", "cache_dir",
    "ensure_wheel", "extract", "install", "load", "source_root", "vllm_modules",
]
