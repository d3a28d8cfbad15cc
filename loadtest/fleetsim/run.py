"""One policy on a fresh simulated fleet over a whole workload, in virtual time.

`run_policy` builds N ``ReplicaEngine``s in one ``VirtualFleet``, a fresh embedded
index (``prefix_index.local_index.embedded_index``; its session clock is the virtual clock) and a fresh policy
(``policies.registry.make_policy``), then lets `loadtest.fleetsim.sessions` send the
workload's turns. Each turn becomes a ``RequestContext`` exactly as the gateway would
build it (session keys from the session's headers by ``gateway.context.session_keys``,
block hashes, prompt size, ``max_tokens``) and a ``SimRequest`` (``ignore_eos``: the
trace's output length) for the engine the policy picked (`loadtest.fleetsim.router`).

Streaming: the request is submitted with ``stream="first"``: the engine reports the
first token only (the gateway's lease moves from prefill to decode then) and renders no
token ids after it.

Accept length: the turns of a *prose* workload (``PROSE_WORKLOADS``: Mooncake's and
Bailian's chat traces) are ``SimRequest.prose`` (decoded at the profile's prose accept
length, `Profile.accept_length`); every other workload (Claude Code, synthetic) is
coding-agent traffic, decoded at ``spec_accept_length``.

Admission (``SimConfig.admission``, the gateway's ``admission`` settings, on by default):
the routed turn goes through `loadtest.fleetsim.admission` (the gateway's rule in virtual
time): sent at once, or held and sent when its replica's released prefill drops below
the budget, smallest predicted prefill first, at most ``max_wait_s`` later.

Index mode (``SimConfig.index_mode``): ``approximate`` (the gateway's prediction from its
own decisions, above) or ``precise`` (`loadtest.fleetsim.precise`: the engines publish
their KV events into an ``EventBlockIndex``; before each decision every engine is brought
to the decision's time, so the index holds every event up to it, and the request is
matched with SGLang's page hashes of its token ids). The summary's
``prediction_within_page`` is the share of served requests whose predicted cached tokens
are within one page of what the engine then reported.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.admission import AdmissionConfig
from gateway.context import HashingConfig, SessionConfig, session_keys
from gateway.settings import POLICIES_NEEDING_ROUTING_TEXT
from loadtest.fleetsim.admission import SimAdmission
from loadtest.fleetsim.metrics import Record, summarize
from loadtest.fleetsim.oracle import Oracle
from loadtest.fleetsim.precise import PreciseFleetIndex, SglangPages
from loadtest.fleetsim.prompts import TEXT_CHARS_PER_BLOCK, SessionPrompt
from loadtest.fleetsim.router import SimRouter
from loadtest.fleetsim.sessions import Done, Pacing, start_closed_loop, start_open_loop
from loadtest.fleetsim.tail import tail_breakdown
from loadtest.simulator.clock import VirtualFleet
from loadtest.simulator.engine import ReplicaEngine, RequestResult, SimRequest
from loadtest.simulator.profile import Profile
from loadtest.workload import Session, Workload
from policies.base import Decision, Outcome, RequestContext, SessionKeys
from policies.registry import make_policy
from policies.sglang_cache_aware import SglangParams
from prefix_index.base import ReplicaId
from prefix_index.config import IndexConfig
from prefix_index.local_index import embedded_index
from replicas.admission import Ticket
from replicas.load import LoadLease
from replicas.probe import Capacity
from replicas.speed import ReplicaSpeed, fleet_seed

PROSE_WORKLOADS = frozenset({"mooncake", "bailian"})  # chat traffic, not coding agents (module docstring)


@dataclass(frozen=True)
class SimConfig:
    profile: Profile
    replicas: int = 8
    gpus_per_replica: int = 8
    pacing: Pacing = field(default_factory=Pacing)
    seed: int = 0
    max_requests: int | None = None
    sim_duration_s: float | None = None
    loads_poll_interval_s: float = 1.0
    policy_params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    index_mode: str = "approximate"  # or "precise" (loadtest.fleetsim.precise)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # the gateway's (gateway.admission)
    # a mixed fleet: replica i runs replica_profiles[i] (empty: every replica runs ``profile``)
    replica_profiles: tuple[Profile, ...] = ()
    # "learned": each replica's speed learned as the gateway learns it (replicas/speed.py, seeded
    # from the fleet constants, its reported accept length read); "no-accept": the same without
    # reading the accept length (the per-stream rate alone); "fleet": the policy prices every
    # replica at its constants
    speeds: str = "learned"

    def profiles(self) -> tuple[Profile, ...]:
        """Replica i's profile, for every replica."""
        return self.replica_profiles or (self.profile,) * self.replicas


@dataclass
class SimRunResult:
    policy: str
    records: list[Record]
    summary: dict[str, Any]
    wall_s: float


class _Conv:
    """Per conversation: its prompt state, session keys and routing key."""

    __slots__ = ("keys", "prompt", "sglang")

    def __init__(self, session: Session, max_tokens_hashed: int, want_text: bool, page_size: int | None) -> None:
        bs = session.block_size
        self.prompt = SessionPrompt(session.namespace, session.id, bs,
                                    max(1, max_tokens_hashed // bs), want_text)
        self.keys: SessionKeys = session_keys(session.headers, None, SessionConfig())
        self.sglang = SglangPages(page_size) if page_size else None  # precise mode only


class _InFlight:
    """The engine's listener for one request (and the gateway's lease for it)."""

    __slots__ = ("ctx", "decision", "lease", "on_done", "rec", "run", "ticket")

    def __init__(self, run: FleetRun, rec: Record, ctx: RequestContext, decision: Decision,
                 lease: LoadLease, on_done: Done) -> None:
        self.run, self.rec, self.ctx, self.decision = run, rec, ctx, decision
        self.lease, self.on_done = lease, on_done
        self.ticket: Ticket | None = None  # its place in prefill admission

    def on_tokens(self, rid: str, token_ids: Any, now_s: float) -> None:
        if self.rec.first_token_s is None:
            self.rec.first_token_s = now_s
            self.lease.first_byte()
            self.run.admission.started(self.ticket)

    def on_finish(self, result: RequestResult, now_s: float) -> None:
        self.run.finished(self, result, now_s)


class FleetRun:
    """One policy, one fresh fleet and index; implements `sessions.Sender`."""

    def __init__(self, workload: Workload, policy_name: str, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.workload = workload
        prof = cfg.profile
        profiles = cfg.profiles()
        self.engines = [ReplicaEngine(pr, seed=cfg.seed + i) for i, pr in enumerate(profiles)]
        self.fleet = VirtualFleet(self.engines)
        # the index's session clock is the virtual clock; block hashes are chains (the traces'
        # hash ids are: equal id = equal prefix), as the gateway's are
        self.index = embedded_index(IndexConfig(), chains=True, clock=self._now)
        block = workload.sessions[0].block_size if workload.sessions else 64
        self.want_text = policy_name in POLICIES_NEEDING_ROUTING_TEXT
        self.policy = make_policy(policy_name, self._params(policy_name, block), cfg.seed)
        specs = [Capacity(pr.device_tokens, pr.host_tokens, pr.page_size, pr.max_running_requests,
                          pr.served_model_name, context_tokens=pr.context_length) for pr in profiles]
        self.memory_bound = [s.memory_bound for s in specs]
        ids = [ReplicaId(f"sim-{i}") for i in range(len(profiles))]
        self.admission = SimAdmission(cfg.admission, self.fleet)
        seed = fleet_seed(cfg.policy_params.get(policy_name) or {})  # as the gateway seeds them
        self.speeds = None if cfg.speeds == "fleet" else [
            ReplicaSpeed.seeded(*seed, read_accept=cfg.speeds == "learned") for _ in ids]
        self.router = SimRouter(self.policy, self.index, ids, specs, self.fleet.snapshot, block, cfg.seed,
                                cfg.loads_poll_interval_s, held_prefill=self.admission.held, speeds=self.speeds,
                                speculative=[pr.spec_algorithm is not None for pr in profiles])
        self.precise: PreciseFleetIndex | None = None
        if cfg.index_mode == "precise":
            self.precise = PreciseFleetIndex(prof.page_size)
            for engine, rid in zip(self.engines, ids):
                engine.attach_events(self.precise.recorder(rid))
        h = HashingConfig()
        self.max_tokens_hashed = int(h.max_blocks * h.block_chars / h.chars_per_token)
        self.oracle = Oracle()
        self.records: list[Record] = []
        self.convs: dict[str, _Conv] = {}
        self.sent = 0
        self.prose = workload.name in PROSE_WORKLOADS

    def _now(self) -> float:
        return self.fleet.now_s

    def _params(self, name: str, block_size: int) -> dict[str, Any]:
        """The policy's params; a text policy's character budget scaled like its text."""
        params = dict(self.cfg.policy_params.get(name) or {})
        if self.want_text:
            scale = TEXT_CHARS_PER_BLOCK / (4 * block_size)
            params.setdefault("max_tree_chars", max(1, int(SglangParams().max_tree_chars * scale)))
        return params

    # -- sessions.Sender ---------------------------------------------------------------
    def stopped(self, now_s: float) -> bool:
        c = self.cfg
        return (c.max_requests is not None and self.sent >= c.max_requests) or (
            c.sim_duration_s is not None and now_s >= c.sim_duration_s)

    def send(self, session: Session, turn: int, now_s: float, on_done: Done) -> None:
        self.sent += 1
        conv = self.convs.get(session.id)
        if conv is None:
            conv = self.convs[session.id] = _Conv(session, self.max_tokens_hashed, self.want_text,
                                                  self.cfg.profile.page_size if self.precise else None)
        t = session.turns[turn]
        prompt = conv.prompt
        prompt.advance(t.shared_blocks, t.new_hash_ids)
        if conv.sglang is not None:
            conv.sglang.truncate(t.shared_blocks * session.block_size)
        if turn == len(session.turns) - 1:
            del self.convs[session.id]
        rec = Record(session.id, turn, session.parent is not None, now_s, t.in_tokens)
        self.records.append(rec)
        ctx = self._context(session, conv, turn, t.in_tokens, t.out_tokens)
        ids = prompt.prompt_ids(t.in_tokens, turn)
        routed = self.router.route(ctx, now_s, self._precise_matches(conv, ids))
        if routed is None:
            rec.rejected = True
            on_done(now_s)
            return
        decision, lease = routed
        slot = self.router.slot(decision.replica)
        rec.replica, rec.reason = slot, decision.reason
        rec.predicted_cached = decision.predicted_cached_tokens
        hashes = prompt.hashes
        matched = self.oracle.match_blocks(hashes)
        rec.oracle_cached = min(matched * session.block_size, t.in_tokens)
        req = SimRequest(ctx.request_id, ids, t.out_tokens, ignore_eos=True, seed=self.cfg.seed,
                         stream="first", page_hashes=prompt.page_hashes(ids, self.cfg.profile.page_size),
                         prose=self.prose)
        f = _InFlight(self, rec, ctx, decision, lease, on_done)
        f.ticket = self.admission.offer(decision.replica, lease.predicted_uncached_tokens, ctx.stream, now_s,
                                        self.memory_bound[slot])
        self.admission.send_or_hold(f.ticket, lambda: self.fleet.submit(slot, req, f))
        if not rec.rejected:
            self.oracle.record(hashes, matched)

    def _precise_matches(self, conv: _Conv, ids: Any) -> dict[ReplicaId, Any] | None:
        """Precise mode: every engine brought to now (its events applied), then the match."""
        if self.precise is None or conv.sglang is None:
            return None
        for i in range(len(self.engines)):
            self.fleet.snapshot(i)
        return self.precise.matches(conv.sglang.hashes(ids, conv.prompt.tokens), self.router.ids)

    def _context(self, session: Session, conv: _Conv, turn: int, in_tokens: int,
                 out_tokens: int) -> RequestContext:
        p = conv.prompt
        hashes = p.block_hashes()
        keys = conv.keys
        routing_key = keys.session or (f"p:{hashes[0]:016x}" if hashes else f"p:{p.key:016x}")
        return RequestContext(
            request_id=f"{session.id}#{turn}", endpoint="chat", model=self.cfg.profile.served_model_name,
            session=keys, block_hashes=hashes, prompt_chars=in_tokens * 4, est_prompt_tokens=in_tokens,
            block_tokens=session.block_size, max_tokens=out_tokens, stream=True,
            routing_key=routing_key, routing_text=p.routing_text(in_tokens, turn),
        )

    # -- completion --------------------------------------------------------------------
    def finished(self, f: _InFlight, result: RequestResult, now_s: float) -> None:
        rec = f.rec
        rec.finish_s = now_s
        f.lease.release()
        self.admission.done(f.ticket)
        stream_s = None
        if result.finish_reason == "abort":
            rec.rejected = True
            outcome = Outcome(ok=False, status=503)
        else:
            rec.completion_tokens = result.completion_tokens
            rec.cached_device, rec.cached_host = result.cached_device, result.cached_host
            rec.first_token_s = result.first_token_s
            ttft = None if result.first_token_s is None else result.first_token_s - rec.arrival_s
            stream_s = None if result.first_token_s is None else now_s - result.first_token_s
            outcome = Outcome(ok=True, status=200, prompt_tokens=result.prompt_tokens,
                              cached_tokens=result.cached_tokens,
                              completion_tokens=result.completion_tokens, ttft_s=ttft)
        if outcome.ok:
            self.admission.observe(f.decision.replica, f.decision.predicted_cached_tokens, outcome.cached_tokens,
                                   outcome.prompt_tokens)
        self.router.completed(f.ctx, f.decision, outcome, now_s, stream_s)
        f.on_done(now_s)

    # -- the run -----------------------------------------------------------------------
    def run(self) -> SimRunResult:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        if self.workload.open_loop:
            start_open_loop(self.workload, self.fleet, self)
        else:
            start_closed_loop(self.workload, self.fleet, self, self.cfg.pacing)
        self.fleet.run()
        stats = [e.snapshot() for e in self.engines]
        cfg = self.cfg
        summary = summarize(self.records, cfg.replicas, cfg.replicas * cfg.gpus_per_replica,
                            [s.total_prefill_busy_s for s in stats],
                            sum(s.total_prefill_uncached_tokens for s in stats))
        wall = time.perf_counter() - wall0
        name = self.policy.name if cfg.index_mode == "approximate" else f"{self.policy.name} ({cfg.index_mode})"
        summary.update(policy=name, index=cfg.index_mode, prediction_within_page=self._prediction_share(),
                       wall_s=wall, cpu_s=time.process_time() - cpu0, load_polls=self.router.polls,
                       evicted_tokens=sum(s.evicted_tokens_total for s in stats),
                       host_dropped_tokens=sum(s.host_dropped_tokens_total for s in stats),
                       ttft_tail=tail_breakdown(self.records), speeds=self._speeds())
        return SimRunResult(self.policy.name, self.records, summary, wall)

    def _speeds(self) -> list[dict[str, Any]] | None:
        """Each replica's learned figures at the end, beside its profile's."""
        if self.speeds is None:
            return None
        return [{"profile": pr.name, "prefill_tokens_per_s": round(sp.prefill_tokens_per_s),
                 "profile_prefill_tokens_per_s": pr.prefill_tokens_per_s,
                 "decode_step_s": round(sp.decode_step_s, 4), "profile_decode_step_base_s": pr.decode_step_base_s,
                 "spec_accept_length": None if sp.spec_accept_length is None else round(sp.spec_accept_length, 3),
                 "profile_spec_accept_length": pr.accept_length(self.prose)}
                for sp, pr in zip(self.speeds, self.cfg.profiles(), strict=True)]

    def _prediction_share(self) -> float | None:
        page = self.cfg.profile.page_size
        served = [r for r in self.records if not r.rejected and r.finish_s is not None]
        if not served:
            return None
        return sum(abs(r.predicted_cached - r.cached) <= page for r in served) / len(served)


def run_policy(workload: Workload, policy_name: str, cfg: SimConfig) -> SimRunResult:
    """Simulate one policy over the workload on a fresh fleet and index."""
    return FleetRun(workload, policy_name, cfg).run()
