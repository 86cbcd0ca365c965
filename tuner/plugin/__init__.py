"""dynspec's SGLang plugin: per-batch speculation decided by the tuner's table.

Importing this package must stay cheap: SGLang loads plugins in every process. The pure core
lives in :mod:`tuner.plugin.core`; SGLang is imported lazily, inside hooks only.
"""

from __future__ import annotations

from tuner.plugin.core import PluginCore, Telemetry

__all__ = ["PluginCore", "Telemetry"]
