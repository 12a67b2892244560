"""The ``lit-mhar`` command line.

``fit``, ``validate``, ``test`` and ``predict`` go through LightningCLI (``--config``,
``--print_config``, every argument from the classes' docstrings); the other verbs through
jsonargparse over one function each (``sweep``: one per subcommand).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator, Optional, Union

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


def check_config_files(argv: list[str]) -> None:
    """Raises ValueError naming the file, line and column when a ``--config FILE`` in ``argv`` is
    not valid YAML (jsonargparse would print its usage and an error that names the line but not
    the file). Options that are not an existing file are left to jsonargparse (it also takes a
    config as an inline string)."""
    import yaml

    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in paths:
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                yaml.compose(f, Loader=yaml.SafeLoader)  # the syntax only; jsonargparse reads the values
        except yaml.MarkedYAMLError as e:
            where = f" at line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}" if e.problem_mark else ""
            context = f" ({e.context} at line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
            raise ValueError(f"--config {path}: not valid YAML: {e.problem}{where}{context}; correct the file") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--config {path}: not a text file ({e.reason} at byte {e.start}); give a YAML file") from None


DEBUG_ENV = "LIT_MHAR_DEBUG"  # set to 1: user errors raise with their traceback instead of one line


def _raised_by_lit_mhar(error: BaseException) -> bool:
    """Whether ``error`` was raised by lit-mhar's own code (the innermost frame of its traceback)."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    origin = os.path.realpath(tb.tb_frame.f_code.co_filename)
    # lit_mhar, lit_mhar.cli, .sweeps and .kernels live in separate source folders (package-dir mapping)
    roots = {
        os.path.dirname(os.path.realpath(module.__file__))
        for name in ("lit_mhar", "lit_mhar.cli", "lit_mhar.sweeps", "lit_mhar.kernels")
        if (module := sys.modules.get(name)) is not None and getattr(module, "__file__", None)
    }
    return any(origin.startswith(root + os.sep) for root in roots)


def is_user_error(error: BaseException) -> bool:
    """Whether ``error`` is the user's to fix (see :func:`main`), as opposed to an internal failure."""
    if isinstance(error, (FileNotFoundError, FileExistsError)):
        return True
    tracking = sys.modules.get("lit_mhar.tracking")  # imported by whatever raised it, if that is the case
    if tracking is not None and isinstance(error, getattr(tracking, "TrackingUnavailable", ())):
        return True
    return isinstance(error, ValueError) and _raised_by_lit_mhar(error)


def run_failure(error: BaseException) -> Optional[str]:
    """The one-line message of a run that went wrong (see :func:`main`), or None for other errors:
    a fit that diverged (``lit_mhar.callbacks.TrainingDiverged``) or ran out of memory
    (``torch.OutOfMemoryError``)."""
    callbacks = sys.modules.get("lit_mhar.callbacks")  # imported by whatever raised it, if that is the case
    if callbacks is not None and isinstance(error, callbacks.TrainingDiverged):
        return str(error)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, torch.OutOfMemoryError):
        first = (str(error).strip().splitlines() or ["out of memory"])[0]
        return (
            f"out of memory: {first.rstrip('.')}. Use a smaller batch (--data.batch_size), sequence (--data.seq_len) or "
            "model, free the device of other work, or, for fit, trade compute for memory with --model.activation_checkpointing true"
        )
    return None


def _message(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return f"{error.strerror}: {error.filename}"  # open('x') -> "No such file or directory: x", not "[Errno 2] ..."
    return str(error) or type(error).__name__


def main(args: Optional[list[str]] = None) -> int:
    """Entry point of ``lit-mhar``; ``args`` defaults to ``sys.argv[1:]``. Returns the exit status.

    Exit status: 0 on success; 2 for a usage or user error; 1 for a run that went wrong (below); 130 when interrupted (Ctrl-C, or SIGTERM
    to ``sweep run``: one line, no traceback); what a command's function returns when that is an int
    (``sweep run``: 1 when the study holds no completed trial).

    Errors. Run as the command (``args`` is None: the ``lit-mhar`` console script, ``python -m
    lit_mhar.cli``), an error that is the user's to fix prints one line, ``lit-mhar CMD: error:
    MESSAGE``, to stderr and exits 2; ``LIT_MHAR_DEBUG=1`` raises it with its traceback instead.
    The user's errors are:

    * ``FileNotFoundError`` and ``FileExistsError``: a path given that does not exist or would be
      overwritten (checkpoints, datasets, output folders; raised by lit-mhar, Lightning or litdata);
    * ``ValueError`` raised by lit-mhar's own code, which validates every argument and config
      value (``ModelConfig``, the data, sweep files) and the shapes of the tensors given to its
      functions (the routing kernels' checks) with a message naming the value and what is valid;
      this includes classes that LightningCLI instantiates for fit/validate/test/predict;
    * ``lit_mhar.tracking.TrackingUnavailable``: the MLflow server given cannot be reached.

    A run that went wrong prints one line the same way and exits 1 (:func:`run_failure`): a fit
    whose loss or gradient norm became NaN or infinite (``TrainingDiverged``: the step and what to
    try), and ``torch.OutOfMemoryError`` (what to shrink).

    Everything else keeps its traceback: a ``ValueError`` raised inside torch or another library
    (a shape mismatch deep inside torch is a bug, not a bad argument), other ``RuntimeError`` exceptions
    (CUDA errors), ``TypeError``, ``KeyError``, ``KeyboardInterrupt``. Argument
    parsing errors are jsonargparse's: a usage message and exit 2 (``SystemExit``), as before.

    Called from Python with an argument list, every exception propagates unchanged, so callers
    (tests, scripts) can catch the exception they expect.
    """
    # LightningCLI still calls jsonargparse APIs that warn as deprecated; nothing a user can act on
    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    argv = list(sys.argv[1:] if args is None else args)
    lightning_args = None if args is None else argv  # LightningCLI reads sys.argv itself
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in LIGHTNING_VERBS and verb not in FUNCTION_VERBS:
        print(f"lit-mhar: unknown command {verb!r}; valid: {', '.join(LIGHTNING_VERBS + tuple(FUNCTION_VERBS))}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    command = f"lit-mhar {verb}"
    with tracking_uri_restored():
        return _run(verb, rest, args, lightning_args, command)


@contextlib.contextmanager
def tracking_uri_restored() -> Iterator[None]:
    """Leave MLflow's process-wide tracking URI as it was: Lightning's MLFlowLogger calls
    ``mlflow.set_tracking_uri``, which also sets ``MLFLOW_TRACKING_URI`` in ``os.environ``, so a
    second ``main`` in the same process (a script, a test) would otherwise log into the first one's store."""
    saved = os.environ.get("MLFLOW_TRACKING_URI")
    try:
        yield
    finally:
        if "mlflow" in sys.modules:
            import mlflow

            mlflow.set_tracking_uri(saved)  # None unsets the variable
        elif saved is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved


def _run(verb: str, rest: list[str], args: Optional[list[str]], lightning_args: Optional[list[str]], command: str) -> int:
    """Run one verb under :func:`main`'s error handling."""
    try:
        if verb in LIGHTNING_VERBS:
            check_config_files(rest)
            from lit_mhar.cli.lightning import run_lightning

            run_lightning(lightning_args)
            return 0
        from jsonargparse import CLI

        function = FUNCTION_VERBS[verb][0]()
        if isinstance(function, list) and rest and rest[0] in {f.__name__ for f in function}:
            command += f" {rest[0]}"  # the subcommand: lit-mhar sweep run
        check_config_files(rest)
        result = CLI(function, args=rest, prog=f"lit-mhar {verb}", as_positional=False)
        return result if isinstance(result, int) and not isinstance(result, bool) else 0
    except KeyboardInterrupt:
        # Ctrl-C, or SIGTERM in lit-mhar sweep run (which has already said how to resume): one line, 130
        if args is not None or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if args is not None or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        failure = run_failure(error)
        if failure is not None:
            print(f"{command}: error: {failure} ({DEBUG_ENV}=1 shows the traceback)", file=sys.stderr)
            return 1
        if not is_user_error(error):
            raise
        message = _message(error)
        hint = f"({DEBUG_ENV}=1 shows the traceback)"
        # a message of several lines ends with a command to copy: the hint goes below it, not onto it
        print(f"{command}: error: {message}{chr(10) if chr(10) in message else ' '}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
