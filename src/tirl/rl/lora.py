"""LoRA adapters on the policy (peft): which modules, injection, freezing, the merged weights the
engines get, the adapter checkpoint and its merge into a plain Hugging Face model.

peft injects its LoRA layers into the Hugging Face model in place (`inject_adapter_in_model`), so the
policy stays the same model class with the same forward, head and decoder layers (FSDP2 shards it the
same way); an adapted linear layer `x.q_proj` becomes `x.q_proj.base_layer` (frozen) plus
`x.q_proj.lora_A.default` / `lora_B.default` (trained). The engines never see LoRA: after each step
they get W + (alpha / r) B A of the adapted layers under the base model's names (`x.q_proj.weight`),
computed fresh from the frozen base, so a sync never accumulates and a missed one shows as a gap.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from tirl.config import ConfigError
from tirl.distributed.weight_sync import Lazy
from tirl.rl.config import LoraConfig
from tirl.rl.model_files import check_links

INSTALL = "pip install 'tirl[lora]'"
ALL_LINEAR = "all-linear"
ADAPTER_DIR = "adapter"  # in a checkpoint: the peft adapter (adapter_config.json names the base)
MERGED_DIR = "merged"  # in a checkpoint: the adapter merged into a plain HF model, made on first use
# In an adapter directory: the local base model's path relative to it (peft's adapter_config.json names
# the absolute path). Its `adapter_` prefix keeps it out of the merged model's directory.
BASE_RELATIVE = "adapter_base_relative.txt"
HEAD = "lm_head"  # the chunked log-prob head (tirl.rl.policy.TokenHead) must stay a plain Linear


def require_peft():
    """The peft module, or one clear line saying how to get it."""
    try:
        import peft
    except ImportError:
        raise ConfigError(f"optim.lora.enabled=true needs peft: {INSTALL}") from None
    return peft


def linear_names(model: torch.nn.Module) -> list[str]:
    """The leaf names (q_proj, down_proj, ...) of the model's linear layers, in order, once each."""
    found: dict[str, None] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name:
            found[name.rpartition(".")[2]] = None
    return list(found)


def resolve_targets(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """optim.lora.target_modules as leaf names of the model's linear layers ("all-linear": all of them
    but the output head); a name the model does not have is one ConfigError line listing those it has."""
    names = linear_names(model)
    adaptable = [n for n in names if n != HEAD]
    kind = type(model).__name__
    targets: list[str] = []
    for t in lora.target_modules:
        if t == ALL_LINEAR:
            targets += adaptable
        elif t == HEAD:
            raise ConfigError(
                f"optim.lora.target_modules: {HEAD} cannot be adapted (the trainer computes log-probs through "
                f"its own chunked head); choose among {', '.join(adaptable)} or {ALL_LINEAR}"
            )
        elif t not in names:
            raise ConfigError(
                f"optim.lora.target_modules: {t!r} is not a linear module of {kind}; its linear modules are "
                f"{', '.join(adaptable)} (or {ALL_LINEAR})"
            )
        else:
            targets.append(t)
    return list(dict.fromkeys(targets))


def meta_model(model_path: str) -> torch.nn.Module:
    """The model's architecture on the meta device: its real module names, no weights read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path)
    except OSError as e:
        raise FileNotFoundError(f"cannot load the policy model from {model_path!r}: {e}") from e
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_lora(model_path: str, lora: LoraConfig) -> list[str]:
    """Before anything starts: peft is installed and every target module exists (on the meta device);
    the resolved leaf names. Nothing to check when LoRA is off."""
    if not lora.enabled:
        return []
    require_peft()
    return resolve_targets(meta_model(model_path), lora)


def peft_config(lora: LoraConfig, targets: list[str]):
    peft = require_peft()
    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
    )


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """Inject the adapters in place (on any device, meta included) and freeze everything else."""
    peft = require_peft()
    with torch.random.fork_rng(devices=[]):  # the same initial adapter in every run (B = 0, A random)
        torch.manual_seed(lora.init_seed)
        peft.inject_adapter_in_model(peft_config(lora, resolve_targets(model, lora)), model)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name))
    if lora.dropout > 0:  # the policy runs in eval mode (no dropout in RL): SFT's adapter dropout on
        for module in model.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                module.lora_dropout.train()
    return model


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def has_lora(model: torch.nn.Module) -> bool:
    return any(is_adapter_param(n) for n, _ in model.named_parameters())


def lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, layer) of every adapted linear layer, in module order (the same on every FSDP rank)."""
    peft = require_peft()
    return [(n, m) for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.Linear)]


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather over the FSDP ranks when it is a DTensor shard)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def merged_weight(layer: torch.nn.Module, adapter: str = "default") -> torch.Tensor:
    """W + scaling * B A of one adapted linear layer, in fp32, from the frozen base (a collective under
    FSDP: every rank calls it)."""
    base = _full(layer.base_layer.weight).float()
    a = _full(layer.lora_A[adapter].weight).float()
    b = _full(layer.lora_B[adapter].weight).float()
    return base + layer.scaling[adapter] * (b @ a)


# Linear layers vLLM fuses into one (qkv_proj, gate_up_proj): its in-place reload rebuilds a fused layer
# from what arrives, so a sync that touches one member must carry all of them (an absent member would
# be left uninitialized), even those without an adapter (their frozen base weight).
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def merged_tensors(model: torch.nn.Module) -> list[tuple[str, Lazy]]:
    """What the engines need after a step, under the base model's names, each made on demand (one
    layer at a time in memory; a collective under FSDP, called in this order on every rank): every
    adapted layer's merged weight (`model.layers.0.self_attn.q_proj.weight`) and bias, and the frozen
    weight and bias of each layer fused with one of them in vLLM."""
    adapted = dict(lora_layers(model))
    wanted: dict[str, None] = {}
    for name in adapted:
        parent, _, leaf = name.rpartition(".")
        fused = next((group for group in FUSED if leaf in group), (leaf,))
        for member in fused:
            wanted[f"{parent}.{member}" if parent else member] = None
    modules = dict(model.named_modules())
    out: list[tuple[str, Lazy]] = []
    for name in (n for n in modules if n in wanted):  # module order: the same on every rank
        module = modules[name]
        base = module.base_layer if name in adapted else module
        shape = tuple(base.weight.shape)  # a DTensor's shape is the whole tensor's
        if name in adapted:
            out.append((f"{name}.weight", Lazy(shape, torch.float32, lambda m=module: merged_weight(m))))
        else:
            out.append((f"{name}.weight", Lazy(shape, torch.float32, lambda m=base: _frozen(m.weight))))
        if getattr(base, "bias", None) is not None:
            bias = Lazy(tuple(base.bias.shape), torch.float32, lambda m=base: _frozen(m.bias))
            out.append((f"{name}.bias", bias))
    return out


@torch.no_grad()
def _frozen(t: torch.Tensor) -> torch.Tensor:
    return _full(t).detach().float()


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights under peft's saved names (`base_model.model.<module>.lora_A.weight`), whole
    (a collective under FSDP); on every rank."""
    out = {}
    for name, p in model.named_parameters():
        if is_adapter_param(name):
            key = "base_model.model." + name.replace(".default.", ".")
            out[key] = _full(p).detach().to("cpu", torch.float32).contiguous()
    return out


def save_adapter(model: torch.nn.Module, out_dir: Path, base: str, is_main: bool) -> None:
    """The adapter as peft saves one (adapter_config.json naming the base model, adapter_model.safetensors):
    `peft.PeftModel.from_pretrained(base_model, out_dir)` loads it. A collective under FSDP."""
    from safetensors.torch import save_file

    state = adapter_state(model)
    if not is_main:
        return
    config = model.peft_config["default"]
    config.base_model_name_or_path = str(base)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    if Path(base).is_dir():  # a local base: also where it lies from here, so that moving runs keeps it
        relative = os.path.relpath(Path(base).resolve(), out_dir.resolve())
        (out_dir / BASE_RELATIVE).write_text(relative + "\n")


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def adapter_base(adapter_dir: str | Path) -> str:
    """The base model an adapter was trained on: where it lies relative to the adapter (tirl's
    BASE_RELATIVE file: a run and its base moved together), else adapter_config.json's
    base_model_name_or_path (an absolute path, or a Hugging Face id). A local base found at neither is
    one line saying so."""
    adapter_dir = Path(adapter_dir)
    named = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    relative_file = adapter_dir / BASE_RELATIVE
    relative = adapter_dir / relative_file.read_text().strip() if relative_file.is_file() else None
    if relative is not None and relative.is_dir():
        return str(relative.resolve())
    if not named:
        raise FileNotFoundError(f"{adapter_dir}: adapter_config.json names no base model")
    if relative is not None and not Path(named).is_dir():
        raise FileNotFoundError(
            f"{adapter_dir}: its base model moved: it is neither at {os.path.normpath(relative)} (where it "
            f"lay relative to the adapter) nor at {named}; move it back, or write its new path as "
            f"base_model_name_or_path in {adapter_dir / 'adapter_config.json'}"
        )
    return str(named)


def merge_adapter(adapter_dir: str | Path, out_dir: str | Path, replace: bool = False) -> Path:
    """The adapter merged into its base: a plain Hugging Face model directory (fp32 safetensors, the
    tokenizer and tirl's agent settings copied along), built beside out_dir and renamed into place
    (build_dir: safe when several processes merge the same adapter at once). An existing merge is
    reused, unless `replace`."""
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    if not replace and is_model_dir(out_dir):
        return out_dir
    return build_dir(out_dir, lambda tmp: _write_merged(adapter_dir, tmp), replace)


def build_dir(out_dir: Path, build: Callable[[Path], None], replace: bool = False) -> Path:
    """out_dir as `build` fills it, appearing whole or not at all. Several processes may ask for the
    same directory at once (trainer ranks, eval and chat on one checkpoint): each builds into its own
    hidden temp directory and renames it into place; the first rename wins, a later caller discards its
    copy and returns the winner's. A finished directory is never removed, since another process may be
    reading it, except with `replace` (an explicit export), and then only a model directory or an empty
    one: it is moved aside first (a rename: open files stay readable), then deleted."""
    out_dir = Path(out_dir)
    if replace and out_dir.exists() and not is_model_dir(out_dir) and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not a model directory: it is left alone")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_dir(out_dir)
    held = os.open(out_dir.parent, os.O_RDONLY | os.O_DIRECTORY)  # open: its inode number stays unique
    parent = _identity(os.fstat(held))
    try:
        try:
            build(tmp)
        except OSError as e:
            _check_parent_kept(out_dir, parent, e)
            raise
        _check_parent_kept(out_dir, parent)
        if replace and out_dir.exists():
            old = _fresh_dir(out_dir)
            with contextlib.suppress(FileNotFoundError):  # another replacing caller moved it first
                os.replace(out_dir, old / out_dir.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, out_dir)  # fails when out_dir exists (and is not empty): another caller won
        except OSError:
            if not is_model_dir(out_dir):
                raise FileExistsError(f"{out_dir} exists and is not a model directory") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # already gone when the rename succeeded
        if _identity(out_dir.parent) != parent:  # made again by the build's own makedirs: not a checkpoint
            with contextlib.suppress(OSError):
                out_dir.parent.rmdir()
        os.close(held)
    return out_dir


def _identity(path: Path | os.stat_result) -> tuple[int, int] | None:
    try:
        st = path if isinstance(path, os.stat_result) else path.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _check_parent_kept(out_dir: Path, parent: tuple[int, int] | None, cause: OSError | None = None) -> None:
    """The directory out_dir goes into must be the one the build started in: a checkpoint pruned (or
    saved again) meanwhile is gone, and a merge renamed into a parent made again would leave a step
    directory holding only merged/ (a checkpoint to readers, never pruned)."""
    if _identity(out_dir.parent) != parent:
        raise FileNotFoundError(
            f"{out_dir.parent} was removed while {out_dir.name} was built in it (a checkpoint pruned or "
            "saved again meanwhile): open the run's newest checkpoint instead"
        ) from cause


def _fresh_dir(beside: Path) -> Path:
    """A new hidden directory beside `beside`, unique to this call (not tempfile.mkdtemp: its mode 0700
    would stay with the model renamed into place)."""
    path = beside.with_name(f".{beside.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    path.mkdir()
    return path


def _write_merged(adapter_dir: Path, out: Path) -> None:
    check_links(adapter_dir, "adapter")  # its files are copied beside the merge: none may lead outside it
    peft = require_peft()
    from transformers import AutoModelForCausalLM

    base_path = adapter_base(adapter_dir)
    try:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    except OSError as e:
        raise FileNotFoundError(f"{adapter_dir}: cannot load its base model {base_path!r}: {e}") from e
    merged = peft.PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    for f in adapter_dir.iterdir():  # tokenizer files, tirl_agent.yaml
        if f.is_file() and not f.name.startswith("adapter_") and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)


def is_model_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def merged_adapter_dir(adapter_dir: str | Path) -> Path:
    """A bare peft adapter directory's plain HF model: <adapter>-merged beside it, merged again when the
    adapter's weights are newer than it (the adapter was trained on)."""
    adapter_dir = Path(adapter_dir)
    out = adapter_dir.with_name(adapter_dir.name + "-merged")
    weights = [adapter_dir / f for f in ("adapter_model.safetensors", "adapter_model.bin")]
    newest = max((f.stat().st_mtime for f in weights if f.is_file()), default=0.0)
    if not is_model_dir(out):
        return merge_adapter(adapter_dir, out)
    if (out / "config.json").stat().st_mtime < newest:
        return merge_adapter(adapter_dir, out, replace=True)
    return out


def merged_model_dir(ckpt: str | Path) -> Path:
    """A LoRA checkpoint's plain HF model: <ckpt>/merged, merged from <ckpt>/adapter on first use (by
    whichever process gets there first: merge_adapter)."""
    out = Path(ckpt) / MERGED_DIR
    return out if is_model_dir(out) else merge_adapter(Path(ckpt) / ADAPTER_DIR, out)
