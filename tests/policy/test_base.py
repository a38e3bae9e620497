"""``--set`` values become the type of the parameter's default (moesim.policy.base.coerce)."""

from __future__ import annotations

import pytest

from moesim.errors import ConfigError
from moesim.policy.base import coerce
from moesim.policy.systems import build_system


def test_numbers_take_the_defaults_type_and_range():
    assert coerce("3", 1, "cache.n") == 3 and coerce("0.5", 1.0, "substitute.alpha") == 0.5
    assert coerce("true", False, "x.flag") is True
    with pytest.raises(ConfigError, match="is negative"):
        coerce("-1", 4, "cache.w_size")
    with pytest.raises(ConfigError, match="not a valid int"):
        coerce("1.5", 4, "cache.w_size")


def test_a_negative_default_can_be_asked_for_again_and_no_other_negative():
    """-1 defaults mean "the paper's value for the model": naming -1 again (in a sweep, say) gives that."""
    assert coerce("-1", -1, "cache.u_size") == -1 and coerce("-1", -1.0, "substitute.alpha") == -1.0
    with pytest.raises(ConfigError, match="is negative"):
        coerce("-2", -1, "cache.u_size")
    system = build_system("dali", {"cache.u_size": "-1", "prefetch.size": "-1"})
    assert (system.cache.u_size, system.prefetch.size) == (-1, -1)
