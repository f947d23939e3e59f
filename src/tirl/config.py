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

import re
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

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
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; values are parsed as YAML scalars/lists (`lr=1e-6`, `xs=[1,2]`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key.path=value")
        if not raw.strip():
            raise ConfigError(f"override {item!r} has no value: write {key.strip()}=VALUE")
        node = data
        *parents, leaf = key.strip().split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        try:
            node[leaf] = parse_yaml(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: cannot parse value: {e}") from e
    return data


def _section_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The BaseModel type of field `key` (also inside `X | None`), or None."""
    field = model.model_fields.get(key)
    if field is None:
        return None
    for candidate in (field.annotation, *typing.get_args(field.annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def include_sections(model: type[BaseModel], data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Replace `section: other.yaml` by that file's mapping (relative to `base`)."""
    for key, value in data.items():
        if isinstance(value, str) and value.endswith((".yaml", ".yml")) and _section_model(model, key):
            data[key] = read_yaml(base / value)
    return data


def load_config(model: type[M], path: str | Path | None = None, overrides: list[str] | None = None) -> M:
    data = read_yaml(path) if path is not None else {}
    if path is not None:
        data = include_sections(model, data, Path(path).parent)
    data = apply_overrides(data, list(overrides or []))
    data = include_sections(model, data, Path.cwd())  # `cluster=path/to/cluster.yaml` on the command line
    return validate(model, data, f" in {path}" if path else "")


def validate(model: type[M], data: dict[str, Any], where: str = "") -> M:
    """model.model_validate with the errors as one ConfigError naming each bad key."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(p) for p in err['loc'])}: {_message(err)}" for err in e.errors()]
        raise ConfigError(f"invalid config{where}:\n" + "\n".join(lines)) from e


def _message(err: dict) -> str:
    if err["type"] == "missing":
        return "required: set it in the config or as key=value"
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
    return f"{err['msg']}{shown}"


def ensure_writable_dir(path: str | Path, what: str) -> Path:
    """Create directory `path` (and its parents) and check that it can be written, before a long job."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".tirl-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{what} {path}: cannot write there ({e.strerror}); choose another directory"
        ) from e
    return path


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False))
