"""The two ways the config layer speaks up: ConfigError (refuse) and InfinityConfigWarning (warn).

ConfigError is a ValueError, so callers that catch ValueError (as DeepSpeed's
users do around ``deepspeed.initialize``) keep working. Every message names
the key path, the value and what would be accepted.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be run as written; the message names key, value and fix."""


class InfinityConfigWarning(UserWarning):
    """A config that runs, but not as its author may think (unknown keys, typos)."""
