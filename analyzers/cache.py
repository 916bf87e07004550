"""Cache verdict: why did this request's prefix-cache lookup reuse what it reused?

Definitions (the contract; tests check them):
- ``cached`` = prompt tokens reused; ``seen`` = the longest prefix of this prompt that any earlier
  request on any instance had (as prompt or stored entry), at block granularity; a prefix is
  *longer* than ``cached`` when it covers at least one block more; on an instance that reuses whole
  blocks of G tokens coarser than the fingerprint's (vLLM; G from its heartbeat: byte limit / entry
  limit / KV bytes per token), only whole G-blocks of what its entry shared with the prompt count.
- ``cause``, the first that holds:
  ``capacity``        a longer prefix was cached on this instance and evicted before the lookup;
  ``restart``         a longer prefix was cached on this instance, no eviction of it was reported,
                      and the instance loaded its model between that insert and the lookup;
  ``instance_change`` a longer prefix was never cached on this instance but was cached on another;
  ``prefix_change``   an earlier request shares later segments (same content hashes) but diverges
                      before them, where this prompt's reuse stopped: the first segment that
                      differs (or ``template`` when no message differs) and a token inside it; or
                      everything an earlier prompt had was reused, and it had the message this
                      prompt's reuse stopped in, shared at least a block of it and differs inside
                      it, with more input after it here (an edited system prompt, one-shot);
  ``model_change``, ``template_change``  the session's previous turn was served by another model
                      revision / chat template and its prompt differs from this one inside the
                      first segment;
  ``too_short``       nothing reusable: the prompt, or the leading segments it shares with an
                      earlier prompt, is shorter than one cache block;
  ``new_prefix``      nothing reusable was ever cached and nothing resembles the prompt;
  None                everything reusable was reused (shown as ``none``: ``NO_CAUSE``).
  ``unknown`` when the engine sends no prompt fingerprint (e.g. vLLM's native spans), or when no
                      observer measured how many tokens were reused.
- ``cached``: the lookup's matched tokens; where the lookup lacks them (a gateway in front of an
  engine whose response leaves them out), the request row's cached tokens (the engine's own count,
  e.g. the vLLM plugin's), in the lookup's unit; where neither says, unknown (None), never 0.
- ``result``: hit when cause is None, partial when cached > 0, miss when cached = 0; ``unknown``
  when cached is unknown; None for a request that never reached the cache (refused, failed or
  cancelled before its lookup).

``load_cache_facts`` reads through the reader role (``rows``: no frames, so that ``analyze cache
--db`` imports no polars or pyarrow); ``classify_cache`` is a pure function of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokentrace import contract as c
from tokentrace.analyzers.evidence import NO_CAUSE, Evidence, fmt_bytes  # noqa: F401 - NO_CAUSE is re-exported
from tokentrace.analyzers.live import not_found
from tokentrace.analyzers.outcome import COMPLETED, outcome_of
from tokentrace.analyzers.upstream import upstream_evidence
from tokentrace.collector.stores.store import TraceReader

CAUSES = ("capacity", "restart", "instance_change", "prefix_change", "model_change", "template_change",
          "too_short", "new_prefix", None, "unknown")
#: The segment role a divergence names when no message differs, only what lies between them.
TEMPLATE = "template"


@dataclass(frozen=True)
class Divergence:
    """Where a prompt first differs from an earlier one that shares later content."""

    token_index: int  #: a token of the first differing segment, at or before the first differing token
    segment_role: str | None  #: role of the first differing segment (system, user ...), or ``template``
    segment_index: int | None  #: index of that segment in the prompt (0 = first); None for ``template``


@dataclass
class CacheVerdict:
    """The cache verdict of one request (schema in the module docstring)."""

    request_id: str
    instance_id: str | None
    prompt_tokens: int | None  #: None when no observer counted them
    cached_tokens: int | None  #: prompt tokens reused; None when no observer measured it
    seen_tokens: int | None  #: None when cached_tokens is unknown and nothing earlier was seen
    result: str | None  #: hit | partial | miss | unknown; None when the request never reached the cache
    cause: str | None  #: one of CAUSES
    evidence: list[Evidence] = field(default_factory=list)
    evicted_by: str | None = None  #: request whose insert evicted the longer prefix (capacity)
    cached_on: str | None = None  #: instance holding the longer prefix (instance_change)
    divergence: Divergence | None = None  #: first divergence (prefix_change)
    block_size: int = c.DEFAULT_BLOCK_SIZE
    outcome: str = COMPLETED  #: the request's outcome (outcome.outcome_of)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (evidence flattened to {kind, text, ...})."""
        return {
            "request_id": self.request_id, "instance_id": self.instance_id,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "seen_tokens": self.seen_tokens, "result": self.result, "cause": self.cause,
            "evidence": [e.as_dict() for e in self.evidence], "evicted_by": self.evicted_by,
            "cached_on": self.cached_on,
            "divergence": None if self.divergence is None else vars(self.divergence),
            "block_size": self.block_size, "outcome": self.outcome,
        }


@dataclass
class CacheFacts:
    """Everything the cache verdict needs, read from the store."""

    request: dict  #: the requests row
    lookup: dict | None  #: the cache_lookups row; None when the engine sent no fingerprint
    hashes: list[int]  #: chained block hashes of the prompt
    segments: list[dict]  #: the prompt's segments (segments_of rows)
    seen: dict | None  #: the deepest block any earlier prompt or entry had, and who had it first
    cached_on: list[dict]  #: per instance, the deepest block an entry stored there before held
    eviction: dict | None  #: the eviction of this instance's entry holding a longer prefix, if found
    evicted_elsewhere: set[tuple[str | None, int]]  #: (instance, fingerprint) of other entries gone by then
    segment_matches: list[dict]  #: earlier segments with equal content hashes (segment_matches rows)
    divergences: dict[str, int]  #: earlier request id -> token where its prompt first differs
    earlier_segments: dict[str, list[dict]] = field(default_factory=dict)  #: their segments, by request
    loads: list[dict] = field(default_factory=list)  #: this instance's model loads after its longer entry
    previous: dict | None = None  #: the session's previous turn: request_id, identity, divergence
    identity: dict = field(default_factory=dict)  #: this request's model revision and template hash
    #: tokens per cache block of this instance where it reuses whole blocks coarser than the
    #: fingerprint's (vLLM: its heartbeat's entry size); None: the fingerprint's block
    granularity: int | None = None
    #: the earlier *prompt* (a lookup, not an entry) that shared the most blocks with this one, and
    #: its segments: read only when this prompt's reuse ended inside a message that input follows
    seen_prompt: dict | None = None
    seen_prompt_segments: list[dict] = field(default_factory=list)
    #: earlier segments that end like the one this prompt's reuse stopped in (tail_matches rows):
    #: read only when it stopped inside the first block
    tail_matches: list[dict] = field(default_factory=list)
    #: a distributed instance's nodes as their heartbeats stood when its longer entry went (its
    #: eviction, else this lookup): node_heartbeats_at rows, one per rank; [] for one process
    nodes: list[dict] = field(default_factory=list)
    #: on a distributed instance, the rank whose bytes its cache's byte limit counted at that eviction,
    #: as the insert that evicted the entry declares it (tokentrace.cache.limit_rank, its row's
    #: cache_inserts.limit_rank); None where it does not (an engine older than the declaration, whose
    #: limit counted rank 0's) or its row has none (stored before the column, collector/stores/sql)
    limit_rank: int | None = None


def request_window(request: dict) -> dict[str, int]:
    """The request's own time span (plus a second): child rows lie inside, and the bounds let the
    store skip row groups by their min/max times instead of scanning whole tables."""
    return {"t0_ns": request["start_ns"] - 1_000_000_000, "t1_ns": request["end_ns"] + 1_000_000_000}


def load_cache_facts(reader: TraceReader, request_id: str) -> CacheFacts:
    """Read the facts of one request; NotFound when the store has no such request.

    After the request's own rows, three branches that do not depend on one another run together
    (``TraceReader.together``): where the prompt's blocks were seen and cached, and what became of
    those entries; the earlier prompts sharing its segments; the session's previous turn and the
    model identity on both sides."""
    request = reader.request(request_id)
    if request is None:
        raise not_found(reader, request_id)
    request_id = request["request_id"]  # the request's own id, should an alias have been given
    window = request_window(request)
    lookups, blocks, segments = reader.together(
        lambda: reader.rows("cache_lookup", request_id=request_id, **window),
        lambda: reader.rows("lookup_blocks", request_id=request_id, **window),
        lambda: reader.rows("segments_of", request_id=request_id, **window))
    if not lookups:
        return CacheFacts(request, None, [], [], None, [], None, set(), [], {})
    lookup = lookups[0]
    t, block = lookup["start_ns"], lookup["block_size"] or c.DEFAULT_BLOCK_SIZE
    prompt, (cached, _) = lookup["prompt_tokens"] or 0, reused_tokens(lookup, request)
    if cached is None:  # nothing to explain by: the verdict is unknown (classify_cache)
        return CacheFacts(request, lookup, [], segments, None, [], None, set(), [], {})
    hashes = [row["hash"] for row in blocks]
    # A message edited near its start is found by its tail only where less than a block was reused.
    stopped_in = _holding(segments, cached) if cached < block else None
    tail = stopped_in.get("tail_hash") if stopped_in else None
    # Only a lookup that reused less than a block can be a model or template change.
    (seen, seen_prompt, cached_on, eviction, loads, evicted_elsewhere, granularity, nodes, limit_rank), \
        (matches, divergences, earlier), (identity, previous), tails = \
        reader.together(lambda: _reach(reader, request, hashes, t, block, prompt, cached),
                        lambda: _shared_segments(reader, request_id, segments, hashes, t, cached, block),
                        lambda: _turns(reader, request, hashes, block) if cached < block else ({}, None),
                        lambda: reader.rows("tail_matches", tails=[tail], before_ns=t, request_id=request_id)
                        if tail is not None else [])
    prompt_segments: list[dict] = []
    if seen_prompt is not None and _edited_at(segments, seen_prompt["diverge"]) is not None:
        prompt_segments = _earlier_segments(reader, {seen_prompt["request_id"]: seen_prompt["t_ns"]},
                                            [seen_prompt["request_id"]]).get(seen_prompt["request_id"], [])
    return CacheFacts(request, lookup, hashes, segments, seen, cached_on, eviction, evicted_elsewhere, matches,
                      divergences, earlier, loads, previous, identity, granularity, seen_prompt, prompt_segments,
                      tails, nodes, limit_rank)


def _declared_limit_rank(reader: TraceReader, instance_id: str, eviction: dict) -> int | None:
    """The rank whose bytes a distributed instance's byte limit counted at ``eviction``: what the insert
    that made it declared (tokentrace.cache.limit_rank, a non-negative integer), read from the evicting
    request's cache_inserts row on the instance whose span holds the eviction (``insert_limit_rank``);
    None where it declared none (an engine older than the declaration), the row is not stored or was
    stored before the column, or no request is named."""
    if not eviction.get("evicted_by_request_id"):
        return None
    rows = reader.rows("insert_limit_rank", request_id=eviction["evicted_by_request_id"], instance_id=instance_id,
                       evicted_ns=eviction["t_ns"])
    return rows[0]["limit_rank"] if rows else None


def _reach(reader: TraceReader, request: dict, hashes: list[int], t: int, block: int, prompt: int,
           cached: int) -> tuple:
    """(seen, seen_prompt, cached_on, eviction, loads, evicted_elsewhere, granularity, nodes, limit_rank): the
    deepest block of this prompt any earlier prompt or entry had, the earlier prompt (lookup) that had
    the deepest and where it leaves this one (``diverge``), per instance the deepest cached, what ended
    this instance's longer entry (an eviction, else model loads since) and the other instances'
    entries, the tokens per block this instance reuses in (``cache_granularity_at``), and where this
    instance is distributed, its nodes' memory when that entry went (``node_heartbeats_at``) and the
    rank whose bytes its byte limit counted then (``_declared_limit_rank``)."""
    reach = reader.rows("prefix_reach", hashes=hashes, before_ns=t) if hashes else []
    seen, cached_on = _deepest(reach), _deepest_per_instance(reach)
    prompts = [row for row in reach if row["source"] == "lookup" and row["request_id"] is not None]
    seen_prompt = None
    if prompts:
        row = _first_of_deepest(prompts)
        seen_prompt = {"request_id": row["request_id"], "t_ns": row["t_ns"], "instance_id": row["instance_id"],
                       "diverge": (row["block_index"] + 1) * block}
    here_key = request["instance_id"]
    sizes = reader.rows("cache_granularity_at", instance_id=here_key, t_ns=t) if reach else []
    granularity = sizes[0]["block_tokens"] if sizes and (sizes[0]["block_tokens"] or 0) > block else None
    longer = _longer(cached_on, block, prompt, cached, {here_key: granularity})
    here = next((row for row in longer if row["instance_id"] == here_key), None)
    eviction, loads, nodes, limit_rank = None, [], [], None
    if here is not None:
        eviction = _find_eviction(reader, request["instance_id"], here["last_block"], hashes, t, cached, block)
        if eviction is None:
            eviction = _block_eviction(reader, request["instance_id"], hashes, t, cached, block)
        if eviction is None:
            rows = reader.rows("loads_in", since_ns=here["t_ns"], until_ns=t)
            loads = list({row["load_id"]: row for row in rows
                          if row["instance_id"] == here_key and here["t_ns"] < row["start_ns"] < t}.values())
        nodes = reader.rows("node_heartbeats_at", instance_id=here_key, t_ns=eviction["t_ns"] if eviction else t)
        if len(nodes) > 1 and eviction is not None:
            limit_rank = _declared_limit_rank(reader, here_key, eviction)
    others = [row for row in cached_on if row["instance_id"] != here_key and row["fingerprint"] is not None]
    gone = reader.rows("evictions_of", fingerprints=[row["fingerprint"] for row in others],
                       before_ns=t) if others else []
    return seen, seen_prompt, cached_on, eviction, loads, {(row["instance_id"], row["fingerprint"]) for row in gone}, \
        granularity, nodes, limit_rank


def _shared_segments(reader: TraceReader, request_id: str, segments: list[dict], hashes: list[int], t: int,
                     cached: int, block: int) -> tuple:
    """(matches, divergences, earlier): earlier segments with this prompt's content hashes, where
    the latest of those prompts first differ from this one, and their segments."""
    wanted = _match_hashes(segments, cached, block)
    matches = reader.rows("segment_matches", hashes=wanted, before_ns=t, request_id=request_id) if wanted else []
    divergences = _divergences(reader, matches, segments, hashes, cached, block)
    return matches, divergences, _earlier_segments(reader, _latest(matches), divergences)


def _turns(reader: TraceReader, request: dict, hashes: list[int], block: int) -> tuple[dict, dict | None]:
    """(identity, previous): this request's model identity and the session's previous turn."""
    return _identity(reader, request["instance_id"], request["end_ns"]), _previous_turn(reader, request, hashes, block)


def _latest(matches: list[dict]) -> dict[str, int]:
    """request id -> the latest ``t_ns`` among its rows, in the order the rows first name them."""
    times: dict[str, int] = {}
    for row in matches:
        rid = row["request_id"]
        times[rid] = row["t_ns"] if rid not in times else max(times[rid], row["t_ns"])
    return times


def _earlier_segments(reader: TraceReader, times: dict[str, int], wanted) -> dict[str, list[dict]]:
    """The segments of each ``wanted`` earlier request (those of its prompt at ``times[rid]``, within
    a nanosecond), read in one query."""
    wanted = [rid for rid in wanted if rid in times]
    if not wanted:
        return {}
    found: dict[str, list[dict]] = {rid: [] for rid in wanted}
    rows = reader.rows("segments_of_many", request_ids=wanted, t0_ns=min(times[rid] for rid in wanted) - 1,
                       t1_ns=max(times[rid] for rid in wanted) + 1)
    for row in rows:
        rid = row.pop("request_id")
        if abs(row.pop("t_ns") - times[rid]) <= 1:
            found[rid].append(row)
    for segments in found.values():
        segments.sort(key=lambda row: row["segment_index"])
    return found


def _identity(reader: TraceReader, instance_id: str | None, t_ns: int) -> dict:
    """The model revision and chat-template hash an instance's resource declared at ``t_ns``."""
    rows = reader.rows("resource_at", instance_id=instance_id, t_ns=t_ns)
    try:
        attributes = json.loads(rows[0]["attributes"] or "{}") if rows else {}
    except ValueError:  # a foreign sender's resource is stored as sent; an unreadable one declares nothing
        attributes = {}
    return {"model_revision": attributes.get(c.MODEL_REVISION), "chat_template": attributes.get(c.CHAT_TEMPLATE_HASH)}


def _previous_turn(reader: TraceReader, request: dict, hashes: list[int], block: int) -> dict | None:
    """The session's previous turn: its id, instance, identity and where its prompt first differs
    from this one (block granularity)."""
    if not request.get("session_id"):
        return None
    rows = reader.rows("previous_turn", session_id=request["session_id"], before_ns=request["start_ns"],
                       request_id=request["request_id"])
    if not rows:
        return None
    prev = rows[0]
    theirs = [row["hash"] for row in reader.rows("lookup_blocks", request_id=prev["request_id"],
                                                  **request_window(prev))]
    if not theirs:
        return None
    differ = next((i for i, (a, b) in enumerate(zip(hashes, theirs, strict=False)) if a != b),
                  min(len(hashes), len(theirs)))
    return {"request_id": prev["request_id"], "instance_id": prev["instance_id"], "diverge": differ * block,
            **_identity(reader, prev["instance_id"], prev["end_ns"])}


def _longer(cached_on: list[dict], block: int, prompt: int, cached: int,
            granularity: dict[str | None, int | None] | None = None) -> list[dict]:
    """The instances whose cache held at least a block more of this prompt than was reused, each
    with the prompt tokens it ``covered``: of what its entry shared with this prompt, the whole
    blocks it can reuse (an engine reusing blocks of G tokens, ``granularity`` by instance, reuses
    none of a G-block the prompt leaves part-way: that is the prompt's change, not a lost entry)."""
    sizes = granularity or {}
    rows = [{**row, "covered": _reusable(_covered(row["last_block"], block, prompt), sizes.get(row["instance_id"]))}
            for row in cached_on]
    return [row for row in rows if row["covered"] - cached >= block]


def _reusable(tokens: int, granularity: int | None) -> int:
    """``tokens`` rounded down to whole blocks of ``granularity`` tokens (None: as they are)."""
    return tokens // granularity * granularity if granularity else tokens


def _first_of_deepest(rows: list[dict]) -> dict:
    """The row of the deepest block, the earliest of them: chained hashes make the deepest equal
    block the longest shared prefix."""
    return min(rows, key=lambda row: (-row["block_index"], row["t_ns"], row["request_id"] or ""))


def _deepest(reach: list[dict]) -> dict | None:
    """The deepest block any earlier prompt or entry had (any instance), and who had it first
    (``reach``: prefix_reach rows, one per instance and source)."""
    if not reach:
        return None
    row = _first_of_deepest(reach)
    return {"last_block": row["block_index"], "request_id": row["request_id"], "instance_id": row["instance_id"],
            "source": row["source"], "t_ns": row["t_ns"]}


def _deepest_per_instance(reach: list[dict]) -> list[dict]:
    """Per instance, the deepest block a cache entry stored there held, and the first such entry."""
    stored = [row for row in reach if row["source"] == "insert"]
    return [{"instance_id": row["instance_id"], "last_block": row["block_index"], "request_id": row["request_id"],
             "fingerprint": row["fingerprint"], "t_ns": row["t_ns"]}
            for row in sorted(stored, key=lambda row: (-row["block_index"], str(row["instance_id"])))]


def _find_eviction(reader: TraceReader, instance_id: str | None, deepest: int, hashes: list[int], t: int,
                   cached: int, block: int) -> dict | None:
    """The latest capacity eviction on this instance, before the lookup, of an entry holding more of
    this prompt than was reused: its stored blocks at the deepest cached index (or, failing that, the
    first unreused one) equal this prompt's. Only the latest few evictions are examined."""
    reused = cached // block
    candidates = reader.rows("capacity_evictions", instance_id=instance_id, before_ns=t,
                             min_tokens=(reused + 1) * block, reasons=list(c.CAPACITY_EVICT_REASONS))
    for candidate in candidates:
        if candidate["inserted_ns"] is None:
            continue
        stored = reader.rows("entry_block", request_id=candidate["entry_request_id"],
                             inserted_ns=candidate["inserted_ns"], block_indices=sorted({reused, deepest}))
        held = {row["block_index"]: row["hash"] for row in stored}
        for index in (deepest, reused):
            if index < len(hashes) and held.get(index) == hashes[index]:
                return {**candidate, "held_block": index}
    return None


def _block_eviction(reader: TraceReader, instance_id: str | None, hashes: list[int], t: int, cached: int,
                    block: int) -> dict | None:
    """The latest capacity eviction on this instance, before the lookup, of a single cache *block* of
    this prompt beyond what was reused: vLLM's KV events (through the plugin) evict blocks, each
    fingerprinted by the chained hash of the prefix it ends, with no entry or insert behind it."""
    beyond = hashes[cached // block:]
    if not beyond:
        return None
    rows = [row for row in reader.rows("evictions_of", fingerprints=beyond, before_ns=t)
            if row["instance_id"] == instance_id and row["reason"] in c.CAPACITY_EVICT_REASONS]
    if not rows:
        return None
    row = max(rows, key=lambda r: r["t_ns"])
    return {**row, "held_block": hashes.index(row["fingerprint"]), "inserted_ns": None}


def _worth(segments: list[dict], cached: int, block: int) -> list[dict]:
    """The segments an earlier copy can explain a miss by: past what was reused, a block long at least."""
    return [row for row in segments if row["token_end"] > cached and row["token_end"] - row["token_start"] >= block]


def _match_hashes(segments: list[dict], cached: int, block: int) -> list[int]:
    """The content hashes whose earlier copies the verdict uses: the segments worth explaining
    (``_divergences``, ``_prefix_change``) and, when less than a block was reused, the leading ones up
    to the first that ends past the first block (``_too_short``'s runs from segment 0). The
    rest, what was reused (a system prompt above all, which every request of an application may
    share), are left out: the store would read every earlier request that had them."""
    wanted = {row["hash"] for row in _worth(segments, cached, block)}
    if cached < block:
        for row in sorted(segments, key=lambda row: row["segment_index"]):
            wanted.add(row["hash"])
            if row["token_end"] >= block:
                break
    return [h for h in dict.fromkeys(row["hash"] for row in segments) if h is not None and h in wanted]


#: Earlier requests sharing a segment whose divergence point is computed (most recent first).
DIVERGENCE_CANDIDATES = 8


def _divergences(reader: TraceReader, matches: list[dict], segments: list[dict], hashes: list[int],
                 cached: int, block: int) -> dict[str, int]:
    """For the most recent earlier requests sharing a segment worth explaining, the token where their
    prompt first differs from this one (block granularity)."""
    if not matches:
        return {}
    worth = {row["hash"] for row in _worth(segments, cached, block)}
    latest = _latest([row for row in matches if row["hash"] in worth])
    candidates = sorted(latest.items(), key=lambda item: -item[1])[:DIVERGENCE_CANDIDATES]
    if not candidates:
        return {}
    times = [t for _, t in candidates]
    blocks: dict[str, list[int]] = {}
    for row in reader.rows("lookup_blocks_many", request_ids=[rid for rid, _ in candidates], t0_ns=min(times),
                           t1_ns=max(times)):
        blocks.setdefault(row["request_id"], []).append(row["hash"])
    found = {}
    for request_id, theirs in blocks.items():
        pairs = zip(hashes, theirs, strict=False)
        shared = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(hashes), len(theirs)))
        found[request_id] = shared * block
    return found


def _covered(last_block: int, block: int, prompt_tokens: int) -> int:
    """Tokens of the prompt covered by blocks 0..last_block (the last block may be partial)."""
    return min(prompt_tokens, (last_block + 1) * block)


def reused_tokens(lookup: dict, request: dict) -> tuple[int | None, str | None]:
    """(prompt tokens reused, in the lookup's unit; where the number comes from): the lookup's
    matched tokens, else the request row's cached tokens (scaled to the lookup's unit when the two
    count the prompt differently, as the gateway's byte-level fingerprint does), else (None, None)."""
    if lookup.get("matched_tokens") is not None:
        return lookup["matched_tokens"], "lookup"
    cached = request.get("cached_tokens")
    if cached is None:
        return None, None
    ours, theirs = lookup.get("prompt_tokens"), request.get("prompt_tokens")
    if ours and theirs and ours != theirs:
        return round(ours * min(cached, theirs) / theirs), "request_scaled"
    return (min(cached, ours) if ours else cached), "request"


def classify_cache(facts: CacheFacts) -> CacheVerdict:
    """The verdict, by the definitions in the module docstring. Pure."""
    request, lookup = facts.request, facts.lookup
    if lookup is None:
        return _unknown(request) if outcome_of(request) == COMPLETED else _not_served(request)
    block = lookup["block_size"] or c.DEFAULT_BLOCK_SIZE
    prompt = lookup["prompt_tokens"] or request.get("prompt_tokens") or 0
    cached, source = reused_tokens(lookup, request)
    if cached is None:
        return _unmeasured(request, lookup, prompt, block)
    seen = max(cached, _covered(facts.seen["last_block"], block, prompt)) if facts.seen else cached
    verdict = CacheVerdict(request["request_id"], request["instance_id"], prompt, cached, seen, "miss", None,
                           block_size=block)
    verdict.evidence.append(_lookup_evidence(lookup, request, prompt, cached, source))
    verdict.outcome = outcome_of(request)
    longer = _longer(facts.cached_on, block, prompt, cached, {request["instance_id"]: facts.granularity})
    if not (_capacity(verdict, facts, longer) or _instance_change(verdict, facts, longer)
            or _prefix_change(verdict, facts, block, cached) or _identity_change(verdict, facts, block, cached)):
        _new_or_reused(verdict, facts, block)
    verdict.result = "hit" if verdict.cause is None else ("partial" if cached > 0 else "miss")
    verdict.evidence.extend(upstream_evidence(request, "cache"))
    return verdict


def _lookup_evidence(lookup: dict, request: dict, prompt: int, cached: int, source: str | None) -> Evidence:
    """What the lookup says, in words made only of what was measured (an unknown is named, never
    printed as ``None``)."""
    if source == "lookup":
        text = f"Lookup matched {cached} of {prompt} prompt tokens"
    else:
        text = (f"The engine reported {request.get('cached_tokens')} of {_count(request.get('prompt_tokens'))} prompt "
                "tokens cached (its request record; the lookup itself did not say)")
        if source == "request_scaled":
            text += f", {cached} of the lookup's {prompt} units"
    if lookup.get("match"):
        text += f" ({lookup['match']} match)"
    held = [part for part in (_plural(lookup.get("cache_entries"), "entry", "entries"),
                              _plural(lookup.get("cache_bytes"), "byte", "bytes")) if part]
    text += f"; the cache held {', '.join(held)}." if held else "; what the cache held is not reported."
    return Evidence(
        "lookup", text,
        {"t_ns": lookup["start_ns"], "matched_tokens": cached, "prompt_tokens": prompt, "matched_from": source,
         "match": lookup.get("match"), "cache_entries": lookup.get("cache_entries"),
         "cache_bytes": lookup.get("cache_bytes")},
        basis="inferred" if source == "request_scaled" else "measured",
    )


def _unmeasured(request: dict, lookup: dict, prompt: int, block: int) -> CacheVerdict:
    """A lookup whose reuse no observer measured: neither the lookup nor the request row says how
    many tokens were reused, so neither result nor cause can be known."""
    verdict = CacheVerdict(request["request_id"], request["instance_id"], prompt, None, None, "unknown", "unknown",
                           block_size=block, outcome=outcome_of(request))
    observer = request.get("observer") or "the engine"
    verdict.evidence.append(Evidence(
        "unavailable", f"The prompt's fingerprint ({prompt} tokens) was recorded, but neither the lookup nor the "
                       f"request record says how many of them were reused ({observer} of engine "
                       f"{request.get('engine') or 'unknown'} did not report cached tokens), so whether this "
                       "was a hit, and why not, cannot be determined.",
        {"engine": request.get("engine"), "observer": request.get("observer"), "prompt_tokens": prompt,
         "t_ns": lookup["start_ns"]},
    ))
    verdict.evidence.extend(upstream_evidence(request, "cache"))
    return verdict


def _not_served(request: dict) -> CacheVerdict:
    verdict = CacheVerdict(request["request_id"], request["instance_id"], request.get("prompt_tokens"),
                           request.get("cached_tokens"), None, None, None, outcome=outcome_of(request))
    verdict.evidence.append(Evidence(
        "outcome", f"The request was {verdict.outcome} (HTTP {request.get('http_status')}, "
                   f"{request.get('error_type') or request.get('finish_reason') or 'no error type'}) before its "
                   "cache lookup: there is no cache verdict, and it is left out of cache hit rates.",
        {"outcome": verdict.outcome, "http_status": request.get("http_status"),
         "error_type": request.get("error_type")},
    ))
    return verdict


def _plural(count: int | None, one: str, many: str) -> str | None:
    """``"3 entries"``; None when the count is unknown (the caller leaves it out)."""
    return None if count is None else f"{count} {one if count == 1 else many}"


def _on(instance_id: str | None) -> str:
    """An instance for a sentence (a sender that names none)."""
    return instance_id if instance_id is not None else "an unnamed instance"


def _entry_of(request_id: str | None) -> str:
    """Whose cache entry, for a sentence: the plugin's KV blocks name no request."""
    return f"entry of request {request_id}" if request_id else "an entry no request is named for"


def _by(request_id: str | None, unnamed: str = "by an earlier request", named: str = "by request") -> str:
    return f"{named} {request_id}" if request_id else unnamed


def _count(value: int | None) -> str:
    return "an unknown number of" if value is None else str(value)


def _unknown(request: dict) -> CacheVerdict:
    prompt, cached = request.get("prompt_tokens"), request.get("cached_tokens")
    result = "unknown" if cached is None else "partial" if cached else "miss"
    verdict = CacheVerdict(request["request_id"], request["instance_id"], prompt, cached, cached, result, "unknown")
    if prompt and cached is not None and cached >= prompt - 1:
        verdict.result = "hit"
    verdict.evidence.append(Evidence(
        "unavailable", f"The engine reported {_count(cached)} of {_count(prompt)} prompt tokens cached but no "
                       "prompt fingerprint, so the cause of a miss cannot be determined.",
        {"engine": request.get("engine")},
    ))
    verdict.evidence.extend(upstream_evidence(request, "cache"))
    return verdict


def _capacity(verdict: CacheVerdict, facts: CacheFacts, longer: list[dict]) -> bool:
    here = next((row for row in longer if row["instance_id"] == verdict.instance_id), None)
    if here is None:
        return False
    eviction = facts.eviction
    if eviction is None and facts.loads:
        load = facts.loads[-1]
        verdict.cause = "restart"
        verdict.evidence.append(Evidence(
            "restart", f"{here['covered']} tokens of this prompt were cached on {_on(verdict.instance_id)} "
                       f"({_entry_of(here['request_id'])}); no eviction of it was reported, and the instance loaded "
                       f"its model again ({'lazily' if load['lazy'] else 'at start'}) before this lookup: the "
                       "cache did not survive the restart.",
            {"load_id": load["load_id"], "load_start_ns": load["start_ns"], "load_end_ns": load["end_ns"],
             "entry_request_id": here["request_id"], "inserted_at_ns": here["t_ns"],
             "lost_tokens": here["covered"] - verdict.cached_tokens},
        ))
        return True
    verdict.cause = "capacity"
    if eviction is None and facts.request.get("observer") == c.OBSERVER_GATEWAY:
        # Seen from a gateway: the upstream served this prefix before and now reused less of it.
        # The engine reports no evictions, so that it was evicted is inferred, not measured.
        verdict.evidence.append(Evidence(
            "no_longer_cached", f"{here['covered']} tokens of this prompt were served on {_on(verdict.instance_id)} "
                                f"{_by(here['request_id'])}, and this time it reused only "
                                f"{verdict.cached_tokens}: evicted in between (inferred; the engine reports "
                                "no evictions).",
            {"entry_request_id": here["request_id"], "inserted_at_ns": here["t_ns"],
             "lost_tokens": here["covered"] - verdict.cached_tokens}, basis="inferred",
        ))
        return True
    if eviction is None:
        # A longer prefix was stored here before the lookup and the lookup did not find it: it was
        # gone, but its eviction is not among the latest ones examined on this instance.
        verdict.evidence.append(Evidence(
            "no_longer_cached", f"{here['covered']} tokens of this prompt were cached on {_on(verdict.instance_id)} "
                                f"({_entry_of(here['request_id'])}) and were no longer cached at this "
                                "lookup; the eviction is older than the latest ones on this instance.",
            {"entry_request_id": here["request_id"], "inserted_at_ns": here["t_ns"],
             "lost_tokens": here["covered"] - verdict.cached_tokens},
        ))
        return True
    verdict.evicted_by = eviction["evicted_by_request_id"]
    lost = here["covered"] if eviction["held_block"] == here["last_block"] else min(
        verdict.prompt_tokens, (eviction["held_block"] + 1) * verdict.block_size)
    by = f"by request {verdict.evicted_by}'s insert" if verdict.evicted_by else "outside any insert"
    entry = (f"entry of request {eviction['entry_request_id']}" if eviction["entry_request_id"]
             else "a cache block ending at that token")
    verdict.evidence.append(Evidence(
        "eviction", f"{lost} tokens of this prompt were cached on {_on(verdict.instance_id)} ({entry}) and evicted "
                    f"({eviction['reason'] or 'reason not reported'}) {by} before this lookup; "
                    f"{lost - verdict.cached_tokens} tokens were "
                    "lost.",
        {"evicted_at_ns": eviction["t_ns"], "reason": eviction["reason"], "evicted_by": verdict.evicted_by,
         "entry_request_id": eviction["entry_request_id"], "fingerprint": eviction["fingerprint"],
         "inserted_at_ns": eviction["inserted_ns"], "lost_tokens": lost - verdict.cached_tokens,
         "cache_entries_after": eviction["cache_entries"], "cache_bytes_after": eviction["cache_bytes"]},
    ))
    _binding_node(verdict, facts)
    return True


def _binding_node(verdict: CacheVerdict, facts: CacheFacts) -> None:
    """A distributed instance (issue 46): each node caches its own share of the KV (in pipeline
    placement its layers'), rank 0 decides what the cache keeps, and its byte limit counts the bytes
    of the rank its inserts declare (``CacheFacts.limit_rank``: the one holding the most KV per token;
    undeclared, an older engine: rank 0's own). Each node holds the limit x its KV per token / that
    rank's when the cache is at its limit. The node whose memory binds is the one whose free memory
    holds the fewest more tokens of its KV (without free memory reported: the one holding the most KV
    per token)."""
    nodes = [dict(n, rank=c.node_rank(verdict.instance_id, n["instance_id"])) for n in facts.nodes
             if n["kv_bytes_per_token"]]
    counted_rank = facts.limit_rank if facts.limit_rank is not None else 0
    counted = next((n for n in nodes if n["rank"] == counted_rank), None)
    first = next((n for n in nodes if n["rank"] == 0), None)
    if len(nodes) < 2 or first is None or counted is None:
        return
    # The counted rank's heartbeat states the limit itself (every node's states its own bytes at it,
    # an engine older than the declaration the limit on every node).
    limit = counted["cache_max_bytes"]
    for node in nodes:
        node["ratio"] = node["kv_bytes_per_token"] / counted["kv_bytes_per_token"]
        free = node["memory_free_bytes"]
        node["tokens_fit"] = int(free // node["kv_bytes_per_token"]) if free is not None else None
        node["bytes_at_limit"] = round(limit * node["ratio"]) if limit else None
    known = [n for n in nodes if n["tokens_fit"] is not None]
    binding = (min(known, key=lambda n: (n["tokens_fit"], n["rank"])) if len(known) == len(nodes)
               else max(nodes, key=lambda n: (n["ratio"], -n["rank"])))
    held_most = max(n["kv_bytes_per_token"] for n in nodes) == counted["kv_bytes_per_token"]
    text = (f"On this {len(nodes)}-node cluster each node caches its own share of the KV, and the cache's byte "
            f"limit{f' ({fmt_bytes(limit)})' if limit else ''} counts rank {counted_rank}'s "
            f"({fmt_bytes(counted['kv_bytes_per_token'])} a token"
            + ("; no node's cache holds more" if held_most else "") + "). ")
    if binding["rank"] == counted_rank:
        text += f"Memory binds at rank {counted_rank}, the node the limit counts"
    else:
        text += (f"Memory binds at rank {binding['rank']}: it holds {binding['ratio']:.2g}x rank {counted_rank}'s KV "
                 "per token"
                 + (f", {fmt_bytes(binding['bytes_at_limit'])} when the cache is at its limit"
                    if binding["bytes_at_limit"] else ""))
    text += (f"; {fmt_bytes(binding['memory_free_bytes'])} was free there, room for {binding['tokens_fit']:,} more "
             "tokens of its KV: a larger cache needs that room." if binding["tokens_fit"] is not None
             else "; its free memory was not reported.")
    verdict.evidence.append(Evidence(
        "binding_node", text,
        {"binding_rank": binding["rank"], "cache_max_bytes": limit, "limit_counts_rank": counted_rank,
         "limit_rank_declared": facts.limit_rank is not None,
         "nodes": [{key: node[key] for key in ("rank", "instance_id", "kv_bytes_per_token", "cache_bytes",
                                               "memory_free_bytes", "tokens_fit", "bytes_at_limit")}
                   for node in sorted(nodes, key=lambda n: n["rank"])]},
    ))


def _instance_change(verdict: CacheVerdict, facts: CacheFacts, longer: list[dict]) -> bool:
    if not longer:
        return False
    for row in longer:
        row["alive"] = (row["instance_id"], row["fingerprint"]) not in facts.evicted_elsewhere
    entry = max(longer, key=lambda row: (row["alive"], row["covered"], row["t_ns"]))
    verdict.cause, verdict.cached_on = "instance_change", entry["instance_id"]
    state = "still cached there at this lookup" if entry["alive"] else "since evicted there"
    verdict.evidence.append(Evidence(
        "cached_elsewhere", f"{entry['covered']} tokens of this prompt were cached on instance "
                            f"{_on(entry['instance_id'])} ({_entry_of(entry['request_id'])}, {state}), never "
                            f"on {_on(verdict.instance_id)}: the conversation moved instances.",
        {"instance_id": entry["instance_id"], "entry_request_id": entry["request_id"], "alive": entry["alive"],
         "fingerprint": entry["fingerprint"], "inserted_at_ns": entry["t_ns"], "covered_tokens": entry["covered"]},
        # Behind a gateway the other upstream's cache is known only from what it served there.
        basis="inferred" if facts.request.get("observer") == c.OBSERVER_GATEWAY else "measured",
    ))
    return True


def _prefix_change(verdict: CacheVerdict, facts: CacheFacts, block: int, cached: int) -> bool:
    if not facts.segment_matches or not facts.segments:
        return False
    segments = facts.segments
    best = None
    for match in facts.segment_matches:
        diverge = facts.divergences.get(match["request_id"])
        if diverge is None or diverge < cached // block * block:
            # This prompt reused past the point where it leaves that request: its reuse came from
            # elsewhere, and the shared segment is a coincidence, not the reason for the miss.
            continue
        for segment in segments:
            if segment["hash"] != match["hash"] or segment["token_start"] < diverge:
                continue
            if segment["token_end"] <= cached:
                continue  # that shared segment was reused: nothing to explain
            shared = segment["token_end"] - segment["token_start"]
            if shared < block:
                continue  # a few equal tokens ("hi") across unrelated prompts are no evidence
            if best is None or shared > best[0]:
                best = (shared, diverge, segment, match)
    if best is None:
        return False
    shared, diverge, segment, match = best
    token, role, index = first_difference(segments, facts.earlier_segments.get(match["request_id"]), diverge)
    where = next((s for s in segments if s["segment_index"] == index), None)
    verdict.cause = "prefix_change"
    verdict.divergence = Divergence(token, role, index)
    place = ("between the messages (template markup or a tools block), in no message" if role == TEMPLATE
             else f"{role} segment {index}" if role else f"token {token}")
    verdict.evidence.append(Evidence(
        "divergence", f"Request {match['request_id']} had the same {segment['role']} segment "
                      f"({shared} tokens) but its prompt differs from this one from token {token} on, "
                      f"{place}: everything after the change had to be recomputed.",
        {"earlier_request_id": match["request_id"], "earlier_instance_id": match["instance_id"],
         "shared_segment_index": segment["segment_index"], "shared_segment_role": segment["role"],
         "shared_tokens": shared, "token_index": token, "block_token_index": diverge,
         "segment_role": role, "segment_index": index,
         "snippet": where.get("snippet") if where else None},
    ))
    return True


def first_difference(ours: list[dict], theirs: list[dict] | None, block_diverge: int) -> tuple[int, str | None,
                                                                                          int | None]:
    """(token index, role, segment index) of the first segment of ``ours`` whose role or content hash
    differs from the segment at the same place in ``theirs``; the role is ``template`` (index None)
    when that segment is a tools block or a message ``theirs`` also has elsewhere (what changed lies
    between messages). The token index is the later of that segment's start and ``block_diverge``
    (the first differing block's first token), so it lies inside the segment, at or before the first
    differing token. Without ``theirs``: the segment ``block_diverge`` falls in."""
    if not theirs:
        where = next((s for s in ours if s["token_start"] <= block_diverge < s["token_end"]), None)
        return block_diverge, (where["role"] if where else None), (where["segment_index"] if where else None)
    pairs = zip(ours, theirs, strict=False)
    first = next((mine for mine, other in pairs if (mine["role"], mine["hash"]) != (other["role"], other["hash"])),
                 ours[len(theirs)] if len(ours) > len(theirs) else None)
    if first is None:  # the same segments: the difference is past this prompt's end
        return block_diverge, None, None
    token = min(max(first["token_start"], block_diverge), first["token_end"] - 1)
    if first["role"] == c.ROLE_TOOLS or first["hash"] in {other["hash"] for other in theirs}:
        return token, TEMPLATE, None
    return token, first["role"], first["segment_index"]


def _identity_change(verdict: CacheVerdict, facts: CacheFacts, block: int, cached: int) -> bool:
    """model_change / template_change: the session's previous turn ran on another model revision or
    chat template, and its prompt differs from this one inside the first segment."""
    prev, ours = facts.previous, facts.identity
    if prev is None or cached >= block or not facts.segments:
        return False
    first_end = facts.segments[0]["token_end"]
    if prev["diverge"] >= first_end:
        return False
    for key, cause, what in (("model_revision", "model_change", "model revision"),
                             ("chat_template", "template_change", "chat template")):
        before, now = prev.get(key), ours.get(key)
        if before is None or now is None or before == now:
            continue
        verdict.cause = cause
        verdict.evidence.append(Evidence(
            cause, f"The session's previous turn (request {prev['request_id']} on {_on(prev['instance_id'])}) was "
                   f"served with {what} {before}, this one with {now}: the prompts differ from token "
                   f"{prev['diverge']} on, inside the first segment, before any message could be reused.",
            {"earlier_request_id": prev["request_id"], "earlier_instance_id": prev["instance_id"],
             "before": before, "after": now, "token_index": prev["diverge"]},
        ))
        return True
    return False


def _new_or_reused(verdict: CacheVerdict, facts: CacheFacts, block: int) -> None:
    gap = _reusable(verdict.seen_tokens, facts.granularity) - verdict.cached_tokens
    if gap >= block:
        # Seen earlier but in no cache at lookup time: still being computed, or never stored.
        seen = facts.seen or {}
        verdict.cause = "new_prefix"
        verdict.evidence.append(Evidence(
            "not_cached_yet", f"{_by(seen.get('request_id'), 'An earlier request', 'Request')} had "
                              f"{verdict.seen_tokens} tokens of this prompt, but no cache held them at this "
                              "lookup (still in flight, or never stored).",
            {"request_id": seen.get("request_id"), "instance_id": seen.get("instance_id"),
             "seen_tokens": verdict.seen_tokens},
        ))
    elif verdict.cached_tokens < block and _edited_start(verdict, facts, block):
        pass
    elif verdict.cached_tokens < block and (short := _too_short(verdict, facts, block)) is not None:
        verdict.cause = "too_short"
        verdict.evidence.append(Evidence(
            "too_short", (f"The prompt has {verdict.prompt_tokens} tokens, fewer than one cache block of {block}: "
                          "nothing of it could be stored as a reusable block."
                          if short["request_id"] is None else
                          f"Request {short['request_id']} began with the same {short['segments']} segment(s), "
                          f"{short['shared_tokens']} tokens, fewer than one cache block of {block}: a shared "
                          "part this short cannot be reused."),
            {"shared_tokens": short["shared_tokens"], "block_size": block, "earlier_request_id": short["request_id"],
             "segments": short["segments"]},
        ))
    elif verdict.cached_tokens < block:
        verdict.cause = "new_prefix"
        verdict.evidence.append(Evidence(
            "new_prefix", "No earlier request on any instance had a prefix of this prompt, and none shares "
                          "its segments: a first-time prompt.",
            {"seen_tokens": verdict.seen_tokens},
        ))
    elif not _edited_message(verdict, facts, block):
        verdict.evidence.append(Evidence(
            "reused", f"Reused {verdict.cached_tokens} of {verdict.prompt_tokens} prompt tokens: everything an "
                      "earlier request had was reused; the rest is new.",
            {"new_tokens": verdict.prompt_tokens - verdict.cached_tokens},
        ))


#: Segment roles that are input: a message of these after another means the prompt goes on past it.
_INPUT_ROLES = frozenset({c.ROLE_SYSTEM, c.ROLE_USER, c.ROLE_TOOL, c.ROLE_TOOLS, c.ROLE_PROMPT})


def _holding(segments: list[dict], token: int) -> dict | None:
    """The segment of this prompt that holds ``token``."""
    return next((row for row in segments if row["token_start"] <= token < row["token_end"]), None)


def _edited_at(segments: list[dict], diverge: int) -> dict | None:
    """The segment of this prompt that holds token ``diverge`` (where an earlier prompt's shared
    blocks end); None when no segment holds it or no input message follows it (a prompt's last
    message differing from an earlier one's is a new question, not an edit in front of the rest)."""
    row = _holding(segments, diverge)
    if row is None:
        return None
    later = [other for other in segments if other["segment_index"] > row["segment_index"]]
    return row if any(other["role"] in _INPUT_ROLES for other in later) else None


def _edited_start(verdict: CacheVerdict, facts: CacheFacts, block: int) -> bool:
    """prefix_change where nothing before the change is shared: less than a block was reused, and an
    earlier prompt had a message of the same role at the same index, of about the same length
    (within a block), that ends with the same block of tokens as the one this prompt's reuse
    stopped in but differs from it — a timestamp or an id at the start of a system prompt — with
    more input after it here."""
    ours = _edited_at(facts.segments, verdict.cached_tokens)
    if ours is None or not facts.tail_matches:
        return False
    length = ours["token_end"] - ours["token_start"]
    earlier = next((row for row in facts.tail_matches
                    if (row["role"], row["segment_index"]) == (ours["role"], ours["segment_index"])
                    and row["hash"] != ours["hash"]
                    and abs(row["token_end"] - row["token_start"] - length) <= block), None)
    if earlier is None:
        return False
    role, index = ours["role"], ours["segment_index"]
    token = max(ours["token_start"], verdict.cached_tokens // block * block)
    theirs = earlier["token_end"] - earlier["token_start"]
    return _edited(verdict, earlier, ours, token, block,
                   f"Request {earlier['request_id']} had a {role} segment {index} that ends with the same {block} "
                   f"tokens as this one's and is about as long ({theirs} tokens, this one {length}), but it "
                   f"differs from this one near its start (from token {token} on, at block granularity): the "
                   "message was edited there; all of it had to be computed again, and so did everything after it.")


def _edited(verdict: CacheVerdict, earlier: dict, ours: dict, token: int, shared: int, text: str) -> bool:
    """Make the verdict a prefix_change at this prompt's segment ``ours``, edited from the one of the
    ``earlier`` request: from ``token`` on, after ``shared`` equal tokens of it."""
    role, index = ours["role"], ours["segment_index"]
    verdict.cause = "prefix_change"
    verdict.divergence = Divergence(token, role, index)
    verdict.evidence.append(Evidence(
        "divergence", text,
        {"earlier_request_id": earlier["request_id"], "earlier_instance_id": earlier["instance_id"],
         "shared_segment_index": index, "shared_segment_role": role, "shared_tokens": shared,
         "token_index": token, "block_token_index": token, "segment_role": role, "segment_index": index,
         "snippet": ours.get("snippet")},
    ))
    return True


def _edited_message(verdict: CacheVerdict, facts: CacheFacts, block: int) -> bool:
    """prefix_change without a shared later segment: everything an earlier prompt had was reused, but
    that prompt had the same message at the same place, shared at least a block of it with this one
    and then differs inside it, and more input follows the message here (a one-shot request behind a
    system message edited in its middle or at its end: what follows it is new anyway, but the rest
    of the message had to be computed again)."""
    earlier = facts.seen_prompt
    ours = _edited_at(facts.segments, earlier["diverge"]) if earlier else None
    if ours is None or earlier is None:
        return False
    diverge = earlier["diverge"]
    theirs = next((row for row in facts.seen_prompt_segments if row["segment_index"] == ours["segment_index"]), None)
    if (theirs is None or (theirs["role"], theirs["token_start"]) != (ours["role"], ours["token_start"])
            or theirs["hash"] == ours["hash"] or theirs["token_end"] <= diverge
            or diverge - ours["token_start"] < block or verdict.cached_tokens >= ours["token_end"]):
        return False
    shared, rest = diverge - ours["token_start"], ours["token_end"] - max(verdict.cached_tokens, diverge)
    return _edited(verdict, earlier, ours, diverge, shared,
                   f"Request {earlier['request_id']} had the same {ours['role']} segment {ours['segment_index']} "
                   f"for its first {shared} tokens, but it differs from this one inside that message (from token "
                   f"{diverge} on, at block granularity): the message was edited; its {rest} tokens after the "
                   "change had to be computed again, and so did everything after them.")


def _too_short(verdict: CacheVerdict, facts: CacheFacts, block: int) -> dict | None:
    """The prompt itself under one block, or the longest run of leading segments an earlier prompt
    shares with it (same index, start and content hash from segment 0) when it is under one block."""
    if verdict.prompt_tokens < block:
        return {"request_id": None, "shared_tokens": verdict.prompt_tokens, "segments": 0}
    if not facts.segment_matches or not facts.segments:
        return None
    ours = {row["segment_index"]: row for row in facts.segments}
    by_request: dict[str, list[dict]] = {}
    for row in facts.segment_matches:
        by_request.setdefault(row["request_id"], []).append(row)
    best = None
    for request_id, rows in by_request.items():
        same = {row["segment_index"] for row in rows
                if row["segment_index"] in ours and row["hash"] == ours[row["segment_index"]]["hash"]
                and row["token_start"] == ours[row["segment_index"]]["token_start"]}
        run = 0
        while run in same:
            run += 1
        if run and (best is None or ours[run - 1]["token_end"] > best["shared_tokens"]):
            best = {"request_id": request_id, "shared_tokens": ours[run - 1]["token_end"], "segments": run}
    return best if best is not None and 0 < best["shared_tokens"] < block else None


def analyze_cache(reader: TraceReader, request_id: str) -> CacheVerdict:
    """Load and classify."""
    return classify_cache(load_cache_facts(reader, request_id))
