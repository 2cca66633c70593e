"""The error a bad config raises, in a module of its own so that ``model.config`` (which checks
the positional settings with ``model.positional``) and ``model.positional`` (which names the bad
setting) both import it without importing each other."""


class ConfigError(ValueError):
    """A config value is unknown, missing or inconsistent; the message names the field."""
