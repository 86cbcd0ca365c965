"""A pure-torch stand-in for ``sgl_kernel``'s CPU ops (a test fixture of tests/real).

PyPI has no CPU build of sgl-kernel and upstream's CPU kernels need AVX-512/AMX, so the
real-server tier puts this package on the SGLang server's PYTHONPATH only; it is never
installed. It covers the ops SGLang 0.5.23's CPU engine calls for a Llama target with an
EAGLE-3 draft; any other name resolves to a function that raises naming that op, so an
uncovered code path fails loudly where it is reached (an unused import stays harmless).
"""

from __future__ import annotations

import torch

from sgl_kernel import spec_ops
from sgl_kernel.attention import decode_attention_cpu, extend_attention_cpu
from sgl_kernel.spec_ops import *  # noqa: F403  (the speculative ops, listed in spec_ops)

__all__ = ["decode_attention_cpu", "extend_attention_cpu"]
__all__ += spec_ops.__all__


class MissingOpError(NotImplementedError):
    """An sgl_kernel op the stand-in has no port of was called."""


def _missing(name: str):
    def op(*_args, **_kwargs):
        raise MissingOpError(f"sgl_kernel stand-in (tests/real) has no port of {name!r}")

    op.__name__ = name
    return op


def __getattr__(name: str):
    if name.startswith("_"):
        raise AttributeError(name)
    return _missing(name)


# SGLang's attention backend calls these through the op namespace, as the C++ build
# registers them.
torch.ops.sgl_kernel.decode_attention_cpu = decode_attention_cpu
torch.ops.sgl_kernel.extend_attention_cpu = extend_attention_cpu
