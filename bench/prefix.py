"""Prefix reuse under multi-turn chat: the coordinator's routing policies, same traffic.

    python -m bench.prefix                      # least-loaded vs p2c, 8 and 32 ranks
    python -m bench.prefix --policy prefix      # least-loaded vs prefix
    python -m bench.prefix --quick | --smoke

For every group size (8 and 32 ranks) and mode (lockstep and dense), and for
every policy (least-loaded, the baseline, then each `--policy`), one run:

* a fresh coordinator (`python -m coordinator serve --policy P`, with
  `--no-wave-coordination` for dense), its metrics endpoint on a free port;
* a group of simulated engines as their own process (`python -m coordinator.sim
  group`), each with a real prefix cache (block size 16, a bounded number of
  blocks, LRU eviction) and a prefill cost per uncached prompt token, so a
  cache hit shortens both the request's time to first token and the step its
  group waits for;
* the load generator as its own process (`python -m coordinator.loadgen
  --workload chat`): the same sessions, prompts and think times for every
  policy (one seed), sent as vLLM `EngineCoreRequest` payloads so a router
  that reads prompt tokens can.

Measured per run, from what the engines report (their `prefix_cache_stats`
and `PrefillStats`, read by the load generator): prompt tokens, the ideal
reusable tokens (every turn on the rank holding its history, capacity
permitting: `coordinator.sim.workload.ideal_reuse`), hit tokens and the hit
rate, prompt tokens computed (prefill), time to first token p50/p99 (submit
-> first token at the frontend), the balance ratio (mean/max of decode steps
per rank) and the coordinator's routing decision latency p99, read from its
`/metrics` (its `*route_decision_seconds` histogram: the event loop's CPU
time over each submit). Goals for a prefix-aware policy are checked against
the baseline measured in the same run.

Results: `bench/results/prefix.json` and `PREFIX.md` for a full run;
`bench/results/{quick,smoke}/` otherwise (git-ignored). Only a full run
writes the committed results.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from typing import Any

from bench import report
from bench.run import RESULTS_DIR, output_dir

BASELINE = "least-loaded"
MODES = ("lockstep", "dense")
RUN_TIMEOUT_S = 300.0
# The goals for a prefix-aware policy, against the baseline in the same run.
GOAL_IDEAL_FRACTION = 0.9
GOAL_HIT_RATE_VS_BASELINE_8 = 4.0
GOAL_BALANCE_VS_BASELINE = 0.9
GOAL_DECISION_P99_US = 200.0


@dataclass(frozen=True)
class Plan:
    mode: str
    ranks: tuple[int, ...]
    duration_s: float
    sessions_per_rank: int
    concurrency_per_rank: int
    turns: int
    system_prompts: int
    system_prompt_tokens: int
    user_tokens: str
    answer_tokens: str
    think_s: float
    step_ms_per_8_ranks: float
    prefill_us_per_token: float
    kv_blocks: int
    block_size: int = 16


# Sessions whose own history outweighs the shared system prompt, as in long chats:
# a turn that lands away from its history recomputes most of its prompt. The
# duration only bounds a run; every planned session normally completes.
FULL = Plan("full", (8, 32), duration_s=150.0, sessions_per_rank=4, concurrency_per_rank=2,
            turns=8, system_prompts=2, system_prompt_tokens=256, user_tokens="96,384",
            answer_tokens="16,96", think_s=0.5, step_ms_per_8_ranks=10.0,
            prefill_us_per_token=20.0, kv_blocks=2048)
QUICK = replace(FULL, mode="quick", duration_s=60.0, sessions_per_rank=2, turns=6)
SMOKE = Plan("smoke", (2,), duration_s=6.0, sessions_per_rank=2, concurrency_per_rank=1,
             turns=2, system_prompts=1, system_prompt_tokens=64, user_tokens="8,24",
             answer_tokens="4,12", think_s=0.05, step_ms_per_8_ranks=2.0,
             prefill_us_per_token=5.0, kv_blocks=256)


def log(message: str) -> None:
    print(f"[bench.prefix {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports (vLLM offsets by rank).

    Taken below Linux's ephemeral range, where a busy machine's outgoing
    connections do not come and go, and probed as libzmq binds (SO_REUSEADDR).
    """
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 32000 - count)
        probes: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                probe = socket.socket()
                probes.append(probe)
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return first
    raise RuntimeError(f"no {count} consecutive free ports")


def _env() -> dict[str, str]:
    env = os.environ.copy()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _stop(process: subprocess.Popen[bytes] | None, timeout_s: float = 20.0) -> str:
    """SIGTERM, then SIGKILL; the process's stdout."""
    if process is None:
        return ""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate(timeout=10)
    return out.decode(errors="replace") if out else ""


def decision_p99_us(metrics_text: str) -> float | None:
    """p99 of a `*route_decision_seconds` Prometheus histogram, in µs (bucket bound)."""
    buckets: list[tuple[float, float]] = []
    for line in metrics_text.splitlines():
        name, _, rest = line.partition("{")
        if not name.endswith("route_decision_seconds_bucket") or 'le="' not in rest:
            continue
        bound = rest.split('le="', 1)[1].split('"', 1)[0]
        try:
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
        except ValueError:
            continue
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    for bound, count in buckets:
        if count >= 0.99 * total:
            return None if bound == float("inf") else round(bound * 1e6, 1)
    return None  # pragma: no cover - the +Inf bucket always reaches the total


def run_one(plan: Plan, ranks: int, mode: str, policy: str, seed: int,
            scratch: str) -> dict[str, Any]:
    """One coordinator, one engine group, one load; the figures, or why there are none."""
    addr_file = os.path.join(scratch, f"{policy}-{mode}-{ranks}.json")
    metrics_port = _free_port()
    step_ms = plan.step_ms_per_8_ranks * max(1.0, ranks / 8)
    prefill_us = plan.prefill_us_per_token * max(1.0, ranks / 8)
    serve = [sys.executable, "-m", "coordinator", "serve", "--engines", str(ranks),
             "--frontends", "2", "--addr-file", addr_file, "--policy", policy,
             "--ipc-dir", os.path.join(scratch, f"ipc-{policy}-{mode}-{ranks}"),
             "--metrics-port", str(metrics_port), "--log-level", "warning"]
    if mode == "dense":
        serve.append("--no-wave-coordination")
    serve += os.environ.get("PREFIX_EXTRA", "").split()
    engines = [sys.executable, "-m", "coordinator.sim", "group", "--engines", str(ranks),
               "--addr-file", addr_file, "--step-ms", f"{step_ms:g}",
               "--block-size", str(plan.block_size), "--kv-blocks", str(plan.kv_blocks),
               "--prefill-us-per-token", f"{prefill_us:g}", "--collective-timeout", "60",
               "--log-level", "WARNING"]
    if mode == "dense":
        engines.append("--dense")
    # Every engine publishes vLLM's KV events and names its publisher in its greeting,
    # whatever the policy; a policy that reads them follows them there.
    events = _free_port_run(2 * ranks)
    engines += ["--kv-events-endpoint", f"tcp://*:{events}",
                "--kv-events-replay-endpoint", f"tcp://*:{events + ranks}"]
    load = [sys.executable, "-m", "coordinator.loadgen", "--addr-file", addr_file,
            "--frontends", "2", "--workload", "chat", "--seed", str(seed),
            "--sessions", str(plan.sessions_per_rank * ranks),
            "--concurrency", str(plan.concurrency_per_rank * ranks),
            "--turns", str(plan.turns), "--system-prompts", str(plan.system_prompts),
            "--system-prompt-tokens", str(plan.system_prompt_tokens),
            "--user-tokens", plan.user_tokens, "--answer-tokens", plan.answer_tokens,
            "--think", str(plan.think_s), "--duration", str(plan.duration_s),
            "--drain-timeout", "60", "--block-size", str(plan.block_size),
            "--kv-blocks", str(plan.kv_blocks), "--json"]
    result: dict[str, Any] = {"ranks": ranks, "mode": mode, "policy": policy,
                              "step_ms": step_ms, "prefill_us_per_token": prefill_us}
    coordinator = group = None
    err_path = os.path.join(scratch, f"{policy}-{mode}-{ranks}.err")
    with open(err_path, "wb") as errors:
        try:
            coordinator = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=errors,
                                           env=_env())
            problem = _wait_for_address_file(coordinator, addr_file)
            if problem is not None:
                errors.flush()
                with open(err_path, errors="replace") as text:
                    result["error"] = f"{problem}: {text.read()[-800:]}"
                return result
            group = subprocess.Popen(engines, stdout=subprocess.PIPE, stderr=errors,
                                     env=_env())
            started = time.monotonic()
            loaded = subprocess.run(load, capture_output=True, timeout=RUN_TIMEOUT_S,
                                    env=_env(), check=False)
            result["elapsed_s"] = round(time.monotonic() - started, 2)
            if loaded.returncode not in (0, 1) or not loaded.stdout.strip():
                result["error"] = (f"load generator exited {loaded.returncode}: "
                                   f"{loaded.stderr.decode(errors='replace')[-800:]}")
                return result
            summary = json.loads(loaded.stdout)
            result["decision_p99_us"] = _scrape_decision_p99(metrics_port)
        except subprocess.TimeoutExpired:
            result["error"] = f"the run took longer than {RUN_TIMEOUT_S:.0f} s"
            return result
        finally:
            engine_lines = _stop(group)
            _stop(coordinator)
    result.update(_figures(summary, engine_lines))
    return result


def _wait_for_address_file(coordinator: subprocess.Popen[bytes], path: str,
                           timeout_s: float = 30.0) -> str | None:
    """None once the coordinator wrote its address file, else what went wrong."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if coordinator.poll() is not None:
            return f"the coordinator exited {coordinator.returncode}"
        if time.monotonic() > deadline:
            return f"no address file within {timeout_s:.0f} s"
        time.sleep(0.05)
    return None


def _scrape_decision_p99(port: int) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            return decision_p99_us(page.read().decode(errors="replace"))
    except OSError:
        return None


def _figures(summary: dict[str, Any], engine_lines: str) -> dict[str, Any]:
    per_engine = []
    for line in engine_lines.splitlines():
        try:
            per_engine.append(json.loads(line))
        except ValueError:
            continue
    steps = [e.get("steps", 0) for e in per_engine]
    prompt = summary.get("prompt_tokens") or 0
    return {
        "requests": summary.get("submitted"),
        "completed": summary.get("completed"),
        "lost": summary.get("lost"),
        "healthy": summary.get("healthy"),
        "prompt_tokens": prompt,
        "ideal_reusable_tokens": summary.get("ideal_reusable_tokens"),
        "hit_tokens": summary.get("hit_tokens"),
        "hit_rate": summary.get("hit_rate"),
        "ideal_hit_rate": summary.get("ideal_hit_rate"),
        "ideal_fraction": summary.get("ideal_fraction"),
        "prefill_tokens": summary.get("prefill_tokens"),
        "ttft_ms_p50": summary.get("ttft_ms_p50"),
        "ttft_ms_p99": summary.get("ttft_ms_p99"),
        "balance_ratio": summary.get("balance_ratio"),
        "engine_step_balance": (round(sum(steps) / len(steps) / max(steps), 4)
                                if steps and max(steps) else None),
        "engine_hit_tokens": sum(e.get("hit_tokens", 0) for e in per_engine),
        "evicted_blocks": sum(e.get("evicted_blocks", 0) for e in per_engine),
        "throughput_rps": summary.get("throughput_rps"),
    }


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each policy against the baseline of the same size and mode: ratios and goals."""
    baseline = {(r["ranks"], r["mode"]): r for r in rows if r["policy"] == BASELINE}
    out = []
    for row in rows:
        base = baseline.get((row["ranks"], row["mode"]))
        if row["policy"] == BASELINE or base is None or "error" in row:
            continue
        hit_vs = report.ratio(row.get("hit_rate"), base.get("hit_rate"))
        balance_vs = report.ratio(row.get("balance_ratio"), base.get("balance_ratio"))
        goals = {
            "ideal_fraction >= 0.9": _met(row.get("ideal_fraction"), GOAL_IDEAL_FRACTION),
            "balance >= 0.9 x baseline": _met(balance_vs, GOAL_BALANCE_VS_BASELINE),
            "decision p99 <= 200 us": (None if row.get("decision_p99_us") is None
                                       else row["decision_p99_us"] <= GOAL_DECISION_P99_US),
        }
        if row["ranks"] == 8:
            goals["hit rate >= 4 x baseline"] = _met(hit_vs, GOAL_HIT_RATE_VS_BASELINE_8)
        out.append({"ranks": row["ranks"], "mode": row["mode"], "policy": row["policy"],
                    "hit_rate_vs_baseline": hit_vs,
                    "prefill_vs_baseline": report.ratio(row.get("prefill_tokens"),
                                                        base.get("prefill_tokens")),
                    "ttft_p99_vs_baseline": report.ratio(row.get("ttft_ms_p99"),
                                                         base.get("ttft_ms_p99")),
                    "balance_vs_baseline": balance_vs, "goals": goals})
    return out


def _met(value: float | None, least: float) -> bool | None:
    return None if value is None else value >= least


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"# Prefix reuse by routing policy ({data['mode']} run, {data['date'][:10]})", "",
        f"Chat workload, seed {data['seed']}; {data['machine']['cpu']}, "
        f"{data['machine']['cores']} cores. Hit rate = hit tokens / prompt tokens; ideal = "
        "every turn on the rank holding its history, capacity permitting. Decision p99 is "
        "the coordinator's CPU time over a submit, from its metrics (a bucket bound).", "",
        "| ranks | mode | policy | requests | hit rate | ideal | of ideal | prefill tokens "
        "| TTFT p50 / p99 (ms) | balance | decision p99 (µs) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["runs"]:
        if "error" in row:
            lines.append(f"| {row['ranks']} | {row['mode']} | {row['policy']} | "
                         f"error: {' '.join(row['error'].split())[-120:]} |||||||")
            continue
        lines.append(
            f"| {row['ranks']} | {row['mode']} | {row['policy']} | {_cell(row['requests'])} "
            f"| {_cell(row['hit_rate'], 3)} | {_cell(row['ideal_hit_rate'], 3)} "
            f"| {_cell(row['ideal_fraction'], 3)} | {_cell(row['prefill_tokens'])} "
            f"| {_cell(row['ttft_ms_p50'], 1)} / {_cell(row['ttft_ms_p99'], 1)} "
            f"| {_cell(row['balance_ratio'], 3)} | {_cell(row.get('decision_p99_us'), 1)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefix",
        description="Prefix-cache reuse of the coordinator's routing policies on the same "
        "multi-turn chat traffic, against least-loaded.")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="shorter runs (bench/results/quick)")
    size.add_argument("--smoke", action="store_true",
                      help="tiny runs that only check the harness (bench/results/smoke)")
    parser.add_argument("--policy", action="append", default=[], metavar="NAME",
                        help="a policy to compare with least-loaded (repeatable; default p2c)")
    parser.add_argument("--ranks", default=None, metavar="N,N",
                        help="group sizes (default 8,32; smoke 2)")
    parser.add_argument("--modes", default=",".join(MODES), metavar="MODE,MODE",
                        help="lockstep and/or dense (default both)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=None, help="results directory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    try:
        out = output_dir(plan.mode, args.out)
    except ValueError as exc:
        print(f"bench.prefix: {exc}", file=sys.stderr)
        return 2
    ranks = plan.ranks if args.ranks is None else tuple(int(n) for n in args.ranks.split(","))
    modes = tuple(m for m in args.modes.split(",") if m)
    if not set(modes) <= set(MODES) or not ranks or min(ranks) < 1:
        print(f"bench.prefix: modes must be among {', '.join(MODES)} and ranks >= 1",
              file=sys.stderr)
        return 2
    policies = [BASELINE, *dict.fromkeys(p for p in (args.policy or ["p2c"]) if p != BASELINE)]
    machine = report.machine()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpc-prefix-") as scratch:
        for n in ranks:
            for mode in modes:
                for policy in policies:
                    log(f"{n} ranks, {mode}, {policy}")
                    row = run_one(plan, n, mode, policy, args.seed, scratch)
                    log(f"  -> {row.get('error') or _brief(row)}")
                    rows.append(row)
    data = report.clean({
        "benchmark": "prefix", "mode": plan.mode, "date": report.now_iso(), "seed": args.seed,
        "machine": machine, "plan": plan.__dict__, "policies": policies,
        "load_average_at_end": list(os.getloadavg()), "runs": rows,
        "comparisons": compare(rows),
    })
    report.write_json(os.path.join(out, "prefix.json"), data)
    with open(os.path.join(out, "PREFIX.md"), "w") as handle:
        handle.write(markdown(data))
    log(f"wrote {os.path.join(out, 'prefix.json')} and PREFIX.md")
    return 0 if all("error" not in row for row in rows) else 1


def _brief(row: dict[str, Any]) -> str:
    return (f"hit rate {_cell(row.get('hit_rate'), 3)} (ideal "
            f"{_cell(row.get('ideal_hit_rate'), 3)}), TTFT p99 "
            f"{_cell(row.get('ttft_ms_p99'), 1)} ms, balance {_cell(row.get('balance_ratio'), 3)}")


__all__ = ["FULL", "QUICK", "RESULTS_DIR", "SMOKE", "compare", "decision_p99_us", "main",
           "markdown", "run_one"]

if __name__ == "__main__":
    raise SystemExit(main())
