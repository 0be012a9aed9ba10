"""Where a config's values come from, and the one place they are applied.

Precedence, lowest first: dataclass defaults < `--deepspeed-config` (engine keys, `rlhf.ds_config`)
< `--trl-config` (a TRL trainer config, `rlhf.trl_config`) < `--config` file < explicit CLI flags.
Every command, and rlhf e2e for each stage, gathers its `ConfigSources` and calls `resolve_config`.

This module sits above `rlhf.config`, `rlhf.ds_config` and `rlhf.trl_config` (the two readers
build on the configs, so the configs cannot name them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from rlhf.config import apply_mapping, field_named, fields_by_name, set_field
from rlhf.errors import UserError

if TYPE_CHECKING:
    from rlhf.ds_config import DeepSpeedImport
    from rlhf.trl_config import TrlImport

ConfigT = TypeVar("ConfigT")


@dataclass
class ConfigSources:
    """Where a config's values come from besides its defaults, lowest precedence first."""

    deepspeed: DeepSpeedImport | None = None
    """A parsed `--deepspeed-config` (`rlhf.ds_config.import_ds_config`)."""
    trl: TrlImport | None = None
    """A read `--trl-config` (`rlhf.trl_config.import_trl_config`): TRL's keys, mapped when applied."""
    file: Mapping[str, Any] = field(default_factory=dict)
    """A parsed `--config` file (flat or under engine:/data:/tracking:); for e2e, one stage's section."""
    file_name: str = "--config"
    """How errors name the file (e2e adds the section: `e2e.yaml [ppo]`)."""
    flags: Mapping[str, Any] = field(default_factory=dict)
    """Values given on the command line, by field name (`kl_coef` or `kl-coef`), as text or parsed by click."""
    flag_prefix: str = "--"
    """How errors name a flag: `--lr`, or `--ppo.lr` for e2e's prefixed stage flags."""


def resolve_config(config: ConfigT, sources: ConfigSources, where: str = "config") -> ConfigT:
    """Apply `sources` onto `config` (which holds the defaults): ds_config < TRL config < file <
    flags, each value checked as it is set; then the rules between fields, once. Every command, and
    e2e for each stage, resolves its config here and nowhere else."""
    if sources.deepspeed is not None:
        sources.deepspeed.apply_to(config)
    if sources.trl is not None:
        sources.trl.apply_to(config)
    if sources.file:
        apply_mapping(config, sources.file, sources.file_name)
    by_name = fields_by_name(type(config))
    for key, value in sources.flags.items():
        flag = sources.flag_prefix + key.replace("_", "-")
        info = field_named(by_name, key)
        if info is None:
            command = sources.flag_prefix.strip("-.")
            raise UserError(f"{flag}: `rlhf {command}` has no such option; see `rlhf {command} --help`")
        set_field(config, info, value, flag)
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate(where)
    return config
