"""The zkit command: run (torchrun underneath), plugins, report."""
import os
import subprocess
import sys
import textwrap

from zkit.cli import plugins_text
from zkit.records import FAMILIES


def _zkit(*args, **kw):
    return subprocess.run([sys.executable, "-m", "zkit.cli", *args], capture_output=True, text=True, timeout=300, **kw)


def test_plugins_lists_all_six_families_with_distributions():
    text = plugins_text()
    for family in FAMILIES:
        assert f"\n{family}:" in text
    assert "zero3" in text and "zkit-offload" in text and "block_sparse" in text


def test_block_option_needs_no_prefix():
    out = _zkit("-p", "offload", "plugins")
    assert out.returncode != 0 and "-p takes 'no:NAME'" in out.stderr


def test_run_launches_ranks_through_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(
        """
        import sys, torch, zkit
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        engine, *_ = zkit.initialize(model=model, config={"train_batch_size": 4, "steps_per_print": 100,
                                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        loss = engine(torch.ones(2, 4)).sum()
        engine.backward(loss); engine.step()
        print(f"rank {engine.rank}/{engine.world_size} arg {sys.argv[1]} steps {engine.global_steps}")
        """
    ))
    out = _zkit("run", "--nproc", "2", "--master-port", "29611", str(script), "hello", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rank 0/2 arg hello steps 1" in out.stdout and "rank 1/2 arg hello steps 1" in out.stdout


def test_a_failing_rank_fails_the_job_with_its_error(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent(
        """
        import torch.distributed as dist, zkit
        from zkit import distributed
        distributed.ensure_initialized()
        if dist.get_rank() == 1:
            raise SystemExit("rank 1 gave up")
        dist.barrier()
        """
    ))
    out = _zkit("run", "--nproc", "2", "--master-port", "29612", str(script), cwd=tmp_path)
    assert out.returncode != 0
    assert "rank 1 gave up" in out.stderr


def test_report_names_versions_and_simulator():
    out = _zkit("report", env={**os.environ, "ZKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out.returncode == 0, out.stderr
    assert "torch 2." in out.stdout and "numba CUDA simulator:" in out.stdout and "backends: gloo yes" in out.stdout
