"""``lit-instruct``: ``fit``/``validate`` through LightningCLI, plus ``prepare``, ``export``, ``generate``."""

from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn, get_args

import lightning as L
import yaml
from jsonargparse import Namespace
from jsonargparse._common import debug_mode_active
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_instruct.adapter_folder import adapter_chat_template
from lit_instruct.callbacks import GracefulInterrupt, PlainProgress
from lit_instruct.callbacks.interrupt import forced_exit_status
from lit_instruct.cpu_threads import sharing_cores, usable_cores
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.records import DataError
from lit_instruct.distributed import launched_rank
from lit_instruct.errors import ConfigError, closest
from lit_instruct.fit_help import HELP_ALL, short_help
from lit_instruct.io import check_replaceable
from lit_instruct.loggers import finish_wandb_runs
from lit_instruct.loss.preference import PreferenceConfig, PreferenceKind
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.models.output_head import UnsupportedModelError
from lit_instruct.objectives.base import init_parameters
from lit_instruct.objectives.choice import OBJECTIVES, batch_kind_of, objective_class
from lit_instruct.precision import AUTO, auto_precision, base_dtype
from lit_instruct.preflight import check_adapter_dir, check_config, check_trains_something
from lit_instruct.preflight.resume import resolve_last
from lit_instruct.secrets import redact
from lit_instruct.train.checkpoint_io import SafeCheckpointIO
from lit_instruct.train.fit_report import FitReport
from lit_instruct.train.module import InstructLoRAModule
from lit_instruct.train.trainer import InstructTrainer


def _val_metrics(results: list[Mapping[str, float]]) -> dict[str, float]:
    return {k: float(v) for k, v in (results[0] if results else {}).items()}


def redact_namespace(config: Namespace) -> Namespace:
    """A copy of a parsed config with secret-looking fields and secret environment values redacted."""
    config = config.clone()
    for key, value in config.items():
        leaf = key.rsplit(".", 1)[-1]
        if isinstance(value, list):
            config[key] = [
                redact_namespace(v) if isinstance(v, Namespace) else redact(v, key=leaf) for v in value
            ]
        else:
            config[key] = redact(value, key=leaf)
    return config


def yaml_plain(value: Any) -> Any:
    """``value`` in YAML's own types, as ``hparams.yaml`` and W&B then show it: tuples as lists, paths
    and other objects as their text (no ``!!python/tuple`` or ``!!python/object`` tags)."""
    if isinstance(value, dict):
        return {key: yaml_plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [yaml_plain(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


class ConfigToLoggers(SaveConfigCallback):
    """Writes ``config.yaml`` to the log directory and logs the full resolved config as the run
    config of every logger (``config`` in W&B), both with secrets redacted."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.config = redact_namespace(self.config)
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        config = yaml_plain(self.config.as_dict())
        for logger in trainer.loggers:
            logger.log_hyperparams({"config": config})


class OneLineErrorParser(LightningArgumentParser):
    """A parser whose error is one line naming the setting, the value and what was expected, and
    where the settings are listed (not the ~100 lines of usage before it); exit status 2."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or debug_mode_active():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "").split()
        command = " ".join(["lit-instruct", *(prog[1:] or ["fit"])])  # not `__main__.py` (python -m)
        flat = " ".join(message.split())
        line = objective_error(flat) or in_our_words(union_error(flat), list(parser._option_string_actions))
        sys.stderr.write(f"lit-instruct: config error: {line} (`{command} --help` lists the settings)\n")
        raise SystemExit(2)


SETTINGS_GROUPS = {"model.preference": PreferenceConfig, "model.lora": LoRAConfig}
"""Groups of settings given as one value (a dataclass), whose keys the parser does not list."""


def in_our_words(line: str, options: list[str]) -> str:
    """jsonargparse's complaints about a value of a fixed set, a misspelt option or a misspelt key,
    in our words, with the closest name: ``model.preference.kind: 'dpo2' is none of dpo, ipo, simpo,
    orpo (closest: dpo)``."""
    literal = re.match(
        r'(?:Parser key "([^"]+)": |([\w.]+): )Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$', line
    )
    if literal:
        key = literal.group(1) or literal.group(2)
        choices = [choice.strip().strip("'\"") for choice in literal.group(3).split(",")]
        value = literal.group(4)
        return f"{key}: {value!r} is none of {', '.join(choices)}{closest(value, choices)}"
    option = re.match(r"([\w.]+): Option '([^']+)' is not accepted$", line)
    if option:
        group, name = option.groups()
        known = [o.removeprefix(f"--{group}.") for o in options if o.startswith(f"--{group}.")]
        if group in SETTINGS_GROUPS:  # a dataclass given as one value: its fields
            known = [f.name for f in fields(SETTINGS_GROUPS[group])]
        return f"{group}.{name}: is not a setting{closest(name, known)}"
    unknown = re.match(r"unrecognized arguments: (--[\w.]+)(.*)$", line)
    if unknown:  # the closest name of the same group (``--trainer.``), the group's prefix left out
        group, _, name = unknown.group(1).rpartition(".")
        known = [o.removeprefix(f"{group}.") for o in options if o.startswith(f"{group}.")]
        hint = closest(name, known)
        return f"{unknown.group(1)}: is not a setting{hint.replace('closest: ', f'closest: {group}.')}"
    return line


def objective_error(line: str) -> str | None:
    """jsonargparse's error for ``model.objective`` (a union of a name and a class), in our words:
    a name that is no objective (a short name given as ``class_path`` says how to write it), or the
    chosen class's own complaint about its ``init_args``; ``None`` for another setting's error."""
    if line.startswith("argument batch_kind_of("):  # a link's target: not the user's to set
        return "data.batch_kind: is set by model.objective (the batch kind it takes): choose the objective"
    if not line.startswith('Parser key "model.objective":'):
        return None
    inner = re.search(r"Problem with given class_path '([^']*)': (.*?) - Expected a typing", line)
    if inner:
        cls = inner.group(1).rpartition(".")[2]
        option = re.match(r"Option '([^']+)' is not accepted", inner.group(2))
        if option:
            known = init_parameters(objective_class(inner.group(1)))
            return f"model.objective.init_args.{option.group(1)}: is not a setting of {cls}" + closest(
                option.group(1), known
            )
        nested = re.match(r'Parser key "([^"]+)": (.*)', inner.group(2))
        if nested:
            return f"model.objective.init_args.{nested.group(1)}: {nested.group(2)}"
        return f"model.objective: {cls}: {inner.group(2)}"
    given = re.search(r"Expected a dot import path string: (\S+)", line)
    if given is None:
        return None
    name = given.group(1)
    if name.lower() in OBJECTIVES:
        cls = OBJECTIVES[name.lower()].__name__
        return (
            f"model.objective: {name!r} is a short name: write model.objective: {name.lower()} (its "
            f"defaults), or class_path: {cls} with its init_args"
        )
    names = ", ".join(OBJECTIVES)
    return (
        f"model.objective: {name!r} is none of {names}{closest(name.lower(), list(OBJECTIVES))}, nor the "
        "class name or import path of an Objective subclass"
    )


def union_error(line: str) -> str:
    """jsonargparse's error for a settings group typed ``X | None`` (``model.preference``), cut to the
    group's own complaint: ``model.preference.beta: Expected a <class 'float'>. Got value: abc``."""
    key = re.match(r'Parser key "([^"]+)": Does not validate against any of the Union subtypes', line)
    inner = re.search(r"Problem with given class_path '[^']*': (.*?) - Expected a <class 'NoneType'>", line)
    if key is None or inner is None:
        return line
    nested = re.match(r'Parser key "([^"]+)": (.*)', inner.group(1))
    if nested:
        return f"{key.group(1)}.{nested.group(1)}: {nested.group(2)}"
    return f"{key.group(1)}: {inner.group(1)}"


REWARD_SHOWN = ("val/reward", "val/rewards/accuracies", "val/rewards/margins")
"""The reward metric the fit's last line shows for an objective other than SFT: the first it logs."""


SAVED_CONFIG_HEADER = "# lightning.pytorch=="
"""How the ``config.yaml`` a fit saves begins (LightningCLI's dump header)."""


def check_log_dir(config: Mapping[str, Any], resuming: bool) -> bool:
    """Whether the fit may overwrite a ``config.yaml`` in its log folder: a fit without a logger
    writes it into the root folder itself, where a fresh fit must not find an earlier run's
    (Lightning would stop there, after the model loaded, with a traceback) and a resume may replace
    only one a fit saved (never the user's own config file).

    Raises:
        ConfigError: naming ``trainer.default_root_dir`` and what to do.
    """
    trainer = config.get("trainer") or {}
    if trainer.get("logger") not in (False, []):
        return False
    root = Path(trainer.get("default_root_dir") or ".")
    saved = root / "config.yaml"
    if not saved.is_file():
        return False
    if not resuming:
        raise ConfigError(
            "trainer.default_root_dir",
            f"{str(root)!r} holds an earlier run's config.yaml, and with trainer.logger: false a run writes "
            "into the root itself: name a new folder, resume with --ckpt_path last, or keep a logger "
            "(each run then gets its own version_N)",
        )
    with open(saved, encoding="utf-8", errors="replace") as handle:
        if not handle.readline().startswith(SAVED_CONFIG_HEADER):
            raise ConfigError(
                "trainer.default_root_dir",
                f"{str(root)!r} holds a config.yaml no fit saved, which this run (trainer.logger: false) "
                "would write over: name the run's own root folder",
            )
    return True


FP16_MIXED = ("16-mixed", "16")
"""The precisions that ask fp16 autocast (Lightning's names)."""


def on_the_cpu(accelerator: Any) -> bool:
    """Whether ``trainer.accelerator`` runs on the CPU here (``auto`` without a GPU)."""
    import torch

    return str(accelerator) == "cpu" or (str(accelerator) == AUTO and not torch.cuda.is_available())


class InstructCLI(LightningCLI):
    """LightningCLI for instruction tuning: the datamodule's tokenizer follows ``model.model``, and
    the model is built for packed rows when ``data.packing`` is on.

    ``fit`` reads, renders and checks the data before the model loads (a bad file fails in seconds,
    not after minutes of loading), measures ``val/loss`` before training (``--validate_before_fit``,
    on by default) and after it, and prints both with where the adapter went.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("seed_everything_default", 42)
        kwargs.setdefault("save_config_callback", ConfigToLoggers)
        kwargs.setdefault("trainer_class", InstructTrainer)
        kwargs.setdefault("parser_class", OneLineErrorParser)
        super().__init__(InstructLoRAModule, InstructDataModule, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
        }

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.model", "data.tokenizer")
        parser.link_arguments("data.packing", "model.packing")
        parser.link_arguments(
            ("model.objective", "model.preference"), "data.batch_kind", compute_fn=batch_kind_of
        )
        parser.link_arguments("data", "model.added_tokens", compute_fn=_added_tokens, apply_on="instantiate")
        parser.add_argument(
            "--validate_before_fit", type=bool, default=True, help="Measure val/loss before training starts."
        )
        # the fit report's parameter line replaces Lightning's summary table (its size and FLOPs are
        # estimates that disagree with the base's real bytes)
        parser.set_defaults({"model.dtype": AUTO, "trainer.enable_model_summary": False})

    def parsed(self) -> Namespace:
        """The parsed config of the subcommand being run (changes to it reach what is instantiated)."""
        return self.config[self.subcommand] if self.subcommand else self.config

    def checked_config(self) -> None:
        """The parsed config completed (``auto`` resolved, the root folder followed), then checked
        before any weight is read (:func:`~lit_instruct.preflight.check_config`)."""
        self.resolve_auto()
        self.follow_root_dir()
        config = self.parsed()
        if config.get("ckpt_path") == "last":
            config["ckpt_path"] = resolve_last(config.as_dict())
        if self.subcommand != "validate":  # fit, or check (which parses fit's command line)
            resuming = config.get("ckpt_path") is not None
            self.save_config_kwargs["overwrite"] = check_log_dir(config.as_dict(), resuming)
            check_trains_something(config.as_dict().get("trainer") or {})
            check_adapter_dir(config.as_dict())
        self.model_plan = check_config(self.subcommand_config())

    def resolve_auto(self) -> None:
        """``trainer.precision: auto`` and ``model.dtype: auto`` replaced in the parsed config by what
        they resolve to on this machine (:mod:`lit_instruct.precision`), said once; the saved
        ``config.yaml`` then records the choice."""
        config = self.parsed()
        trainer, model = config["trainer"], config["model"]
        on_cpu = on_the_cpu(trainer.get("accelerator", AUTO))
        if trainer.get("precision") == AUTO:
            choice = auto_precision(trainer.get("accelerator", AUTO))
            trainer["precision"] = choice.precision
            rank_zero_info(f"lit-instruct: {choice.line()}")
        elif (asked := str(trainer.get("precision"))) in FP16_MIXED and on_cpu:  # Lightning swaps it silently
            trainer["precision"] = "bf16-mixed"
            rank_zero_info(
                f"lit-instruct: trainer.precision {asked} asks fp16 autocast, which is for GPUs: on the "
                "CPU bf16-mixed (base weights bfloat16 where model.dtype is auto)"
            )
        if model.get("dtype") == AUTO:
            model["dtype"] = base_dtype(AUTO, trainer.get("precision"))
        asked, cores = str(trainer.get("devices")), usable_cores()
        devices = int(asked) if asked.isdigit() else 0
        if on_cpu and 1 < devices >= cores:
            rank_zero_info(
                f"lit-instruct: trainer.devices {devices} on a CPU of {cores} cores: each process gets "
                f"{cores / devices:g} core{'s' * (cores != devices)}, slower than one process on all of them "
                "(several CPU processes are for trying a multi-device setup, not for speed)"
            )

    def follow_root_dir(self) -> None:
        """A ``trainer.default_root_dir`` set over the config file's holds everything the run writes:
        the loggers' ``save_dir`` and the callbacks' ``dirpath`` that the file put under its own root
        move under the new one (``runs/quickstart/x`` -> ``DIR/x``)."""
        config = self.parsed()
        root = config["trainer"].get("default_root_dir")
        file_root = None
        for path in config.get("config") or []:
            text = Path(getattr(path, "absolute", str(path))).read_text(encoding="utf-8")
            trainer = (yaml.safe_load(text) or {}).get("trainer") or {}
            file_root = trainer.get("default_root_dir", file_root)
        if root is None or file_root is None or Path(root) == Path(file_root):
            return
        entries = []
        for key in ("logger", "callbacks"):
            value = config["trainer"].get(key)
            entries += value if isinstance(value, list) else [value]
        for entry in entries:
            init = getattr(entry, "init_args", None)
            if init is None:
                continue
            for key in ("save_dir", "dirpath"):
                value = init.get(key)
                if isinstance(value, str) and Path(file_root) in (Path(value), *Path(value).parents):
                    init[key] = str(Path(root) / Path(value).relative_to(file_root))

    def _parse_ckpt_path(self) -> None:
        """Nothing of a checkpoint's hyper-parameters comes over the config (Lightning's would bring
        ``trust_remote_code``, ``model`` and ``adapter_dir`` back from a file): the resume takes the
        user's settings, and :func:`~lit_instruct.preflight.check_config` refuses a checkpoint whose
        structure differs from them (:mod:`lit_instruct.preflight.resume`)."""

    def subcommand_config(self) -> dict[str, Any]:
        """The parsed config of the subcommand being run, as plain data."""
        return self.parsed().as_dict()

    def instantiate_classes(self) -> None:
        """The config checked (:mod:`lit_instruct.preflight`: values, pairs of settings, the model's
        structure on its skeleton, no weights), the data (on the launching process: the other ranks
        read it from the cache or in their own setup), then the model, the datamodule (handed the
        checked samples) and the Trainer."""
        self.checked_config()
        checked = None
        if self.subcommand == "fit" and launched_rank() == 0:
            checked = self.data_module()
            if not checked.streaming:
                checked.prepared = checked.prepare_samples()
                nothing = checked.nothing_to_train()
                if nothing is not None:  # before the model loads
                    raise nothing
        super().instantiate_classes()
        if checked is not None and checked.hparams == self.datamodule.hparams:
            self.datamodule.tokenizer, self.datamodule.prepared = checked.tokenizer, checked.prepared

    def data_module(self) -> InstructDataModule:
        """The datamodule the parsed config describes, built alone (no model)."""
        data_class = self.datamodule_class  # InstructDataModule, or PreferenceDataModule
        assert isinstance(data_class, type) and issubclass(data_class, InstructDataModule)
        return data_class(**self._get(self.config, "data").as_dict())

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """The configured Trainer, saving checkpoints atomically and loading them ``weights_only``
        (:class:`SafeCheckpointIO`, unless another checkpoint IO is configured), stopping gracefully
        on Ctrl-C (:class:`GracefulInterrupt`), and printing plain progress lines every
        ``log_every_n_steps`` instead of a progress bar when stdout is no terminal
        (:class:`PlainProgress`); on a terminal, the module makes Lightning's bar readable."""
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = SafeCheckpointIO()
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning at init, undeclared
        if not any(isinstance(callback, GracefulInterrupt) for callback in callbacks):
            callbacks.insert(0, GracefulInterrupt())
        bar = trainer.progress_bar_callback
        if bar is not None and not sys.stdout.isatty():  # a log file: plain lines instead of a bar
            callbacks.remove(bar)
            every = getattr(trainer, "log_every_n_steps", 10)  # set by Lightning at init, undeclared
            callbacks.append(PlainProgress(every_n_steps=max(1, every)))
        return trainer

    def _val(self) -> dict[str, float]:
        return _val_metrics(self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False))

    def before_fit(self) -> None:
        self.before: dict[str, float] = {}
        if self.config["fit"].get("validate_before_fit") and self.trainer.limit_val_batches != 0:
            self.before = self._val()

    def after_fit(self) -> None:
        callbacks = self.trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning at init, undeclared
        interrupt = next(cb for cb in callbacks if isinstance(cb, GracefulInterrupt))
        if interrupt.interrupted:  # the checkpoint and the adapter are saved; say it was interrupted
            raise SystemExit(128 + (interrupt.signal_number or signal.SIGINT))
        report = next((cb for cb in callbacks if isinstance(cb, FitReport)), None)
        finished = 0 < self.trainer.max_steps <= self.trainer.global_step  # resumed at its end: done
        if report is not None and report.steps == 0 and finished:
            rank_zero_info(
                f"lit-instruct: the run had reached trainer.max_steps {self.trainer.max_steps} already"
            )
        elif report is not None and report.steps == 0 and not self.trainer.interrupted:
            rank_zero_info(  # a run that trained nothing is no success (a restart wrapper must not read one)
                f"lit-instruct: the fit took no optimizer step (global step {self.trainer.global_step}, "
                f"trainer.max_steps {self.trainer.max_steps}, trainer.max_epochs {self.trainer.max_epochs})"
            )
            raise SystemExit(2)
        if self.trainer.interrupted or not self.before:
            return
        if self.model.last_val_step != self.trainer.global_step:
            self._val()
        after = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val/")}
        objective = self.model.objective
        counted = objective.val_count_name or objective.count_name
        if "val/loss" in after and "val/ppl" not in after:  # another objective: its loss, a reward metric
            reward = next((k for k in REWARD_SHOWN if k in after), None)
            change = ""
            if reward is not None:
                before = self.before.get(reward, float("nan"))
                change = f", {reward} {before:.3f} -> {after[reward]:.3f}"
            held_out = f"{int(after.get(f'val/{counted}', 0))} held-out {counted.replace('_', ' ')}"
            rank_zero_info(
                f"lit-instruct: val/loss {self.before['val/loss']:.4f} -> {after['val/loss']:.4f}{change} "
                f"over {held_out}, after {self.trainer.global_step} steps"
            )
        elif "val/loss" in after:
            rank_zero_info(
                f"lit-instruct: val/loss {self.before['val/loss']:.4f} -> {after['val/loss']:.4f}, "
                f"val/ppl {self.before['val/ppl']:.2f} -> {after['val/ppl']:.2f} "
                f"over {int(after['val/tokens'])} held-out response tokens, "
                f"after {self.trainer.global_step} steps"
            )
        for name in sorted(k for k in after if k.startswith("val/loss/") and k in self.before):
            rank_zero_info(f"  {name} {self.before[name]:.4f} -> {after[name]:.4f}")


class DataOnlyCLI(InstructCLI):
    """The ``fit`` command line (configs, ``--data.*``, the tokenizer linked to ``model.model``)
    building only the datamodule: no model weights are read."""

    def instantiate_classes(self) -> None:
        self.datamodule = self.data_module()


class CheckCLI(InstructCLI):
    """The ``fit`` command line checked as ``fit`` checks it, the data read and rendered, and no
    weights read: what ``lit-instruct check`` prints its plan from."""

    def instantiate_classes(self) -> None:
        self.checked_config()
        self.datamodule = self.data_module()


def check_main(argv: list[str]) -> None:
    """``lit-instruct check --config X.yaml [--model.* --data.* --trainer.* ...]``: every check ``fit``
    makes before it loads weights (each value, each pair of settings, the model's structure and LoRA
    targets on its weightless skeleton, a continued adapter's fit, every data record), then the plan:
    the model, what LoRA adapts, the trainable parameters, samples, tokens, optimizer steps and an
    estimate of the peak memory. Exit 0 when all is well, 2 with one line on a mistake."""
    from lit_instruct.preflight import config_settings
    from lit_instruct.preflight.plan import plan_text

    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(
            f"usage: lit-instruct check --config X.yaml [fit's options]\n\n{check_main.__doc__}\n"
        )
        return
    with warnings.catch_warnings():  # Lightning warns when args are given while sys.argv has some
        warnings.filterwarnings("ignore", "LightningCLI's args parameter")
        cli = CheckCLI(args=argv, run=False)
    data = cli.datamodule
    data.setup("fit")  # reads, renders and checks every record; prints the counts
    store = None if data.streaming else data.train_samples
    samples, tokens = (None, None) if store is None else (len(store), int(store.offsets[-1]))
    sys.stdout.write(plan_text(cli.model_plan, config_settings(cli.subcommand_config()), samples, tokens))


def inspect_main(argv: list[str]) -> None:
    """``lit-instruct inspect --config X.yaml [--samples N] [--html report.html]``: read, render and
    check the data exactly as ``fit`` would (the same cache), without loading the model's weights;
    print per source the counts, token lengths and samples with the trained tokens marked. Exit 1
    when records were skipped as bad, 2 on a data error or when no training sample is left (as fit
    would refuse it)."""
    from lit_instruct.data.report import html_page, source_reports, terminal_text
    from lit_instruct.io import write_atomically

    parser = argparse.ArgumentParser(
        prog="lit-instruct inspect", description=inspect_main.__doc__, add_help=False
    )
    parser.add_argument("--samples", type=int, default=3, metavar="N", help="samples per source (default 3)")
    parser.add_argument("--html", metavar="report.html", help="also write the report as one HTML page here")
    if "-h" in argv or "--help" in argv:  # LightningCLI's help lists every setting of fit: 800 lines
        parser.add_argument("--config", metavar="X.yaml", help="fit's config; more than one: later ones win")
        parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
        fit_help = "see `lit-instruct fit --help`"  # one line, unlike an epilog argparse would wrap
        sys.stdout.write(
            f"{parser.format_help()}\nall of fit's --data.* / --model.* settings are accepted; {fit_help}\n"
        )
        return
    args, rest = parser.parse_known_args(argv)
    with warnings.catch_warnings():  # Lightning warns when args are given while sys.argv has some
        warnings.filterwarnings("ignore", "LightningCLI's args parameter")
        data = DataOnlyCLI(args=rest, run=False).datamodule
    prepared = data.prepared = data.prepare_samples()
    tokenizer = data.load_tokenizer()
    train, val, shown = prepared.train, prepared.val, args.samples
    if data.batch_kind == "pairs":  # each pair as two samples: its chosen, then its rejected
        train, val, shown = data.pairs("train").samples(), data.pairs("val").samples(), 2 * shown
    elif data.batch_kind in ("unpaired", "prompts"):  # answers marked desirable or not; prompts
        train, val = data.pairs("train").samples(), data.pairs("val").samples()
    reports = [
        *source_reports("train", train, prepared.counts["train"], shown),
        *source_reports("val", val, prepared.counts["val"], shown),
    ]
    sys.stdout.write(terminal_text(reports, tokenizer, colour=sys.stdout.isatty()))
    if args.html:
        write_atomically(
            args.html, html_page(reports, tokenizer, f"lit-instruct inspect: {data.tokenizer_name}")
        )
        sys.stdout.write(f"lit-instruct: report written to {args.html}\n")
    nothing = None if data.streaming else data.nothing_to_train()
    if nothing is not None:  # fit would refuse it: the same line, after the counts that tell why
        raise nothing
    if prepared.rejects:
        sys.stderr.write(
            f"lit-instruct: {len(prepared.rejects)} records skipped as bad (see the counts above)\n"
        )
        raise SystemExit(1)


def prepare_main(argv: list[str]) -> None:
    """``lit-instruct prepare``: convert the bundled model(s) into the cache folder."""
    from lit_instruct.model_names import BUNDLED_MODELS, SMOLLM2_NAME

    parser = argparse.ArgumentParser(prog="lit-instruct prepare", description=prepare_main.__doc__)
    parser.add_argument("--model", choices=sorted(BUNDLED_MODELS), default=SMOLLM2_NAME)
    parser.add_argument("--force", action="store_true", help="convert again even if already prepared")
    args = parser.parse_args(argv)
    path = BUNDLED_MODELS[args.model](force=args.force)
    sys.stdout.write(f"{args.model}: {path}\n")


def check_paths(args: argparse.Namespace) -> None:
    """``--adapter``, ``--model`` / ``--base`` and ``--chat-template`` (a file's text, Jinja or a
    built-in name) of ``export``, ``generate``, ``eval`` and ``chat``, checked before anything loads
    (a mistake is one line, exit 2)."""
    from lit_instruct.preflight.adapter_fit import check_adapter_folder
    from lit_instruct.preflight.model_source import model_source
    from lit_instruct.templates import template_text

    if getattr(args, "adapter", None):
        check_adapter_folder(args.adapter, "--adapter")
    if getattr(args, "chat_template", None):
        args.chat_template = template_text(args.chat_template, "--chat-template")
    for flag in ("model", "base"):
        value = getattr(args, flag, None)
        if isinstance(value, str):
            model_source(value, f"--{flag}")


TEMPLATE_HELP = (
    "chat template: Jinja text, a .jinja file, or 'alpaca' (default: the one saved with the adapter "
    "at training, else the tokenizer's)"
)


def export_main(argv: list[str]) -> None:
    """``lit-instruct export``: a clean PEFT adapter folder, a standalone model (``--merge``), one
    GGUF file for llama.cpp / Ollama / LM Studio (``--gguf``, with ``--ollama`` a Modelfile beside it),
    or the adapter alone as a GGUF LoRA file for its base's GGUF (``--gguf-adapter``)."""
    parser = argparse.ArgumentParser(prog="lit-instruct export", description=export_main.__doc__)
    parser.add_argument("--adapter", required=True, help="adapter folder written by training")
    parser.add_argument("--out", required=True, help="output folder, or .gguf file (replaced atomically)")
    parser.add_argument("--merge", action="store_true", help="merge into a full-precision copy of the base")
    parser.add_argument("--gguf", action="store_true", help="merge and write one GGUF file")
    parser.add_argument(
        "--gguf-adapter",
        action="store_true",
        help="write the adapter alone as a GGUF LoRA file (llama.cpp --lora)",
    )
    parser.add_argument(
        "--quant",
        choices=["f32", "f16", "bf16", "q8_0", "q4_0"],
        help="default: f16 (--gguf), f32 (--gguf-adapter)",
    )
    parser.add_argument("--ollama", action="store_true", help="also write an Ollama Modelfile beside it")
    parser.add_argument("--tokenizer-pre", help="llama.cpp's pre-tokenizer name, for an unknown vocabulary")
    parser.add_argument("--base", help="base model (default: the adapter's base_model_name_or_path)")
    parser.add_argument("--chat-template", help=TEMPLATE_HELP)
    args = parser.parse_args(argv)
    check_paths(args)
    if (args.gguf or args.gguf_adapter) and not args.out.endswith(".gguf"):
        args.out += ".gguf"  # a GGUF file is known by its suffix (llama.cpp, Ollama, LM Studio)
    if args.ollama and not args.gguf:
        parser.error("--ollama needs --gguf")
    if not (args.gguf or args.gguf_adapter):
        check_replaceable(args.out, "--out")  # before the base loads
    with sharing_cores("export", say=say):
        export_files(args)


def say(line: str) -> None:
    """A line for the user, on stderr (stdout holds what a command produces)."""
    sys.stderr.write(line + "\n")


def export_files(args: argparse.Namespace) -> None:
    """What ``export`` writes, its arguments checked."""
    from lit_instruct.export.adapter import export_adapter, merge_adapter

    if args.gguf_adapter:
        from lit_instruct.export.gguf_lora import write_lora_gguf

        quant = args.quant or "f32"
        out = write_lora_gguf(args.adapter, args.out, quant, args.base)
        sys.stdout.write(f"GGUF LoRA ({quant}) written to {out}: llama-cli -m BASE.gguf --lora {out}\n")
        return
    if args.gguf:
        from lit_instruct.export.gguf import export_gguf

        quant = args.quant or "f16"
        out = export_gguf(
            args.adapter, args.out, quant, args.base, args.tokenizer_pre, args.ollama, args.chat_template
        )
        sys.stdout.write(f"GGUF ({quant}) written to {out}\n")
        if args.ollama:
            modelfile = out.with_name(f"{out.stem}.Modelfile")
            sys.stdout.write(f"Modelfile written to {modelfile}: ollama create NAME -f {modelfile}\n")
        return
    out = (
        merge_adapter(args.adapter, args.out, args.base)
        if args.merge
        else export_adapter(args.adapter, args.out)
    )
    sys.stdout.write(f"{'merged model' if args.merge else 'adapter'} written to {out}\n")


def image_processor(args: argparse.Namespace, required: bool) -> Any:
    """The processor of the model ``generate``/``chat`` will load (``None``: it takes no images), read
    before any weight.

    Raises:
        ConfigError: on ``--image``, when ``required`` and the model takes no images.
    """
    from lit_instruct.adapter_folder import adapter_base
    from lit_instruct.infer.generate import processor_for
    from lit_instruct.vocabulary import adapter_tokenizer

    base = args.model or (adapter_base(args.adapter) if args.adapter else "smollm2-135m-instruct")
    try:
        processor = processor_for(args.model, args.adapter, adapter_tokenizer(args.adapter, base))
    except ValueError as error:  # a processor transformers cannot build here (a package missing)
        if required:
            raise ConfigError("--image", str(error)) from None
        say(f"images cannot be shown to this model: {error}")
        return None
    if processor is None and required:
        raise ConfigError("--image", f"{base} takes no images (its folder has no image processor)")
    return processor


def generate_main(argv: list[str]) -> None:
    """``lit-instruct generate``: answer a prompt with the training chat template, streaming tokens."""
    from transformers import TextStreamer

    from lit_instruct.infer.generate import generate, load_for_generation, open_images

    parser = argparse.ArgumentParser(prog="lit-instruct generate", description=generate_main.__doc__)
    parser.add_argument(
        "--model", help="bundled name, folder or hub id (default: the adapter's base, else SmolLM2)"
    )
    parser.add_argument("--adapter", help="PEFT adapter folder to apply")
    parser.add_argument("--prompt", required=True, help="the user message")
    parser.add_argument("--system", help="a system message to put first")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 for greedy decoding")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--chat-template", help=TEMPLATE_HELP)
    parser.add_argument(
        "--image", action="append", default=[], help="an image shown before the prompt (repeatable)"
    )
    args = parser.parse_args(argv)
    check_paths(args)
    images = open_images(args.image)
    processor = image_processor(args, required=True) if images else None
    model, tokenizer = load_for_generation(args.model, args.adapter)
    if processor is not None:
        processor.tokenizer = tokenizer
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with sharing_cores("generation", say=say):
        generate(
            model,
            tokenizer,
            messages,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            streamer=streamer,
            chat_template=adapter_chat_template(args.adapter, args.chat_template),
            images=images,
            processor=processor,
        )


def eval_main(argv: list[str]) -> None:
    """``lit-instruct eval``: token-weighted loss and perplexity of an adapter on held-out files; on
    preference pairs, its preference metrics against a reference (the base, or ``--reference``)."""
    from lit_instruct.data.kind import holds_pairs
    from lit_instruct.infer.evaluate import evaluate, load_adapter_module, results_table, write_answers

    parser = argparse.ArgumentParser(prog="lit-instruct eval", description=eval_main.__doc__)
    parser.add_argument("--adapter", required=True, help="adapter folder written by training")
    parser.add_argument(
        "--data", required=True, nargs="+", help="held-out files (any format training reads), or pairs files"
    )
    parser.add_argument("--model", help="base model (default: the adapter's base_model_name_or_path)")
    parser.add_argument("--base", action="store_true", help="also measure the base model, side by side")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--chat-template", help=TEMPLATE_HELP)
    parser.add_argument(
        "--answers",
        help="write each record's prompt, reference and answer to this JSONL (progress on stderr)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--reference",
        help="pairs: the reference, an adapter of the same base and LoRA structure (default: the base)",
    )
    parser.add_argument(
        "--loss",
        choices=get_args(PreferenceKind),
        help="pairs: the loss (default: the adapter's recorded, else dpo)",
    )
    parser.add_argument(
        "--beta", type=float, help="pairs: the loss's beta (default: the adapter's recorded, else 0.1)"
    )
    args = parser.parse_args(argv)
    check_paths(args)
    args.chat_template = adapter_chat_template(args.adapter, args.chat_template)
    if holds_pairs(args.data, "--data"):  # told from the files, before any weight is read
        eval_pairs(args)
        return
    for flag in ("reference", "loss", "beta"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag}", f"applies to preference pairs; {args.data[0]} holds conversations")
    module = load_adapter_module(args.adapter, args.model)  # once, for the numbers and the answers
    with sharing_cores("eval", say=say):
        results = evaluate(
            module, args.data, args.base, args.max_seq_len, args.batch_size, args.chat_template
        )
        sys.stdout.write(results_table(results))
        sys.stdout.flush()  # the table shows before the answers' progress (stderr) begins
        if args.answers:
            out = write_answers(
                module, args.data, args.answers, args.max_new_tokens, args.chat_template, progress=sys.stderr
            )
            sys.stdout.write(f"answers written to {out}\n")


def eval_pairs(args: argparse.Namespace) -> None:
    """``eval`` on pairs files: the options checked and the reference's folder read before any
    weight, then the table of the adapter's preference metrics."""
    from lit_instruct.infer import evaluate_pairs as pairs
    from lit_instruct.preflight.adapter_fit import check_adapter_folder

    pairs.refuse_for_pairs(args.base, args.answers)
    config, origin = pairs.pair_settings(args.adapter, args.loss, args.beta)
    if args.reference is not None:
        check_adapter_folder(args.reference, "--reference")
        pairs.check_reference(args.adapter, args.reference, config)
    say(pairs.settings_line(config, origin, args.reference))
    module = pairs.load_pair_module(args.adapter, config, args.model, args.reference)
    with sharing_cores("eval", say=say):
        results = pairs.evaluate_pairs(
            module, args.data, args.max_seq_len, args.batch_size, args.chat_template
        )
        sys.stdout.write(pairs.pairs_table(results))


def chat_main(argv: list[str]) -> None:
    """``lit-instruct chat``: a multi-turn chat in the terminal, answers streamed."""
    from transformers import TextStreamer

    from lit_instruct.infer.chat import KEYS, ChatSession, run_chat, terminal_reader
    from lit_instruct.infer.generate import load_for_generation, open_images

    parser = argparse.ArgumentParser(prog="lit-instruct chat", description=chat_main.__doc__, epilog=KEYS)
    parser.add_argument(
        "--model", help="bundled name, folder or hub id (default: the adapter's base, else SmolLM2)"
    )
    parser.add_argument("--adapter", help="PEFT adapter folder to apply")
    parser.add_argument("--system", help="a system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--context-length", type=int, help="default: the model's max_position_embeddings")
    parser.add_argument("--chat-template", help=TEMPLATE_HELP)
    parser.add_argument(
        "--image", action="append", default=[], help="an image shown with the first message (repeatable)"
    )
    args = parser.parse_args(argv)
    check_paths(args)
    args.chat_template = adapter_chat_template(args.adapter, args.chat_template)
    images = open_images(args.image)
    processor = image_processor(args, required=bool(images))  # before the weights: /image needs it
    model, tokenizer = load_for_generation(args.model, args.adapter)
    if processor is not None:
        processor.tokenizer = tokenizer
    text_config = model.config.get_text_config()  # a vision-language model's decoder
    context = args.context_length or getattr(text_config, "max_position_embeddings", 2048)
    session = ChatSession(
        model, tokenizer, context, args.max_new_tokens, args.chat_template, args.system, processor, images
    )
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with sharing_cores("chat", say=say):
        run_chat(session, terminal_reader(), sys.stdout, streamer)


COMMANDS = {
    "check": check_main,
    "inspect": inspect_main,
    "prepare": prepare_main,
    "export": export_main,
    "generate": generate_main,
    "eval": eval_main,
    "chat": chat_main,
}


OVERVIEW = """lit-instruct: instruction fine-tuning of causal LMs with LoRA and QLoRA, on Lightning

  fit        train an adapter              lit-instruct fit --config configs/quickstart.yaml
  validate   val/loss of a model on data   lit-instruct validate --config configs/lora.yaml
  check      every check fit makes before it loads weights (settings, pairs, model, data)
  inspect    the data as fit renders it, trained tokens marked (--html for a page)
  prepare    convert the bundled model into the cache folder
  export     a clean PEFT folder, a merged model (--merge), GGUF for llama.cpp/Ollama (--gguf)
  generate   answer one prompt with an adapter
  chat       a multi-turn chat in the terminal
  eval       an adapter's loss and perplexity on held-out files, or its preference metrics on pairs

`lit-instruct COMMAND --help` shows a command's settings; docs: README.md and docs/ in the repository.
"""
"""What ``lit-instruct`` alone (or ``--help``) prints."""
LIGHTNING_COMMANDS = ("fit", "validate")


def _added_tokens(data: InstructDataModule) -> list[str]:
    """The tokens the data adds to the vocabulary, which the model must add too."""
    return data.new_token_list()


def in_chain(error: BaseException, wanted: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception of ``error``'s chain (it, its causes and contexts) that is ``wanted``."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if wanted(current):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def one_line_failure(error: BaseException) -> tuple[str, int] | None:
    """The one line and exit status for a failure the user can act on without a traceback, wherever
    it was raised: a full disk or quota (naming the file; 1), a chat template doing what Jinja's
    sandbox forbids (2, as a mistaken setting)."""
    from jinja2.exceptions import SecurityError

    full = in_chain(error, lambda e: isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
    if isinstance(full, OSError):
        where = f" writing {full.filename}" if full.filename else ""
        line = (
            f"disk full: {full.strerror}{where}; free space there (or write elsewhere: "
            "trainer.default_root_dir, model.adapter_dir, --out), then resume with --ckpt_path last"
        )
        return line, 1
    unsafe = in_chain(error, lambda e: isinstance(e, SecurityError))
    if unsafe is not None:
        line = (
            f"template error: the chat template does what Jinja's sandbox forbids ({unsafe}); a chat "
            "template renders the messages it is given, nothing else (--chat-template, data.chat_template)"
        )
        return line, 2
    return None


def quiet_progress_bars() -> None:
    """No progress bars of ``transformers`` (loading weights) and ``datasets`` (reading tables)."""
    import datasets
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()


DEBUG_ENV = "LIT_INSTRUCT_DEBUG"
"""Set (to anything but ``0`` or empty), a user's mistake shows its traceback too, as ``--debug`` does."""


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lit-instruct`` command. A user's mistake (a setting, a data record) ends
    with exit status 2 and one line naming it; ``--debug`` (or ``LIT_INSTRUCT_DEBUG=1``) shows the
    traceback as well. However it ends, the W&B run it started is finished with its exit status."""
    try:
        _main(argv)
    except SystemExit as stop:
        finish_wandb_runs(stop.code if isinstance(stop.code, int) else 1)
        raise
    except BaseException:
        finish_wandb_runs(1)
        raise
    finish_wandb_runs()


def _main(argv: list[str] | None) -> None:
    command = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in command or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    command = [arg for arg in command if arg != "--debug"]
    if not command or command[0] in ("-h", "--help"):
        sys.stdout.write(OVERVIEW)
        return
    if command[0] in LIGHTNING_COMMANDS and HELP_ALL in command:
        command = ["--help" if arg == HELP_ALL else arg for arg in command]
    elif command[0] in LIGHTNING_COMMANDS and {"-h", "--help"} & set(command):
        sys.stdout.write(short_help(command[0], tuple(OBJECTIVES)))
        return
    if not sys.stderr.isatty():  # a log file: a bar's carriage returns become one long line
        quiet_progress_bars()
    if not command[0].startswith("-") and command[0] not in (*COMMANDS, *LIGHTNING_COMMANDS):
        known = ", ".join((*LIGHTNING_COMMANDS, *COMMANDS))
        sys.stderr.write(f"lit-instruct: {command[0]!r} is no command; the commands are {known}\n")
        raise SystemExit(2)
    try:
        if command[0] in COMMANDS:
            COMMANDS[command[0]](command[1:])
        else:
            with warnings.catch_warnings():  # args are given (``--debug`` left out) while sys.argv has some
                warnings.filterwarnings("ignore", "LightningCLI's args parameter")
                InstructCLI(args=command)
    except SIGTERMException:  # Lightning's SIGTERM handler, outside training (validation): exits 0
        raise SystemExit(128 + signal.SIGTERM) from None
    except SystemExit as stop:  # a second signal stopped the run at once; Lightning exits 1
        forced = forced_exit_status()
        if forced is not None and stop.code == 1:
            raise SystemExit(forced) from None
        raise
    except (ConfigError, DataError, UnsupportedModelError) as error:  # the message says it all
        if debug:
            raise
        kinds = {ConfigError: "config", DataError: "data", UnsupportedModelError: "model"}
        kind = next(name for cls, name in kinds.items() if isinstance(error, cls))
        sys.stderr.write(f"lit-instruct: {kind} error: {error}\n")
        raise SystemExit(2) from None
    except Exception as error:
        failure = one_line_failure(error)
        if failure is None or debug:
            raise
        sys.stderr.write(f"lit-instruct: {failure[0]}\n")
        raise SystemExit(failure[1]) from None
