"""zkit's kernel: what a plugin author reads.

* :mod:`~zkit.core.hookspecs` - every extension point, its docstring the author's manual
* :mod:`~zkit.core.records` - the typed records plugins register
* :mod:`~zkit.core.plugin_manager` - loads built-in and installed plugins
* :mod:`~zkit.core.stack` / :mod:`~zkit.core.assembly` - which records a run uses, and the one
  object that hands out communicators, allocators and stores
* :mod:`~zkit.core.engine` / :mod:`~zkit.core.microstep` - the training loop, in time order
* :mod:`~zkit.core.config` - the configuration schema
* interfaces: :mod:`~zkit.core.communicator`, :mod:`~zkit.core.allocator` (and its
  :mod:`~zkit.core.copies`), :mod:`~zkit.core.stores`, :mod:`~zkit.core.partitioner`,
  :mod:`~zkit.core.attention`

The kernel imports no built-in plugin package and no installed distribution; the built-ins
(``zkit.zero``, ``zkit.optim``, ``zkit.lr_schedules``, ``zkit.checkpoint``, ``zkit.torch_distributed``,
``zkit.models``, ``zkit.host_memory``, ...) are loaded by name like any plugin.
"""
