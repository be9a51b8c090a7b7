"""ConfigError: how the config layer refuses a config (keys it accepts without acting on are logged, see support.py).

ConfigError is a ValueError, so callers that catch ValueError (as DeepSpeed's
users do around ``deepspeed.initialize``) keep working. Every message names
the key path, the value and what would be accepted.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be run as written; the message names key, value and fix."""
