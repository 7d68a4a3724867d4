"""Digests: NH against its definition, and a tampered transfer is caught naming its sender."""

from __future__ import annotations

import struct

import pytest
import torch

from rl_sync.engine.runner import deadline_in
from rl_sync.transport.digest import Digester, DigestTransport, IntegrityError
from rl_sync.transport.nh import nh_compress, nh_key

from .test_rendezvous import in_threads


def nh_reference(data: bytes, key: list[int]) -> list[int]:
    """NH by its definition, per 1 KiB block (zero-padded) and lane, as signed 64-bit words."""
    data += bytes(-len(data) % 1024)
    out = []
    for start in range(0, len(data), 1024):
        words = struct.unpack("<256I", data[start : start + 1024])
        for lane in range(2):
            k = key[4 * lane : 4 * lane + 256]
            total = (
                sum(
                    ((words[2 * i] + k[2 * i]) % 2**32) * ((words[2 * i + 1] + k[2 * i + 1]) % 2**32)
                    for i in range(128)
                )
                % 2**64
            )
            out.append(total - 2**64 if total >= 2**63 else total)
    return out


@pytest.mark.parametrize("offset, length", [(0, 2048), (3, 1500), (0, 1), (4, 4096 + 7)])
def test_nh_matches_its_definition(offset, length):
    data = torch.randint(0, 256, (offset + length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(length))
    key = nh_key(b"k" * 32, torch.device("cpu"))
    assert nh_compress(data[offset:], key).tolist() == nh_reference(bytes(data[offset:].numpy()), key.tolist())


D = float("inf")


def test_tags_bind_key_peers_sequence_and_every_byte():
    bufs = [torch.arange(100, dtype=torch.uint8)]
    keyed = Digester("keyed", b"k" * 32, label=b"g")
    tag = keyed.tag(0, 1, 0, bufs, D)
    flipped = bufs[0].clone()
    flipped[50] ^= 1
    others = [
        Digester("keyed", b"j" * 32, label=b"g").tag(0, 1, 0, bufs, D),
        keyed.tag(1, 0, 0, bufs, D),
        keyed.tag(0, 1, 1, bufs, D),
        keyed.tag(0, 1, 0, [flipped], D),
        Digester("keyed", b"k" * 32, label=b"h").tag(0, 1, 0, bufs, D),
        Digester("checksum", b"k" * 32, label=b"g").tag(0, 1, 0, bufs, D),
    ]
    assert len({tag, *others}) == 7
    assert Digester("checksum", b"k" * 32, label=b"g").tag(0, 1, 0, bufs, D) == Digester(
        "checksum", b"j" * 32, label=b"g"
    ).tag(0, 1, 0, bufs, D), "a checksum needs no secret"


def test_a_flipped_byte_fails_the_bucket_naming_the_sender(served):
    from rl_sync.transport.gloo import GlooTransport

    server, secret = served
    digester = Digester("keyed", secret, label=b"t")
    transports = in_threads(
        lambda r: DigestTransport(
            GlooTransport(r, 2, "127.0.0.1", server.port, secret, bind_host="127.0.0.1", prefix="d", timeout_s=20),
            digester,
        ),
        2,
    )
    payload = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    for flip in (False, True):
        out = torch.zeros_like(payload)

        def rank(r: int):
            if r == 0:
                transports[0].post([(1, payload)], [], label="bucket 3").wait(deadline_in(30))
                transports[0].finish(deadline_in(30))
                return None
            got = transports[1].post([], [(0, out)], label="bucket 3")
            got.inner.wait(deadline_in(30))
            if flip:
                out[7] ^= 0x80  # as a bad link or an attacker would leave it
            got.wait(deadline_in(30))
            try:
                transports[1].finish(deadline_in(30))
            except IntegrityError as exc:
                return str(exc)
            return torch.equal(out, payload)

        result = in_threads(rank, 2)[1]
        if flip:
            assert result == (
                "rank 1: bucket 3 from rank 0 (transfer 1) failed its keyed digest: altered or "
                "corrupted on the way; nothing of this round counts"
            )
        else:
            assert result is True
    for t in transports:
        t.close()


def test_nh_words_are_sealed_as_their_bytes():
    """On GPUs the tag seals a transfer's NH words (int64) brought to the host; BLAKE3 takes bytes,
    so they are sealed as the bytes they are, whatever the array's element type."""
    words = torch.arange(6, dtype=torch.int64) * 0x0101010101
    keyed = Digester("keyed", b"k" * 32, label=b"g")
    as_words = keyed.seal(0, 1, 0, [48], [words.numpy().data, words.numpy()[2:4].data])
    as_bytes = keyed.seal(
        0, 1, 0, [48], [words.view(torch.uint8).numpy().data, words[2:4].view(torch.uint8).numpy().data]
    )
    assert as_words == as_bytes and len(as_words) == 32
