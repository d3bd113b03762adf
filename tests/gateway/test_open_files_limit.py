"""The gateway takes its open-files soft limit up to the hard one (one socket per SSE stream)."""

import resource

from gateway.main import raise_open_files_limit


def test_soft_limit_is_raised_to_the_hard_one() -> None:
    soft = raise_open_files_limit()
    now_soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == now_soft
    assert now_soft == hard or hard == resource.RLIM_INFINITY
