"""Errors kvpolicy raises for bad input. Each message names the problem and the accepted values."""


class KVPolicyError(Exception):
    """Base class: anything the user can fix by changing their input."""


class ConfigError(KVPolicyError, ValueError):
    """A policy, component or option is invalid (raised when the policy is built)."""


class UnknownNameError(ConfigError, KeyError):
    """A preset or component name is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class BackendUnavailableError(ConfigError):
    """A kernel backend was asked for explicitly but cannot run here."""


class UnsupportedModelError(KVPolicyError):
    """The model has no attention layers the policy can serve."""


class ModelNotFoundError(KVPolicyError, FileNotFoundError):
    """A model path or name does not resolve to a loadable model."""
