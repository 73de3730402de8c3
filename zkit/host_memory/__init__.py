"""Built-in plugin: host memory that training frees goes back to the operating system when memory
is tight (glibc's ``malloc`` policy, chosen by ``ZKIT_HOST_MALLOC``; :mod:`zkit.host_memory.malloc_policy`).
The hooks that apply it around building are in :mod:`zkit.host_memory.plugin`; plugins that free
host memory in bulk (zkit-offload's NVMe stores) call the policy's functions themselves."""
from zkit.host_memory.malloc_policy import fit_to_memory, rank_memory_limit, return_freed_memory, trim

__all__ = ["fit_to_memory", "rank_memory_limit", "return_freed_memory", "trim"]
