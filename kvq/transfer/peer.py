"""Prefill/decode disaggregation between two kvq servers: handshake, export, pull, faults.

Two ``kvq serve`` processes, one ``--kv-role prefill`` (P) and one ``--kv-role
decode --kv-peer URL`` (D), may keep different resident KV formats.  The
decode side drives every transfer (pull, as vLLM's NixlConnector)::

    D (decode server)                                   P (prefill server)
    start: register its whole KV pool with NIXL
           POST /kv/connect {D's KVDescription}  ---->  check_compatible (a field that differs: 409)
                                                        staging pool in D's plan, NIXL-registered
           check_compatible, NIXL connect       <----   {P's KVDescription, staging pool descriptor}
    request: scheduler reserves the whole prompt (RemoteLoadOp, D's layout), then
           POST /kv/prefill {token ids, params}  ---->  prefill, max_tokens=1; in the sampling
                                                        step: SenderCast into staging blocks
                                                        (D's formats, windows, block size), chunk
           check every chunk header             <----   headers (CRC-32 per chunk), first token
           NIXL READ staging -> reserved blocks
           CRC of the received bytes, per chunk
           notif / POST /kv/release             ---->   staging blocks free (also after a TTL)
           first token -> decode here

Faults (P unreachable or failing, a reply that does not fit, incompatible
descriptions, a transfer error, a timeout, a checksum mismatch) end the fill
with a reason (:data:`~kvq.connectors.remote_prefill.FAILURE_REASONS`); the
scheduler then requeues the request to be prefilled locally (``fallback``) or
fails it.  A fill is reported only after its NIXL read has settled (done,
failed or cancelled), so blocks a failed read may have half written are freed,
never read: they are not registered in the prefix cache (``num_computed`` is 0
until success) and a sequence freed while its fill runs leaves them
quarantined until then (:meth:`BlockManager.free`).

Threads: D's engine thread calls :meth:`PrefillClient.start`/``poll``; HTTP
calls run on a small pool; one thread owns D's NIXL agent (posting, polling,
cancelling reads, checksums).  P's export runs on its engine thread; one thread
owns P's agents (notifications, expiry).
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import json
import logging
import math
import os
import queue
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field

import torch

from kvq.cache.plan import CachePlan
from kvq.cache.pool import KVPool
from kvq.cache.window import POOLS
from kvq.connectors.kv_export import KVExporter
from kvq.connectors.remote_prefill import RemotePrefill, RemoteResult
from kvq.transfer.convert import SenderCast, receiver_table
from kvq.models.identity import model_identity, tokenizer_hash
from kvq.transfer.describe import KVDescription, Negotiated, TransferIncompatible, check_compatible, describe_plan
from kvq.transfer.wire import ChunkHeader, WireError, pack_payload, plan_chunks

log = logging.getLogger("kvq.transfer")

KV_ROLES = ("both", "prefill", "decode")
FALLBACKS = ("local", "fail")
#: Layers per chunk header (each has its own CRC-32 of the payload).
LAYERS_PER_CHUNK = 8
#: Seconds a prefill server keeps a request's staged blocks for a reader that never comes.
STAGING_TTL_S = 60.0


class StagingFull(RuntimeError):
    """The prefill server's staging pool cannot hold this request now (HTTP 503; D falls back)."""


def describe_engine(engine) -> KVDescription:
    """The :class:`KVDescription` of an :class:`~kvq.engine.llm_engine.LLMEngine`'s cache."""
    from kvq.models.source import resolve_model

    return describe_plan(engine.plan, model_id=model_identity(resolve_model(engine.config.model)),
                         tokenizer_hash=tokenizer_hash(engine.tokenizer))


def plan_from_description(desc: KVDescription, model) -> CachePlan:
    """The receiver's :class:`CachePlan` rebuilt on the sender (``model``: the sender's ModelShape,
    which the handshake found equal in every agreed field)."""
    hp = desc.hp
    skip = tuple(i for i, f in enumerate(desc.layers) if (f.k, f.v) == (hp.k, hp.v))
    return CachePlan(model, desc.layers, hp, desc.block_size, desc.sink_tokens, desc.residual_tokens, skip)


def scales_to_json(static_scales) -> dict:
    """A decode server's static KV scales (``LLMEngine.static_scales``) as JSON: ``{layer: [k, v]}``."""
    return {str(i): [k.tolist(), v.tolist()] for i, (k, v) in sorted((static_scales or {}).items())}


def scales_from_json(obj, num_layers: int, num_kv_heads: int) -> dict:
    """The inverse of :func:`scales_to_json`, checked (ValueError naming the entry)."""
    if not isinstance(obj, dict):
        raise ValueError("static_scales: expected an object {layer: [k_scales, v_scales]}")
    out = {}
    for key, pair in obj.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < num_layers):
            raise ValueError(f"static_scales: {key!r} is not a layer index in 0..{num_layers - 1}")
        if not (isinstance(pair, list) and len(pair) == 2 and all(
                isinstance(x, list) and len(x) == num_kv_heads and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in x)
                for x in pair)):
            raise ValueError(f"static_scales[{key}]: expected [k, v], each {num_kv_heads} positive numbers")
        out[int(key)] = tuple(torch.tensor(x, dtype=torch.float32) for x in pair)
    return out


def receiver_id(negotiated: Negotiated, scales_json: dict) -> str:
    """One receiver layout on a prefill server: the negotiated digest and the receiver's static scales
    (the bytes of a static-scaled FP8 block depend on them)."""
    import hashlib

    from kvq.transfer.describe import canonical_json

    return hashlib.sha256(negotiated.digest() + canonical_json(scales_json)).hexdigest()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise ValueError(f"{what}: not base64") from None


# -- the prefill side -------------------------------------------------------------------------------
@dataclass
class _Receiver:
    """One decode peer's plan on this prefill server: its staging pool, agent and free lists."""

    rid: str
    negotiated: Negotiated
    cast: SenderCast
    staging: KVPool
    transport: object
    free: dict[str, list[int]]
    connections: int = 0


@dataclass
class _Held:
    rid: str
    ids: dict[str, list[int]]
    deadline: float


class PrefillExporter(KVExporter):
    """A prefill server's side: answers handshakes, casts finished prompts into staging blocks in
    each receiver's format, frees them when read (NIXL notification or ``/kv/release``) or after
    ``ttl_s``.  ``staging_tokens``: tokens of staging per receiver plan (the most KV waiting to be
    read at once, per decode format)."""

    def __init__(self, engine, staging_tokens: int, ttl_s: float = STAGING_TTL_S, transport_factory=None):
        if staging_tokens < engine.max_model_len:
            raise ValueError(f"--kv-staging-tokens {staging_tokens} cannot hold one prompt of max_model_len "
                             f"{engine.max_model_len}")
        self.engine, self.staging_tokens, self.ttl_s = engine, staging_tokens, ttl_s
        self.description = describe_engine(engine)
        self._factory = transport_factory or _nixl_factory(engine.device)
        self._name = f"kvq-prefill-{uuid.uuid4().hex[:12]}"
        self._receivers: dict[str, _Receiver] = {}
        self._held: dict[str, _Held] = {}
        self._released: collections.deque[str] = collections.deque(maxlen=4096)  # released before staged
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.stats = {"exported": 0, "released": 0, "expired": 0, "staging_full": 0, "bytes": 0}
        self._thread = threading.Thread(target=self._run, name="kvq-kv-export", daemon=True)
        self._thread.start()

    # handshake (any thread)
    def connect(self, remote: dict, static_scales: dict | None = None) -> dict:
        """A decode server's ``/kv/connect``: ValueError for a malformed description or static scales
        (``{layer: [k, v]}``, :func:`scales_to_json`), :class:`TransferIncompatible` naming the first
        field that differs."""
        desc = KVDescription.from_dict(remote)
        neg = check_compatible(self.description, desc, receiver="remote")
        scales_json = static_scales or {}
        scales = scales_from_json(scales_json, desc.num_layers, desc.num_kv_heads)
        rid = receiver_id(neg, scales_json)
        with self._lock:
            rec = self._receivers.get(rid)
            if rec is None:
                plan = plan_from_description(desc, self.engine.plan.model)
                nq = nhp = -(-self.staging_tokens // plan.block_size)
                staging = KVPool.create(plan, nq, nhp, self.engine.device, scales or None)
                transport = self._factory(f"{self._name}-{len(self._receivers)}")
                transport.register_pool(staging)
                cast = SenderCast(plan, static_scales=scales or None, kernels=self.engine.kernels)
                rec = _Receiver(rid, neg, cast, staging, transport, {"q": list(range(nq)), "hp": list(range(nhp))})
                self._receivers[rid] = rec
            rec.connections += 1
        return {"description": self.description.to_dict(), "receiver_id": rid,
                "staging": _b64(rec.transport.descriptor.to_bytes())}

    def receiver(self, rid: str) -> _Receiver:
        rec = self._receivers.get(rid)
        if rec is None:
            raise KeyError(f"unknown receiver_id {rid!r}: connect (POST /kv/connect) first")
        return rec

    # the export (engine thread)
    def export(self, request_id: int, pool, table, num_tokens: int, tag) -> dict:
        rid, transfer_id, generation = tag
        rec = self.receiver(rid)
        rtable = receiver_table(rec.cast.plan, num_tokens)
        need = {p: sum(r.pool == p for r in rtable) for p in POOLS}
        with self._lock:
            if transfer_id in self._held:
                raise ValueError(f"transfer {transfer_id!r} is already staged")
            if transfer_id in self._released:
                raise ValueError(f"transfer {transfer_id!r} was released by its reader before it was staged")
            if any(len(rec.free[p]) < need[p] for p in POOLS):
                self.stats["staging_full"] += 1
                raise StagingFull(f"staging for this receiver is full ({need['q']} q + {need['hp']} hp blocks "
                                  f"needed, {len(rec.free['q'])} + {len(rec.free['hp'])} free)")
            ids = {p: [rec.free[p].pop() for _ in range(need[p])] for p in POOLS}
            self._held[transfer_id] = _Held(rid, ids, time.monotonic() + self.ttl_s)
        try:
            rec.cast.cast(pool, table, num_tokens, into=rec.staging, ids=ids)
            headers = []
            for chunk in plan_chunks(rec.cast.plan, need["q"], need["hp"], LAYERS_PER_CHUNK):
                payload = pack_payload(rec.staging, chunk, ids["q"], ids["hp"])
                headers.append(_b64(ChunkHeader.for_chunk(
                    chunk, payload, compat_hash=rec.negotiated.digest(), request_id=transfer_id,
                    transfer_id=request_id, generation=generation, token_range=(0, num_tokens)).encode()))
            if rec.staging.device.type == "cuda":
                torch.cuda.current_stream(rec.staging.device).synchronize()  # staged before anyone reads
        except BaseException:
            self.release(transfer_id)
            raise
        nbytes = sum(ChunkHeader.decode(_unb64(h, "header")).payload_len for h in headers)
        with self._lock:
            self.stats["exported"] += 1
            self.stats["bytes"] += nbytes
        return {"q_blocks": ids["q"], "hp_blocks": ids["hp"], "headers": headers, "nbytes": nbytes}

    def release(self, transfer_id: str, expired: bool = False) -> bool:
        """Free a transfer's staging blocks (idempotent: False when it held none; a transfer released
        before it was staged, its reader gone, is then refused by :meth:`export`)."""
        with self._lock:
            held = self._held.pop(transfer_id, None)
            if held is None:
                self._released.append(transfer_id)
                return False
            rec = self._receivers[held.rid]
            for p in POOLS:
                rec.free[p].extend(held.ids[p])
            self.stats["expired" if expired else "released"] += 1
            return True

    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def status(self) -> dict:
        with self._lock:
            return {"role": "prefill", "receivers": {r: {**rec.negotiated.summary(), "connections": rec.connections,
                                                         "staging_free": {p: len(rec.free[p]) for p in POOLS}}
                                                     for r, rec in self._receivers.items()},
                    "staged_transfers": len(self._held), **self.stats}

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for rec in list(self._receivers.values()):
                try:
                    for _, msg in rec.transport.poll_notifications():
                        self.release(msg.decode(errors="replace"))
                except Exception as e:  # noqa: BLE001 - a bad peer must not stop the others
                    log.warning("kvq: polling KV transfer notifications: %s", e)
            now = time.monotonic()
            with self._lock:
                late = [t for t, h in self._held.items() if h.deadline < now]
            for t in late:
                if self.release(t, expired=True):
                    log.warning("kvq: staged KV of transfer %s expired unread after %g s", t, self.ttl_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for rec in self._receivers.values():
            rec.transport.close()


def _nixl_factory(device):
    def make(name: str):
        from kvq.transfer.nixl_transport import NixlTransport

        return NixlTransport(name, device=device)
    return make


# -- the decode side --------------------------------------------------------------------------------
@dataclass
class _Pull:
    op: object
    token_ids: list[int]
    sampling: dict
    transfer_id: str
    deadline: float
    t0: float
    reply: dict | None = None
    handle: object = None
    headers: list = field(default_factory=list)
    ids: dict = field(default_factory=dict)


class PeerUnavailable(RuntimeError):
    """The prefill peer cannot be reached or answered with an error."""


class PrefillClient(RemotePrefill):
    """A decode server's side: every request's prompt is prefilled by the peer at ``url`` and its
    KV pulled into the blocks the scheduler reserved.  ``fallback``: "local" (prefill here when a
    fill fails) or "fail".  ``verify``: check each chunk's CRC-32 over the received bytes.
    ``on_result``: called with each :class:`RemoteResult` (metrics), on the engine thread."""

    def __init__(self, engine, url: str, *, fallback: str = "local", timeout_s: float = 30.0, verify: bool = True,
                 api_key: str | None = None, connect_timeout_s: float = 30.0, transport=None, on_result=None):
        if fallback not in FALLBACKS:
            raise ValueError(f"unknown KV fallback {fallback!r}; valid: {', '.join(FALLBACKS)}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--kv-peer must be an http:// or https:// URL, got {url!r}")
        self.engine, self.url = engine, url.rstrip("/")
        self.fallback = fallback == "local"
        self.timeout_s, self.verify, self.api_key = timeout_s, verify, api_key
        self.on_result = on_result
        self.description = describe_engine(engine)
        self.scales_json = scales_to_json(getattr(engine, "static_scales", None))
        self.name = f"kvq-decode-{uuid.uuid4().hex[:12]}"
        if transport is None:
            from kvq.transfer.nixl_transport import NixlTransport

            transport = NixlTransport(self.name, device=engine.device)
        self.transport = transport
        self.transport.register_pool(engine.pool)
        self.generation = 0
        self.negotiated: Negotiated | None = None
        self.peer_agent: str | None = None
        self.receiver_id: str | None = None
        self._http = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kvq-kv-http")
        self._jobs: queue.Queue = queue.Queue()  # _Pull with a reply, or ("release"/"stop", ...)
        self._results: queue.Queue = queue.Queue()
        self._pending = 0
        self._ticket = 0
        self._stop = threading.Event()
        self.connect(connect_timeout_s)
        self._thread = threading.Thread(target=self._run, name="kvq-kv-pull", daemon=True)
        self._thread.start()

    # -- handshake ----------------------------------------------------------------------------
    def connect(self, timeout_s: float) -> None:
        """Handshake with the peer, retrying while it is unreachable for up to ``timeout_s``;
        :class:`TransferIncompatible` (never retried) when the two cannot exchange KV."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = self._post("/kv/connect", {"description": self.description.to_dict(),
                                                   "static_scales": self.scales_json}, timeout=30)
                break
            except PeerUnavailable as e:
                if "HTTP 409" in str(e) or "HTTP 400" in str(e):
                    raise TransferIncompatible(f"the prefill peer {self.url} refused this server: {e}") from None
                if time.monotonic() > deadline:
                    raise PeerUnavailable(f"the prefill peer {self.url} did not answer the handshake within "
                                          f"{timeout_s:g} s: {e}") from None
                time.sleep(0.5)
        try:
            remote = KVDescription.from_dict(reply["description"])
            self.negotiated = check_compatible(self.description, remote, receiver="local")
            if reply["receiver_id"] != receiver_id(self.negotiated, self.scales_json):
                raise TransferIncompatible("the peer's receiver id is not the digest of this server's layout "
                                           "and static scales")
            self.peer_agent = self.transport.connect(_unb64(reply["staging"], "staging"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"the prefill peer's handshake reply is malformed ({type(e).__name__}: {e})") from None
        self.receiver_id = reply["receiver_id"]
        self.generation += 1

    def _post(self, path: str, body: dict, timeout: float) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read())["error"]["message"]
            except Exception:  # noqa: BLE001 - not our error body
                msg = e.reason
            raise PeerUnavailable(f"HTTP {e.code} from {path}: {msg}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise PeerUnavailable(f"{path}: {getattr(e, 'reason', e)}") from None

    # -- RemotePrefill (engine thread) --------------------------------------------------------------
    def start(self, op, token_ids, params) -> None:
        self._pending += 1
        self._ticket += 1
        sampling = {k: getattr(params, k) for k in ("temperature", "top_p", "top_k", "seed", "stop_token_ids",
                                                    "ignore_eos", "logprobs")}
        sampling["stop_token_ids"] = list(sampling["stop_token_ids"])
        now = time.monotonic()
        pull = _Pull(op, list(token_ids), sampling, f"{self.name}/{self._ticket}", now + self.timeout_s, now)
        self._http.submit(self._prefill, pull)

    def poll(self, timeout: float = 0.0) -> list[RemoteResult]:
        out = []
        try:
            out.append(self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait())
            while True:
                out.append(self._results.get_nowait())
        except queue.Empty:
            pass
        self._pending -= len(out)
        if self.on_result is not None:
            for r in out:
                self.on_result(r)
        return out

    def num_pending(self) -> int:
        return self._pending

    # -- the fill ----------------------------------------------------------------------------------
    def _fail(self, pull: _Pull, reason: str, error: str) -> None:
        self._results.put(RemoteResult(pull.op, None, reason, error, seconds=time.monotonic() - pull.t0))
        self._http.submit(self._release, pull.transfer_id)

    def _prefill(self, pull: _Pull) -> None:  # an HTTP worker
        body = {"receiver_id": self.receiver_id, "transfer_id": pull.transfer_id, "generation": self.generation,
                "request_id": int(pull.op.ticket), "token_ids": pull.token_ids, "sampling": pull.sampling}
        try:
            pull.reply = self._post("/kv/prefill", body, timeout=max(0.1, pull.deadline - time.monotonic()))
        except PeerUnavailable as e:
            timed_out = "timed out" in str(e)
            reachable = "HTTP" in str(e)
            self._fail(pull, "timeout" if timed_out else "peer_error" if reachable else "peer_unreachable", str(e))
            return
        self._jobs.put(pull)

    def _release(self, transfer_id: str) -> None:  # an HTTP worker; best effort (P also expires it)
        try:
            self._post("/kv/release", {"transfer_id": transfer_id}, timeout=5)
        except PeerUnavailable as e:
            log.debug("kvq: releasing %s on the peer: %s", transfer_id, e)

    def _check_reply(self, pull: _Pull) -> None:
        """Everything the peer said, checked against what this side reserved, before any byte moves."""
        r, op = pull.reply, pull.op
        try:
            first = r["first_token"]
            if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < self._vocab():
                raise ValueError(f"first_token {first!r} is not a token id")
            want = {p: [b for _, b in op.blocks(p)] for p in POOLS}
            got = {"q": r["q_blocks"], "hp": r["hp_blocks"]}
            for p in POOLS:
                if not isinstance(got[p], list) or len(got[p]) != len(want[p]) or \
                        not all(isinstance(b, int) and not isinstance(b, bool) for b in got[p]):
                    raise ValueError(f"{p}_blocks: expected {len(want[p])} block ids, got {got[p]!r:.80}")
            chunks = plan_chunks(self.engine.plan, len(want["q"]), len(want["hp"]), LAYERS_PER_CHUNK)
            if not isinstance(r["headers"], list) or len(r["headers"]) != len(chunks):
                raise ValueError(f"expected {len(chunks)} chunk headers")
            digest = self.negotiated.digest()
            for h, chunk in zip(r["headers"], chunks):
                head = ChunkHeader.decode(_unb64(h, "chunk header"))
                head.check(chunk, compat_hash=digest, generation=self.generation)
                if head.request_id != pull.transfer_id or (head.token_start, head.token_end) != (0, op.num_tokens):
                    raise WireError(f"chunk header is for {head.request_id!r} tokens "
                                    f"[{head.token_start}, {head.token_end}), not this transfer")
                pull.headers.append((head, chunk))
            pull.ids = {p: (want[p], got[p]) for p in POOLS}
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed reply ({type(e).__name__}: {e})") from None

    def _vocab(self) -> int:
        return self.engine.model.config.vocab_size

    def _run(self) -> None:  # the thread that owns the NIXL agent
        active: list[_Pull] = []
        while not self._stop.is_set():
            jobs = []
            try:
                jobs.append(self._jobs.get(timeout=0.001 if active else 0.05))
                while True:
                    jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                pass
            for pull in jobs:
                self._begin(pull, active)
            still = []
            for pull in active:
                if not self._advance(pull):
                    still.append(pull)
            active = still
        for pull in active:
            pull.handle.cancel()
            self._fail(pull, "aborted", "the decode server is shutting down")

    def _begin(self, pull: _Pull, active: list) -> None:
        try:
            self._check_reply(pull)
        except (ValueError, WireError) as e:
            self._fail(pull, "bad_reply", str(e))
            return
        q = [(d, s) for d, s in zip(*pull.ids["q"])]
        hp = [(d, s) for d, s in zip(*pull.ids["hp"])]
        try:
            pull.handle = self.transport.read_blocks(self.peer_agent, q, hp, notif=pull.transfer_id.encode())
        except Exception as e:  # noqa: BLE001 - PeerError, TransferError, a bad block id
            self._fail(pull, "transfer_error", f"{type(e).__name__}: {e}")
            return
        active.append(pull)

    def _advance(self, pull: _Pull) -> bool:
        """Poll one read; True once it has ended (reported)."""
        state = pull.handle.poll()
        if state == "pending":
            if time.monotonic() < pull.deadline:
                return False
            pull.handle.cancel()
            self._fail(pull, "timeout", f"the KV read of {pull.handle.nbytes} bytes did not finish within "
                       f"{self.timeout_s:g} s")
            return True
        if state == "failed":
            self._fail(pull, "transfer_error", str(pull.handle.error))
            return True
        if self.verify:
            try:
                for head, chunk in pull.headers:
                    head.check_payload(pack_payload(self.engine.pool, chunk, pull.ids["q"][0], pull.ids["hp"][0]))
            except WireError as e:
                self._fail(pull, "checksum", str(e))
                return True
        r = pull.reply
        self._results.put(RemoteResult(pull.op, r["first_token"], logprobs=r.get("logprobs"), nbytes=pull.handle.nbytes,
                                       seconds=time.monotonic() - pull.t0))
        self._http.submit(self._release, pull.transfer_id)  # the notification usually got there first
        return True

    def status(self) -> dict:
        return {"role": "decode", "peer": self.url, "fallback": "local" if self.fallback else "fail",
                "generation": self.generation, "pending": self._pending,
                "negotiated": self.negotiated.summary() if self.negotiated else None}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._http.shutdown(wait=False, cancel_futures=True)
        self.transport.close()


def peer_api_key(own_key: str | None) -> str | None:
    """The key a decode server sends to its prefill peer: $KVQ_KV_PEER_API_KEY, else its own."""
    return os.environ.get("KVQ_KV_PEER_API_KEY") or own_key
