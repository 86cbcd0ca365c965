"""Write the single-slot adaptive config {"1": {"candidate_steps": ARMS}} (so SGLang builds
CUDA graphs for every arm at every batch size and the plugin's table does the bucketing) and
print the speculative flags for sglang.launch_server on stdout, ready for $(...). The arms are
fixed for the server's lifetime: each costs graph-capture time and GPU memory.
"""

from __future__ import annotations

import argparse

from tuner.cli._common import _command, _csv_ints, console, err_console
from tuner.errors import ConfigError


def _add_sglang_args(sub: argparse._SubParsersAction) -> None:
    from pathlib import Path

    from tuner.plugin.launch import (
        ALGORITHMS,
        DEFAULT_ALGORITHM,
        DEFAULT_ARMS,
        DEFAULT_MAX_RUNNING_REQUESTS,
    )

    p = _command(sub, "sglang-args", _cmd_sglang_args, __doc__,
                 help="print the SGLang flags for the plugin and write its adaptive config")
    p.add_argument("--arms", type=_csv_ints, default=DEFAULT_ARMS, metavar="K,K,...",
                   help="draft-step counts the server pre-builds, 0 = no drafting "
                   f"(default {','.join(map(str, DEFAULT_ARMS))})")
    p.add_argument("--out", type=Path, default=Path("dynspec-adaptive.json"), metavar="FILE",
                   help="where to write the adaptive config (default ./dynspec-adaptive.json)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default=DEFAULT_ALGORITHM)
    p.add_argument("--initial-steps", type=int, metavar="K",
                   help="the arm the server starts on (default: SGLang's, the middle arm)")
    p.add_argument("--topk", type=int, default=1, metavar="K",
                   help="--speculative-eagle-topk; above 1 a tree, switched on and off per "
                   "batch: --arms 0,S with S its depth (default 1, a chain)")
    p.add_argument("--draft-tokens", type=int, metavar="N",
                   help="a tree's node count (--speculative-num-draft-tokens); needed with "
                   "--topk above 1")
    p.add_argument("--max-running-requests", type=int, default=DEFAULT_MAX_RUNNING_REQUESTS,
                   metavar="N", help="raise SGLang's EAGLE default of 48 so large-batch "
                   f"buckets occur (default {DEFAULT_MAX_RUNNING_REQUESTS}; 0 = leave it out)")


def _cmd_sglang_args(args: argparse.Namespace) -> int:
    import shlex

    from tuner.plugin.launch import MANY_ARMS, sglang_flags, validate_arms, write_adaptive_config

    try:
        arms = validate_arms(args.arms)
        out = args.out.resolve()
        flags = sglang_flags(
            config_path=out, algorithm=args.algorithm, initial_steps=args.initial_steps,
            max_running_requests=args.max_running_requests or None, arms=arms,
            topk=args.topk, draft_tokens=args.draft_tokens,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    try:
        write_adaptive_config(arms, out)
    except OSError as exc:
        raise ConfigError(f"{out}: cannot write: {exc.strerror or exc}") from exc
    err_console.print(f"wrote {out}: arms {list(arms)}", markup=False, soft_wrap=True)
    if len(arms) > MANY_ARMS:
        err_console.print(
            f"warning: {len(arms)} arms; each one captures its own CUDA graphs at every batch "
            "size, outside SGLang's memory planning (leave --mem-fraction-static headroom)",
            markup=False, soft_wrap=True,
        )
    err_console.print(
        "with the plugin installed in the server's environment (SGLANG_PLUGINS=dynspec to load "
        "only it; DYNSPEC_POLICY_FILE=FILE to start from an exported policy):",
        markup=False, soft_wrap=True,
    )
    console.print(shlex.join(flags), markup=False, highlight=False, soft_wrap=True)
    return 0
