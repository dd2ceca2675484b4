"""DDTree on the public surface: the tree_budget argument and its checks."""

import pytest

from dflash_mlx import validate
from dflash_mlx.errors import DFlashError


def test_tree_budget_zero_or_none_is_the_chain_and_a_positive_int_is_kept():
    assert validate.tree_budget(None, 4096) is None
    assert validate.tree_budget(0, 4096) is None
    assert validate.tree_budget(1, 4096) == 1
    assert validate.tree_budget(4096, 4096) == 4096
    assert validate.tree_budget(10**6, None) == 10**6


@pytest.mark.parametrize("value,message", [
    (-1, "tree_budget must be positive"),
    (4097, "at most the target's context length 4096"),
    (2.0, "tree_budget must be an integer"),
    (True, "tree_budget must be an integer"),
    ("8", "tree_budget must be an integer"),
])
def test_a_bad_tree_budget_is_one_line_error(value, message):
    with pytest.raises(DFlashError, match=message) as e:
        validate.tree_budget(value, 4096)
    assert "\n" not in str(e.value)
