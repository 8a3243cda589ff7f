"""Root cause, not the loudest line: which rank failed first, and why (no I/O).

From the scans (catalog hits, exits, exceptions), run.json and torchelastic's error files:

1. each rank's own cause: its earliest *primary* hit (an OOM, a busy GPU); else how it
   died (SIGKILL -> host OOM, SIGSEGV -> segfault); else an unexplained exception
   (``unknown``). Ranks with only collective timeouts, NCCL errors, "Connection reset by
   peer" or the agent's SIGTERM failed *because of* another rank: they are secondary.
2. the root rank: among ranks with a cause of their own, the first to fail by the best
   clock they all have (run.json ``ended_at``, error files, log timestamps), then
   torchrun's "Root Cause (first observed failure)", then line order within one log.
   With no clock across several logs the more specific cause wins, at lower confidence.
3. the root cause first; the others follow as consequences (secondary causes, later
   failures) or "also" (another primary cause on another rank).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from nbgpu.diagnose.catalog import UNKNOWN, Cause, cause
from nbgpu.diagnose.lines import Stamp
from nbgpu.diagnose.report import Evidence, FoundCause, RankSummary
from nbgpu.diagnose.scan import (
    SECONDARY_ID,
    SIGNAL_OF_CODE,
    ExceptionLine,
    ExitRecord,
    Hit,
    SourceScan,
)
from nbgpu.diagnose.sources import ErrorRecord, RunInfo
from nbgpu.diagnose.specifics import install_fixes, specifics

__all__ = ["Ranking", "rank_failures"]

_SIGNAL_CAUSES = {"SIGKILL": ("host_oom", 0.55), "SIGSEGV": ("segfault", 0.8),
                  "SIGBUS": ("host_oom", 0.5)}  # fmt: skip
_CLOCKS = ("epoch", "iso", "glog")
_LAST = 10**12  # order of a rank's cause that no log line supports (exit code or signal only)


def _primary(hit: Hit) -> bool:
    """A cause of the rank's own: not a marker, nor the echo of a peer's failure."""
    return hit.cause != SECONDARY_ID and not hit.consequence and not cause(hit.cause).secondary


@dataclass
class _Rank:
    """Everything known about one rank (``None``: lines without a rank)."""

    rank: int | None
    hits: list[Hit] = field(default_factory=list)
    exits: list[ExitRecord] = field(default_factory=list)
    exceptions: list[ExceptionLine] = field(default_factory=list)
    error: ErrorRecord | None = None
    exit_code: int | None = None
    signal: str | None = None
    ended: Stamp | None = None
    banner_root: bool = False

    def markers(self) -> list[Hit]:
        return [h for h in self.hits if h.cause == SECONDARY_ID]

    def stamps(self) -> dict[str, float]:
        """The earliest moment this rank showed trouble, per clock."""
        stamps = [h.stamp for h in self.hits] + [x.stamp for x in self.exits]
        stamps += [self.error.stamp] if self.error is not None else []
        stamps += [self.ended] if self.exit_code not in (None, 0) else []
        found: dict[str, float] = {}
        for stamp in (s for s in stamps if s is not None):
            found[stamp.kind] = min(stamp.seconds, found.get(stamp.kind, stamp.seconds))
        return found


@dataclass
class _RankCause:
    state: _Rank
    cause: Cause
    confidence: float
    hits: list[Hit]
    order: int
    secondary: bool = False
    exception: ExceptionLine | None = None


@dataclass(frozen=True)
class Ranking:
    """The outcome: the causes found (root first) and a per-rank summary."""

    causes: tuple[FoundCause, ...]
    ranks: tuple[RankSummary, ...]
    failed: bool
    notes: tuple[str, ...]


def _collect(
    scans: Sequence[SourceScan], errors: Sequence[ErrorRecord], run: RunInfo | None
) -> dict[int | None, _Rank]:
    states: dict[int | None, _Rank] = {}
    single_node = run is None or (run.nnodes or 1) == 1

    def state(rank: int | None) -> _Rank:
        return states.setdefault(rank, _Rank(rank))

    def exit_rank(ex: ExitRecord) -> int | None:
        # One node: the local rank torchrun names is the global rank.
        return ex.rank if ex.rank is not None or not single_node else ex.local_rank

    at_exit = {
        (ex.source, ex.lineno): rank
        for scan in scans
        for ex in scan.exits
        if (rank := exit_rank(ex)) is not None
    }
    for scan in scans:
        for hit in scan.hits:
            rank = hit.rank if hit.rank is not None else at_exit.get((hit.source, hit.lineno))
            if rank is None and hit.local_rank is not None and single_node and len(scans) == 1:
                rank = hit.local_rank  # NCCL's device index stands for the rank on one node
            state(rank).hits.append(hit)
        for exc in scan.exceptions:
            state(exc.rank).exceptions.append(exc)
        for ex in scan.exits:
            s = state(exit_rank(ex))
            s.exits.append(ex)
            s.banner_root = s.banner_root or ex.root
            s.exit_code = ex.exit_code if s.exit_code is None else s.exit_code
            s.signal = s.signal or ex.signal
    for record in errors:
        state(record.rank).error = record
    if run is not None:
        for r in run.ranks:
            s = state(r.rank)
            s.exit_code = r.exit_code if r.exit_code is not None else s.exit_code
            s.signal = r.signal or s.signal  # else the exit code's, below
            s.ended = r.stamp
    for s in states.values():
        s.hits = _most_specific(s.hits)
        if s.signal is None and s.exit_code is not None:
            s.signal = SIGNAL_OF_CODE.get(s.exit_code)
    return states


def _most_specific(hits: list[Hit]) -> list[Hit]:
    """One cause per line, the highest priority: "Torch not compiled with CUDA enabled" is
    a CPU build (``cpu_torch``), not also a driver problem. Only primary causes speak for
    their line: echoes (NCCL errors, timeouts) keep their ranking among themselves."""
    best: dict[tuple[str, int | None], int] = {}
    for h in hits:
        if _primary(h) and h.lineno is not None:
            key = (h.source, h.lineno)
            best[key] = max(best.get(key, 0), cause(h.cause).priority)
    return [
        h
        for h in hits
        if h.cause == SECONDARY_ID or cause(h.cause).priority >= best.get((h.source, h.lineno), 0)
    ]


def _rank_cause(s: _Rank) -> _RankCause | None:
    if primary := [h for h in s.hits if _primary(h)]:
        # The rank's log shows the first symptom; its error file only the last exception.
        first = min(primary, key=lambda h: (h.source.startswith("error-"), h.order))
        same = [h for h in primary if h.cause == first.cause]
        best = max(h.confidence for h in same)
        return _RankCause(s, cause(first.cause), best, same, first.order)
    if s.signal in _SIGNAL_CAUSES:
        cause_id, confidence = _SIGNAL_CAUSES[s.signal]
        return _RankCause(s, cause(cause_id), confidence, [], _LAST)
    explained = {(h.source, h.lineno) for h in s.hits}  # exception lines a hit matched
    own = sorted(
        (e for e in s.exceptions if not e.launcher and (e.source, e.lineno) not in explained),
        key=lambda e: e.order,
    )
    symptoms = [h for h in s.hits if h.cause != SECONDARY_ID and not _primary(h)]
    secondary = [h for h in symptoms if not h.consequence] or symptoms
    # Among symptoms, the most telling one (a collective timeout over the generic
    # DistBackendError wrapping it), then the earliest.
    telling = min(secondary, key=lambda h: (-h.confidence, h.order)) if secondary else None
    earliest = min((h.order for h in secondary), default=None)
    if own and (earliest is None or own[0].order < earliest):
        # The rank raised something of its own before any sign of a peer's failure.
        return _RankCause(s, UNKNOWN, 0.3, [], own[0].order, exception=own[0])
    if telling is not None:
        same = [h for h in secondary if h.cause == telling.cause]
        best = max(h.confidence for h in same)
        return _RankCause(s, cause(telling.cause), best, same, telling.order, secondary=True)
    if s.exit_code not in (None, 0) and s.signal not in ("SIGTERM", "SIGINT") and not s.markers():
        return _RankCause(s, UNKNOWN, 0.2, [], _LAST)
    return None


def _merge_unranked(rank_causes: list[_RankCause]) -> list[_RankCause]:
    """The cause found in unprefixed lines, given to the ranks known only by their exit
    code: a plain log interleaves tracebacks, while torchrun's banner names the ranks."""
    loose = next((v for v in rank_causes if v.state.rank is None and not v.secondary), None)
    if loose is None or (loose.cause is UNKNOWN and loose.exception is None):
        return rank_causes
    ranked = [v for v in rank_causes if v.state.rank is not None]
    takers = [
        v
        for v in ranked
        if v.cause is loose.cause or (v.cause is UNKNOWN and v.exception is None and not v.hits)
    ]
    if not takers:
        return rank_causes
    for v in takers:
        v.cause = loose.cause
        v.confidence = max(v.confidence, loose.confidence)
        v.hits = v.hits + loose.hits
        v.order = min(v.order, loose.order)
        v.exception = v.exception or loose.exception
    return [v for v in rank_causes if v is not loose]


def _tiebreak(v: _RankCause) -> tuple[bool, int]:
    """Ties broken by torchrun's "Root Cause" banner, then by the more specific cause."""
    return not v.state.banner_root, -v.cause.priority


def _pick_root(rank_causes: list[_RankCause]) -> tuple[_RankCause, bool]:
    """The first failing rank among ``rank_causes``; the flag says if a clock decided it."""
    stamps = {id(v): v.state.stamps() for v in rank_causes}
    for clock in _CLOCKS:
        if len(rank_causes) > 1 and all(clock in stamps[id(v)] for v in rank_causes):
            best = min(rank_causes, key=lambda v: (stamps[id(v)][clock], *_tiebreak(v), v.order))
            return best, True
    sources = {h.source for v in rank_causes for h in v.hits} | {
        v.exception.source for v in rank_causes if v.exception is not None
    }
    if len(sources) <= 1:
        return min(rank_causes, key=lambda v: (v.order, -v.cause.priority)), True
    best = min(rank_causes, key=lambda v: (*_tiebreak(v), -v.confidence, v.order))
    return best, len(rank_causes) == 1 or best.state.banner_root


def _evidence(hits: Sequence[Hit], limit: int) -> tuple[Evidence, ...]:
    first: dict[tuple[str, int | None], Hit] = {}  # one per line, the log's before its error file
    for h in sorted(hits, key=lambda h: (h.source.startswith("error-"), h.order)):
        first.setdefault((h.source, h.lineno), h)
    return tuple(Evidence(h.source, h.lineno, h.text, h.rank) for h in [*first.values()][:limit])


def _traceback(v: _RankCause) -> tuple[str, ...]:
    if v.exception is not None and v.exception.traceback:
        return v.exception.traceback[-24:]
    if v.state.error is not None and v.state.error.callstack:
        lines = [line for line in v.state.error.callstack.splitlines() if line.strip()]
        return tuple(lines[-24:])
    for exc in sorted(v.state.exceptions, key=lambda e: e.order):
        if exc.traceback and not exc.launcher:
            return exc.traceback[-24:]
    return ()


def _unknown_evidence(v: _RankCause) -> tuple[Evidence, ...]:
    if (e := v.exception) is not None:
        return (Evidence(e.source, e.lineno, e.text, e.rank),)
    if v.state.error is not None:
        return (Evidence(v.state.error.path.name, None, v.state.error.message, v.state.rank),)
    for ex in v.state.exits:
        text = f"exitcode {ex.exit_code}" + (f" ({ex.signal})" if ex.signal else "")
        return (Evidence(ex.source, ex.lineno, text, v.state.rank),)
    return ()


def _ranks(ranks: Iterable[int | None]) -> tuple[int, ...]:
    return tuple(sorted({r for r in ranks if r is not None}))


def rank_failures(
    scans: Sequence[SourceScan],
    errors: Sequence[ErrorRecord],
    run: RunInfo | None,
    *,
    max_evidence: int = 5,
    world_size: int | None = None,
) -> Ranking:
    states = _collect(scans, errors, run)
    rank_causes = _merge_unranked([v for s in states.values() if (v := _rank_cause(s)) is not None])
    notes: list[str] = []
    clean_exit = (
        run is not None
        and bool(run.ranks)
        and all(r.exit_code == 0 for r in run.ranks)
        and not run.agent_exit_code
    )
    if clean_exit and rank_causes:
        notes.append("errors were logged, but every rank exited with code 0")
        rank_causes = []
    if not rank_causes:
        return Ranking((), _summaries(states, None, {}), failed=False, notes=tuple(notes))
    own = [v for v in rank_causes if not v.secondary]
    if own:
        root, by_clock = _pick_root(own)
    else:
        # Only symptoms: the most telling one stands in for the (unseen) root cause.
        root, by_clock = min(rank_causes, key=lambda v: (-v.confidence, v.order)), False
    root_rank = root.state.rank
    confidence = root.confidence
    if root.state.error is not None and any(h.source.startswith("error-") for h in root.hits):
        confidence = min(0.99, confidence + 0.03)  # the rank's own error file agrees
    rivals = {v.cause.id for v in own if v.state.rank != root_rank and v.cause.id != root.cause.id}
    if rivals and not by_clock:
        confidence *= 0.8
        notes.append(
            "no timestamps order the failing ranks; the more specific cause was taken as the root"
        )
    root_hits = [h for s in states.values() for h in s.hits if h.cause == root.cause.id]
    evidence = _evidence([h for h in root_hits if h.rank == root_rank] + root_hits, max_evidence)
    evidence = evidence or _unknown_evidence(root)
    ranks = _ranks(v.state.rank for v in rank_causes if v.cause is root.cause)
    # Each hit with the lines after it: a message wrapped over lines keeps its numbers.
    first_hits = sorted(root_hits, key=lambda h: h.order)[:max_evidence]
    texts = [" ".join([h.text, *h.context]) for h in first_hits]
    # Traceback lines name the interpreter and the torch the ranks ran.
    frames = [line for s in states.values() for e in s.exceptions for line in e.traceback]
    python = run.python if run is not None else None
    found = root.cause.found(
        "root",
        confidence,
        ranks=ranks,
        first_rank=root_rank,
        evidence=evidence,
        details=specifics(root.cause.id, texts, ranks, world_size, frames=frames, python=python),
        traceback=_traceback(root),
    )
    if concrete := install_fixes(root.cause.id, texts, frames, python):
        # The command with the ranks' own interpreter replaces the generic install advice.
        rest = [f for f in found.fixes if "pip install" not in f]
        found = replace(found, fixes=(*concrete, *rest))
    causes = (found, *_others(states, root, max_evidence))
    summaries = _summaries(states, root, {v.state.rank: v for v in rank_causes})
    return Ranking(causes, summaries, failed=True, notes=tuple(notes))


def _others(
    states: dict[int | None, _Rank], root: _RankCause, max_evidence: int
) -> list[FoundCause]:
    by_cause: dict[str, list[Hit]] = {}
    for s in states.values():
        for h in s.hits:
            if h.cause not in (SECONDARY_ID, root.cause.id):
                by_cause.setdefault(h.cause, []).append(h)
    out = []
    for cause_id, hits in by_cause.items():
        c = cause(cause_id)
        consequence = c.secondary or all(h.consequence for h in hits)
        role = "consequence" if consequence else "also"
        confidence = max(h.confidence for h in hits) * (0.4 if consequence else 0.6)
        ranks = _ranks(h.rank for h in hits)
        evidence = _evidence(hits, max_evidence)
        out.append(c.found(role, confidence, ranks=ranks, first_rank=None, evidence=evidence))
    out.sort(key=lambda f: (f.role != "also", -f.confidence))
    return out


def _summaries(
    states: dict[int | None, _Rank],
    root: _RankCause | None,
    rank_causes: dict[int | None, _RankCause],
) -> tuple[RankSummary, ...]:
    out = []
    for rank in sorted(r for r in states if r is not None):
        s = states[rank]
        v = rank_causes.get(rank)
        if root is not None and rank == root.state.rank:
            role = "root"
        elif v is not None and (v.secondary or s.signal == "SIGTERM"):
            role = "secondary"
        elif v is not None:
            role = "failed"
        elif s.exit_code is None and not s.hits:
            role = "unknown"
        elif s.exit_code == 0:
            role = "ok"
        else:
            role = "secondary" if s.markers() or s.signal == "SIGTERM" else "unknown"
        out.append(RankSummary(rank, s.exit_code, s.signal, v.cause.id if v else None, role))
    return tuple(out)
