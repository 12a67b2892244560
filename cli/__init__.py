"""The ``lit-mhar`` command line.

``fit``, ``validate``, ``test`` and ``predict`` go through LightningCLI (``--config``,
``--print_config``, every argument from the classes' docstrings); the other verbs through
jsonargparse over one function each (``sweep``: one per subcommand).
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Union

LIGHTNING_VERBS = ("fit", "validate", "test", "predict")


def _prepare() -> Callable:
    from lit_mhar.data import prepare

    return prepare


def _sweep() -> list[Callable]:
    from lit_mhar.sweeps import commands

    return commands()


def _probe() -> Callable:
    from lit_mhar.probe import probe

    return probe


def _convert() -> Callable:
    from lit_mhar.convert import convert

    return convert


def _generate() -> Callable:
    from lit_mhar.generate import generate

    return generate


# verb -> (loader of the function(s) jsonargparse exposes; a list gives subcommands, one-line help)
FUNCTION_VERBS: dict[str, tuple[Callable[[], Union[Callable, list[Callable]]], str]] = {
    "prepare": (_prepare, "tokenise a corpus (default: the Python standard library) into litdata chunks"),
    "probe": (_probe, "measure a checkpoint's depth routing on held-out data (JSON + plots, logged to its MLflow run)"),
    "convert": (_convert, "turn a prenorm model (lit-mhar, or local HF Llama / Qwen3) into an equivalent Delta-routed one"),
    "generate": (_generate, "sample text from a checkpoint (KV cache; --ckpt PATH --prompt TEXT, streams to the terminal)"),
    "sweep": (_sweep, "Optuna sweeps of fit runs, in MLflow (sweep run --config FILE; sweep report --study NAME)"),
}

USAGE = """usage: lit-mhar COMMAND [options]   (lit-mhar COMMAND --help for a command's options)

Commands:
  fit        train a model (LightningCLI: --config FILE, --print_config, --model.*, --data.*, --trainer.*)
  validate   validation loss of a checkpoint (--ckpt_path)
  test       test loss of a checkpoint (--ckpt_path)
  predict    run a checkpoint's predict loop (--ckpt_path)
{functions}
Example:
  lit-mhar fit --config configs/debug.yaml
"""


def usage() -> str:
    functions = "".join(f"  {verb:<10} {help_}\n" for verb, (_, help_) in FUNCTION_VERBS.items())
    return USAGE.format(functions=functions)


def main(args: Optional[list[str]] = None) -> int:
    """Entry point of ``lit-mhar``; ``args`` defaults to ``sys.argv[1:]``. Returns the exit status."""
    # LightningCLI still calls jsonargparse APIs that warn as deprecated; nothing a user can act on
    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    argv = list(sys.argv[1:] if args is None else args)
    lightning_args = None if args is None else argv  # LightningCLI reads sys.argv itself
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb in LIGHTNING_VERBS:
        from lit_mhar.cli.lightning import run_lightning

        run_lightning(lightning_args)
        return 0
    if verb in FUNCTION_VERBS:
        from jsonargparse import CLI

        function = FUNCTION_VERBS[verb][0]()
        CLI(function, args=rest, prog=f"lit-mhar {verb}", as_positional=False)
        return 0
    print(f"lit-mhar: unknown command {verb!r}; valid: {', '.join(LIGHTNING_VERBS + tuple(FUNCTION_VERBS))}\n", file=sys.stderr)
    print(usage(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
