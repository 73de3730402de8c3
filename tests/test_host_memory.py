"""With ZKIT_HOST_MALLOC=return, host memory freed during training goes back to the system."""
import os
import subprocess
import sys

import pytest

def _rss_after_churn(env_extra: dict[str, str]) -> tuple[bool, int]:
    code = """
import gc, torch
import zkit.host_memory as hm
applied = hm.return_freed_memory()
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux) only")
def test_freed_tensors_return_to_the_system_when_asked():
    applied, returned = _rss_after_churn({"ZKIT_HOST_MALLOC": "return"})
    assert applied
    assert returned >= 48 * (4 << 20), f"only {returned >> 20} MiB of 256 MiB freed came back"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux) only")
def test_glibc_is_left_alone_by_default_and_when_the_user_chose():
    applied, returned = _rss_after_churn({})
    assert not applied
    assert returned < 16 * (4 << 20), f"{returned >> 20} MiB came back although glibc was left alone"
    assert not _rss_after_churn({"ZKIT_HOST_MALLOC": "return", "MALLOC_MMAP_THRESHOLD_": "33554432"})[0]


def test_a_bad_choice_is_named(monkeypatch):
    import zkit.host_memory as hm

    monkeypatch.setenv("ZKIT_HOST_MALLOC", "yes")
    with pytest.raises(ValueError, match="ZKIT_HOST_MALLOC='yes': expected 'return'"):
        hm._apply()
