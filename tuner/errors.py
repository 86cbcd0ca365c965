"""dynspec-tuner's exception tree.

    DynspecError
    ├── ConfigError                 bad flags, env, config/profile/policy files (exit 2)
    ├── ServerError                 one server, named in the message
    │   ├── ServerUnavailableError  connection refused, timeout, 5xx
    │   ├── MalformedReplyError     a reply that is not what SGLang/the plugin sends
    │   ├── PluginMissingError      the server has no "dynspec" section (stock SGLang)
    │   └── UpdateRejectedError     the server answered updated=false
    └── StorageError                the database cannot be opened or written (URL redacted)
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DynspecError",
    "MalformedReplyError",
    "PluginMissingError",
    "ServerError",
    "ServerUnavailableError",
    "StorageError",
    "UpdateRejectedError",
]


class DynspecError(Exception):
    """Root of everything dynspec-tuner raises on purpose."""


class ConfigError(DynspecError):
    """A usage or configuration problem; the CLI exits 2."""


class ServerError(DynspecError):
    def __init__(self, server: str, message: str) -> None:
        super().__init__(f"{server}: {message}")
        self.server = server


class ServerUnavailableError(ServerError):
    pass


class MalformedReplyError(ServerError):
    pass


class PluginMissingError(ServerError):
    pass


class UpdateRejectedError(ServerError):
    pass


class StorageError(DynspecError):
    pass
