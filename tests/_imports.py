"""What an import costs: which heavy packages a statement loads, in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable


def heavy_imports(statement: str, heavy: Iterable[str]) -> list[str]:
    """The packages among ``heavy`` that running ``statement`` in a fresh interpreter loads."""
    code = (
        f"import sys; {statement}; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({tuple(heavy)!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return ast.literal_eval(out.stdout.strip())
