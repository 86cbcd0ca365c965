"""dynspec's SGLang plugin: per-batch speculation decided by the tuner's table.

Importing this package must stay cheap: SGLang loads plugins in every process. The pure core
lives in :mod:`tuner.plugin.core`; SGLang is imported only when :func:`register` runs (SGLang
calls it through the ``sglang.srt.plugins`` entry point ``dynspec``) and inside hooks.
"""

from __future__ import annotations

from tuner.plugin._sglang import HOOK_TARGETS, POLICY_FILE_ENV, READOUT_KEY, register
from tuner.plugin.core import PluginCore, Telemetry

__all__ = ["HOOK_TARGETS", "POLICY_FILE_ENV", "READOUT_KEY", "PluginCore", "Telemetry", "register"]
