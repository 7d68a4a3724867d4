"""Settings and push arguments are checked where they enter, with errors naming what was wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rl_sync.config.push_args import check_push_args
from rl_sync.config.sync import SyncConfig


@pytest.mark.parametrize(
    "field, value, error, message",
    [
        ("transport", "bogus", ValueError, "SyncConfig.transport must be one of 'auto', 'gloo', 'nccl', got 'bogus'"),
        (
            "mode",
            "dense",
            ValueError,
            "SyncConfig.mode must be one of 'm2n', 'broadcast', 'sparse', 'auto', got 'dense'",
        ),
        ("colocate", None, ValueError, "SyncConfig.colocate must be one of 'auto', 'ipc', 'off', got None"),
        ("sparse_baseline", "gpu", ValueError, "SyncConfig.sparse_baseline must be one of 'device', 'pinned_cpu'"),
        ("bucket_bytes", 2**70, ValueError, f"SyncConfig.bucket_bytes must be in [1, {2**40}], got {2**70}"),
        ("bucket_bytes", 2**61, ValueError, "SyncConfig.bucket_bytes must be in [1,"),
        ("bucket_bytes", 0, ValueError, "SyncConfig.bucket_bytes must be in [1,"),
        ("bucket_bytes", 1.5, TypeError, "SyncConfig.bucket_bytes must be an int, got 1.5 (float)"),
        ("bucket_bytes", True, TypeError, "SyncConfig.bucket_bytes must be an int, got True (bool)"),
        ("coalesce_bytes", -1, ValueError, "SyncConfig.coalesce_bytes must be in [0,"),
        ("dense_refresh_every", -2, ValueError, "SyncConfig.dense_refresh_every must be in [0,"),
        ("rendezvous_port", 70000, ValueError, "SyncConfig.rendezvous_port must be in [0, 65535], got 70000"),
        (
            "round_timeout_s",
            math.inf,
            ValueError,
            "SyncConfig.round_timeout_s must be > 0 and at most 604800 seconds, got inf",
        ),
        (
            "init_timeout_s",
            math.nan,
            ValueError,
            "SyncConfig.init_timeout_s must be > 0 and at most 604800 seconds, got nan",
        ),
        ("round_timeout_s", -1, ValueError, "SyncConfig.round_timeout_s must be > 0"),
        ("round_timeout_s", "30", TypeError, "SyncConfig.round_timeout_s must be a number of seconds, got '30'"),
        ("double_buffer", "yes", TypeError, "SyncConfig.double_buffer must be True or False, got 'yes'"),
        ("name", "", TypeError, "SyncConfig.name must be a non-empty str, got ''"),
        ("rendezvous_host", 127, TypeError, "SyncConfig.rendezvous_host must be a non-empty str, got 127"),
    ],
)
def test_every_setting_is_checked_naming_it(field, value, error, message):
    with pytest.raises(error) as raised:
        SyncConfig(**{field: value})
    assert str(raised.value).startswith(message)


def test_good_settings_are_kept():
    config = SyncConfig(transport="gloo", bucket_bytes=1 << 40, round_timeout_s=0.5, rendezvous_host="127.0.0.1")
    assert (config.transport, config.bucket_bytes, config.round_timeout_s) == ("gloo", 1 << 40, 0.5)


@pytest.mark.parametrize(
    "version, names, mode, error, message",
    [
        (1.5, None, None, TypeError, "push: version must be an int, got 1.5 (float)"),
        ("7", None, None, TypeError, "push: version must be an int, got '7' (str)"),
        (True, None, None, TypeError, "push: version must be an int, got True (bool)"),
        (0, None, None, ValueError, "push: version must be in [1, 2**63 - 1], got 0"),
        (2**63, None, None, ValueError, "push: version must be in [1, 2**63 - 1]"),
        (None, "wb", None, TypeError, "push: names must be a list of tensor names, got str 'wb'"),
        (None, [], None, ValueError, "push: names is empty (nothing to move); pass None to push every tensor"),
        (None, ["w", 3], None, TypeError, "push: every name must be a str, got 3 (int)"),
        (None, ["w", "b", "w"], None, ValueError, "push: names repeat ['w']"),
        (None, {"w"}, None, TypeError, "push: names must be a list of tensor names, got set"),
        (
            None,
            None,
            "dense",
            ValueError,
            "push: mode must be one of 'm2n', 'broadcast', 'sparse', 'auto' or None, got 'dense'",
        ),
    ],
)
def test_bad_push_arguments_are_refused_naming_them(version, names, mode, error, message):
    with pytest.raises(error) as raised:
        check_push_args(version, names, mode)
    assert str(raised.value).startswith(message)


def test_numpy_versions_and_tuples_of_names_are_taken():
    assert check_push_args(np.int64(7), ("a", "b"), "sparse") == (7, ["a", "b"], "sparse")
    assert check_push_args(None, None, None) == (None, None, None)


def test_a_budget_cuts_every_step_and_fails_once_spent():
    import time

    from actors.calls import Budget, SyncError

    budget = Budget()
    assert budget.left(300.0) == 300.0, "outside a call, a step keeps its own timeout"
    with budget.within(0.2, "push"):
        assert budget.left(300.0) <= 0.2
        assert budget.left(0.05) == 0.05
        time.sleep(0.25)
        assert budget.left(300.0, at_least=1.0) == 1.0, "a close still gets its floor"
        with pytest.raises(
            SyncError,
            match=r"^push ran out of its 0.2 s budget \(WeightSync timeout_s\) before it "
            r"was done; nothing was recorded as applied$",
        ):
            budget.left(300.0)
    assert budget.left(300.0) == 300.0
