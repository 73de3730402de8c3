"""The batch-size rule: train_batch_size = micro * gradient_accumulation_steps * world_size."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit.core.config import ConfigError, load_config
from zkit.core.config.batch import resolve_batch

KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
SUBSETS = [s for n in (1, 2, 3) for s in itertools.combinations(range(3), n) if s != (2,)]


@settings(max_examples=200, deadline=None)
@given(micro=st.integers(1, 64), gas=st.integers(1, 16), world=st.integers(1, 64),
       given_keys=st.sampled_from(SUBSETS))
def test_any_determining_subset_resolves_to_the_triple(micro, gas, world, given_keys):
    full = (micro * gas * world, micro, gas)
    args = [full[i] if i in given_keys else None for i in range(3)]
    got = resolve_batch(*args, world)
    # with one key given, DeepSpeed's rule takes one accumulation step
    if len(given_keys) > 1 or gas == 1:
        assert got == full
    elif given_keys == (0,):
        assert got == (full[0], micro * gas, 1)
    else:  # only micro given
        assert got == (micro * world, micro, 1)
    tb, mb, ga = got
    assert tb == mb * ga * world


@settings(max_examples=200, deadline=None)
@given(tb=st.integers(1, 4096), micro=st.integers(1, 64), gas=st.integers(1, 16), world=st.integers(1, 16))
def test_all_three_must_agree(tb, micro, gas, world):
    if tb == micro * gas * world:
        assert resolve_batch(tb, micro, gas, world) == (tb, micro, gas)
    else:
        with pytest.raises(ConfigError) as info:
            resolve_batch(tb, micro, gas, world)
        assert str(info.value) == (
            f"train_batch_size {tb} != train_micro_batch_size_per_gpu {micro} * "
            f"gradient_accumulation_steps {gas} * world size {world} (= {micro * gas * world})"
        )


@settings(max_examples=200, deadline=None)
@given(tb=st.integers(1, 4096), micro=st.integers(1, 64), world=st.integers(1, 16))
def test_derived_value_is_exact_or_an_error(tb, micro, world):
    try:
        got = resolve_batch(tb, micro, None, world)
    except ConfigError as exc:
        assert tb % (micro * world) != 0
        assert str(exc) == (
            f"train_batch_size {tb} is not divisible by train_micro_batch_size_per_gpu {micro} "
            f"* world size {world} (= {micro * world}), so gradient_accumulation_steps cannot be derived"
        )
    else:
        assert got[0] == got[1] * got[2] * world and got[:2] == (tb, micro)


def test_messages():
    msg = "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided (world size 2)"
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        load_config({"gradient_accumulation_steps": 4}, world_size=2)
    with pytest.raises(ConfigError, match="needs to be provided"):
        load_config({}, world_size=1)
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3,
                     "gradient_accumulation_steps": 2}, world_size=2)
    assert str(info.value) == ("train_batch_size 16 != train_micro_batch_size_per_gpu 3 * "
                               "gradient_accumulation_steps 2 * world size 2 (= 12)")
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 10, "gradient_accumulation_steps": 2}, world_size=4)
    assert str(info.value) == ("train_batch_size 10 is not divisible by gradient_accumulation_steps 2 "
                               "* world size 4 (= 8), so train_micro_batch_size_per_gpu cannot be derived")
    with pytest.raises(ConfigError, match="config key 'train_batch_size' must be >= 1, got 0"):
        load_config({"train_batch_size": 0}, world_size=1)
    with pytest.raises(ConfigError, match="config key 'gradient_accumulation_steps' must be an int, got True"):
        load_config({"train_batch_size": 8, "gradient_accumulation_steps": True}, world_size=1)


def test_floats_from_json_are_accepted():
    cfg = load_config({"train_batch_size": 32.0, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (32, 4)
    assert type(cfg.train_batch_size) is int
