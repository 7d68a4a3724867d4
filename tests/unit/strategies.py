"""Hypothesis strategies shared by the unit tests: shapes, meshes, layouts."""

from __future__ import annotations

from hypothesis import strategies as st

from rl_sync.planning.layout import Layout, Mesh, Placement, Replicate, Shard

SIZES = st.sampled_from([0, 1, 2, 3, 5, 7, 8, 11, 13, 16])


@st.composite
def shapes(draw, min_dims: int = 1, max_dims: int = 3) -> tuple[int, ...]:
    return tuple(draw(st.lists(SIZES, min_size=min_dims, max_size=max_dims)))


@st.composite
def layouts(
    draw, shape: tuple[int, ...], start: int = 0, max_axes: int = 3, max_axis: int = 4, blocks: bool = True
) -> Layout:
    """Random layouts for `shape`; with `blocks`, a dim sharded by one axis alone may use a
    (covering) fixed block size, maybe shifted (a part of a sharded dim)."""
    ndim = len(shape)
    mesh_shape = tuple(draw(st.lists(st.integers(1, max_axis), min_size=1, max_size=max_axes)))
    placement = (
        st.one_of(st.just(Replicate()), st.integers(0, max(0, ndim - 1)).map(Shard)) if ndim else st.just(Replicate())
    )
    placements: list[Placement] = [draw(placement) for _ in mesh_shape]
    for axis, p in enumerate(placements):
        alone = sum(isinstance(q, Shard) and q.dim == getattr(p, "dim", -1) for q in placements) == 1
        if blocks and isinstance(p, Shard) and alone and draw(st.booleans()):
            cover = -(-shape[p.dim] // mesh_shape[axis])
            block = max(1, cover + draw(st.integers(0, 2)))
            placements[axis] = Shard(p.dim, block, shift=draw(st.integers(0, block * mesh_shape[axis] - shape[p.dim])))
    mesh = Mesh(mesh_shape, start_rank=start)
    if draw(st.booleans()):
        ranks = list(mesh.ranks)
        ranks = draw(st.permutations(ranks))
        mesh = Mesh(mesh_shape, ranks=ranks)
    return Layout(mesh, tuple(placements))
