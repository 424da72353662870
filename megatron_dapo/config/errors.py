"""The config error type: always names the offending key."""


class ConfigError(ValueError):
    """An invalid configuration. `key` is the dotted key (e.g. "actor.clip_ratio_c")."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")
