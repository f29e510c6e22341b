"""The deployment examples in deploy/ are well-formed and their commands really run.

* The systemd unit: its `ExecStart` parses, runs `--help`, and (its addresses
  moved to loopback and free ports, its files to a temp dir) serves and stops
  cleanly on the unit's `KillSignal`; `systemd-analyze verify` accepts it where
  installed.
* The Kubernetes example: the YAML parses; ports, probes and the engines'
  handshake port agree with the coordinator's flags; and the coordinator
  container's own arguments, run for real, give the probes the meaning the
  file's comments claim: /healthz 200 at once, /readyz 503 while ranks load and
  200 once a frontend registered and every rank joined.
* The container file: what it copies exists, its RUN lines name commands that
  exist, and its ENTRYPOINT and CMD run.

The docs reference every example.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.cli import build_parser
from coordinator.frontend import FrontendClient
from coordinator.launch import stop_process
from coordinator.protocol.addresses import SOCKET_KEYS
from coordinator.sim import SimConfig, SimEngineGroup

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "dp-coordinator.service"
KUBERNETES = DEPLOY / "kubernetes" / "dp-coordinator.yaml"
CONTAINERFILE = DEPLOY / "container" / "Containerfile"
BIN = Path(sys.executable).parent
STEP = 5.0


def console_script() -> str:
    """The `dp-coordinator` command of this environment (pyproject's [project.scripts])."""
    scripts = metadata.distribution("dp-coordinator").entry_points.select(
        group="console_scripts")
    assert {(e.name, e.value) for e in scripts} == {("dp-coordinator", "coordinator.cli:main")}
    path = shutil.which("dp-coordinator", path=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    assert path is not None, "dp-coordinator is not installed in this environment"
    return path


def serve_args(argv: Sequence[str]) -> Any:
    """`dp-coordinator serve` flags parsed by the real parser (SystemExit on a bad one)."""
    args = build_parser().parse_args(list(argv))
    assert args.command == "serve"
    return args


def free_port_block(count: int) -> int:
    """The first of `count` consecutive loopback ports that were all free a moment ago."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError(f"no {count} consecutive free ports")


def replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """Set `flag` (given as `--flag V` or `--flag=V`) to `value`; it must be there."""
    out, found, skip = [], False, False
    for index, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == flag:
            out += [flag, value]
            found, skip = True, index + 1 < len(argv)
        elif arg.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(arg)
    assert found, f"{flag} is not in {argv}"
    return out


def flag_value(argv: Sequence[str], flag: str) -> str:
    for index, arg in enumerate(argv):
        if arg == flag:
            return argv[index + 1]
        if arg.startswith(flag + "="):
            return arg.partition("=")[2]
    raise AssertionError(f"{flag} is not in {argv}")


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=STEP) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except OSError:
        return 0


class Served:
    """`python -m coordinator <argv>` running, with its address file read."""

    def __init__(self, argv: Sequence[str], addr_file: Path,
                 command: Sequence[str] = (sys.executable, "-m", "coordinator")) -> None:
        self.log = addr_file.with_suffix(".log")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen([*command, *argv],
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + 20.0
        while not addr_file.exists():
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "no address file"
            time.sleep(0.02)
        self.addresses: dict[str, str] = json.loads(addr_file.read_text())

    def stop(self) -> int | None:
        """One SIGTERM (as systemd's KillSignal and the kubelet send), SIGKILL after STEP."""
        return stop_process(self.process, timeout=STEP)


@pytest.fixture
def served() -> Iterator[list[Served]]:
    running: list[Served] = []
    yield running
    for item in running:
        item.stop()


# ---- systemd ------------------------------------------------------------------------------------


def read_unit(path: Path) -> dict[str, dict[str, str]]:
    """systemd's unit syntax: [Section], Key=Value, `\\` continues a line, # comments."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep, f"not Key=Value: {line!r}"
        current[key.strip()] = value.strip()
    assert not pending, "a continuation at the end of the file"
    return sections


def test_the_unit_runs_the_standalone_coordinator() -> None:
    unit = read_unit(UNIT)
    assert set(unit) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert os.path.basename(argv[0]) == "dp-coordinator"
    args = serve_args(argv[1:])
    assert args.state_file and args.port_base and args.host and args.insecure
    assert args.state_file.startswith(f"/var/lib/{service['StateDirectory']}/")
    assert args.addr_file.startswith(f"/run/{service['RuntimeDirectory']}/")
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"
    helped = subprocess.run([console_script(), *argv[1:], "--help"], capture_output=True,
                            text=True, timeout=30)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: dp-coordinator serve")


PRIVATE_TMP = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /tmp && exec "$@"', "sh"]
"""A command prefix giving what follows a /tmp of its own, as PrivateTmp=yes does."""


def private_tmp_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        tried = subprocess.run([*PRIVATE_TMP, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return tried.returncode == 0


needs_private_tmp = pytest.mark.skipif(
    not private_tmp_works(), reason="cannot make a private /tmp here (unshare --mount and "
    "mount need root or user namespaces)")


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory outside /tmp, which the private /tmp would hide from the service."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(REPO)
    path = Path(tempfile.mkdtemp(prefix="dpc-unit-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def unit_command(scratch: Path, *, drop: Sequence[str] = ()) -> list[str]:
    """The unit's ExecStart arguments as they are, but for what cannot be used here:
    loopback for the group's addresses, free ports, and the unit's own directories
    (StateDirectory, RuntimeDirectory) made under `scratch`, as systemd makes them."""
    service = read_unit(UNIT)["Service"]
    argv = shlex.split(service["ExecStart"])[1:]
    for flag in ("--host", "--metrics-host", "--master-ip"):
        argv = replace_flag(argv, flag, "127.0.0.1")
    argv = replace_flag(argv, "--port-base", str(free_port_block(6)))
    for flag in ("--metrics-port", "--master-port"):
        argv = replace_flag(argv, flag, str(free_port_block(1)))
    for key, under in (("StateDirectory", "/var/lib"), ("RuntimeDirectory", "/run")):
        systemd_path = f"{under}/{service[key]}"
        (scratch / key).mkdir(mode=0o755)
        argv = [arg.replace(systemd_path, str(scratch / key)) for arg in argv]
    for flag in drop:
        index = argv.index(flag)
        del argv[index:index + 2]
    return argv


def test_the_units_command_serves_and_stops_on_sigterm(
    scratch: Path, served: list[Served]
) -> None:
    argv = unit_command(scratch)
    addr_file = Path(flag_value(argv, "--addr-file"))
    coordinator = Served(argv, addr_file, command=[console_script()])
    served.append(coordinator)
    base = int(flag_value(argv, "--port-base"))
    # The six sockets on --port-base, and the operators' owner-only ipc socket in the
    # RuntimeDirectory (--ipc-dir).
    admin = coordinator.addresses.pop("admin")
    assert admin == f"ipc://{scratch}/RuntimeDirectory/admin.d/admin"
    assert coordinator.addresses == {key: f"tcp://127.0.0.1:{base + index}"
                                     for index, key in enumerate(SOCKET_KEYS)}
    metrics = f"http://127.0.0.1:{flag_value(argv, '--metrics-port')}"
    deadline = time.monotonic() + STEP
    while http_status(metrics + "/healthz") != 200:
        assert time.monotonic() < deadline, coordinator.log.read_text()
        time.sleep(0.05)
    assert coordinator.stop() == 0, coordinator.log.read_text()
    assert Path(flag_value(argv, "--state-file")).exists()  # kept for the restart
    assert not addr_file.exists()
    assert not (scratch / "RuntimeDirectory" / "admin.d").exists()


def wait_for_status(url: str, status: int, log: Path) -> None:
    deadline = time.monotonic() + 4 * STEP
    while http_status(url) != status:
        assert time.monotonic() < deadline, f"{url} never {status}:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([console_script(), *args], capture_output=True, text=True,
                          timeout=4 * STEP)


@needs_private_tmp
def test_the_unit_under_a_private_tmp_gets_ready_and_takes_the_documented_commands(
    scratch: Path, served: list[Served]
) -> None:
    """As systemd runs it (a /tmp of its own), the group joins, /readyz turns 200, and
    the commands the unit's comments show reach the admin socket from outside."""
    argv = unit_command(scratch)
    addr_file = Path(flag_value(argv, "--addr-file"))
    coordinator = Served(argv, addr_file, command=[*PRIVATE_TMP, console_script()])
    served.append(coordinator)
    metrics = f"http://127.0.0.1:{flag_value(argv, '--metrics-port')}"
    wait_for_status(metrics + "/healthz", 200, coordinator.log)
    assert http_status(metrics + "/readyz") == 503
    documented = [line.strip("# ").rstrip("\\ ") for line in UNIT.read_text().splitlines()
                  if "sudo -u" in line]
    assert any(line.endswith(" cordon 3") for line in documented), documented

    async def the_group_joins_and_a_rank_is_cordoned() -> None:
        group = SimEngineGroup(coordinator.addresses["handshake"], serve_args(argv).engines,
                               config=SimConfig(
            heartbeat_interval_s=0.5, handshake_timeout_s=STEP, ready_timeout_s=2 * STEP,
            accept_timeout_s=STEP))
        try:
            await asyncio.wait_for(group.start(), 3 * STEP)
            await asyncio.to_thread(wait_for_status, metrics + "/readyz", 200, coordinator.log)
            # The documented command, as the service user (this test's user is the one
            # the service runs as here).
            cordoned = await asyncio.to_thread(run_cli, "cordon", "3", "--addr-file",
                                               str(addr_file))
            assert cordoned.returncode == 0, cordoned.stderr
            assert cordoned.stdout.strip() == "dp_rank=3 is now cordoned"
            drained = await asyncio.to_thread(run_cli, "drain", "2", "--wait", "30",
                                              "--addr-file", str(addr_file))
            assert drained.returncode == 0, drained.stderr
            assert "dp_rank=2 drained" in drained.stdout
            assert http_status(metrics + "/readyz") == 200  # maintenance: still serving
        finally:
            await asyncio.wait_for(group.stop(), 2 * STEP)

    asyncio.run(the_group_joins_and_a_rank_is_cordoned())
    assert coordinator.stop() == 0, coordinator.log.read_text()


@needs_private_tmp
def test_an_admin_socket_hidden_in_a_private_tmp_is_named_as_missing(
    scratch: Path, served: list[Served]
) -> None:
    """Without --ipc-dir the socket is made in the service's own /tmp: the command says
    the file does not exist, and what to do, at once (not after its timeout)."""
    argv = unit_command(scratch, drop=["--ipc-dir"])
    addr_file = Path(flag_value(argv, "--addr-file"))
    coordinator = Served(argv, addr_file, command=[*PRIVATE_TMP, console_script()])
    served.append(coordinator)
    started = time.monotonic()
    refused = run_cli("cordon", "3", "--addr-file", str(addr_file), "--timeout", "60")
    assert time.monotonic() - started < 30
    assert refused.returncode == 2
    assert "does not exist here" in refused.stderr
    assert "--ipc-dir" in refused.stderr and "sudo -u dp-coordinator" in refused.stderr
    assert coordinator.stop() == 0, coordinator.log.read_text()


def test_a_stale_address_file_is_named_as_such(scratch: Path, served: list[Served]) -> None:
    """After a SIGKILL the address file and the socket file stay; nothing listens."""
    argv = unit_command(scratch)
    addr_file = Path(flag_value(argv, "--addr-file"))
    coordinator = Served(argv, addr_file, command=[console_script()])
    coordinator.process.kill()
    coordinator.process.wait(timeout=4 * STEP)
    refused = run_cli("cordon", "3", "--addr-file", str(addr_file), "--timeout", "60")
    assert refused.returncode == 2
    assert "nothing listens on the admin socket" in refused.stderr, refused.stderr


def systemd_analyze(text: str, directory: Path) -> tuple[int, list[str]]:
    """`systemd-analyze verify` on the unit text, with the command path and user of this
    machine (the unit's do not exist here): its exit code and what it said about the
    file (it exits 0 on an unknown key, but says so)."""
    text = text.replace("/opt/dp-coordinator/bin/dp-coordinator", console_script())
    text = re.sub(r"(?m)^(User|Group)=.*$", r"\1=root", text)
    copy = directory / "dp-coordinator.service"
    copy.write_text(text)
    verified = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                              text=True, timeout=60)
    said = [line for line in (verified.stdout + verified.stderr).splitlines()
            if str(copy) in line]
    return verified.returncode, said


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze not installed")
def test_systemd_analyze_accepts_the_unit(tmp_path: Path) -> None:
    assert systemd_analyze(UNIT.read_text(), tmp_path) == (0, [])
    # What it would say about a misspelt key, which it accepts with exit code 0.
    _, said = systemd_analyze(UNIT.read_text().replace("PrivateTmp=", "PrivateTemp="),
                              tmp_path)
    assert any("Unknown key" in line and "PrivateTemp" in line for line in said), said


# ---- Kubernetes ---------------------------------------------------------------------------------


def kubernetes_objects() -> dict[str, dict[str, Any]]:
    documents = [d for d in yaml.safe_load_all(KUBERNETES.read_text()) if d is not None]
    return {doc["kind"]: doc for doc in documents}


def containers() -> dict[str, dict[str, Any]]:
    spec = kubernetes_objects()["Deployment"]["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def test_the_kubernetes_example_is_consistent() -> None:
    objects = kubernetes_objects()
    assert set(objects) == {"Service", "Deployment"}
    deployment, service = objects["Deployment"], objects["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert service["spec"]["selector"] == labels
    assert service["spec"]["publishNotReadyAddresses"] is True
    coordinator, engines = containers()["coordinator"], containers()["engines"]
    args = serve_args(coordinator["args"])
    assert args.host == "$(POD_IP)" and args.insecure
    ports = {p["name"]: p["containerPort"] for p in coordinator["ports"]}
    # The six sockets on --port-base in the address-file order, and the metrics port.
    assert ports == {**{key.replace("_", "-"): args.port_base + index
                        for index, key in enumerate(SOCKET_KEYS)}, "metrics": args.metrics_port}
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]] == port["port"]
    assert coordinator["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert coordinator["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert coordinator["image"] == "dp-coordinator:" + metadata.version("dp-coordinator")
    # The engines: stock headless vLLM, all ranks in this pod, on the handshake socket.
    vllm = engines["args"]
    assert engines["command"] == ["vllm", "serve"] and "--headless" in vllm
    assert flag_value(vllm, "--data-parallel-rpc-port") == str(ports["handshake"])
    assert flag_value(vllm, "--data-parallel-address") == "$(POD_IP)"
    assert flag_value(vllm, "--data-parallel-size") == str(args.engines)
    assert flag_value(vllm, "--data-parallel-size-local") == str(args.engines)
    assert flag_value(vllm, "--data-parallel-start-rank") == str(args.rank_start)
    for container in (coordinator, engines):
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
        assert env == {"POD_IP": "status.podIP"}


def container_command(run_dir: Path) -> list[str]:
    """The coordinator container's arguments as they are, but for the pod's address
    (loopback), free ports, and the `run` emptyDir's mount (a directory here)."""
    coordinator = containers()["coordinator"]
    mounts = {m["name"]: m["mountPath"] for m in coordinator["volumeMounts"]}
    argv = [arg.replace("$(POD_IP)", "127.0.0.1").replace(mounts["run"], str(run_dir))
            for arg in coordinator["args"]]
    argv = replace_flag(argv, "--port-base", str(free_port_block(6)))
    return replace_flag(argv, "--metrics-port", str(free_port_block(1)))


def test_the_state_file_and_the_addresses_are_on_the_emptydir() -> None:
    coordinator = containers()["coordinator"]
    volumes = {v["name"]: v for v in kubernetes_objects()["Deployment"]["spec"]["template"][
        "spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in coordinator["volumeMounts"]}
    assert "emptyDir" in volumes["run"]
    args = serve_args(coordinator["args"])
    for path in (args.state_file, args.addr_file, args.ipc_dir):
        assert path is not None, "the state file, address file and ipc directory are set"
        assert os.path.commonpath([path, mounts["run"]]) == mounts["run"], path


def test_the_coordinator_containers_probes_mean_what_the_example_says(
    scratch: Path, served: list[Served]
) -> None:
    """Live at once; ready once the group joined; still ready through a drain; and a
    restarted container (SIGKILL, then the same arguments, as the kubelet restarts it)
    resumes the group from the emptyDir with the same engines, which never say HELLO
    again."""
    run_dir = scratch / "run"
    run_dir.mkdir()
    argv = container_command(run_dir)
    addr_file = Path(flag_value(argv, "--addr-file"))
    engines = int(flag_value(argv, "--engines"))
    coordinator = Served(argv, addr_file)
    served.append(coordinator)
    metrics = f"http://127.0.0.1:{flag_value(argv, '--metrics-port')}"

    def wait_for(path: str, status: int) -> None:
        wait_for_status(metrics + path, status, coordinator.log)

    wait_for("/healthz", 200)  # live at once: no restarts while engines load
    assert http_status(metrics + "/readyz") == 503

    async def a_frontend_and_the_ranks_join() -> None:
        nonlocal coordinator
        # The frontend first: with --frontends the engines' INIT waits for it.
        client = FrontendClient(coordinator.addresses, client_index=0, host="127.0.0.1",
                                call_timeout_s=STEP)
        group = SimEngineGroup(coordinator.addresses["handshake"], engines, config=SimConfig(
            heartbeat_interval_s=0.5, handshake_timeout_s=STEP, ready_timeout_s=2 * STEP,
            accept_timeout_s=STEP))
        try:
            await asyncio.wait_for(client.register(), STEP)
            assert http_status(metrics + "/readyz") == 503
            await asyncio.wait_for(group.start(), 3 * STEP)
            await asyncio.to_thread(wait_for, "/readyz", 200)
            # Routine maintenance, as the file's comment shows it: the pod stays Ready.
            drained = await asyncio.to_thread(run_cli, "drain", "3", "--wait", "30",
                                              "--addr-file", str(addr_file))
            assert drained.returncode == 0, drained.stderr
            assert http_status(metrics + "/readyz") == 200
            assert (await asyncio.to_thread(run_cli, "uncordon", "3", "--addr-file",
                                            str(addr_file))).returncode == 0

            coordinator.process.kill()
            coordinator.process.wait(timeout=4 * STEP)
            coordinator = Served(argv, addr_file)
            served.append(coordinator)
            await asyncio.to_thread(wait_for, "/healthz", 200)
            await asyncio.to_thread(wait_for, "/readyz", 200)
            assert f"{engines} registrations, 1 frontends, gate open" in \
                coordinator.log.read_text()
        finally:
            await asyncio.wait_for(group.stop(), 2 * STEP)
            await asyncio.wait_for(client.close(), STEP)

    asyncio.run(a_frontend_and_the_ranks_join())
    code = coordinator.stop()
    assert code == 0, f"exit code {code}:\n{coordinator.log.read_text()[-3000:]}"


# ---- the container file -------------------------------------------------------------------------


def containerfile_instructions() -> list[tuple[str, str]]:
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in CONTAINERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def test_the_container_file_builds_from_the_repository_and_runs_the_cli() -> None:
    instructions = containerfile_instructions()
    keywords = [keyword for keyword, _ in instructions]
    assert keywords.count("FROM") == 2 and keywords[0] == "FROM"
    for keyword, rest in instructions:
        if keyword == "COPY" and not rest.startswith("--from="):
            *sources, _ = rest.split()
            for source in sources:  # the build context is the repository root
                assert (REPO / source).exists(), source
    path = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    assert any("pip wheel" in run and run.endswith(" .") for run in runs)  # this repository
    for run in runs:
        for command in re.split(r"&&|;|\|\|", run):
            program = shlex.split(command)[0]
            assert shutil.which(program, path=path) is not None, f"{program}: not a command"
    entrypoint = json.loads(dict(instructions)["ENTRYPOINT"])
    cmd = json.loads(dict(instructions)["CMD"])
    assert entrypoint == ["dp-coordinator"]
    ran = subprocess.run([console_script(), *cmd], capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("usage: dp-coordinator")
    user = dict(instructions)["USER"]
    assert any(f"--uid {user}" in run for run in runs)  # runs as the user it creates


# ---- the docs point at every example ------------------------------------------------------------


def test_the_docs_reference_every_deployment_file() -> None:
    docs = "\n".join(p.read_text() for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    files = sorted(p.relative_to(REPO).as_posix() for p in DEPLOY.rglob("*") if p.is_file())
    assert files, "deploy/ is empty"
    missing = [name for name in files if name not in docs and not name.endswith("_test.yml")]
    assert missing == []
