"""Secrets in configs (API keys, bearer tokens) are never written to disk: a run directory is its
owner's only (0700), its saved config too (0600) and holds no secret; a secret may be given as
`env:NAME` or `file:PATH` instead of in clear; every config field named like a secret is one."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
from pydantic import BaseModel

from tirl.config import (
    ENGINE_API_KEY_ENV,
    SANDBOX_TOKEN_ENV,
    ConfigError,
    is_secret,
    load_config,
    redacted_dump,
)
from tirl.eval.commands import sandbox_config
from tirl.eval.config import EvalConfig
from tirl.rl.checkpoint import prepare_run_dir
from tirl.rl.config import SFTConfig, TrainConfig
from tirl.sandbox import SandboxConfig, open_executor

KEY, TOKEN = "sk-live-0123456789abcdef", "tok-fedcba9876543210"


def _config(tmp_path, token: str = TOKEN, key: str = KEY) -> TrainConfig:
    return TrainConfig(
        model="m",
        output_dir=str(tmp_path / "runs"),
        run_name="r",
        stages=[{"steps": 1, "data": "x"}],
        sandbox={"mode": "remote", "endpoints": ["http://10.0.0.2:8000"], "token": token},
        engine={"backend": "remote", "remote": {"urls": ["http://10.0.0.3:8000"], "api_key": key}},
    )


def test_a_saved_run_config_holds_no_secret_and_is_the_owners_only(tmp_path):
    cfg = _config(tmp_path)
    prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True, say=lambda _: None)
    saved = cfg.run_dir / "config.yaml"
    text = saved.read_text()
    assert KEY not in text and TOKEN not in text
    assert "http://10.0.0.3:8000" in text  # the rest is saved as it was
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert stat.S_IMODE(cfg.run_dir.stat().st_mode) == 0o700
    reloaded = load_config(TrainConfig, saved)
    assert reloaded.sandbox.token is None and reloaded.engine.remote.api_key is None


def test_a_run_directory_made_readable_by_others_is_made_private_again(tmp_path):
    cfg = _config(tmp_path)
    cfg.run_dir.mkdir(parents=True, mode=0o755)
    (cfg.run_dir / "config.yaml").write_text("old")
    (cfg.run_dir / "config.yaml").chmod(0o644)
    prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True, say=lambda _: None)
    assert stat.S_IMODE(cfg.run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((cfg.run_dir / "config.yaml").stat().st_mode) == 0o600


def test_secrets_come_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_ENGINE_KEY", KEY)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    cfg = _config(tmp_path, token=f"file:{token_file}", key="env:MY_ENGINE_KEY")
    assert (cfg.sandbox.token, cfg.engine.remote.api_key) == (TOKEN, KEY)
    dumped = str(redacted_dump(cfg))
    assert KEY not in dumped and TOKEN not in dumped
    monkeypatch.delenv("MY_ENGINE_KEY")
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: m\nstages: [{steps: 1, data: x}]\nengine: {remote: {api_key: 'env:MY_ENGINE_KEY'}}\n"
    )
    with pytest.raises(ConfigError, match=r"engine\.remote\.api_key: .*MY_ENGINE_KEY is not set"):
        load_config(TrainConfig, path)
    path.write_text(
        f"model: m\nstages: [{{steps: 1, data: x}}]\nsandbox: {{token: 'file:{tmp_path}/none'}}\n"
    )
    with pytest.raises(ConfigError, match=r"sandbox.token: .*cannot read"):
        load_config(TrainConfig, path)


SECRET_NAME = re.compile(r"(^|_)(token|api_key|key|secret|password)$")


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        for sub in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                yield from _fields(sub, f"{prefix}{name}.")


@pytest.mark.parametrize("model", [TrainConfig, SFTConfig, EvalConfig])
def test_every_field_named_like_a_secret_is_a_secret(model):
    named = {path for path, _ in _fields(model) if SECRET_NAME.search(path.rsplit(".", 1)[-1])}
    marked = {path for path, field in _fields(model) if is_secret(field)}
    assert named <= marked, f"not typed tirl.config.Secret: {sorted(named - marked)}"


@pytest.mark.parametrize("model", [TrainConfig, SFTConfig, EvalConfig])
def test_every_secret_left_null_has_one_environment_variable(model):
    secrets = {path: field.json_schema_extra for path, field in _fields(model) if is_secret(field)}
    assert all(isinstance(extra, dict) and extra.get("env") for extra in secrets.values()), secrets


# ---- a reloaded config gets its secrets back, the same way for every consumer ----


def _saved(tmp_path, monkeypatch, **config) -> Path:
    """A run directory's saved config (its secrets written as null), the environment without them."""
    monkeypatch.delenv(SANDBOX_TOKEN_ENV, raising=False)
    monkeypatch.delenv(ENGINE_API_KEY_ENV, raising=False)
    cfg = _config(tmp_path, **config)
    prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True, say=lambda _: None)
    return cfg.run_dir / "config.yaml"


def test_a_reloaded_config_reads_null_secrets_from_the_environment(tmp_path, monkeypatch):
    saved = _saved(tmp_path, monkeypatch)
    bare = load_config(TrainConfig, saved)
    assert (bare.sandbox.token, bare.engine.remote.api_key) == (None, None)
    monkeypatch.setenv(SANDBOX_TOKEN_ENV, TOKEN)
    monkeypatch.setenv(ENGINE_API_KEY_ENV, KEY)
    resumed = load_config(TrainConfig, saved)
    assert (resumed.sandbox.token, resumed.engine.remote.api_key) == (TOKEN, KEY)
    # eval's remote sandbox (tirl eval --sandbox URL) resolves it the same way
    assert sandbox_config(["http://10.0.0.2:8000"]).token == TOKEN
    # a value in the config (or an override) wins; a reference still resolves
    monkeypatch.setenv("OTHER_KEY", "other")
    given = load_config(TrainConfig, saved, ["sandbox.token=mine", "engine.remote.api_key=env:OTHER_KEY"])
    assert (given.sandbox.token, given.engine.remote.api_key) == ("mine", "other")


def test_a_secret_given_by_reference_is_saved_as_the_reference(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("MY_ENGINE_KEY", KEY)
    saved = _saved(tmp_path, monkeypatch, token=f"file:{token_file}", key="env:MY_ENGINE_KEY")
    text = saved.read_text()
    assert KEY not in text and TOKEN not in text
    assert f"file:{token_file}" in text and "env:MY_ENGINE_KEY" in text
    resumed = load_config(TrainConfig, saved)
    assert (resumed.sandbox.token, resumed.engine.remote.api_key) == (TOKEN, KEY)
    assert redacted_dump(resumed) == redacted_dump(load_config(TrainConfig, saved))  # and again
    monkeypatch.delenv("MY_ENGINE_KEY")
    with pytest.raises(ConfigError, match=r"engine\.remote\.api_key: .*MY_ENGINE_KEY is not set"):
        load_config(TrainConfig, saved)


async def test_a_resumed_training_config_reaches_a_token_protected_sandbox(tmp_path, monkeypatch):
    """A real `tirl sandbox serve` that requires a bearer token, reached through the config a resumed
    run reloads: without the token it answers 401 (an infrastructure failure); with it, code runs."""
    async with open_executor(SandboxConfig(mode="local", slots=1, retries=0)) as service:
        saved = _saved(tmp_path, monkeypatch)
        yaml_text = saved.read_text().replace("http://10.0.0.2:8000", service.endpoints[0])
        saved.write_text(yaml_text)
        cfg = load_config(TrainConfig, saved, ["sandbox.retries=0"])
        async with open_executor(cfg.sandbox) as executor:
            refused = await executor.run("print(6 * 7)")
        assert refused.is_infra_error and refused.stdout == ""
        monkeypatch.setenv(SANDBOX_TOKEN_ENV, service.token)
        cfg = load_config(TrainConfig, saved, ["sandbox.retries=0"])
        async with open_executor(cfg.sandbox) as executor:
            assert (await executor.run("print(6 * 7)")).stdout == "42\n"
