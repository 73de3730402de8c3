"""A 1-bit Adam checkpoint's optimizer state is never read as another optimizer's: loading it
into AdamW is refused with what to do, and its weights alone load exactly."""
from __future__ import annotations

import onebit_ranks
from zkit.testing import run_ranks


def test_onebit_state_into_adamw_is_refused_and_weights_alone_load(tmp_path):
    for r in run_ranks(onebit_ranks.onebit_checkpoint_into_adamw, 2, args=(str(tmp_path),), timeout=180):
        assert "saved by optimizer 'onebitadam' (state format 'onebitadam')" in r["with_state"]
        assert "cannot be loaded into optimizer 'adamw' (state format 'adam')" in r["with_state"]
        assert "load_optimizer_states=False" in r["with_state"]
        assert r["weights_equal"]
