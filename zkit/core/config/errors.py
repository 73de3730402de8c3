"""The two exceptions every config problem is reported with."""
from __future__ import annotations


class ConfigError(ValueError):
    """A config the loader cannot accept: unknown key, wrong type, value out of range,
    inconsistent batch sizes, a key owned by a distribution that is not installed.

    ``key`` is the dotted path of the offending key when there is one, ``problem`` the text after
    it. Field validators only know a field's own name; the loader re-raises their errors with the
    full path (:meth:`under`).
    """

    def __init__(self, message: str, *, key: str | None = None, problem: str | None = None):
        super().__init__(message)
        self.key = key
        self.problem = problem

    @classmethod
    def at(cls, key: str, problem: str) -> "ConfigError":
        """``config key '<key>' <problem>``."""
        return cls(f"config key '{key}' {problem}", key=key, problem=problem)

    def under(self, prefix: str) -> "ConfigError":
        """The same error with ``prefix`` put in front of its key (unchanged when it has none)."""
        if not prefix or self.key is None or self.problem is None:
            return self
        return type(self).at(f"{prefix}.{self.key}", self.problem)


class NotImplementedConfigError(ConfigError):
    """A key zkit accepts (DeepSpeed files carry it) but does not implement yet, set to a value
    that asks for the feature."""


def auto_error(key: str) -> ConfigError:
    """The error for DeepSpeed's ``"auto"`` placeholder at ``key``."""
    return ConfigError.at(
        key,
        'is "auto": "auto" is a placeholder that the Hugging Face Trainer fills in before it hands '
        "the config to DeepSpeed; zkit needs the actual value, so resolve it before calling "
        "zkit (set a number, a bool or a name)",
    )
