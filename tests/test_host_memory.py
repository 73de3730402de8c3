"""Host memory freed during training goes back to the system when memory is tight
(``ZKIT_HOST_MALLOC=auto``, the default), always (``return``) or never (``keep``)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zkit.testing import run_ranks

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux) only")


def _rss_after_churn(env_extra: dict[str, str], before_churn: str = "applied = hm.return_freed_memory()") -> tuple[bool, int]:
    code = f"""
import gc, torch
import zkit.host_memory.malloc_policy as hm
{before_churn}
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
t = torch.empty(1 << 20); t.fill_(1.0); del t          # raises glibc's dynamic threshold to 4 MiB
keep, drop = [], []
for i in range(64):                                     # interleaved: freed blocks sit between kept ones
    a = torch.ones(1 << 20); b = torch.ones(16)
    drop.append(a); keep.append(b)
before = rss()
del drop; gc.collect()
print(applied, before - rss())
"""
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "ZKIT_HOST_MALLOC")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    applied, returned = out.split()
    return applied == "True", int(returned)


@linux_only
def test_freed_tensors_return_to_the_system_when_asked():
    applied, returned = _rss_after_churn({"ZKIT_HOST_MALLOC": "return"})
    assert applied
    assert returned >= 48 * (4 << 20), f"only {returned >> 20} MiB of 256 MiB freed came back"


@linux_only
@pytest.mark.parametrize("choice", [None, "keep"])
def test_glibc_is_left_alone_while_memory_is_ample_and_when_the_user_chose(choice):
    applied, returned = _rss_after_churn({"ZKIT_HOST_MALLOC": choice} if choice else {})
    assert not applied
    assert returned < 16 * (4 << 20), f"{returned >> 20} MiB came back although glibc was left alone"
    assert not _rss_after_churn({"ZKIT_HOST_MALLOC": "return", "MALLOC_MMAP_THRESHOLD_": "33554432"})[0]


@linux_only
def test_an_offload_that_needs_it_returns_freed_memory_unless_the_user_chose_keep():
    """zkit-offload's NVMe allocator asks with ``because``: the threshold is fixed under ``auto``
    whatever the model, and ``keep`` still wins."""
    ask = 'applied = hm.return_freed_memory(because="NVMe offload")'
    applied, returned = _rss_after_churn({}, ask)
    assert applied
    assert returned >= 48 * (4 << 20), f"only {returned >> 20} MiB of 256 MiB freed came back"
    assert not _rss_after_churn({"ZKIT_HOST_MALLOC": "keep"}, ask)[0]


@linux_only
def test_auto_returns_freed_memory_once_the_model_states_take_a_third_of_the_rank_memory():
    limit = "hm.rank_memory_limit(1)"
    below = _rss_after_churn({}, f"applied = hm.fit_to_memory(int({limit} * hm.TIGHT_FRACTION) - 1)")
    assert below[0] is False and below[1] < 16 * (4 << 20)
    applied, returned = _rss_after_churn({}, f"applied = hm.fit_to_memory(int({limit} * hm.TIGHT_FRACTION) + 1)")
    assert applied
    assert returned >= 48 * (4 << 20), f"only {returned >> 20} MiB of 256 MiB freed came back"
    # the ranks of one machine share it: the same states are tight for one of 4 ranks
    assert _rss_after_churn({}, f"applied = hm.fit_to_memory(int({limit} * hm.TIGHT_FRACTION / 3), local_ranks=4)")[0]
    assert not _rss_after_churn({"ZKIT_HOST_MALLOC": "keep"}, f"applied = hm.fit_to_memory(10**15)")[0]


def test_the_rank_limit_is_the_tightest_cgroup_limit_or_the_machine_shared_by_its_ranks(tmp_path: Path):
    import zkit.host_memory.malloc_policy as hm

    def files(cgroup: str, limits: dict[str, str], mem_kib: int = 16 << 20) -> Path:
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        (root / "proc/self").mkdir(parents=True)
        (root / "proc/self/cgroup").write_text(cgroup)
        (root / "proc/meminfo").write_text(f"MemTotal:       {mem_kib} kB\nMemFree:  1 kB\n")
        for path, value in limits.items():
            (root / path).mkdir(parents=True, exist_ok=True)
            name = "memory.max" if path.startswith("sys/fs/cgroup/") and "/memory/" not in path + "/" else "memory.limit_in_bytes"
            (root / path / name).write_text(value + "\n")
        return root

    gib = 1 << 30
    # cgroup v2: the parent's limit binds; the job's own is "max"
    v2 = files("0::/job/step\n", {"sys/fs/cgroup/job": str(8 * gib), "sys/fs/cgroup/job/step": "max"})
    assert hm.rank_memory_limit(4, root=v2) == 2 * gib
    # cgroup v1 (the memory controller's own hierarchy): "no limit" is a huge number
    v1 = files("4:memory:/slurm/job\n0::/\n", {"sys/fs/cgroup/memory/slurm": str(6 * gib),
                                                 "sys/fs/cgroup/memory/slurm/job": str(1 << 62)})
    assert hm.rank_memory_limit(2, root=v1) == 3 * gib
    # no cgroup limit: the machine's memory
    assert hm.rank_memory_limit(2, root=files("0::/\n", {})) == 8 * gib
    # the machine's memory when it is below the cgroup's
    assert hm.rank_memory_limit(1, root=files("0::/a\n", {"sys/fs/cgroup/a": str(64 * gib)}, mem_kib=4 << 20)) == 4 * gib
    assert hm.rank_memory_limit(1, root=tmp_path / "nothing") is None


def _engine_fixes_threshold(limit_bytes: int) -> tuple[bool, int]:
    import torch

    import zkit
    import zkit.host_memory.malloc_policy as hm

    hm.rank_memory_limit = lambda local_ranks=1, root=None: limit_bytes  # this rank's memory, as a cgroup would set it
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    engine, *_ = zkit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2}})
    from zkit.host_memory.plugin import host_state_bytes

    return hm._applied, host_state_bytes(engine)


@linux_only
def test_initialize_returns_freed_memory_when_the_model_states_are_tight():
    env = {"ZKIT_HOST_MALLOC": "auto"}
    (ample, states), = run_ranks(_engine_fixes_threshold, 1, args=(1 << 40,), env=env)
    assert not ample
    # Adam at stage 2 on 1 rank: parameters, gradient shard and state 16 bytes per parameter, plus a bucket
    psi = 256 * 256 + 256 + 256 * 8 + 8
    assert 16 * psi <= states <= 24 * psi
    (tight, _), = run_ranks(_engine_fixes_threshold, 1, args=(2 * states,), env=env)
    assert tight


def test_a_bad_choice_is_named(monkeypatch):
    import zkit.host_memory.malloc_policy as hm

    monkeypatch.setenv("ZKIT_HOST_MALLOC", "yes")
    with pytest.raises(ValueError, match="ZKIT_HOST_MALLOC='yes': expected 'auto' .*'return' .*or 'keep'"):
        hm.choice()
    monkeypatch.setenv("ZKIT_HOST_MALLOC", "default")
    with pytest.raises(ValueError, match="ZKIT_HOST_MALLOC='default'"):
        hm.return_freed_memory()


def _libc_calls_while_training(limit_bytes: int) -> tuple[list[str], float]:
    """The C library functions the host-memory policy called while a stage-3 model was built under
    ``zkit.zero.Init``, initialized and trained two steps; the last loss."""
    import torch

    import zkit
    import zkit.host_memory.malloc_policy as hm

    calls: list[str] = []
    hm.rank_memory_limit = lambda local_ranks=1, root=None: limit_bytes
    hm._libc_function = lambda name, argtypes: calls.append(name)  # records, and runs nothing
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}
    with zkit.zero.Init(config=config):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    engine, *_ = zkit.initialize(model=model, config=config)
    torch.manual_seed(0)
    for _ in range(2):
        loss = engine(torch.randn(2, 16)).square().mean()
        engine.backward(loss)
        engine.step()
    return calls, float(loss)


@linux_only
def test_the_policy_is_a_plugin_and_blocking_it_leaves_malloc_alone():
    """The built-in ``zkit.host_memory`` applies ZKIT_HOST_MALLOC through the engine's hooks (and
    zero.Init's): with it blocked, training runs and glibc is neither tuned nor trimmed."""
    tight = 1 << 10  # any model is tight in a kibibyte: ``auto`` would fix the threshold
    (used, loss_used), = run_ranks(_libc_calls_while_training, 1, args=(tight,), env={"ZKIT_HOST_MALLOC": "auto"})
    assert "mallopt" in used and used.count("malloc_trim") == 2  # after zero.Init and after initialize
    for choice in ("auto", "return"):
        env = {"ZKIT_HOST_MALLOC": choice, "ZKIT_BLOCK_PLUGINS": "zkit.host_memory"}
        (blocked, loss_blocked), = run_ranks(_libc_calls_while_training, 1, args=(tight,), env=env)
        assert blocked == []
        assert loss_blocked == loss_used
