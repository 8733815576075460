"""Model folding: layer -> (rank, phase), uneven counts, explicit splits, errors."""

import pytest

from ds_dhelix.pipe.folding import (
    balanced_split,
    chunk_index,
    chunk_owner,
    fold_layers,
    next_chunk_owner,
    prev_chunk_owner,
)


def test_even_fold_is_a_u():
    fold = fold_layers(8, 2)
    assert fold.chunk_sizes == (2, 2, 2, 2)
    assert list(fold.layers(0, 0)) == [0, 1] and list(fold.layers(0, 1)) == [6, 7]
    assert list(fold.layers(1, 0)) == [2, 3] and list(fold.layers(1, 1)) == [4, 5]
    assert fold.rank_layers(0) == [0, 1, 6, 7]
    assert fold.owner(5) == (1, 1) and fold.owner(7) == (0, 1)
    assert fold.holds_embedding(0) and fold.holds_head(0) and not fold.holds_head(1)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_no_layer_dropped_or_doubled(p):
    for num_layers in range(2 * p, 6 * p + 3):
        fold = fold_layers(num_layers, p)
        chunks = [list(fold.layers(*chunk_owner(c, p))) for c in range(2 * p)]
        assert [layer for chunk in chunks for layer in chunk] == list(range(num_layers))
        assert max(fold.chunk_sizes) - min(fold.chunk_sizes) <= 1
        for layer in range(num_layers):
            assert layer in fold.layers(*fold.owner(layer))


def test_uneven_extras_go_to_the_far_ranks_first():
    assert balanced_split(10, 2) == (2, 3, 3, 2)  # rank 1 (both chunks) gets the two extras
    assert balanced_split(11, 3) == (2, 2, 2, 2, 2, 1)  # rank 0's return chunk (head) stays light
    sizes = balanced_split(13, 3)  # base 2, one extra: rank 2 phase 0 (chunk 2)
    assert sizes == (2, 2, 3, 2, 2, 2)


def test_explicit_split():
    fold = fold_layers(10, 2, split=[1, 4, 4, 1])
    assert list(fold.layers(0, 0)) == [0] and list(fold.layers(1, 0)) == [1, 2, 3, 4]
    assert list(fold.layers(1, 1)) == [5, 6, 7, 8] and list(fold.layers(0, 1)) == [9]


@pytest.mark.parametrize(
    "args, match",
    [
        ((3, 2), r"num_layers=3 < 4 chunks.*num_stages <= 1"),
        ((8, 0), r"num_stages=0"),
        ((8, 2, [2, 2, 4]), r"split=\[2, 2, 4\] has 3 entries.*needs 2\*2=4"),
        ((8, 2, [2, 2, 2, 3]), r"sums to 9 but num_layers=8"),
        ((8, 2, [0, 4, 2, 2]), r"integer >= 1"),
    ],
)
def test_bad_input_raises_with_values(args, match):
    with pytest.raises(ValueError, match=match):
        fold_layers(*args)


def test_table_lists_every_layer_between_embedding_and_head():
    fold = fold_layers(6, 3)
    lines = fold.table().splitlines()
    assert lines[0].split() == ["layer", "chunk", "rank", "phase"]
    assert lines[1].startswith("embedding") and lines[-1].startswith("norm+head+loss")
    body = [line.split() for line in lines[2:-1]]
    assert [row[0] for row in body] == [str(i) for i in range(6)]
    assert [(row[2], row[3]) for row in body] == [
        ("0", "0"),
        ("1", "0"),
        ("2", "0"),
        ("2", "1"),
        ("1", "1"),
        ("0", "1"),
    ]


def test_topology_helpers():
    p = 3
    for c in range(2 * p):
        assert chunk_index(*chunk_owner(c, p), p) == c
    assert next_chunk_owner(2, 0, p) == (2, 1)  # the turn
    assert next_chunk_owner(0, 1, p) is None  # loss
    assert prev_chunk_owner(0, 0, p) is None  # embedding
    assert prev_chunk_owner(1, 1, p) == (2, 1)
