"""Forget an engine's cached prefixes after its weights changed, in O(1) where vLLM allows.

vLLM's `LLM.reset_prefix_cache()` clears the cache by visiting every KV-cache
block (`BlockPool.reset_prefix_cache`: a Python loop), so it costs time in
proportion to the KV cache, not to the weights: 24 ms of a 29 ms commit on an
H200 with half its memory given to the cache. Where the engine's scheduler runs
in this process (rl-sync's engine ranks: external launcher, engine core in
process) and nothing else reads the cache's hashes, `forget_cached_prefixes`
instead gives every prefix a new root: vLLM chains each block's hash from
`kv_cache_utils.NONE_HASH`, so replacing that seed (with one derived from it)
makes every block hash computed from then on differ from every hash cached
before. No earlier block can be hit again; each is evicted by vLLM's own LRU
when its memory is next handed out, exactly as a block without a hash is.

The fast path is taken where no one else reads the hashes:

* no KV connector (an external or offloaded cache keyed by these hashes), no
  auxiliary-output connector (vLLM's reset starts its state anew) and no
  KV-cache events (their consumers expect vLLM's `AllBlocksCleared`);
* the installed vLLM reads the seed when it hashes (checked each time, by
  hashing an empty block with `repr` and finding the seed in the result).

Requests the engine holds (a commit between two of its steps,
`rl_sync.rank.steps`) keep the KV they computed, as with vLLM's
`pause_generation(mode="keep", clear_cache=False)`; their later tokens come from
the new weights. No request that starts after the commit reads what they cache:
a request that never started hashes its tokens anew under the new root (hashed
ahead, `hash_ahead`, or inside the commit); a started one (running, or
preempted: vLLM sets its computed tokens back to 0 and counts the preemption)
keeps the hashes it has, whose blocks chain from the old root, and gets a salt
of this update's on its first block (vLLM's `cache_salt`, which only the first
block's hash reads: it counts where the request filled no block yet, so its
first would be hashed from the new root, or where vLLM hashes its blocks anew,
as for a streaming session's next input). Preempted before or after the
commit, a started request so resumes from the blocks it cached, as it would
with no update (computing them anew under the new weights cost the engine a
112 ms step and 15 more steps in a 6.5 s generation on an H100); what it reads
was computed by requests started before the commit, under the old weights or,
after it, the new. vLLM's own reset, which runs where the
fast path cannot, refuses while requests hold blocks.

Otherwise it calls vLLM's own reset, and raises `RuntimeError(STALE_PREFIXES)`
where that refuses. What the fast path
leaves as it was: vLLM's prefix-cache hit-rate window and block-residency
metrics, which its reset starts anew.

Typical use (on the engine rank, after every rank applied a round)::

    forget_cached_prefixes(llm)
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STALE_PREFIXES = (
    "vLLM refused to reset its prefix cache (requests are running); the weights changed, so cached "
    "prefixes would be stale: finish or abort requests before pushing"
)
SEED_SALT = b"rl-sync weight update\x00"


def _in_process_scheduler(llm) -> Any | None:
    """The engine core's scheduler when the core runs in this process (vLLM's in-process client),
    else None."""
    core = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)


def _seed_is_read_when_hashing() -> bool:
    """Whether vLLM's block hashing reads `kv_cache_utils.NONE_HASH` at each call (so a new seed
    roots every later prefix); False before an engine set it. (Microseconds: checked each time.)"""
    from vllm.v1.core import kv_cache_utils

    seed = getattr(kv_cache_utils, "NONE_HASH", None)
    if not isinstance(seed, bytes):
        return False
    hashed = kv_cache_utils.hash_block_tokens(_repr_bytes, None, ())
    return repr(seed).encode() in hashed


def _repr_bytes(value: object) -> bytes:
    return repr(value).encode()


def _fast_path_allowed(scheduler) -> bool:
    return (
        getattr(scheduler, "connector", None) is None
        and getattr(scheduler, "aux_output_connector", None) is None
        and not getattr(scheduler, "enable_kv_cache_events", True)
        and _seed_is_read_when_hashing()
    )


def new_root() -> bytes:
    """Replace vLLM's prefix seed with one derived from it (the same on every rank and engine that
    shared the old one, after the same number of updates); returns the new seed."""
    from vllm.v1.core import kv_cache_utils

    seed = next_root()
    kv_cache_utils.NONE_HASH = type(kv_cache_utils.NONE_HASH)(seed)
    return seed


def next_root() -> bytes:
    """The seed the next `new_root` gives (vLLM's seed left as it is)."""
    from vllm.v1.core import kv_cache_utils

    return hashlib.sha256(SEED_SALT + kv_cache_utils.NONE_HASH).digest()


def _started(request) -> bool:
    """Whether `request` computed tokens before now: running, or preempted (vLLM sets a preempted
    request's computed tokens back to 0 and counts its preemptions)."""
    return request.num_computed_tokens > 0 or getattr(request, "num_preemptions", 0) > 0


def _rehash_held(scheduler, seed: bytes, ahead: Ahead | None = None) -> None:
    """After `new_root` gave `seed`: no request started from now on reads what the requests the
    engine holds cache (see the module docstring; the salt is the same on every rank). A request
    that never started takes its hashes from `ahead` where they were computed under `seed` for
    its tokens (the same request object: an id may come back), else hashes them here."""
    ready = ahead.hashes if ahead is not None and ahead.root == seed else {}
    for request in list(scheduler.requests.values()):
        if _started(request):  # (salted even with hashes: vLLM's streaming sessions hash anew)
            request.cache_salt = f"{request.cache_salt or ''}|rl-sync update {seed.hex()}"
            continue
        computed = ready.get(request.request_id) if ready else None
        request.block_hashes.clear()
        if computed is not None and computed[0] is request and computed[1] == request.num_tokens:
            request.block_hashes.extend(computed[2])
        else:
            request.update_block_hashes()


def _fast_path_scheduler(llm) -> Any | None:
    """The in-process scheduler whose prefixes a new root forgets (`_fast_path_allowed`), or None
    where vLLM's own reset must run."""
    scheduler = _in_process_scheduler(llm)
    return scheduler if scheduler is not None and _fast_path_allowed(scheduler) else None


def forgets_in_place(llm) -> bool:
    """Whether `forget_cached_prefixes` takes the fast path on `llm`, so requests it holds keep
    what they computed (vLLM's own reset refuses while they hold blocks)."""
    return _fast_path_scheduler(llm) is not None


def forget_cached_prefixes(llm, ahead: Ahead | None = None) -> bool:
    """No request that starts after this call is served a prefix cached before it, nor what
    requests held now cache later (they keep what they computed and, preempted, resume from
    it). Returns True where the seed was replaced (O(1) and
    O(requests held), `ahead` sparing the hashing of waiting requests: `hash_ahead`), False
    where vLLM's own reset ran. Raises `RuntimeError(STALE_PREFIXES)` where vLLM refuses
    (requests hold KV-cache blocks)."""
    scheduler = _fast_path_scheduler(llm)
    if scheduler is not None:
        _rehash_held(scheduler, new_root(), ahead)
        return True
    if not llm.reset_prefix_cache():
        raise RuntimeError(STALE_PREFIXES)
    return False


@dataclass(frozen=True)
class Ahead:
    """Block hashes computed ahead of a commit, off the engine's stall (`hash_ahead`)."""

    root: bytes
    """The seed they chain from: the next `new_root`'s."""
    hashes: dict[str, tuple[Any, int, list]]
    """Per request id that had not started: the request, its tokens then, its block hashes."""


def hash_ahead(llm) -> Ahead | None:
    """The block hashes the requests `llm` holds that never started will need under the next
    root, computed here (on any thread, while the engine runs: only their prompts are read), so a
    commit between two steps does not hash them inside the engine's stall. None where the fast
    path is not taken, or where this vLLM's block hasher is not of the form known here (then the
    commit hashes them itself)."""
    scheduler = _fast_path_scheduler(llm)
    if scheduler is None:
        return None
    root, hashes = next_root(), {}
    forms: dict[int, tuple[int, Callable] | None] = {}  # (per hasher: every request shares one)
    for request in list(scheduler.requests.values()):  # (a copy: the engine's thread adds to it)
        if _started(request):
            continue
        hasher = getattr(request, "_block_hasher", None)
        if id(hasher) not in forms:
            forms[id(hasher)] = _hasher_form(hasher)
        form = forms[id(hasher)]
        if form is None:
            continue
        try:
            hashes[request.request_id] = (request, request.num_tokens, _hashes_under(request, root, *form))
        except (ImportError, TypeError):  # (another vLLM's hashing helpers: the commit hashes)
            return None
    return Ahead(root, hashes)


def _hasher_form(hasher) -> tuple[int, Callable] | None:
    """vLLM's request block hasher's block size and hash function (`get_request_block_hasher`'s
    arguments), or None where it is not that function."""
    names = inspect.getclosurevars(hasher).nonlocals if inspect.isfunction(hasher) else {}
    size, hash_fn = names.get("hash_block_size"), names.get("caching_hash_fn")
    return (size, hash_fn) if isinstance(size, int) and callable(hash_fn) else None


def _hashes_under(request, root: bytes, size: int, hash_fn: Callable) -> list:
    """`request`'s full blocks hashed as vLLM's block hasher does, chained from `root`."""
    from vllm.v1.core.kv_cache_utils import NONE_HASH, generate_block_hash_extra_keys, hash_block_tokens

    parent, hashes, mm_index = type(NONE_HASH)(root), [], 0
    tokens = request.all_token_ids
    for start in range(0, request.num_tokens - size + 1, size):
        extra, mm_index = generate_block_hash_extra_keys(request, start, start + size, mm_index)
        parent = hash_block_tokens(hash_fn, parent, tokens[start : start + size], extra)
        hashes.append(parent)
    return hashes
