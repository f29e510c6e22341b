"""Profile our coordinator while a benchmark scenario drives it (py-spy, sampled).

    pip install py-spy                     # not a dependency of the project
    python -m bench.profile cpu            # 256 ranks x 50 stats/s + 2,000 submits/s
    python -m bench.profile dispatch --seconds 8 --reps 3
    python -m bench.profile scale --engines 1024 --delay 0.5 --seconds 14
    python -m bench.profile core           # the core's per-submit work alone, step by step
    python -m bench.profile ingest         # stats ingest per message vs a no-logic reader

Runs `python -m bench --quick --scenario NAME` with our coordinator alone (no
floor, no peer, no asyncio twin), waits for the `serve --engines N` process of
the scenario, waits `--delay` seconds more (the set-up), records it with
`py-spy record --format raw` for `--seconds`, then prints where the samples
fell: each function's own share, and the share of the stacks it is on. The
raw stacks are kept in `--out` (git-ignored under bench/results/quick/), for
flame graphs or a closer look.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time

from bench.run import RESULTS_DIR

ENGINES = {"cpu": 256, "dispatch": 64, "scale": 1024, "stats": 64, "cadence": 64, "flood": 64,
           "wake": 8, "first_request": 8, "rss": 256, "handshake": 256}


def find_target(engines: int, timeout_s: float) -> int | None:
    """The pid of our coordinator serving `engines` ranks, once it runs."""
    deadline = time.monotonic() + timeout_s
    needle = f"coordinator serve --engines {engines} "
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmdline:
                return int(pid)
        time.sleep(0.05)
    return None


def summarize(path: str, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    on_stack: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as handle:
        for line in handle:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            own[frames[-1]] += n
            for frame in set(frames):
                on_stack[frame] += n
    if not total:
        return "no samples"
    lines = [f"{total} samples", "", "own time:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    lines += ["", "on the stack:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in on_stack.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile",
                                     description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("scenario", choices=[*sorted(ENGINES), "core", "ingest"])
    parser.add_argument("--engines", type=int, default=None,
                        help="the scenario's rank count, to find its coordinator (default: "
                        "the quick plan's)")
    parser.add_argument("--delay", type=float, default=2.0, help="seconds to skip first")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds to record")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of the scenario")
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    parser.add_argument("--top", type=int, default=30, help="lines per list")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "quick", "profile"),
                        help="where the raw stacks go")
    parser.add_argument("--number", type=int, default=2000,
                        help="core: calls per timed run")
    parser.add_argument("--repeats", type=int, default=7, help="core: timed runs per step")
    args = parser.parse_args(argv)
    if args.scenario == "core":
        from bench import core_cost
        return core_cost.main(args.engines or 64, args.number, args.repeats)
    if args.scenario == "ingest":
        from bench import ingest_cost
        return ingest_cost.main(max(1, args.number // 50), args.repeats)
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    stacks = os.path.join(args.out, f"{args.scenario}.txt")
    bench = [sys.executable, "-m", "bench", "--quick", "--scenario", args.scenario,
             "--no-floor", "--no-asyncio-compare", "--no-figure",
             "--out", os.path.join(args.out, "run")]
    if args.reps:
        bench += ["--reps", str(args.reps)]
    engines = args.engines or ENGINES[args.scenario]
    with subprocess.Popen(bench, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True) as run:
        pid = find_target(engines, 120.0)
        if pid is None:
            run.terminate()
            print(f"no `serve --engines {engines}` process appeared", file=sys.stderr)
            return 1
        time.sleep(args.delay)
        subprocess.run([spy, "record", "-p", str(pid), "-d", f"{args.seconds:g}", "-r",
                        str(args.rate), "-f", "raw", "-o", stacks, "--nonblocking"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        _, err = run.communicate(timeout=900)
    for line in err.splitlines():
        if line.startswith("[bench") and "  " in line:
            print(line)
    if not os.path.exists(stacks):
        print("py-spy recorded nothing (is ptrace allowed here?)", file=sys.stderr)
        return 1
    print(summarize(stacks, args.top))
    print(f"\nraw stacks: {stacks}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
