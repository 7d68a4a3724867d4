"""A double-buffered worker's shadows: rounds land in spares, commits copy or swap them in."""

from __future__ import annotations

import ctypes
import types

import pytest
import torch

from rl_sync.engine.endpoint import Endpoint
from rl_sync.rank.shadow import Shadows


def _bound() -> tuple[torch.Tensor, torch.Tensor, dict[str, Endpoint]]:
    """A fused parameter with two bound slots (q, k), a whole tensor (n) and a fallback buffer (f)."""
    fused = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    norm = torch.arange(5, dtype=torch.float32)
    endpoints = {
        "q": Endpoint(fused[:, :2], (0, 0)),
        "k": Endpoint(fused[:, 2:6], (0, 0)),
        "n": Endpoint(norm, (0,)),
        "f": Endpoint(torch.zeros(3), (0,)),
    }
    return fused, norm, endpoints


def _write(shadows: Shadows, value: float) -> None:
    for name in ("q", "k", "n"):
        shadows.endpoints[name].tensor.fill_(value)


def test_rounds_land_in_the_spares_and_a_swap_makes_them_live_without_a_copy(each_swap):
    fused, norm, endpoints = _bound()
    before = fused.clone()
    shadows = Shadows.of(endpoints, keep={"f"}, swappable={"q", "k", "n"})
    assert shadows.endpoints["f"] is endpoints["f"], "a fallback is received as it is"
    assert shadows.endpoints["q"].tensor.stride() == (6, 1), "a spare keeps its view's strides"
    assert shadows.swapped_bytes() == 4 * 2 * 2 + 4 * 4 * 2 + 5 * 4, "q and k (bf16), n (float32)"
    shadows.prepare(writes_all=True)
    _write(shadows, 7.0)
    assert torch.equal(fused, before) and torch.equal(norm, torch.arange(5.0)), "live weights untouched"
    spare = shadows.endpoints["q"].tensor.data_ptr()
    assert shadows.commit(swap=True) is True
    assert fused.data_ptr() == spare, "the live storage took the spare's memory"
    assert torch.equal(fused, torch.full((4, 6), 7.0, dtype=torch.bfloat16))
    assert torch.equal(endpoints["k"].tensor, torch.full((4, 4), 7.0, dtype=torch.bfloat16)), "views see it too"
    assert torch.equal(norm, torch.full((5,), 7.0))
    assert torch.equal(shadows.endpoints["q"].tensor, before[:, :2]), "the spare now holds the previous round"


def test_a_commit_whose_storages_do_not_all_match_their_spares_changes_no_live_tensor(each_swap):
    fused, norm, endpoints = _bound()
    copied = torch.arange(4.0)
    endpoints["c"] = Endpoint(copied, (0,))
    shadows = Shadows.of(endpoints, keep={"f"}, swappable={"q", "k", "n"})
    _write(shadows, 7.0)
    shadows.endpoints["c"].tensor.fill_(7.0)
    before = fused.clone()
    norm.untyped_storage().resize_(8)  # the engine laid the last storage out anew in place
    expected = r"^swap: storages of 8 bytes on cpu and 20 bytes on cpu; expected the same size on the same device$"
    with pytest.raises(ValueError, match=expected):
        shadows.commit(swap=True)
    assert torch.equal(fused, before) and shadows.swaps == 0, "the first storage, which matched, kept its memory"
    assert copied.tolist() == [0.0, 1.0, 2.0, 3.0], "nor was a name that commits by copy written"


def test_a_stale_spare_catches_up_before_a_partial_round_and_not_before_a_full_one(each_swap):
    fused, _, endpoints = _bound()
    shadows = Shadows.of(endpoints, keep={"f"}, swappable={"q", "k", "n"})
    _write(shadows, 7.0)
    shadows.commit(swap=True)
    shadows.prepare(writes_all=False)  # a sparse round next: it writes only what changed
    assert torch.equal(shadows.endpoints["k"].tensor, torch.full((4, 4), 7.0, dtype=torch.bfloat16))
    shadows.endpoints["q"].tensor[0, 0] = 9.0
    shadows.commit(swap=True)
    expected = torch.full((4, 6), 7.0, dtype=torch.bfloat16)
    expected[0, 0] = 9.0
    assert torch.equal(fused, expected)
    shadows.prepare(writes_all=True)  # a dense round of every tensor overwrites the spares
    assert torch.equal(shadows.endpoints["k"].tensor, torch.full((4, 4), 7.0, dtype=torch.bfloat16))
    assert shadows.endpoints["q"].tensor[0, 0].item() == 7.0, "no catch-up before a round that writes all"


def test_a_storage_with_a_name_the_engine_does_not_allow_commits_by_copy(each_swap):
    fused, norm, endpoints = _bound()
    address = fused.data_ptr()
    shadows = Shadows.of(endpoints, keep={"f"}, swappable={"q", "n"})
    assert [live.data_ptr() for live, _ in shadows.copied.values()] == [address, endpoints["k"].tensor.data_ptr()]
    assert shadows.endpoints["q"].tensor.is_contiguous(), "a copied view's spare is contiguous"
    assert shadows.swapped_bytes() == 5 * 4, "only n's storage swaps"
    _write(shadows, 3.0)
    assert shadows.commit(swap=True) is True, "the whole tensor n swaps"
    assert fused.data_ptr() == address, "the fused parameter was copied into, in place"
    assert torch.equal(fused, torch.full((4, 6), 3.0, dtype=torch.bfloat16))
    assert torch.equal(norm, torch.full((5,), 3.0))
    assert torch.equal(shadows.endpoints["q"].tensor, torch.full((4, 2), 3.0, dtype=torch.bfloat16))


def test_memory_another_process_maps_commits_by_copy_even_where_the_engine_allows_swaps():
    fused, norm, endpoints = _bound()
    addresses = fused.data_ptr(), norm.data_ptr()
    shadows = Shadows.of(endpoints, keep={"f"}, swappable={"q", "k", "n"})
    _write(shadows, 5.0)
    assert shadows.commit(swap=False) is False
    assert (fused.data_ptr(), norm.data_ptr()) == addresses
    assert torch.equal(fused, torch.full((4, 6), 5.0, dtype=torch.bfloat16))
    assert torch.equal(norm, torch.full((5,), 5.0))
    endpoints_before = shadows.endpoints
    shadows.prepare(writes_all=False)
    assert shadows.endpoints is endpoints_before, "no swap: the session's compiled round stays valid"


def _by_address(view: torch.Tensor) -> torch.Tensor:
    """`view`'s elements reached by their address, as another process maps them (CUDA IPC): a swap
    of the storage behind `view` does not move them."""
    storage = view.untyped_storage()
    raw = torch.frombuffer((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr()), dtype=torch.uint8)
    return raw.view(view.dtype).as_strided(view.shape, view.stride(), view.storage_offset())


def test_a_trainer_that_maps_both_faces_writes_the_spare_whichever_way_the_last_commit_swapped(each_swap):
    fused, norm, endpoints = _bound()
    shadows = Shadows.of(endpoints, keep={"f"}, swappable={"q", "k", "n"})
    views = {name: e.tensor for name, e in shadows.endpoints.items()}
    alternate = shadows.alternate(views)
    assert list(alternate) == list(views) and alternate["f"] is views["f"], "a fallback is the same in both faces"
    assert alternate["q"].data_ptr() == fused.data_ptr() and alternate["n"].data_ptr() == norm.data_ptr()
    faces = [{n: _by_address(v) for n, v in face.items() if n != "f"} for face in (views, alternate)]
    for version in (1, 2, 3):  # face 0, then 1, then 0 again: each round writes what the engine does not read
        face = faces[(version - 1) % 2]
        shadows.prepare(writes_all=True)
        for view in face.values():
            view.fill_(version)
        assert fused[0, 0].item() == version - 1 and norm[0].item() == version - 1, "live weights untouched"
        assert shadows.commit(swap=True)
        assert torch.equal(fused, torch.full((4, 6), float(version), dtype=torch.bfloat16))
        assert torch.equal(norm, torch.full((5,), float(version)))
    shadows.prepare(writes_all=False)  # a partial round into face 1: the spare caught up first
    faces[1]["q"][0, 0] = 9.0
    shadows.commit(swap=True)
    expected = torch.full((4, 6), 3.0, dtype=torch.bfloat16)
    expected[0, 0] = 9.0
    assert torch.equal(fused, expected) and torch.equal(norm, torch.full((5,), 3.0))


def test_a_colocated_round_writes_the_face_the_swaps_since_the_export_name_and_a_rebind_stales_the_export(
    each_swap,
):
    """The worker's side of the two faces (`WorkerRank._rl_sync_face`, `_rl_sync_faces_stale`):
    the face follows the count of swapping commits since the export; a weight the engine replaced
    in a swapped storage makes that storage commit by copy, and the export, whose alternate face
    still holds the storage's old live memory, must be made anew (the round answers MOVED)."""
    from rl_sync.rank.worker import WorkerRank

    _, _, endpoints = _bound()
    shadows = Shadows.of(endpoints, keep={"f"}, swappable={"q", "k", "n"})
    shadows.commit(swap=True)  # a commit before the export: the export's face 0 is where rounds write now
    worker = types.SimpleNamespace(_rl_sync_ipc_basis=(frozenset(shadows.swapped), shadows.swaps))
    faces = []
    for _ in range(3):
        faces.append(WorkerRank._rl_sync_face(worker, shadows))
        assert WorkerRank._rl_sync_faces_stale(worker, shadows) is False
        shadows.commit(swap=True)
    assert faces == [0, 1, 0]
    replaced = torch.zeros(5)
    shadows.rebound({"n": Endpoint(replaced, (0,))}, "worker rank 0")
    assert WorkerRank._rl_sync_faces_stale(worker, shadows) is True, "n's storage now commits by copy"
    assert WorkerRank._rl_sync_faces_stale(worker, None) is True
    assert WorkerRank._rl_sync_face(types.SimpleNamespace(_rl_sync_ipc_basis=None), shadows) == 0, "one face"


def test_a_rebound_name_is_committed_into_its_new_view_and_a_fallback_received_in_its_new_endpoint():
    fused, _, endpoints = _bound()
    shadows = Shadows.of(endpoints, keep={"f"}, swappable={"n"})
    _write(shadows, 4.0)
    new_q, new_f = torch.zeros(4, 2, dtype=torch.bfloat16), torch.zeros(3)
    before = shadows.endpoints
    assert shadows.rebound({"q": Endpoint(new_q, (0, 0))}, "worker rank 0") is False
    assert shadows.endpoints is before, "a rebound spare's view stays: the compiled round replays"
    assert shadows.rebound({"f": Endpoint(new_f, (0,))}, "worker rank 0") is True
    assert shadows.endpoints["f"].tensor is new_f and shadows.endpoints is not before
    shadows.commit(swap=True)
    assert torch.equal(new_q, torch.full((4, 2), 4.0, dtype=torch.bfloat16))
    assert torch.equal(fused[:, :2], torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)[:, :2]), "the old q stays"


def test_a_stale_spare_whose_live_storage_was_resized_in_place_is_refused_naming_the_tensor():
    _, norm, endpoints = _bound()
    shadows = Shadows.of(endpoints, keep={"f"}, swappable={"q", "k", "n"})
    _write(shadows, 7.0)
    shadows.commit(swap=True)
    norm.untyped_storage().resize_(0)  # the engine released it in place (the spare holds the round before)
    with pytest.raises(ValueError) as raised:
        shadows.rebound({"n": Endpoint(torch.zeros(5), (0,))}, "worker rank 0")
    assert str(raised.value) == (
        "worker rank 0: 'n' was laid out anew in place after a commit swapped its storage, whose spare holds the "
        "round before, so nothing was written; repair() binds it anew (the next push does, with auto_repair)"
    )
