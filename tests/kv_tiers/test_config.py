"""A bad KV tier configuration is one line from `tokenmill serve`, before any engine starts or model loads."""

from __future__ import annotations

import pytest

from tests.cli_errors import serve_error

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-tier", "cpu"], "kv_tiers entry 'cpu' must be 'NAME:CAPACITY[:PATH]'"),
        (["--kv-tier", "cpu:half"], "kv_tiers entry 'cpu': capacity"),
        (["--kv-tier", "ram:4GiB"], "kv_tiers: unknown kv_tier 'ram'; installed: cpu, disk"),
        (["--kv-tier", "disk:4GiB"], "the 'disk' tier needs a path"),
        (["--kv-tier", "cpu:4GiB:/var/cache/kv"], "the 'cpu' tier takes no path"),
        (["--disaggregated-prefill", "--data-parallel-size", "2"], "cannot be combined with"),
        (["--disaggregated-prefill", "--no-enable-prefix-caching"], "needs cache.enable_prefix_caching"),
    ],
)
def test_a_bad_kv_tier_setting_is_one_line_before_anything_starts(flags: list[str], message: str) -> None:
    assert message in serve_error(*flags)
