"""tools.vllm_wheel: the pinned vLLM wheel, fetched, verified, and imported with stubs.

The failure paths run everywhere (pip is pointed at no index, so nothing is
downloaded). The paths that need the wheel fetch it once into the shared
cache and skip, saying why, when it cannot be had (no network).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from bench import wire
from tools import vllm_wheel

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip finds nothing anywhere: no config files, no index, no local wheels."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)


@pytest.fixture(scope="module")
def shared_wheel() -> Path:
    """The verified wheel in the shared cache (downloaded on first use), or a skip."""
    try:
        return vllm_wheel.ensure_wheel(timeout_s=600)
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM {vllm_wheel.VLLM_VERSION} wheel unavailable: {exc}")


@pytest.fixture
def private_cache(tmp_path: Path, shared_wheel: Path) -> Iterator[Path]:
    """A cache of its own holding the wheel (hard-linked when possible)."""
    cache = tmp_path / "cache"
    vllm_wheel._adopt(shared_wheel, cache)
    yield cache


def test_failed_download_says_what_failed_and_how_to_work_offline(
        tmp_path: Path, no_index: None) -> None:
    with pytest.raises(vllm_wheel.WheelUnavailable) as caught:
        vllm_wheel.ensure_wheel(tmp_path, timeout_s=120)
    text = str(caught.value)
    assert f"pip download --no-deps vllm=={vllm_wheel.VLLM_VERSION}" in text
    assert "No matching distribution" in text  # pip's own words are passed on
    assert vllm_wheel.WHEEL_SHA256 in text and str(tmp_path) in text
    assert not list(tmp_path.rglob("*.whl")), "a failed download left a wheel behind"


def test_cli_exits_non_zero_with_the_reason_when_the_wheel_cannot_be_had(
        tmp_path: Path, no_index: None) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tools.vllm_wheel", "fetch", "--cache", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert result.stderr.startswith("vllm wheel unavailable: `pip download")


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    impostor = tmp_path / vllm_wheel.WHEEL_NAME
    with zipfile.ZipFile(impostor, "w") as archive:
        archive.writestr("vllm/v1/engine/coordinator.py", "raise SystemExit('not vLLM')\n")
    cache = tmp_path / "cache"
    result = subprocess.run(
        [sys.executable, "-m", "tools.vllm_wheel", "fetch", "--cache", str(cache),
         "--wheel", str(impostor)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "is not the pinned vllm 0.33.0 wheel" in result.stderr
    assert not cache.exists() or not list(cache.iterdir())


def test_a_corrupted_cached_wheel_is_moved_aside_not_used(tmp_path: Path) -> None:
    cached = tmp_path / vllm_wheel.WHEEL_NAME
    cached.write_bytes(b"truncated download")
    with pytest.raises(vllm_wheel.WheelUnavailable, match="does not match the pinned sha256"):
        vllm_wheel.ensure_wheel(tmp_path, download=False)
    assert not cached.exists()
    assert (tmp_path / (vllm_wheel.WHEEL_NAME + ".bad")).read_bytes() == b"truncated download"
    with pytest.raises(vllm_wheel.WheelUnavailable, match="to work offline"):
        vllm_wheel.extract(["vllm.v1.engine.coordinator"], tmp_path, download=False)


def test_stub_modules_hand_out_classes_that_survive_import_time_use() -> None:
    torch = vllm_wheel.StubModule("torch")
    tensor = torch.Tensor
    assert isinstance(tensor, type) and torch.Tensor is tensor
    assert tensor[int] is tensor and isinstance(tensor | None, object)
    assert not isinstance(3, tensor)

    def step() -> int:
        return 7

    assert torch.inference_mode(step) is step  # bare decorator
    assert torch.compile(dynamic=True)(step) is step  # decorator factory
    assert torch.autograd.profiler.record_function.__qualname__ == (
        "autograd.profiler.record_function")
    with torch.cuda.device(0):
        pass
    assert not torch.cuda.is_available()


def test_a_filled_cache_serves_unmodified_modules_offline(private_cache: Path,
                                                          no_index: None) -> None:
    before = set(sys.modules)
    with vllm_wheel.vllm_modules("vllm.v1.engine.coordinator", cache=private_cache) as mods:
        module = mods["vllm.v1.engine.coordinator"]
        run = module.DPCoordinatorProc.run_coordinator
        assert run.__code__.co_varnames[:4] == ("engine_count", "front_publish_address",
                                                "back_output_address", "back_publish_address")
        assert isinstance(sys.modules["torch"], vllm_wheel.StubModule)
        assert isinstance(sys.modules["vllm.config"], vllm_wheel.StubModule)
    # Only what was asked for is extracted, byte for byte as in the wheel.
    src = vllm_wheel.source_root(private_cache)
    extracted = sorted(str(p.relative_to(src)) for p in src.rglob("*.py"))
    assert len(extracted) == len(vllm_wheel.COORDINATOR_REAL)
    with zipfile.ZipFile(private_cache / vllm_wheel.WHEEL_NAME) as archive:
        for name in extracted:
            assert (src / name).read_bytes() == archive.read(name), name
    # The import system is as it was.
    assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
    assert not isinstance(sys.modules.get("torch"), vllm_wheel.StubModule)
    assert "torch" in before or "torch" not in sys.modules


def test_vllms_own_decoder_reads_what_the_bench_engines_send(shared_wheel: Path) -> None:
    names = ("vllm.v1.engine", "vllm.v1.serial_utils")
    with vllm_wheel.vllm_modules(*names) as mods:
        engine, serial = mods["vllm.v1.engine"], mods["vllm.v1.serial_utils"]
        decoder = serial.MsgpackDecoder(engine.EngineCoreOutputs)
        stats = decoder.decode(bytes(wire.StatsTemplate(5).set_counter(42)))
        assert type(stats.scheduler_stats).__module__ == "vllm.v1.metrics.stats"
        assert (stats.engine_index, stats.scheduler_stats.num_waiting_reqs,
                stats.scheduler_stats.step_counter) == (5, 42, 42)
        assert decoder.decode(wire.start_wave_report(3, 9)).start_wave == 9
        assert engine.EngineCoreRequestType.START_DP_WAVE.value == b"\x02"


def test_kv_event_structs_round_trip_with_their_hash_alias_from_source(
        shared_wheel: Path) -> None:
    with vllm_wheel.vllm_modules("vllm.distributed.kv_events",
                                 real=vllm_wheel.KV_EVENTS_REAL) as mods:
        kv = mods["vllm.distributed.kv_events"]
        batch = kv.KVEventBatch(ts=1.0, events=[kv.BlockStored(
            block_hashes=[b"\x01" * 32, 7], parent_block_hash=None, token_ids=[1, 2, 3],
            block_size=16, lora_id=None, medium="GPU", lora_name=None)])
        back = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(msgspec.msgpack.encode(batch))
        assert back == batch


def test_vllms_socket_factory_works_through_the_stand_ins(shared_wheel: Path,
                                                          tmp_path: Path) -> None:
    """`make_zmq_socket` acts on psutil's and urllib3's answers; the stand-ins must agree."""
    import zmq

    with vllm_wheel.vllm_modules("vllm.utils.network_utils") as mods:
        net = mods["vllm.utils.network_utils"]
        assert net.split_zmq_path("tcp://127.0.0.1:5555") == ("tcp", "127.0.0.1", "5555")
        assert net.split_zmq_path("tcp://[::1]:5555") == ("tcp", "::1", "5555")
        assert net.split_zmq_path(f"ipc://{tmp_path}/x") == ("ipc", "", "")
        with pytest.raises(ValueError, match="Invalid zmq path"):
            net.split_zmq_path("tcp://127.0.0.1")
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            pull = net.make_zmq_socket(ctx, f"ipc://{tmp_path}/pull", zmq.PULL, bind=True)
            xpub = net.make_zmq_socket(ctx, f"ipc://{tmp_path}/xpub", zmq.XPUB, bind=True)
            assert pull.getsockopt(zmq.RCVHWM) == 0
            assert pull.getsockopt(zmq.LAST_ENDPOINT).decode() == f"ipc://{tmp_path}/pull"
            push = ctx.socket(zmq.PUSH)
            push.connect(f"ipc://{tmp_path}/pull")
            push.send(b"through vLLM's socket")
            assert pull.poll(5000) and pull.recv() == b"through vLLM's socket"
            for sock in (pull, xpub, push):
                sock.close(0)
        finally:
            ctx.term()


def test_a_callers_stand_ins_replace_vllms_modules_and_are_gone_afterwards(
        shared_wheel: Path) -> None:
    class Config:
        def __init__(self, **fields: object) -> None:
            self.fields = fields

    before = set(sys.modules)
    modules = vllm_wheel.load(
        "vllm.distributed.kv_events",
        # vllm.logger would run from source by default; the stand-in wins.
        real=("vllm.logger",),
        stand_ins={"vllm.config.kv_events": {"KVEventsConfig": Config},
                   "vllm.logger": {"init_logger": lambda name: f"logger {name}"},
                   "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int}})
    kv = modules["vllm.distributed.kv_events"]
    assert kv.KVEventsConfig is Config
    assert kv.logger == "logger vllm.distributed.kv_events"
    # Names a stand-in does not give are placeholders, as in any stub module.
    assert issubclass(kv.get_ip, vllm_wheel.Stub)
    assert kv.__file__.startswith(str(vllm_wheel.source_root()))
    assert not [m for m in set(sys.modules) - before if m.startswith("vllm")]
    # The module keeps working after the import system was restored.
    batch = kv.KVEventBatch(ts=1.0, events=[kv.AllBlocksCleared()], data_parallel_rank=2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch)) == [
        1.0, [{"type": "AllBlocksCleared"}], 2]


def test_every_supported_release_is_pinned_with_its_own_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert vllm_wheel.VERSIONS == ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
    monkeypatch.delenv(vllm_wheel.CACHE_ENV, raising=False)
    monkeypatch.setenv(vllm_wheel.CACHE_ROOT_ENV, str(tmp_path))
    dirs = {vllm_wheel.cache_dir(version=v) for v in vllm_wheel.VERSIONS}
    assert dirs == {tmp_path / f"vllm-{v}" for v in vllm_wheel.VERSIONS}
    assert vllm_wheel.wheel_name("0.29.0") == "vllm-0.29.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with pytest.raises(vllm_wheel.WheelUnavailable, match=r"0\.28\.0 is not pinned here"):
        vllm_wheel.cache_dir(version="0.28.0")


def test_an_old_release_lacking_a_helper_module_gets_it_stubbed() -> None:
    """0.29-0.31 have no vllm/logging_utils/uvicorn_logging.py: it is a stub for them."""
    try:
        vllm_wheel.ensure_wheel(version="0.29.0", timeout_s=600)
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM 0.29.0 wheel unavailable: {exc}")
    with vllm_wheel.vllm_modules("vllm.v1.engine.coordinator", version="0.29.0") as mods:
        assert mods["vllm.v1.engine.coordinator"].DPCoordinatorProc
        import importlib

        helper = importlib.import_module("vllm.logging_utils.uvicorn_logging")
        assert isinstance(helper, vllm_wheel.StubModule)
    root = vllm_wheel.source_root(version="0.29.0")
    assert "vllm.logging_utils.uvicorn_logging" in vllm_wheel.absent(root)


def test_a_module_a_release_lacks_fails_loudly_unless_optional() -> None:
    try:
        vllm_wheel.ensure_wheel(version="0.29.0", timeout_s=600)
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM 0.29.0 wheel unavailable: {exc}")
    with pytest.raises(vllm_wheel.ModuleNotInWheel, match=r"vllm\.v1\.no_such_module is not in"):
        vllm_wheel.extract(["vllm.v1.no_such_module"], version="0.29.0")
    assert not issubclass(vllm_wheel.ModuleNotInWheel, vllm_wheel.WheelUnavailable)
