"""The zkit command: run (torchrun underneath), plugins, report."""
import os
import subprocess
import sys
import textwrap

import pytest

from zkit.cli import plugins_text
from zkit.core.records import FAMILIES


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
        from zkit.core import distributed
        distributed.ensure_initialized()
        dist.barrier()  # the mesh is whole: rank 0 cannot fail connecting to a rank that exited
        if dist.get_rank() == 1:
            raise SystemExit("rank 1 gave up")
        dist.barrier()
        """
    ))
    out = _zkit("run", "--nproc", "2", "--master-port", "29612", str(script), cwd=tmp_path)
    assert out.returncode != 0
    summary = out.stderr[out.stderr.find("Root cause: "):]
    assert summary.startswith("Root cause: rank 1 "), out.stderr[-3000:]
    assert "SystemExit: rank 1 gave up" in summary


def test_report_names_versions_and_simulator():
    out = _zkit("report", env={**os.environ, "ZKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out.returncode == 0, out.stderr
    assert "torch 2." in out.stdout and "numba CUDA simulator:" in out.stdout and "backends: gloo yes" in out.stdout


def test_run_without_master_port_uses_a_free_port_and_a_taken_port_names_the_flag(tmp_path):
    import socket

    script = tmp_path / "ok.py"
    # The barrier: a rank that exits at once closes its gloo pairs under a peer still connecting them.
    script.write_text("import zkit.core.distributed as d, torch.distributed as dist\nd.ensure_initialized()\n"
                      "print(f'ws {dist.get_world_size()}', flush=True)\ndist.barrier()\nimport sys\nsys.exit(0)\n")
    with socket.socket() as busy:  # another job holding torchrun's default port changes nothing
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _zkit("run", "--nproc", "2", str(script), cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.count("ws 2") == 2  # two ranks' lines may interleave, not split
        taken = _zkit("run", "--nproc", "2", "--master-port", str(port), str(script), cwd=tmp_path)
    assert taken.returncode != 0
    assert f"zkit run: port {port} on 127.0.0.1 is taken" in taken.stderr
    assert "choose another with --master-port" in taken.stderr


def test_a_port_left_in_time_wait_by_the_last_run_is_free():
    import argparse
    import socket

    from zkit.cli import _master_port

    # the previous run's store: it accepted a connection and closed it first, so its end lingers
    # in TIME_WAIT with nothing listening any more (back-to-back runs with --master-port)
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()
        client.close()
    with socket.socket() as probe, pytest.raises(OSError):
        probe.bind(("127.0.0.1", port))  # a plain bind still fails: the state the check must see through
    args = argparse.Namespace(master_port=port, master_addr="127.0.0.1", nnodes="1", node_rank=0)
    assert _master_port(args) == port


def test_a_failing_rank_shows_its_traceback_in_the_summary(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent(
        """
        import torch.distributed as dist, zkit
        from zkit.core import distributed
        distributed.ensure_initialized()
        def load_batch():
            raise ValueError("batch 7 is corrupt")
        dist.barrier()  # the mesh is whole: rank 0 cannot fail first, connecting to a rank that exited
        if dist.get_rank() == 1:
            load_batch()
        dist.barrier()
        """
    ))
    out = _zkit("run", "--nproc", "2", str(script), cwd=tmp_path)
    assert out.returncode != 0
    summary = out.stderr[out.stderr.find("Root cause: rank 1 "):]
    assert "\n  Traceback (most recent call last)" in summary, out.stderr[-3000:]
    assert "in load_batch" in summary and "ValueError: batch 7 is corrupt" in summary
    assert "NoneType: None" not in summary


def test_ranks_die_with_a_killed_launcher(tmp_path):
    import signal
    import time

    script = tmp_path / "long.py"
    script.write_text(textwrap.dedent(
        f"""
        import os, time
        open(os.path.join({str(tmp_path)!r}, "rank_" + os.environ["RANK"]), "w").write(str(os.getpid()))
        time.sleep(120)
        """
    ))
    launcher = subprocess.Popen([sys.executable, "-m", "zkit.cli", "run", "--nproc", "2", str(script)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"rank_{r}").is_file() for r in (0, 1)):
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        time.sleep(0.5)  # the pid files are written
        pids = [int((tmp_path / f"rank_{r}").read_text()) for r in (0, 1)]
        launcher.kill()  # SIGKILL: the launcher cannot clean up
        launcher.wait(timeout=30)

        def alive(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().split()[2] != "Z"
            except FileNotFoundError:
                return False

        deadline = time.monotonic() + 15
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids), "ranks outlived their killed launcher"
    finally:
        for name in (f"rank_{r}" for r in (0, 1)):
            path = tmp_path / name
            if path.is_file():
                try:
                    os.kill(int(path.read_text() or 0), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        if launcher.poll() is None:
            launcher.kill()


def test_plugins_lists_each_lifecycle_hooks_implementations():
    from zkit.cli import plugins_text

    text = plugins_text()
    assert "lifecycle hooks (implementations, called outermost first):" in text
    line = next(l for l in text.splitlines() if l.strip().startswith("zkit_grad_norm"))
    assert line.rstrip().endswith("zkit.train_loop (trylast)")  # the built-in answer, innermost
