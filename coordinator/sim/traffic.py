"""What a load generator is asked to send, and what it saw: its config, records and summary.

Also the command line's parser (`python -m coordinator.loadgen` runs it).

`coordinator.loadgen` re-exports every name here; import them from there.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from coordinator.sim.workload import ChatConfig, DocumentsConfig

__all__ = [
    "PAYLOADS",
    "WORKLOADS",
    "LoadConfig",
    "LoadSummary",
    "RankWork",
    "RequestRecord",
    "build_parser",
    "config_from_args",
    "milliseconds",
    "percentile",
    "ratio",
    "summary_lines",
]

WORKLOADS = ("poisson", "chat", "documents")
PAYLOADS = ("sim", "vllm")


@dataclass
class LoadConfig:
    """What load to generate, and how long to wait for it to finish."""

    frontends: int = 2
    rate: float = 200.0
    """Mean arrivals per second over all frontends."""
    duration_s: float = 20.0
    max_requests: int | None = None
    """Stop after this many arrivals even if `duration_s` has not passed."""
    steps_median: float = 16.0
    steps_sigma: float = 0.8
    steps_min: int = 1
    steps_max: int = 512
    drain_timeout_s: float = 15.0
    stall_s: float = 5.0
    submit_timeout_s: float = 5.0
    max_outstanding_submits: int = 10_000
    burst_on_s: float | None = None
    """With `burst_off_s`: arrivals come in bursts this long separated by quiet gaps,
    so a lockstep group pauses and must be woken again; the mean rate stays `rate`."""
    burst_off_s: float = 0.0
    seed: int | None = None
    host: str | None = None
    """Bind frontend output sockets on tcp `host` instead of ipc."""
    workload: str = "poisson"
    """"poisson", "chat" or "documents" (see the module docstring)."""
    payload: str = "sim"
    """Poisson load only: "sim" (SimRequest) or "vllm" (EngineCoreRequest, random prompt)."""
    prompt_tokens: int = 256
    """Poisson load with vLLM payloads: the prompt length."""
    chat: ChatConfig = field(default_factory=ChatConfig)
    documents: DocumentsConfig = field(default_factory=DocumentsConfig)
    concurrency: int = 8
    """Chat and documents: sessions in flight at once."""
    block_size: int = 16
    """The engines' KV block size, for the ideal reuse."""
    kv_capacity_blocks: int | None = None
    """The engines' KV cache per rank, in blocks, for the ideal reuse (None: unbounded)."""

    def validate(self) -> None:
        if self.frontends < 1:
            raise ValueError(f"need at least one frontend, got {self.frontends}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, "
                             f"got {self.workload!r}")
        if self.payload not in PAYLOADS:
            raise ValueError(f"payload must be sim or vllm, got {self.payload!r}")
        if self.prompt_tokens < 1 or self.concurrency < 1 or self.block_size < 1:
            raise ValueError("prompt_tokens, concurrency and block_size must be at least 1")
        if self.kv_capacity_blocks is not None and self.kv_capacity_blocks < 1:
            raise ValueError("kv_capacity_blocks must be at least 1")
        self.chat.validate()
        self.documents.validate()
        if not self.rate > 0 or not math.isfinite(self.rate):
            raise ValueError(f"rate must be a positive number, got {self.rate}")
        if not self.duration_s > 0:
            raise ValueError(f"duration must be positive, got {self.duration_s}")
        if self.burst_on_s is not None and not self.burst_on_s > 0:
            raise ValueError(f"burst_on_s must be positive, got {self.burst_on_s}")
        if self.burst_off_s < 0:
            raise ValueError(f"burst_off_s must be >= 0, got {self.burst_off_s}")
        if not 1 <= self.steps_min <= self.steps_max:
            raise ValueError("need 1 <= steps_min <= steps_max")


@dataclass
class RequestRecord:
    """Everything observed about one request (times are `time.monotonic()`)."""

    request_id: str
    client_index: int
    decode_steps: int
    submitted_at: float
    replied_at: float | None = None
    rank: int | None = None
    woke: bool = False
    wave: int = 0
    """The wave stamped on the submit (the newest this frontend had seen)."""
    finished_at: float | None = None
    finished_rank: int | None = None
    refused: str | None = None
    """The ErrorReply code when the coordinator refused the submit."""
    submit_timed_out: bool = False
    failed: str | None = None
    """The reason when the coordinator reported the request failed."""
    prompt_tokens: int = 0
    first_token_at: float | None = None
    """When the output carrying its first token arrived (vLLM payloads)."""
    cached_tokens: int | None = None
    """Prompt tokens the engine's prefix cache served (vLLM's PrefillStats)."""
    session: str | None = None
    ended_by_shutdown: bool = False
    """Outstanding when the coordinator said it was shutting down."""

    @property
    def accepted(self) -> bool:
        """The coordinator took it (or we never heard back and it may have)."""
        return self.refused is None and (self.rank is not None or self.submit_timed_out)

    @property
    def completed(self) -> bool:
        return self.finished_at is not None

    @property
    def lost(self) -> bool:
        return (self.accepted and not self.completed and self.failed is None
                and not self.ended_by_shutdown)


@dataclass
class RankWork:
    """Work one rank did, as observed by the frontends."""

    dispatched: int = 0
    completed: int = 0
    decode_steps: int = 0
    """Decode steps of completed requests."""
    queried_tokens: int = 0
    hit_tokens: int = 0
    """The rank's prefix_cache_stats, summed."""


@dataclass
class LoadSummary:
    """The result of one run; `to_dict()` is the JSON form."""

    frontends: int
    rate: float
    load_seconds: float
    drain_seconds: float
    arrivals: int
    submitted: int
    completed: int
    failed: int
    refused: int
    refused_by_code: dict[str, int]
    submit_timeouts: int
    skipped: int
    lost: int
    engine_dead_notices: int
    stalls: int
    first_wave: int
    last_wave: int
    waves_completed: int
    per_rank: dict[int, RankWork]
    balance_ratio: float | None
    """mean / max of completed decode steps per rank (1.0 = perfectly even)."""
    wakes: int
    wake_reply_ms_p50: float | None
    wake_reply_ms_p99: float | None
    wake_running_ms_p50: float | None
    """From a submit that woke the group to the publish saying that wave runs."""
    wake_running_ms_p99: float | None
    wake_finish_ms_p50: float | None
    wake_finish_ms_p99: float | None
    latency_ms_p50: float | None
    latency_ms_p99: float | None
    reply_ms_p50: float | None
    reply_ms_p99: float | None
    throughput_rps: float
    lost_ids: list[str] = field(default_factory=list)
    workload: str = "poisson"
    shutdown_reason: str | None = None
    """The coordinator's ShuttingDown notice, when one ended the run."""
    ended_by_shutdown: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of the requests the coordinator accepted."""
    ideal_reusable_tokens: int | None = None
    hit_tokens: int = 0
    """Prompt tokens the engines' prefix caches served (their prefix_cache_stats)."""
    queried_tokens: int = 0
    prefill_tokens: int = 0
    """Prompt tokens the engines computed (queried less hit, recomputations included)."""
    hit_rate: float | None = None
    """hit_tokens / queried_tokens."""
    ideal_hit_rate: float | None = None
    """ideal_reusable_tokens / prompt_tokens."""
    ideal_fraction: float | None = None
    """hit_tokens / ideal_reusable_tokens: how much of the possible reuse was had."""
    ttft_ms_p50: float | None = None
    ttft_ms_p99: float | None = None
    sessions_started: int = 0

    @property
    def healthy(self) -> bool:
        return self.lost == 0 and self.stalls == 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["per_rank"] = {str(rank): asdict(work) for rank, work in self.per_rank.items()}
        data["healthy"] = self.healthy
        return data


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[index]


def milliseconds(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


def ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


# ---- the command line of `python -m coordinator.loadgen` -------------------------------

_EPILOG = """\
Workloads:
  poisson    open-loop Poisson arrivals at --rate; SimRequest payloads, or vLLM
             payloads with fresh random prompts (--payload vllm)
  chat       multi-turn sessions over shared system prompts; each turn re-sends
             the history (prompts and answers) plus a new user message
  documents  one-question sessions over a few long shared documents
chat and documents send vLLM EngineCoreRequest payloads, --concurrency sessions
at a time, and report prefix reuse: the engines' hit tokens, the tokens they
computed, time to first token, and the ideal reusable tokens.

Exit status: 0 when every accepted request ended (finished, failed, or outstanding
when the coordinator announced its shutdown) without a stall; 1 otherwise; 2 on bad
arguments; 4 if the coordinator could not be reached.

Example:
  python -m coordinator.loadgen --addr-file /tmp/coord.json --workload chat \\
      --duration 30 --sessions 64 --turns 4 --seed 1 --json
"""


def _token_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(",")
    try:
        bounds = (int(low), int(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW,HIGH, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.loadgen",
        description="Frontends that submit simulated requests to a coordinator, then "
        "report what happened to every one of them.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--addr-file", required=True,
                        help="the coordinator's JSON address file (waited for up to "
                        "--wait-addr-file seconds)")
    parser.add_argument("--wait-addr-file", type=float, default=30.0, metavar="S")
    parser.add_argument("--frontends", type=int, default=2, help="client indices 0..K-1 (2)")
    parser.add_argument("--workload", choices=WORKLOADS, default="poisson")
    parser.add_argument("--duration", type=float, default=20.0, metavar="S",
                        help="stop sending after this long (20)")
    parser.add_argument("--max-requests", type=int, default=None, metavar="N",
                        help="stop sending after N requests")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--drain-timeout", type=float, default=15.0, metavar="S",
                        help="wait this long for outstanding requests at the end (15)")
    parser.add_argument("--wait-ready", type=float, default=60.0, metavar="S",
                        help="wait this long for every rank to be ready first (60)")
    parser.add_argument("--host", default=None,
                        help="bind the frontends' output sockets on tcp HOST (default ipc)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    poisson = parser.add_argument_group("poisson")
    poisson.add_argument("--rate", type=float, default=200.0, help="arrivals per second")
    poisson.add_argument("--payload", choices=PAYLOADS, default="sim")
    poisson.add_argument("--prompt-tokens", type=int, default=256, metavar="N")
    poisson.add_argument("--steps-median", type=float, default=16.0, metavar="N",
                         help="median decode steps (log-normal)")
    poisson.add_argument("--steps-max", type=int, default=512, metavar="N")
    sessions = parser.add_argument_group("chat and documents")
    sessions.add_argument("--concurrency", type=int, default=8, help="sessions at once (8)")
    sessions.add_argument("--sessions", type=int, default=64, help="chat sessions (64)")
    sessions.add_argument("--turns", type=int, default=4, help="turns per chat session (4)")
    sessions.add_argument("--system-prompts", type=int, default=2, metavar="N")
    sessions.add_argument("--system-prompt-tokens", type=int, default=1024, metavar="N")
    sessions.add_argument("--user-tokens", type=_token_range, default=(64, 256),
                          metavar="LOW,HIGH", help="new user tokens per turn (64,256)")
    sessions.add_argument("--answer-tokens", type=_token_range, default=None,
                          metavar="LOW,HIGH", help="max_tokens per request "
                          "(chat 32,192; documents 16,128)")
    sessions.add_argument("--think", type=float, default=0.5, metavar="S",
                          help="mean think time between turns (0.5)")
    sessions.add_argument("--documents", type=int, default=4, metavar="N")
    sessions.add_argument("--document-tokens", type=int, default=4096, metavar="N")
    sessions.add_argument("--questions", type=int, default=256, metavar="N")
    sessions.add_argument("--question-tokens", type=_token_range, default=(16, 96),
                          metavar="LOW,HIGH")
    sessions.add_argument("--block-size", type=int, default=16,
                          help="the engines' block size, for the ideal reuse (16)")
    sessions.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                          help="the engines' KV cache per rank in blocks, for the ideal "
                          "reuse (default: unbounded)")
    return parser


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    chat = ChatConfig(
        sessions=args.sessions, turns=args.turns, system_prompts=args.system_prompts,
        system_prompt_tokens=args.system_prompt_tokens, user_tokens=args.user_tokens,
        answer_tokens=args.answer_tokens or ChatConfig.answer_tokens, think_s=args.think)
    documents = DocumentsConfig(
        documents=args.documents, document_tokens=args.document_tokens,
        questions=args.questions, question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens or DocumentsConfig.answer_tokens)
    return LoadConfig(
        frontends=args.frontends, rate=args.rate, duration_s=args.duration,
        max_requests=args.max_requests, steps_median=args.steps_median,
        steps_max=args.steps_max, drain_timeout_s=args.drain_timeout, seed=args.seed,
        host=args.host, workload=args.workload, payload=args.payload,
        prompt_tokens=args.prompt_tokens, chat=chat, documents=documents,
        concurrency=args.concurrency, block_size=args.block_size,
        kv_capacity_blocks=args.kv_blocks)


def summary_lines(summary: LoadSummary) -> list[str]:
    data = summary.to_dict()
    keys = ["workload", "arrivals", "submitted", "completed", "failed", "refused", "lost",
            "ended_by_shutdown", "stalls", "balance_ratio", "latency_ms_p50",
            "latency_ms_p99", "throughput_rps"]
    if summary.prompt_tokens:
        keys += ["prompt_tokens", "ideal_reusable_tokens", "hit_tokens", "prefill_tokens",
                 "hit_rate", "ideal_hit_rate", "ideal_fraction", "ttft_ms_p50", "ttft_ms_p99"]
    if summary.shutdown_reason is not None:
        keys.append("shutdown_reason")
    width = max(len(key) for key in keys)
    return [f"{key:<{width}}  {data[key]}" for key in keys]
