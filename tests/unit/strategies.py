"""Hypothesis strategies shared by the unit tests: shapes, meshes, layouts."""

from __future__ import annotations

from hypothesis import strategies as st

from rl_sync.layout import Layout, Mesh, Replicate, Shard

SIZES = st.sampled_from([0, 1, 2, 3, 5, 7, 8, 11, 13, 16])


@st.composite
def shapes(draw, min_dims: int = 1, max_dims: int = 3) -> tuple[int, ...]:
    return tuple(draw(st.lists(SIZES, min_size=min_dims, max_size=max_dims)))


@st.composite
def layouts(draw, ndim: int, start: int = 0, max_axes: int = 3, max_axis: int = 4) -> Layout:
    mesh_shape = tuple(draw(st.lists(st.integers(1, max_axis), min_size=1, max_size=max_axes)))
    placement = st.one_of(st.just(Replicate()), st.integers(0, max(0, ndim - 1)).map(Shard)) if ndim else st.just(Replicate())
    placements = tuple(draw(placement) for _ in mesh_shape)
    mesh = Mesh(mesh_shape, start_rank=start)
    if draw(st.booleans()):
        ranks = list(mesh.ranks)
        ranks = draw(st.permutations(ranks))
        mesh = Mesh(mesh_shape, ranks=ranks)
    return Layout(mesh, placements)
