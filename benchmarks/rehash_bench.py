"""What a commit between two steps spends on requests that have not started yet.

A staged round's commit made while the engine generates (`rl_sync.rank.steps`) gives vLLM's
prefix cache a new root (`rl_sync.vllm.prefix`): every request the scheduler holds that has
computed nothing yet needs its prompt hashed anew under it. This times, for `--requests` waiting
requests of `--tokens` prompt tokens each and per hash function vLLM offers for prefix caching
(`--algos`): the commit hashing them itself (`prefix._rehash_held`, inside the engine's stall),
the commit taking hashes computed ahead of it, and that hashing ahead (`prefix.hash_ahead`, on
the commit's thread, beside the engine's steps). No engine runs: vLLM is imported only for its
`Request` and block hasher (16-token blocks).

    python benchmarks/rehash_bench.py [--requests 256,1024,4096] [--tokens 512] [--algos sha256,sha256_cbor]
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

BLOCK_TOKENS = 16


def _waiting(algo: str, requests: int, tokens: int, rng: random.Random) -> SimpleNamespace:
    """A scheduler (as `prefix` reads one) holding `requests` requests that computed nothing."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK_TOKENS, hash_fn)
    sampling = SamplingParams(max_tokens=8)
    held = {
        f"r{i}": Request(f"r{i}", [rng.randrange(30000) for _ in range(tokens)], sampling, None, block_hasher=hasher)
        for i in range(requests)
    }
    return SimpleNamespace(requests=held, connector=None, aux_output_connector=None, enable_kv_cache_events=False)


def rehash_ms(algo: str, requests: int, tokens: int, rng: random.Random) -> tuple[float, float, float]:
    """Milliseconds of the commit hashing the waiting requests itself, of the commit taking hashes
    computed ahead, and of that hashing ahead."""
    from rl_sync.vllm import prefix

    scheduler = _waiting(algo, requests, tokens, rng)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace())))
    llm.llm_engine.engine_core.engine_core.scheduler = scheduler
    start = time.perf_counter()
    prefix._rehash_held(scheduler, prefix.new_root())
    itself = time.perf_counter() - start
    start = time.perf_counter()
    ahead = prefix.hash_ahead(llm)
    beside = time.perf_counter() - start
    assert ahead is not None and len(ahead.hashes) == requests
    start = time.perf_counter()
    prefix._rehash_held(scheduler, prefix.new_root(), ahead)
    taken = time.perf_counter() - start
    return 1e3 * itself, 1e3 * taken, 1e3 * beside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", default="256,1024,4096")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--algos", default="sha256,sha256_cbor")
    args = parser.parse_args()
    rng = random.Random(0)
    for algo in args.algos.split(","):
        for requests in (int(n) for n in args.requests.split(",")):
            itself, taken, beside = rehash_ms(algo, requests, args.tokens, rng)
            print(
                f"{algo}: {requests} waiting x {args.tokens} tokens: in the stall {itself:.1f} ms hashing them, "
                f"{taken:.1f} ms taking hashes computed ahead ({beside:.1f} ms beside the engine's steps)"
            )


if __name__ == "__main__":
    main()
