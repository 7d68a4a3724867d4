"""Forgetting cached prefixes after a round (`rl_sync.vllm.prefix`): a new root for every later
block hash where that is what vLLM's reset does, vLLM's own reset everywhere else, one refusal.

The engine-level check (a prefix cached before a push is not served after it) is
`tests/distributed/test_vllm.py`: its long prompt fills a cache block, and each step's
generations must equal a fresh engine's."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.core import kv_cache_utils

from rl_sync.rank.steps import CONTROL_GROUP
from rl_sync.vllm import prefix

BLOCK = list(range(32))


@pytest.fixture
def seeded(monkeypatch):
    """vLLM's seed as an engine sets it (restored after the test)."""
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", kv_cache_utils.BlockHash(b"\x01" * 32), raising=False)


class FakeLlm:
    """An `LLM` whose in-process engine core has `scheduler`; records calls of vLLM's reset."""

    def __init__(self, scheduler=None, reset_answers: bool = True):
        core = SimpleNamespace(scheduler=scheduler) if scheduler is not None else None
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core))
        self.reset_answers, self.resets = reset_answers, 0

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return self.reset_answers


class HeldRequest:
    """A request the scheduler holds: `computed` tokens computed, `hashed` of its blocks hashed
    (each from the root of its time, as vLLM's block hasher chains them)."""

    def __init__(self, computed: int, hashed: int, salt: str | None = None, preemptions: int = 0):
        self.num_computed_tokens, self.cache_salt, self.num_preemptions = computed, salt, preemptions
        self.block_hashes: list[bytes] = []
        self.blocks = max(hashed, 2)
        self.block_hashes.extend(self._hashes()[:hashed])

    def _hashes(self) -> list[bytes]:
        return [_hash([i]) for i in range(self.blocks)]

    def update_block_hashes(self) -> None:
        self.block_hashes.extend(self._hashes()[len(self.block_hashes) :])


def scheduler(requests: int = 0, connector=None, aux=None, events: bool = False, held: dict | None = None):
    """A scheduler holding `requests` requests (vLLM's `requests`: every one it knows, whatever
    its state), or the `held` ones."""
    return SimpleNamespace(
        requests=held if held is not None else {f"r{i}": HeldRequest(4, 1) for i in range(requests)},
        connector=connector,
        aux_output_connector=aux,
        enable_kv_cache_events=events,
    )


def _sha(obj) -> bytes:
    return hashlib.sha256(repr(obj).encode()).digest()


def _hash(block) -> bytes:
    return kv_cache_utils.hash_block_tokens(_sha, None, block)


def test_a_new_root_changes_every_later_block_hash_and_is_the_same_from_the_same_seed(seeded):
    before = _hash(BLOCK)
    root = prefix.new_root()
    assert root == kv_cache_utils.NONE_HASH and _hash(BLOCK) != before
    chained = kv_cache_utils.hash_block_tokens(_sha, _hash(BLOCK), BLOCK)
    assert chained != kv_cache_utils.hash_block_tokens(_sha, before, BLOCK)
    kv_cache_utils.NONE_HASH = kv_cache_utils.BlockHash(b"\x01" * 32)
    assert prefix.new_root() == root, "derived from the seed alone: every rank that shared it agrees"


def test_an_idle_in_process_engine_gets_a_new_root_and_vllms_loop_does_not_run(seeded):
    llm, before = FakeLlm(scheduler()), kv_cache_utils.NONE_HASH
    assert prefix.forget_cached_prefixes(llm) is True
    assert llm.resets == 0 and before != kv_cache_utils.NONE_HASH


def test_requests_held_keep_what_they_computed_and_nothing_they_cache_later_is_served_to_a_later_one(seeded):
    waiting, unhashed, hashed = HeldRequest(0, 2), HeldRequest(5, 0, salt="user"), HeldRequest(40, 2)
    preempted, preempted_unhashed = HeldRequest(0, 2, preemptions=1), HeldRequest(0, 0, preemptions=2)
    old_waiting, old_hashed = list(waiting.block_hashes), list(hashed.block_hashes)
    old_preempted = list(preempted.block_hashes)
    held = {"w": waiting, "u": unhashed, "h": hashed, "p": preempted, "pu": preempted_unhashed}
    llm = FakeLlm(scheduler(held=held))
    assert prefix.forget_cached_prefixes(llm) is True and llm.resets == 0
    assert waiting.block_hashes == waiting._hashes() and waiting.block_hashes[0] != old_waiting[0], (
        "a request that never started hashes its prompt from the new root"
    )
    seed = bytes(kv_cache_utils.NONE_HASH).hex()
    assert unhashed.cache_salt == f"user|rl-sync update {seed}", "its first block, hashed later, is its own"
    assert preempted_unhashed.cache_salt == f"|rl-sync update {seed}", "preempted before filling a block"
    assert hashed.block_hashes == old_hashed, "its later blocks chain from the old root"
    assert preempted.block_hashes == old_preempted, "preempted before the commit, it resumes from its blocks"
    assert hashed.cache_salt == preempted.cache_salt == f"|rl-sync update {seed}", "hashed anew, still its own"
    assert not any(hasattr(r, "skip_reading_prefix_cache") for r in held.values()), "preempted, each reads its own"


@pytest.mark.parametrize(
    "sched, why",
    [
        (None, "the engine core runs in another process"),
        (scheduler(connector=object()), "a KV connector keys its cache by these hashes"),
        (scheduler(aux=object()), "vLLM's reset starts the auxiliary-output connector anew"),
        (scheduler(events=True), "KV-cache events' consumers expect vLLM's AllBlocksCleared"),
    ],
)
def test_vllms_own_reset_runs_where_a_new_root_is_not_equivalent(seeded, sched, why):
    llm, before = FakeLlm(sched), kv_cache_utils.NONE_HASH
    assert not prefix.forgets_in_place(llm), "a commit between steps waits for the generation's end"
    assert prefix.forget_cached_prefixes(llm) is False, why
    assert llm.resets == 1 and before == kv_cache_utils.NONE_HASH, why


def test_a_vllm_that_does_not_read_the_seed_when_hashing_gets_its_own_reset(seeded, monkeypatch):
    monkeypatch.setattr(kv_cache_utils, "hash_block_tokens", lambda fn, parent, block, extra=None: fn(block))
    llm = FakeLlm(scheduler())
    assert prefix.forget_cached_prefixes(llm) is False and llm.resets == 1


def test_before_any_engine_set_the_seed_vllms_reset_runs(monkeypatch):
    monkeypatch.delattr(kv_cache_utils, "NONE_HASH", raising=False)
    llm = FakeLlm(scheduler())
    assert prefix.forget_cached_prefixes(llm) is False and llm.resets == 1


def test_a_refused_reset_raises_naming_why_and_what_to_do(seeded):
    with pytest.raises(RuntimeError) as raised:
        prefix.forget_cached_prefixes(FakeLlm(scheduler(connector=object()), reset_answers=False))
    assert str(raised.value) == (
        "vLLM refused to reset its prefix cache (requests are running); the weights changed, so cached "
        "prefixes would be stale: finish or abort requests before pushing"
    )


@pytest.mark.parametrize(
    "tp, sched, group",
    [
        (1, scheduler(connector=object()), CONTROL_GROUP),
        (2, scheduler(), CONTROL_GROUP),
        (2, scheduler(connector=object()), ""),
        (2, scheduler(events=True), ""),
    ],
)
def test_a_tensor_parallel_engine_whose_commits_wait_for_the_generations_end_takes_every_call_in_order(
    seeded, tp, sched, group
):
    """Its ranks could not agree on a step (`rl_sync.rank.steps`), and committing each at its own
    generation's end beside the next generation could give its ranks two versions: they report
    no control group. A lone rank keeps it (its commit waits for its own generation)."""
    from actors.vllm import VllmWorkerMixin

    class Rank(VllmWorkerMixin):
        rl_sync_control_group = CONTROL_GROUP

        def rl_sync_llm(self):
            return FakeLlm(sched)

        def _rl_sync_engine(self) -> tuple[int, str]:
            return tp, "engine-a"

    assert Rank()._rl_sync_control_of("worker") == group


def _requests(hasher, tokens: int = 80, first: int = 7) -> dict:
    """vLLM requests that computed nothing: plain, salted, of a LoRA adapter, and one with no full
    block; the same for the same `tokens` and `first` token."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=4)
    kinds: dict[str, dict] = {
        "plain": {},
        "salted": {"cache_salt": "tenant"},
        "lora": {"lora_request": LoRARequest("a", 1, "/a")},
    }
    held = {
        name: Request(name, list(range(first, first + tokens)), sampling, None, block_hasher=hasher, **kwargs)
        for name, kwargs in kinds.items()
    }
    held["short"] = Request("short", [1, 2, 3], sampling, None, block_hasher=hasher)
    return held


def test_hashes_computed_ahead_are_the_ones_the_commit_would_compute_and_spare_it_the_hashing(seeded):
    from vllm.utils.hashing import get_hash_fn_by_name

    hasher = kv_cache_utils.get_request_block_hasher(16, get_hash_fn_by_name("sha256"))
    held, reference = _requests(hasher), _requests(hasher)
    preempted = _requests(hasher, first=3)["plain"]
    preempted.request_id, preempted.num_preemptions = "preempted", 1  # (computed tokens set back to 0)
    held["preempted"], before_preempted = preempted, list(preempted.block_hashes)
    llm = FakeLlm(scheduler(held=held))
    ahead = prefix.hash_ahead(llm)
    assert ahead is not None and set(ahead.hashes) == {"plain", "salted", "lora", "short"}
    late = _requests(hasher, tokens=40)["plain"]
    late.request_id = "late"
    held["late"] = late  # (arrived after the hashing ahead: hashed inside the commit)
    for request in [held[n] for n in ("plain", "salted", "lora", "short")]:
        request.update_block_hashes = None  # (hashing them inside the commit would fail)
    assert prefix.forget_cached_prefixes(llm, ahead) is True
    for request in reference.values():
        request.block_hashes.clear()
        request.update_block_hashes()  # vLLM's own hashing, under the new root
    for name, request in reference.items():
        assert held[name].block_hashes == request.block_hashes, name
    assert [len(held[n].block_hashes) for n in ("plain", "salted", "lora", "short", "late")] == [5, 5, 5, 0, 2]
    assert len({held[n].block_hashes[0] for n in ("plain", "salted", "lora")}) == 3, "salt and adapter keyed"
    assert preempted.block_hashes == before_preempted and len(before_preempted) == 5, "it resumes from its blocks"


def test_hashes_computed_ahead_under_another_root_are_not_used(seeded):
    from vllm.utils.hashing import get_hash_fn_by_name

    hasher = kv_cache_utils.get_request_block_hasher(16, get_hash_fn_by_name("sha256"))
    held = _requests(hasher)
    llm = FakeLlm(scheduler(held=held))
    ahead = prefix.hash_ahead(llm)
    prefix.new_root()  # (another update came first)
    before = {name: list(r.block_hashes) for name, r in held.items()}
    prefix.forget_cached_prefixes(llm, ahead)
    assert ahead is not None and held["plain"].block_hashes != ahead.hashes["plain"][2]
    assert held["plain"].block_hashes != before["plain"] and len(held["plain"].block_hashes) == 5


def test_a_request_id_that_came_back_with_other_tokens_is_hashed_by_the_commit_not_taken(seeded):
    from vllm.utils.hashing import get_hash_fn_by_name

    hasher = kv_cache_utils.get_request_block_hasher(16, get_hash_fn_by_name("sha256"))
    held = _requests(hasher)
    llm = FakeLlm(scheduler(held=held))
    ahead = prefix.hash_ahead(llm)
    held["plain"] = _requests(hasher, first=9)["plain"]  # (the same id and length, other tokens)
    prefix.forget_cached_prefixes(llm, ahead)
    fresh = _requests(hasher, first=9)["plain"]
    fresh.block_hashes.clear()
    fresh.update_block_hashes()
    assert ahead is not None and held["plain"].block_hashes == fresh.block_hashes != ahead.hashes["plain"][2]


def _cache_manager(block: int):
    """vLLM's own KV-cache manager, prefix caching on, 32 blocks of `block` tokens."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)])
    return KVCacheManager(config, max_model_len=256, scheduler_block_size=block, hash_block_size=block)


@pytest.mark.parametrize("preempted", ["before the commit", "after the commit"])
def test_a_preempted_request_resumes_from_its_own_blocks_and_no_later_request_reads_them(seeded, preempted):
    """vLLM's cache manager: a request that computed 70 tokens (four 16-token blocks cached) and
    is preempted resumes from them, whichever side of the commit; a request that had not started
    when the commit came, and one that arrived after it, find nothing with the same prompt."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.request import Request

    hasher = kv_cache_utils.get_request_block_hasher(16, get_hash_fn_by_name("sha256"))
    manager = _cache_manager(16)

    def request(name: str) -> Request:
        return Request(name, list(range(70)), SamplingParams(max_tokens=8), None, block_hasher=hasher)

    started, waiting = request("started"), request("waiting")
    blocks, hits, *_ = manager.get_computed_blocks(started)
    manager.allocate_slots(started, 70, hits, blocks)
    started.num_computed_tokens = 70

    def preempt() -> None:  # (as vLLM's scheduler does)
        manager.free(started)
        started.num_computed_tokens, started.num_preemptions = 0, started.num_preemptions + 1

    if preempted == "before the commit":
        preempt()
    assert manager.get_computed_blocks(waiting)[1] == 64, "before the commit, an equal prompt is served"
    prefix.forget_cached_prefixes(FakeLlm(scheduler(held={"started": started, "waiting": waiting})))
    if preempted == "after the commit":
        preempt()
    assert manager.get_computed_blocks(started)[1] == 64, "it resumes from the blocks it cached"
    assert manager.get_computed_blocks(waiting)[1] == 0 and manager.get_computed_blocks(request("later"))[1] == 0


def test_a_started_request_that_fills_its_first_block_after_the_commit_keeps_it_from_later_requests(seeded):
    """vLLM's cache manager: a request that computed 10 tokens (no full block) when the commit came
    fills its first block after it, from the new root; a later request with the same tokens finds
    it not (its first 10 tokens' KV came from the old weights)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.request import Request

    hasher = kv_cache_utils.get_request_block_hasher(16, get_hash_fn_by_name("sha256"))
    manager = _cache_manager(16)
    started = Request("started", list(range(10)), SamplingParams(max_tokens=40), None, block_hasher=hasher)
    blocks, hits, *_ = manager.get_computed_blocks(started)
    manager.allocate_slots(started, 10, hits, blocks)
    started.num_computed_tokens = 10
    prefix.forget_cached_prefixes(FakeLlm(scheduler(held={"started": started})))
    started.append_output_token_ids(list(range(10, 30)))  # (its first block fills: hashed now)
    manager.allocate_slots(started, 20)
    started.num_computed_tokens = 30
    assert len(started.block_hashes) == 1
    later = Request("later", list(range(30)), SamplingParams(max_tokens=8), None, block_hasher=hasher)
    same_salt = Request("same_salt", list(range(30)), SamplingParams(max_tokens=8), None, block_hasher=hasher)
    same_salt.cache_salt, same_salt.block_hashes[:] = started.cache_salt, []
    same_salt.update_block_hashes()
    assert manager.get_computed_blocks(later)[1] == 0, "the block is the started request's own"
    assert manager.get_computed_blocks(same_salt)[1] == 16, "cached: found with the started request's salt"
