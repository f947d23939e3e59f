"""YAML configs validated by pydantic, overridable by dotted `key=value` arguments.

Three departures from plain PyYAML, both so that what the docs write works as written:
- YAML 1.2 booleans: only true/false are booleans, so `roc: off` is the string "off" (YAML 1.1 read it
  as False); boolean fields still accept on/off/yes/no, which pydantic converts.
- `1e-6` is a float (YAML 1.1 wanted `1.0e-6`).
- A section may name another YAML file (`agent: agent.yaml`, relative to the config): one definition of
  the agent protocol shared by the demo's sft, train and eval configs. On the command line
  (`cluster=src/tirl/configs/rstar2/cluster_64gpu.yaml`) the path is relative to the working directory.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config that cannot be used; the message says what is wrong and where."""


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans (true/false only) and floats (`1e-6` without a dot)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = parse_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}{_yaml_where(e)}: not valid YAML: {_yaml_problem(e)}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _yaml_where(e: yaml.YAMLError) -> str:
    """`:LINE:COLUMN` (1-based, as editors count) of a YAML error, when PyYAML knows it."""
    mark = getattr(e, "problem_mark", None)
    return f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line, without PyYAML's "<unicode string>" marks (the caller names the file)."""
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    text = "; ".join(p for p in parts if p)
    return text or str(e).splitlines()[0]


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; values are parsed as YAML scalars/lists (`lr=1e-6`, `xs=[1,2]`).
    A number indexes a list: `stages.0.steps=3` sets the first stage's steps."""
    for item in overrides:
        key, value = parse_override(item)
        *parents, leaf = key.split(".")
        node: Any = data
        for depth, part in enumerate(parents):
            node = _child(node, part, item, ".".join(parents[: depth + 1]))
        _set(node, leaf, value, item, key)
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """(key path, value) of one `a.b.c=value` override, or a ConfigError; needs no schema, so a command
    checks its overrides before it imports what validating them needs (torch, for a training config)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like key.path=value")
    if not raw.strip():
        raise ConfigError(f"override {item!r} has no value: write {key.strip()}=VALUE")
    try:
        return key.strip(), parse_yaml(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: cannot parse value: {_yaml_problem(e)}") from e


def _index(node: list, part: str, item: str, path: str) -> int:
    """The list position `part` names (0-based; -1 is the last), or a ConfigError saying which exist."""
    try:
        index = int(part)
    except ValueError:
        raise ConfigError(
            f"override {item!r}: {path.rpartition('.')[0] or path} is a list: index it by number "
            f"(0..{len(node) - 1}), not {part!r}"
        ) from None
    if not -len(node) <= index < len(node):
        raise ConfigError(
            f"override {item!r}: {path} does not exist ({path.rpartition('.')[0]} has {len(node)} "
            f"entr{'y' if len(node) == 1 else 'ies'}, from 0); to change their number set the whole list"
        )
    return index


def _child(node: Any, part: str, item: str, path: str) -> Any:
    """The section or list entry `part` of `node`, creating missing sections (not list entries)."""
    node = node[_index(node, part, item, path)] if isinstance(node, list) else node.setdefault(part, {})
    if not isinstance(node, dict | list):
        raise ConfigError(f"override {item!r}: {path} is a value ({node!r}), not a section or a list")
    return node


def _set(node: dict | list, leaf: str, value: Any, item: str, path: str) -> None:
    if isinstance(node, list):
        node[_index(node, leaf, item, path)] = value
    else:
        node[leaf] = value


def _section_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The BaseModel type of field `key` (also inside `X | None`), or None."""
    field = model.model_fields.get(key)
    if field is None:
        return None
    for candidate in (field.annotation, *typing.get_args(field.annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def include_sections(
    model: type[BaseModel], data: dict[str, Any], base: Path, config: Path | None = None
) -> dict[str, Any]:
    """Replace `section: other.yaml` by that file's mapping (relative to `base`, the directory of
    `config` when the config file names it)."""
    for key, value in data.items():
        if isinstance(value, str) and value.endswith((".yaml", ".yml")) and _section_model(model, key):
            path = base / value
            if config is not None and not path.is_file():  # e.g. a demo config copied elsewhere alone
                raise ConfigError(_missing_section_file(key, value, path, config))
            data[key] = read_yaml(path)
    return data


def _missing_section_file(key: str, value: str, path: Path, config: Path) -> str:
    """One line: where a config's section file was looked for, and the shipped file of that name."""
    shipped = sorted((Path(__file__).parent / "configs").rglob(Path(value).name))
    hint = f", or write its path: {key}: {shipped[0]}" if shipped else ""
    return (
        f"{config}: {key}: {value} names {path}, which does not exist (a section file is relative to "
        f"the config that names it: copy it beside {config.name}{hint})"
    )


def load_config(model: type[M], path: str | Path | None = None, overrides: list[str] | None = None) -> M:
    data = read_yaml(path) if path is not None else {}
    if path is not None:
        data = include_sections(model, data, Path(path).parent, Path(path))
    overrides = list(overrides or [])
    data = apply_overrides(data, overrides)
    data = include_sections(model, data, Path.cwd())  # `cluster=path/to/cluster.yaml` on the command line
    typed = {item.partition("=")[0].strip(): item for item in overrides}
    return validate(model, data, f" in {path}" if path else "", typed)


def validate(model: type[M], data: dict[str, Any], where: str = "", typed: dict[str, str] | None = None) -> M:
    """model.model_validate with the errors as one ConfigError naming each bad key. `typed` maps the
    key paths given on the command line to their `key=value`: an error in one of them is the command
    line's, not the file's, and says so."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        keys = [".".join(str(p) for p in err["loc"]) for err in errors]
        lines = [f"  {key}: {_message(err, model)}" for key, err in zip(keys, errors, strict=True)]
        items = [item for key in keys if (item := _typed_override(key, typed or {})) is not None]
        header = _invalid_header(where, list(dict.fromkeys(items)), from_file=len(items) < len(keys))
        raise ConfigError(header + "\n".join(lines)) from e


def _typed_override(key: str, typed: dict[str, str]) -> str | None:
    """The command-line `key=value` that set `key` (itself or a section above it), or None."""
    owners = [k for k in typed if key == k or key.startswith(f"{k}.")]
    return typed[max(owners, key=len)] if owners else None


def _invalid_header(where: str, items: list[str], from_file: bool) -> str:
    """Who is wrong: the file (`where`), the command-line overrides `items`, or both. A valid file is not
    named when only overrides are wrong: it would send the user to the wrong place."""
    typed = f"command-line override{'s' if len(items) > 1 else ''} {', '.join(items)}" if items else ""
    if not from_file:
        return f"invalid {typed}:\n"
    return f"invalid config{where}{f' and its {typed}' if typed else ''}:\n"


def _message(err: dict, model: type[BaseModel]) -> str:
    if err["type"] == "missing":
        return "required: set it in the config or as key=value"
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
    return f"{err['msg']}{shown}{_did_you_mean(model, err) if err['type'] == 'extra_forbidden' else ''}"


def _did_you_mean(model: type[BaseModel], err: dict) -> str:
    """`; did you mean 'lr'?` for an unknown key close to a valid key of its section (difflib)."""
    *parents, leaf = err["loc"]
    section: type[BaseModel] | None = model
    for part in parents:  # a list index (stages.0) stays in the list's entry model
        section = section if isinstance(part, int) else _entry_model(section, str(part))
        if section is None:
            return ""
    names = [f.alias or name for name, f in section.model_fields.items()]
    close = difflib.get_close_matches(str(leaf), names, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _entry_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The BaseModel of field `key`, also as `X | None` or as the entries of `list[X]`."""
    field = model.model_fields.get(key)
    if field is None:
        return None
    for candidate in (field.annotation, *typing.get_args(field.annotation)):
        for inner in (candidate, *typing.get_args(candidate)):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def ensure_writable_dir(path: str | Path, what: str, private: bool = False) -> Path:
    """Create directory `path` (and its parents) and check that it can be written, before a long job.
    `private`: the directory is its owner's only (0700), as a run directory is."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if private:
            path.chmod(0o700)
        probe = path / ".tirl-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{what} {path}: cannot write there ({e.strerror}); choose another directory"
        ) from e
    return path


# ---- secrets: never written to disk ----
#
# A field typed `Secret` (an API key, a bearer token) takes the value itself, `env:NAME` (read from
# that environment variable) or `file:PATH` (the file's first line, e.g. a 0600 file of its own), and
# is written in every saved config and report (`redacted_dump`) as the reference it was given as, or
# as null when it was given in clear. A `secret_or_env(VAR)` field left null (as a reloaded saved config
# then holds it) is read from $VAR when the config is loaded, so every consumer of the field gets the
# same value, whoever loaded the config.

SECRET_MARK = {"secret": True}
SANDBOX_TOKEN_ENV = "TIRL_SANDBOX_TOKEN"  # sandbox.token; also how tirl hands a service its token
ENGINE_API_KEY_ENV = "TIRL_ENGINE_API_KEY"  # engine.remote.api_key


def _resolve_secret(value: object, env: str | None = None) -> object:
    """A Secret field's value: as given, from `env:NAME` or `file:PATH`, or (null) from $`env`."""
    if value is None and env:
        return os.environ.get(env) or None
    if not isinstance(value, str):
        return value
    if value.startswith("env:"):
        name = value[4:]
        if name not in os.environ:
            raise ValueError(f"{value}: the environment variable {name} is not set")
        return os.environ[name]
    if value.startswith("file:"):
        path = Path(value[5:]).expanduser()
        try:
            return path.read_text().strip()
        except OSError as e:
            raise ValueError(f"{value}: cannot read {path} ({e.strerror})") from None
    return value


class SecretRef(str):
    """A secret's value read through `env:NAME` or `file:PATH`, keeping that reference: a saved config
    writes the reference (it discloses nothing), so a reloaded config reads the secret again."""

    reference: str = ""


def _secret_validator(env: str | None) -> WrapValidator:
    def validate(value: object, handler: ValidatorFunctionWrapHandler) -> object:
        if isinstance(value, SecretRef):  # a validated config's value, validated again
            return value
        resolved = handler(_resolve_secret(value, env))
        if isinstance(resolved, str) and isinstance(value, str) and value.startswith(("env:", "file:")):
            kept = SecretRef(resolved)
            kept.reference = value
            return kept
        return resolved

    return WrapValidator(validate)


Secret = Annotated[str | None, _secret_validator(None), Field(json_schema_extra=SECRET_MARK)]


def secret_or_env(env: str) -> Any:
    """The type of a Secret field that, left null, is read from the environment variable `env`."""
    return Annotated[
        str | None,
        _secret_validator(env),
        Field(validate_default=True, json_schema_extra={**SECRET_MARK, "env": env}),
    ]


def is_secret(field: FieldInfo) -> bool:
    return isinstance(field.json_schema_extra, dict) and bool(field.json_schema_extra.get("secret"))


def redacted_dump(cfg: BaseModel) -> dict[str, Any]:
    """cfg.model_dump(mode="json", by_alias=True) with every Secret field (at any depth) set to its
    reference (`env:NAME`, `file:PATH`), or null when it was given in clear."""
    data = cfg.model_dump(mode="json", by_alias=True)
    _redact(cfg, data)
    return data


def _redact(model: BaseModel, data: dict[str, Any]) -> None:
    for name, field in type(model).model_fields.items():
        key = field.alias or name
        if key not in data:
            continue
        value = getattr(model, name)
        if is_secret(field):
            data[key] = value.reference if isinstance(value, SecretRef) else None
        elif isinstance(value, BaseModel) and isinstance(data[key], dict):
            _redact(value, data[key])
        elif isinstance(value, list | tuple) and isinstance(data[key], list):
            for item, dumped in zip(value, data[key], strict=False):
                if isinstance(item, BaseModel) and isinstance(dumped, dict):
                    _redact(item, dumped)


def write_private(path: str | Path, text: str) -> None:
    """Write `text` to a file only its owner can read (0600, also when it existed before)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    """The config as YAML, secrets redacted, readable by its owner only."""
    write_private(path, yaml.safe_dump(redacted_dump(cfg), sort_keys=False))
