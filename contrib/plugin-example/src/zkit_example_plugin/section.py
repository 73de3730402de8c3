"""The plugin's own config section, ``"grad_norm_watch"``, declared like the kernel's sections:
an attrs frozen class whose fields are ``zkit.core.config.fields.setting`` (type check from the
annotation, range checks, a doc). The loader structures the user's dict into it with the kernel's
strictness: an unknown key names the closest valid one, a bad value names the key and the rule."""
from __future__ import annotations

import attrs

from zkit.core.config.fields import above, at_least, setting


@attrs.frozen(kw_only=True)
class GradNormWatchConfig:
    every: int = setting(1, doc="record the global gradient norm every this many optimizer steps", check=at_least(1))
    warn_above: float | None = setting(None, doc="warn when a recorded norm exceeds this", check=above(0))
