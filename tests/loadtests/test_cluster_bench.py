"""The login-node benchmark's fourth-node figures (loadtests/cluster.py): what chance gives
for accounts that each move with chance 1/4, and the share of 1,000 rig names that move."""

from __future__ import annotations

from loadtests.cluster import binomial, moved_share
from sshpool.devhost.accounts import account_names

THREE = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def test_the_fourth_node_figures_state_the_chance_spread() -> None:
    assert binomial(40, 0.25) == {"expected": 10.0, "sd": 2.74, "range_95": "5-16", "p_more": 0.416}
    share = moved_share(THREE, (*THREE, "127.0.0.5"), account_names(1000))
    assert 0.223 <= share <= 0.277  # inside Binomial(1000, 1/4)'s 95 % range
    assert moved_share(THREE, THREE, account_names(40)) == 0.0
