"""``deepspeed.utils.logging``: DeepSpeed's names, reached as Lightning reaches them."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest


def test_logger_is_an_attribute_after_a_bare_import():
    # Lightning's DeepSpeedStrategy.__init__: `import deepspeed; deepspeed.utils.logging.logger.setLevel(...)`
    code = textwrap.dedent("""
        import logging, deepspeed
        deepspeed.utils.logging.logger.setLevel(logging.ERROR)
        assert deepspeed.utils.logging.logger is deepspeed.utils.logger is deepspeed.logger
        assert logging.getLogger("zkit").level == logging.ERROR
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_deepspeeds_names():
    from deepspeed.utils import logging as ds_logging
    from deepspeed.utils.logging import LoggerFactory, log_dist, logger, should_log_le

    assert ds_logging.log_levels["info"] == logging.INFO
    before = logger.level
    try:
        logger.setLevel(logging.INFO)
        assert should_log_le("info") and should_log_le("DEBUG") is False
        ds_logging.set_log_level_from_string("debug")
        assert ds_logging.get_current_level() == logging.DEBUG and should_log_le("debug")
    finally:
        logger.setLevel(before)
    assert log_dist is ds_logging.log_dist
    made = LoggerFactory.create_logger(name="zkit-test-factory", level=logging.INFO)
    assert made.propagate is False and made.level == logging.INFO and made.handlers[-1].stream is sys.stdout
    assert callable(logger.warning_once) and callable(logger.log_dist_once)


def test_bad_inputs_say_what_is_wrong():
    from deepspeed.utils.logging import LoggerFactory, get_log_level_from_string, should_log_le

    with pytest.raises(ValueError, match="name for logger cannot be None"):
        LoggerFactory.create_logger()
    with pytest.raises(ValueError, match="loud is not one of the valid logging levels"):
        get_log_level_from_string("loud")
    with pytest.raises(ValueError, match="20 is not a string"):
        should_log_le(20)


def test_log_dist_outside_a_process_group_logs_with_rank_minus_one(caplog, monkeypatch):
    import torch.distributed

    from deepspeed.utils.logging import get_dist_msg, log_dist, logger

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # whatever tests before left

    assert get_dist_msg("hello", ranks=[0]) == "[Rank -1] hello"
    before, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="zkit"):
            log_dist("from every rank", ranks=[-1])
    finally:
        logger.setLevel(before)
        logger.propagate = propagate
    assert "[Rank -1] from every rank" in caplog.text
