"""What one sweep is: its search space, sampler, pruner, objective, and how a point becomes a fit config.

A sweep file is the argument list of :func:`lit_mhar.sweeps.runner.run` (jsonargparse reads it
with ``--config``). This module holds the parts of it that are not plain strings and numbers:

* the **search space**: a mapping of parameter name -> list of values (categorical) or range
  ``{low, high, log, step}``, or a list of such mappings for a grid that is a union of products
  (as scikit-learn's ``ParameterGrid`` takes: ``[{residual: [prenorm]}, {residual: [delta],
  heads: [1, 2, 4]}]`` runs the baseline once and not once per H);
* the :class:`Sampler`, :class:`Pruner`, :class:`Objective` and :class:`Tracking` settings;
* :func:`compose_trial_config`, which turns a base fit config and one point into the fit config of
  a trial, and :func:`token_budget`, which turns the objective's token budget into ``max_steps``.

Parameter names are short names (:data:`SHORT_NAMES`) or dotted fit arguments as ``lit-mhar fit``
takes them (``model.lr``, ``data.batch_size``, ``trainer.gradient_clip_val``).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional, Union

from lit_mhar.config import PRESETS, RESIDUALS

Value = Union[int, float, str, bool]

# Short parameter names and the fit arguments each one sets. `seed` seeds both the weights
# (seed_everything) and the order in which the train split is shuffled (data.seed). `budget` sets
# none: it is the fraction of objective.tokens a point trains (the baseline at several budgets
# gives the loss-vs-compute fit of the report).
SHORT_NAMES: dict[str, tuple[str, ...]] = {
    "heads": ("model.config.heads",),
    "block_size": ("model.config.block_size",),
    "residual": ("model.config.residual",),
    "scale": ("model.config.name",),
    "seed": ("seed_everything", "data.seed"),
    "lr": ("model.lr",),
    "budget": (),
}

# Fit arguments the sweep sets itself for every trial; sweeping them would break the objective.
RESERVED: dict[str, str] = {
    "trainer.max_steps": "set from objective.tokens",
    "trainer.max_epochs": "the token budget decides when a trial stops",
    "trainer.max_time": "the token budget decides when a trial stops",
    "trainer.val_check_interval": "set from objective.evals",
    "trainer.check_val_every_n_epoch": "set from objective.evals",
    "trainer.logger": "each trial logs to its own nested MLflow run",
    "trainer.callbacks": "the sweep adds its pruning callback",
    "trainer.default_root_dir": "each trial has its own folder under output_dir",
    "model.config.vocab_size": "linked from the data",
    "model.config.seq_len": "linked from data.seq_len; sweep data.seq_len instead",
}
FIT_SECTIONS = ("model.", "data.", "trainer.", "checkpoint.")


@dataclass(frozen=True)
class Range:
    """A numeric range searched by TPE or random sampling (not by the grid sampler).

    Attributes:
        low: Smallest value.
        high: Largest value (included).
        log: Sample uniformly in log space (learning rates, weight decays).
        step: Spacing of the values; None for a continuous float range.
        integer: Sample integers (``trial.suggest_int``) rather than floats.
    """

    low: float
    high: float
    log: bool = False
    step: Optional[float] = None
    integer: bool = False

    def suggest(self, trial: Any, name: str) -> Value:
        """The value ``trial`` (an ``optuna.Trial``) draws for parameter ``name``."""
        if self.integer:
            return trial.suggest_int(name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(name, self.low, self.high, step=self.step, log=self.log)


@dataclass(frozen=True)
class Categorical:
    """A list of values; the grid sampler runs each, TPE and random pick among them."""

    values: tuple[Value, ...]


Dimension = Union[Categorical, Range]


def _number(name: str, key: str, value: Any) -> float:
    # YAML 1.1 (PyYAML) reads 1e-4 as a string; accept any numeric spelling.
    if isinstance(value, bool):
        raise ValueError(f"space.{name}.{key}={value!r} must be a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"space.{name}.{key}={value!r} must be a number") from None


def _parse_range(name: str, spec: dict[str, Any]) -> Range:
    unknown = set(spec) - {"low", "high", "log", "step", "type"}
    if unknown or not {"low", "high"} <= set(spec):
        raise ValueError(
            f"space.{name}={spec!r}: a range is {{low: L, high: H}} with optional log: true, step: S and "
            f"type: int|float; {'unknown keys ' + str(sorted(unknown)) if unknown else 'low and high are required'}"
        )
    kind = spec.get("type")
    if kind is None:
        kind = "int" if all(isinstance(spec[k], int) and not isinstance(spec[k], bool) for k in ("low", "high")) else "float"
    if kind not in ("int", "float"):
        raise ValueError(f"space.{name}.type={kind!r} is not valid; valid: int, float")
    low, high = _number(name, "low", spec["low"]), _number(name, "high", spec["high"])
    step = None if spec.get("step") is None else _number(name, "step", spec["step"])
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise ValueError(f"space.{name}.log={log!r} must be true or false")
    if not low < high:
        raise ValueError(f"space.{name}: low={low} must be below high={high}")
    if log and low <= 0:
        raise ValueError(f"space.{name}: a log range needs low > 0, got low={low}")
    if log and step is not None:
        raise ValueError(f"space.{name}: log and step cannot be combined (Optuna samples one or the other)")
    if step is not None and step <= 0:
        raise ValueError(f"space.{name}.step={step} must be > 0")
    if kind == "int" and any(v is not None and v != int(v) for v in (low, high, step)):
        raise ValueError(f"space.{name}: an int range needs integer low, high and step")
    return Range(low=low, high=high, log=log, step=step, integer=kind == "int")


def _check_short_value(name: str, value: Any) -> None:
    """Early checks of the short names' values; model validity itself (H | d) is checked per trial."""
    if name in ("heads", "block_size"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"space.{name} contains {value!r}; every value must be an integer >= 1")
    elif name == "residual" and value not in RESIDUALS:
        raise ValueError(f"space.residual contains {value!r}; valid: {list(RESIDUALS)}")
    elif name == "scale" and value not in PRESETS:
        raise ValueError(f"space.scale contains {value!r}; valid presets: {list(PRESETS)}")
    elif name == "seed" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"space.seed contains {value!r}; seeds are integers")
    elif name == "lr" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ValueError(f"space.lr contains {value!r}; learning rates are numbers > 0")
    elif name == "budget" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
        raise ValueError(f"space.budget contains {value!r}; a budget is the fraction of objective.tokens a point trains, in (0, 1]")


def check_parameter_name(name: str) -> None:
    """Raises ValueError unless ``name`` is a short name or a sweepable dotted fit argument."""
    if name in SHORT_NAMES:
        return
    if name in RESERVED:
        raise ValueError(f"space.{name} cannot be swept: {RESERVED[name]}")
    for short, targets in SHORT_NAMES.items():
        if name in targets:
            raise ValueError(f"space.{name}: write it as the short name {short!r}")
    if name == "seed_everything" or (name.startswith(FIT_SECTIONS) and all(name.split("."))):
        return
    raise ValueError(
        f"space has an unknown parameter {name!r}; valid: the short names {sorted(SHORT_NAMES)} or a dotted "
        f"fit argument under {', '.join(s.rstrip('.') for s in FIT_SECTIONS)} (e.g. model.warmup_steps, data.batch_size)"
    )


@dataclass
class SearchSpace:
    """A parsed search space: one or more sub-spaces, each a mapping name -> :data:`Dimension`.

    A grid sweep runs the union of the sub-spaces' Cartesian products (a point that several
    sub-spaces produce runs once). TPE and random sampling take exactly one sub-space.
    """

    subspaces: list[dict[str, Dimension]]

    @classmethod
    def parse(cls, space: Union[dict[str, Any], list[dict[str, Any]]]) -> "SearchSpace":
        """Parses the ``space`` of a sweep file.

        Raises:
            ValueError: an empty space or sub-space, an empty list of values, an unknown or reserved
                parameter name, a malformed range, or a short name with an invalid value (the
                message names the parameter and the value).
        """
        raw = space if isinstance(space, list) else [space]
        if not raw:
            raise ValueError("space is an empty list; give at least one mapping of parameter -> values")
        subspaces: list[dict[str, Dimension]] = []
        for i, sub in enumerate(raw):
            where = f"space[{i}]" if isinstance(space, list) else "space"
            if not isinstance(sub, dict) or not sub:
                raise ValueError(f"{where} must be a non-empty mapping of parameter -> list of values or range, got {sub!r}")
            parsed: dict[str, Dimension] = {}
            for name, spec in sub.items():
                check_parameter_name(name)
                if isinstance(spec, dict):
                    parsed[name] = _parse_range(name, spec)
                    continue
                values = list(spec) if isinstance(spec, (list, tuple)) else [spec]
                if not values:
                    raise ValueError(f"{where}.{name} is an empty list, so the grid is empty; give at least one value")
                for value in values:
                    if not isinstance(value, (int, float, str, bool)):
                        raise ValueError(f"{where}.{name} contains {value!r}; values are numbers, strings or booleans")
                    if name in SHORT_NAMES:
                        _check_short_value(name, value)
                if len(set(map(_key, values))) != len(values):
                    raise ValueError(f"{where}.{name}={values!r} lists a value twice")
                parsed[name] = Categorical(tuple(values))
            if "seed" in parsed and "seed_everything" in parsed:
                raise ValueError(f"{where}: give seed or seed_everything, not both")
            subspaces.append(parsed)
        return cls(subspaces)

    @property
    def names(self) -> list[str]:
        """Every parameter name, in order of first appearance."""
        return list(dict.fromkeys(name for sub in self.subspaces for name in sub))

    def choices(self, name: str) -> tuple[Value, ...]:
        """Every value of the categorical parameter ``name`` over all sub-spaces (one Optuna distribution)."""
        values: dict[str, Value] = {}
        for sub in self.subspaces:
            dim = sub.get(name)
            if isinstance(dim, Categorical):
                for v in dim.values:
                    values.setdefault(_key(v), v)
        return tuple(values.values())

    def check_sampler(self, sampler: "Sampler") -> None:
        """Raises ValueError if the space does not suit the sampler (ranges in a grid, several sub-spaces for TPE)."""
        if sampler.name == "grid":
            for sub in self.subspaces:
                for name, dim in sub.items():
                    if isinstance(dim, Range):
                        raise ValueError(
                            f"space.{name} is a range, which a grid cannot enumerate; list the values, or use sampler.name tpe or random"
                        )
        elif len(self.subspaces) != 1:
            raise ValueError(f"sampler.name={sampler.name!r} takes one mapping as space, got a list of {len(self.subspaces)}; a list is for grid sweeps")
        else:
            for name in self.names:
                if sum(isinstance(sub.get(name), Range) for sub in self.subspaces) and any(
                    isinstance(sub.get(name), Categorical) for sub in self.subspaces
                ):
                    raise ValueError(f"space.{name} is a range in one place and a list in another")

    def grid(self) -> list[dict[str, Value]]:
        """Every point of a grid sweep, in file order, each once."""
        points: dict[str, dict[str, Value]] = {}
        for sub in self.subspaces:
            names = list(sub)
            for values in itertools.product(*(sub[n].values for n in names)):  # type: ignore[union-attr]
                point = dict(zip(names, values))
                points.setdefault(point_key(point), point)
        return list(points.values())

    def suggest(self, trial: Any, fixed: Optional[dict[str, Value]] = None) -> dict[str, Value]:
        """Draws the parameters of ``trial`` (an ``optuna.Trial``) through its ``suggest_*`` API.

        With ``fixed`` (a grid point enqueued into the study), only the point's names are suggested
        and Optuna returns the enqueued values; otherwise the sampler draws from the single sub-space.
        """
        if fixed is not None:
            return {name: trial.suggest_categorical(name, self.choices(name)) for name in fixed}
        (sub,) = self.subspaces
        return {
            name: dim.suggest(trial, name) if isinstance(dim, Range) else trial.suggest_categorical(name, dim.values)
            for name, dim in sub.items()
        }

    def describe(self) -> list[dict[str, Any]]:
        """A JSON-able form, stored with the study to detect a changed sweep file on resume."""
        return [
            {name: asdict(dim) if isinstance(dim, Range) else list(dim.values) for name, dim in sub.items()}
            for sub in self.subspaces
        ]


def _key(value: Value) -> str:
    return json.dumps(value)


def point_key(point: dict[str, Value]) -> str:
    """A canonical string for a point (sorted JSON), the identity of a grid point in the study."""
    return json.dumps(point, sort_keys=True)


@dataclass
class Sampler:
    """How trials choose points of the search space.

    Attributes:
        name: ``grid``: every point of the space exactly once (the points are enqueued into the
            study and each worker takes the next one atomically). ``tpe``: Optuna's
            TPESampler (Bergstra et al., NeurIPS 2011). ``random``: Optuna's RandomSampler.
        n_trials: Trials the study should hold for tpe/random, counted over every worker and
            every run of the command (unused by grid: the grid size decides).
        seed: Seed of the tpe/random sampler; ``--workers N`` gives worker i the seed ``seed + i``.
    """

    name: Literal["grid", "tpe", "random"] = "grid"
    n_trials: Optional[int] = None
    seed: int = 0

    def build(self, seed_offset: int = 0) -> Any:
        """The Optuna sampler. Grid trials are enqueued with fixed parameters, which no sampler overrides."""
        import optuna

        if self.name == "tpe":
            return optuna.samplers.TPESampler(seed=self.seed + seed_offset)
        return optuna.samplers.RandomSampler(seed=self.seed + seed_offset)


@dataclass
class Pruner:
    """When an unpromising trial stops early, judged on the objective's intermediate validations.

    Intermediate values are reported at steps 1..objective.evals (the k-th validation after k/evals
    of the token budget), so trials of different batch sizes are compared at equal token counts.

    Attributes:
        name: ``none``; ``median``: Optuna's MedianPruner, stops a trial whose value at a step is
            worse than the median of earlier trials at that step; ``hyperband``: Optuna's
            HyperbandPruner (Li et al., JMLR 2018) with resources counted in validations.
        n_startup_trials: median: trials that finish before any pruning.
        n_warmup_steps: median: validations of a trial before it may be pruned.
        min_resource: hyperband: validations every trial gets at least.
        reduction_factor: hyperband: the fraction 1/reduction_factor of trials promoted per rung.
    """

    name: Literal["none", "median", "hyperband"] = "none"
    n_startup_trials: int = 5
    n_warmup_steps: int = 0
    min_resource: int = 1
    reduction_factor: int = 3

    def build(self, evals: int) -> Any:
        """The Optuna pruner for an objective with ``evals`` validations per trial."""
        import optuna

        if self.name == "median":
            return optuna.pruners.MedianPruner(n_startup_trials=self.n_startup_trials, n_warmup_steps=self.n_warmup_steps)
        if self.name == "hyperband":
            return optuna.pruners.HyperbandPruner(
                min_resource=self.min_resource, max_resource=evals, reduction_factor=self.reduction_factor
            )
        return optuna.pruners.NopPruner()


@dataclass
class Objective:
    """What a trial is scored on: the validation loss after a fixed number of training tokens.

    Attributes:
        tokens: Training tokens per trial. ``max_steps`` = ceil(tokens / (batch_size x seq_len x
            accumulate_grad_batches x devices x num_nodes)), rounded up to a multiple of evals.
        evals: Validations per trial, evenly spaced; the last one, at the end of the budget, is the
            objective; all of them are reported to the pruner.
        metric: The logged metric that is minimised.
    """

    tokens: int = 1_000_000
    evals: int = 4
    metric: str = "val/loss"


@dataclass
class Tracking:
    """Where the sweep's MLflow runs go: one parent run per study, one nested child run per trial.

    Attributes:
        experiment: MLflow experiment of the parent and child runs (created if missing).
        tracking_uri: MLflow tracking URI; default ``MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db``.
        artifact_location: Artifact root of the experiment when the sweep creates it (default: MLflow's).
    """

    experiment: str = "lit-mhar-sweeps"
    tracking_uri: Optional[str] = None
    artifact_location: Optional[str] = None


@dataclass
class Budget:
    """The trial length derived from an :class:`Objective` and a resolved fit config."""

    max_steps: int
    val_every: int  # optimizer steps between validations
    tokens_per_step: int
    tokens: int  # tokens actually trained: max_steps * tokens_per_step (>= objective.tokens)


def token_budget(objective: Objective, resolved: dict[str, Any], fraction: float = 1.0) -> Budget:
    """``max_steps`` and the validation interval that spend ``fraction`` of ``objective.tokens`` on one trial.

    Args:
        objective: the token budget and number of validations.
        resolved: the fully resolved fit config (``lit-mhar fit --print_config``), for
            data.batch_size, data.seq_len, trainer.accumulate_grad_batches, devices, num_nodes.
        fraction: the point's ``budget`` (a baseline trained on less compute for the loss-vs-compute fit).

    Raises:
        ValueError: ``trainer.devices`` is not a fixed count (``auto``, -1), or the budget is
            smaller than one step per validation.
    """
    data, trainer = resolved.get("data", {}), resolved.get("trainer", {})
    devices = trainer.get("devices", 1)
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    elif isinstance(devices, (list, tuple)):
        devices = len(devices)
    elif isinstance(devices, str) and "," in devices:
        devices = len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"trainer.devices={devices!r}: a token budget needs a fixed device count (e.g. 1)")
    accumulate = trainer.get("accumulate_grad_batches", 1) or 1
    if not isinstance(accumulate, int):
        raise ValueError(f"trainer.accumulate_grad_batches={accumulate!r}: a token budget needs one integer")
    tokens_per_step = int(data["batch_size"]) * int(data["seq_len"]) * accumulate * devices * int(trainer.get("num_nodes", 1) or 1)
    steps = math.ceil(objective.tokens * fraction / tokens_per_step)
    if steps < objective.evals:
        raise ValueError(
            f"objective.tokens={objective.tokens} x budget {fraction:g} is {steps} step(s) of {tokens_per_step} tokens, fewer than "
            f"objective.evals={objective.evals}: raise the budget or lower evals"
        )
    val_every = math.ceil(steps / objective.evals)
    return Budget(max_steps=val_every * objective.evals, val_every=val_every, tokens_per_step=tokens_per_step,
                  tokens=val_every * objective.evals * tokens_per_step)


def budget_overrides(budget: Budget, resolved: dict[str, Any]) -> dict[str, Any]:
    """The fit arguments (dotted) that make a trial train exactly ``budget`` and validate ``evals`` times.

    ``log_every_n_steps`` is lowered to half the validation interval when it is longer: LitLM
    measures tokens/s and peak memory over windows of that many steps, and a validation restarts
    the window, so a longer window would never complete and the trial would log neither.
    """
    trainer = resolved.get("trainer", {})
    accumulate = int(trainer.get("accumulate_grad_batches", 1) or 1)
    log_every = int(trainer.get("log_every_n_steps") or 50)
    return {
        "trainer.max_steps": budget.max_steps,
        "trainer.max_epochs": None,
        "trainer.max_time": None,
        "trainer.val_check_interval": budget.val_every * accumulate,  # counted in batches, not optimizer steps
        "trainer.check_val_every_n_epoch": None,
        "trainer.log_every_n_steps": min(log_every, max(1, budget.val_every // 2)),
    }


def get_dotted(config: dict[str, Any], path: str, default: Any = None) -> Any:
    """``config["a"]["b"]`` for ``path="a.b"``, or ``default`` when a key is missing."""
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def set_dotted(config: dict[str, Any], path: str, value: Any) -> None:
    """Sets ``config["a"]["b"] = value`` for ``path="a.b"``, creating mappings on the way.

    Raises:
        ValueError: a key on the way holds a non-mapping value.
    """
    parts = path.split(".")
    node = config
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"cannot set {path}: {'.'.join(parts[: i + 1])} is {child!r}, not a mapping")
        node = child
    node[parts[-1]] = value


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``override`` merged in: mappings recursively, other values replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def point_scale(base: dict[str, Any], point: dict[str, Value]) -> str:
    """The preset of a point: its ``scale`` if swept, else the base config's ``model.config.name``."""
    return str(point.get("scale", get_dotted(base, "model.config.name", "debug")))


def compose_trial_config(base: dict[str, Any], per_scale: dict[str, dict[str, Any]], point: dict[str, Value]) -> dict[str, Any]:
    """The fit config of one point: ``base``, then ``per_scale[scale]``, then the point's values.

    Short names expand to their fit arguments (:data:`SHORT_NAMES`); dotted names are set as given.
    The budget, logger and callbacks are added later by the runner.
    """
    config = deep_merge(base, per_scale.get(point_scale(base, point), {}))
    for name, value in point.items():
        for target in SHORT_NAMES.get(name, (name,)):
            set_dotted(config, target, value)
    return config


@dataclass
class SweepSpec:
    """Everything that defines a study's results; stored with the study and compared on resume."""

    base: dict[str, Any]
    per_scale: dict[str, dict[str, Any]]
    space: SearchSpace
    sampler: Sampler
    objective: Objective
    extra: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> dict[str, Any]:
        """The JSON-able identity of the sweep (sampler seed and n_trials excluded: they may change on resume)."""
        return {
            "base": self.base,
            "per_scale": self.per_scale,
            "space": self.space.describe(),
            "sampler": self.sampler.name,
            "objective": asdict(self.objective),
        }
