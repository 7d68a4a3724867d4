"""What a commit between two steps spends on requests that have not started yet.

A staged round's commit made while the engine generates (`rl_sync.rank.steps`) gives vLLM's
prefix cache a new root (`rl_sync.vllm.prefix`): every request the scheduler holds that has
computed nothing yet hashes its prompt anew under it, inside the engine's stall. This times that
rehash (`prefix._rehash_held`, on vLLM's own `Request`s and block hasher, 16-token blocks) for
`--requests` waiting requests of `--tokens` prompt tokens each, per hash function vLLM offers
for prefix caching (`--algos`). No engine runs: vLLM is imported only for its request and
hashing code.

    python benchmarks/rehash_bench.py [--requests 256,1024,4096] [--tokens 512] [--algos sha256,sha256_cbor]
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

BLOCK_TOKENS = 16


def rehash_seconds(algo: str, requests: int, tokens: int, rng: random.Random) -> float:
    """Seconds `_rehash_held` takes over `requests` unstarted requests of `tokens` tokens."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    from rl_sync.vllm import prefix

    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK_TOKENS, hash_fn)
    held = {
        f"r{i}": Request(
            f"r{i}",
            [rng.randrange(30000) for _ in range(tokens)],
            SamplingParams(max_tokens=8),
            None,
            block_hasher=hasher,
        )
        for i in range(requests)
    }
    start = time.perf_counter()
    prefix._rehash_held(SimpleNamespace(requests=held), prefix.new_root())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", default="256,1024,4096")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--algos", default="sha256,sha256_cbor")
    args = parser.parse_args()
    rng = random.Random(0)
    for algo in args.algos.split(","):
        for requests in (int(n) for n in args.requests.split(",")):
            seconds = rehash_seconds(algo, requests, args.tokens, rng)
            print(f"{algo}: {requests} waiting requests x {args.tokens} tokens: rehash {seconds * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
