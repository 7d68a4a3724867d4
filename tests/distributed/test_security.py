"""A stranger on the network cannot read or steer a group; a tampered transfer never counts.

The stranger (`stranger.py`) is a separate, isolated Python process with no Ray,
no rl-sync and no secret, on 127.0.0.1. Tampering on the wire is played by a
rank's own transport flipping a received byte after the transfer, before the
digest check: what an attacker on the path (or a bad link) would leave.
"""

from __future__ import annotations

import pytest
import ray
import torch

from actors import SyncError

from .harness import Group
from .recipes import as_bytes, expected, read_all
from .stranger import listening_ports, run_stranger
from .test_failures import W


def store_port(coordinator) -> int:
    return ray.get(coordinator.__ray_call__.remote(lambda c: (c._store.port, c._store.refused)))


def test_a_stranger_cannot_read_write_or_flood_the_group(ray_session):
    with Group(W, 2, 2) as g:
        members = g.trainers + g.workers
        before = ray.get([m.call.remote(listening_ports) for m in members])
        sync = g.connect()
        after = ray.get([m.call.remote(listening_ports) for m in members])
        gloo = sorted(p for old, new in zip(before, after) for p in new - old)
        assert len(gloo) >= len(members), f"every rank listens for its Gloo peers: {gloo}"
        g.step(1)
        sync.push()
        port, refused_before = store_port(sync.coordinator)
        seen = run_stranger(port, gloo)
        assert seen["torch_client"].startswith("refused"), seen
        assert seen["junk_reply"] == "", "the store answered a stranger's junk"
        assert seen["guessed_proof_reply_bytes"] == 64, (
            "only the store's own proof (of the stranger's nonce) comes back"
        )
        assert seen["store_flood"] > 0 and seen["listener_flood"] > 0, seen
        _, refused = store_port(sync.coordinator)
        assert refused - refused_before >= 3 + seen["store_flood"] // 2, f"the store refused {refused - refused_before}"
        for version in (2, 3):  # the group works on, and re-forms (a new store, a new secret) after the flood
            g.step(version)
            sync.push()
            g.check(version)
        sync.repair()
        g.step(4)
        sync.push()
        g.check(4)
        assert sync.versions() == [4, 4]


class FlipOnce:
    """Wraps a rank's transport below the digest: flips one byte of the first payload of the next
    bucket it receives, after the transfer (what a bad link or an attacker on the path leaves).
    Tags follow payloads, so the first buffer received is always payload."""

    def __init__(self, inner, skip: int = 0, at: float = 0.5):
        """Flip a bit of the first receive buffer of the (`skip` + 1)-th post that receives, at
        fraction `at` of the buffer."""
        self.inner, self.armed, self.skip, self.at = inner, True, skip, at

    def post(self, sends, recvs, label=""):
        pending, owner = self.inner.post(sends, recvs, label=label), self

        class Flipped:
            def wait(self, deadline):
                pending.wait(deadline)
                if owner.armed and recvs and owner.skip:
                    owner.skip -= 1
                elif owner.armed and recvs:
                    owner.armed = False
                    buf = recvs[0][1]
                    buf[min(buf.numel() - 1, int(buf.numel() * owner.at))] ^= 0x10

        return Flipped()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _tamper(actor) -> None:
    transport = actor._rl_sync_session.transport
    transport.inner = FlipOnce(transport.inner)


@pytest.mark.parametrize("integrity", ["keyed", "checksum"])
def test_a_byte_flipped_on_the_wire_fails_the_round_and_double_buffered_weights_stay(ray_session, integrity):
    with Group(W, 2, 2, double_buffer=True, integrity=integrity, round_timeout_s=10.0) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        ray.get(g.workers[1].call.remote(_tamper))
        g.step(2)
        with pytest.raises(SyncError) as info:
            sync.push()
        text = str(info.value)
        assert "round 2 (m2n) failed on" in text
        assert (
            "worker 1 (rank 3): BucketError: rank 3, round 2 (m2n), completing the round: IntegrityError: rank 3: "
            "bucket 0 (tensors 'w', 'b') from rank "
        ) in text
        assert f"failed its {integrity} digest: altered or corrupted on the way; nothing of this round counts" in text
        g.check(1)  # the live weights are still version 1, bit for bit
        assert sync.versions() == [1, 1]
        g.step(3)
        assert sync.push(version=3).version == 3  # repairs first
        g.check(3)
        assert sync.versions() == [3, 3]


def _tamper_sparse_payload(actor) -> None:
    transport = actor._rl_sync_session.transport
    transport.inner = FlipOnce(transport.inner, skip=1, at=1.0)  # past the headers, in the last value


def test_a_flip_in_a_sparse_payload_fails_the_round_at_its_end(ray_session):
    """Sparse rounds check every digest once, when the round finishes: the flipped value fails
    the round, and double buffering keeps the live weights."""
    with Group(W, 2, 2, double_buffer=True, round_timeout_s=10.0) as g:
        sync = g.connect()
        g.step(1)
        assert sync.push(mode="sparse").mode == "m2n"  # the baselines
        ray.get(g.workers[1].call.remote(_tamper_sparse_payload))
        g.step(2)
        with pytest.raises(SyncError) as info:
            sync.push(mode="sparse")
        text = str(info.value)
        assert "worker 1 (rank 3): BucketError: rank 3, round 2 (sparse): IntegrityError: rank 3: bucket 0 " in text
        assert "failed its keyed digest: altered or corrupted on the way; nothing of this round counts" in text
        g.check(1)
        assert sync.versions() == [1, 1]
        g.step(3)
        assert sync.push(version=3, mode="sparse").mode == "m2n"  # the repair's round is dense
        g.check(3)


def test_without_a_digest_the_same_flip_goes_unseen(ray_session):
    """What `integrity='off'` gives up: the flipped byte lands in the live weights."""
    with Group(W, 2, 2, integrity="off") as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        ray.get(
            g.workers[1].call.remote(
                lambda self: setattr(self._rl_sync_session, "transport", FlipOnce(self._rl_sync_session.transport))
            )
        )
        g.step(2)
        sync.push()
        got = ray.get(g.workers[1].call.remote(read_all))
        differs = [n for n, v in expected(W, 1, 2).items() if not torch.equal(got[n], as_bytes(v))]
        assert len(differs) == 1 and sync.versions() == [2, 2]
