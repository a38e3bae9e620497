"""Loading a checkpoint for capture and finding its routers (torch and transformers needed)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moesim.errors import ConfigError
from moesim.model.spec import ModelSpec
from moesim.trace.capture.arch import ArchInfo, arch_for, config_to_spec
from moesim.trace.capture.errors import (CaptureError, ModelNotFoundError, TorchMissingError,
                                         UnsupportedRouterError)

LOCAL_FIX = ("point at a local checkpoint: --model /path/to/checkpoint "
             "(a directory with config.json and *.safetensors)")


def require_torch() -> None:
    """Raise :class:`TorchMissingError` unless torch and transformers import."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise TorchMissingError() from None


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def check_local_checkpoint(path: Path) -> None:
    """A local ``--model`` must be a directory with config.json and safetensors weights."""
    if not path.is_dir():
        raise ModelNotFoundError("is a file, not a checkpoint directory", source=str(path), field="--model",
                                 fix=LOCAL_FIX)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError("checkpoint directory has no config.json", source=str(path), field="--model",
                                 fix=LOCAL_FIX)
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError("checkpoint directory has no *.safetensors weights", source=str(path),
                                 field="--model", fix=LOCAL_FIX)


def resolve_model(model: str) -> tuple[str, bool]:
    """(name or path to load, local_files_only); raise before any download is tried."""
    if not model.strip():  # Path("") is the working folder: the error would name '.' and its missing config.json
        raise ModelNotFoundError("the model is empty (an unset shell variable gives an empty one)", field="--model",
                                 fix=LOCAL_FIX)
    path = Path(model).expanduser()
    if path.exists():
        check_local_checkpoint(path)
        return str(path), True
    looks_like_path = model.startswith(("/", "./", "../", "~")) or model.count("/") > 1
    if looks_like_path:
        raise ModelNotFoundError("model path does not exist", source=model, field="--model", fix=LOCAL_FIX)
    return model, hub_offline()


def _load_error(model: str, local_only: bool, err: Exception | None = None) -> ModelNotFoundError:
    if local_only:
        why = "is not a local directory and HF_HUB_OFFLINE is set, so no download was attempted"
    elif "couldn't connect" in str(err):
        why = "is not a local directory or in the Hugging Face cache, and the hub could not be reached"
    else:
        why = "could not be loaded (not a local directory, and the hub did not provide it)"
    return ModelNotFoundError(f"model '{model}' {why}", source=model, field="--model", fix=LOCAL_FIX)


def load_config(model: str) -> tuple[Any, str, bool]:
    from transformers import AutoConfig
    name, local_only = resolve_model(model)
    try:
        from huggingface_hub.errors import StrictDataclassError  # config field of the wrong type (transformers 5)
    except ImportError:  # an older huggingface_hub
        StrictDataclassError = ValueError  # noqa: N806
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=local_only)
    except StrictDataclassError as err:
        import re
        named = re.search(r"field '([^']+)'", str(err))
        field = named.group(1) if named else None
        cause = str(err.__cause__ or err).strip().splitlines()[-1].strip()
        cause = re.sub(r"^\w+Error: ", "", cause)
        where = str(Path(name) / "config.json") if Path(name).is_dir() else model
        raise ModelNotFoundError(f"config.json has a value transformers refuses ({cause})", source=where,
                                 field=field, fix="use the checkpoint's own config.json") from None
    except (OSError, ValueError) as err:
        if Path(name).is_dir():  # present but unreadable: say what is wrong with it, or what transformers said
            raise _config_error(Path(name) / "config.json", err) from None
        raise _load_error(model, local_only, err) from None
    return config, name, local_only


def _config_error(path: Path, err: Exception) -> ModelNotFoundError:
    """The one line for a local config.json that transformers would not read: not JSON, no model_type, or a
    model_type this transformers does not know; the fix for each (a checkpoint folder is what was given)."""
    import json

    import transformers

    from moesim.trace.capture.arch import ARCHITECTURES
    supported = ", ".join(sorted(ARCHITECTURES))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as bad:
        return ModelNotFoundError(f"config.json is not valid JSON ({str(bad).splitlines()[0]})", source=str(path),
                                  fix="download config.json again with the checkpoint's *.safetensors")
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not model_type:
        return ModelNotFoundError("config.json has no model_type", source=str(path), field="model_type",
                                  fix=f"use the checkpoint's own config.json (capture supports model_type {supported})")
    if "does not recognize this architecture" in str(err) or "Unrecognized model" in str(err):
        return ModelNotFoundError(f"model_type '{model_type}' is not one transformers {transformers.__version__} "
                                  "knows", source=str(path), field="model_type",
                                  fix=f"capture supports {supported}")
    return ModelNotFoundError(f"cannot read config.json ({str(err).strip().splitlines()[0]})", source=str(path),
                              fix="download config.json again with the checkpoint's *.safetensors")


def pick_device(device: str) -> str:
    """The torch device ``--device`` names (auto: cuda when present), refused in one line when it is no
    device this machine has."""
    import re

    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    named = re.fullmatch(r"cuda(?::(\d+))?", device)
    if named is None:
        raise ConfigError(f"unknown device '{device}'", field="--device", fix="use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError("no CUDA device is visible to torch", field="--device",
                          fix="run on a machine with an NVIDIA GPU and a CUDA build of torch, or use --device cpu")
    if named.group(1) is not None and int(named.group(1)) >= torch.cuda.device_count():
        raise ConfigError(f"no CUDA device {named.group(1)}: torch sees {torch.cuda.device_count()}",
                          field="--device", fix=f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def load_model(name: str, local_only: bool, dtype: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, local_files_only=local_only)
    except Exception as err:  # noqa: BLE001 - what loading the weights can raise is sorted just below
        raise _weights_error(name, local_only, err) from None
    return model.to(pick_device(device)).eval()


def _weights_error(name: str, local_only: bool, err: Exception) -> Exception:
    """The one-line error for weights that would not load: unreadable or corrupt files (a download cut
    short), or tensors whose shapes are not the ones config.json gives; anything else as it was."""
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if isinstance(err, ImportError):  # a quantised checkpoint (FP8 DeepSeek-V3, MXFP4 gpt-oss) needs accelerate
        import re
        command = re.search(r"pip install [\w.\-\[\]=<>]+", str(err))
        return CaptureError(f"loading these weights needs a package that is not installed ({first_line})",
                            source=name, field="--model",
                            fix=f"{command.group(0) if command else 'install it'}, or capture the checkpoint's "
                                "unquantised (bf16) release")
    if "ignore_mismatched_sizes" in str(err) or "size mismatch" in str(err):
        return ModelNotFoundError("the weights do not fit config.json (a tensor's shape differs from what the "
                                  "config gives)", source=name, field="--model",
                                  fix="use the config.json that came with these *.safetensors")
    if type(err).__name__ == "SafetensorError" or (isinstance(err, OSError) and Path(name).is_dir()):
        return ModelNotFoundError(f"cannot read the weights ({first_line})", source=name, field="--model",
                                  fix="download the checkpoint's *.safetensors again (a file may be cut short)")
    if isinstance(err, OSError):
        return _load_error(name, local_only, err)
    return err


def load_tokenizer(name: str, local_only: bool) -> Any | None:
    """The checkpoint's tokenizer, or None when it has none; a local checkpoint's tokenizer files that do not
    load (cut short, or needing a package that is not installed) are one line saying so."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=local_only)
    except Exception as err:  # noqa: BLE001 - sorted below: no tokenizer, or one that would not load
        files = [f for f in TOKENIZER_FILES if (Path(name) / f).is_file()] if Path(name).is_dir() else []
        if not files and isinstance(err, (OSError, ValueError, TypeError)):
            return None
        if not files:
            raise
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CaptureError(f"the checkpoint's tokenizer ({', '.join(files)}) did not load ({first_line})",
                           source=name, field="--model",
                           fix="download the tokenizer files again (or install what the message names), or give "
                               "pre-tokenised prompts as {\"token_ids\": [...]}") from None


#: files a checkpoint's tokenizer is read from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "tiktoken.model")


@dataclass
class MoEModel:
    """A loaded model with the facts capture needs: its spec, architecture and router modules in layer order."""

    model: Any
    spec: ModelSpec
    arch: ArchInfo
    routers: list[Any]
    decoder_layers: list[int]

    @property
    def device(self) -> Any:
        return self.routers[0].weight.device


def decoder_layers_of(model: Any) -> Any:
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UnsupportedRouterError(f"{type(model).__name__} has no decoder layer list", field="model.layers",
                                     fix="capture a decoder-only Hugging Face MoE model")
    return layers


def inspect_model(model: Any, name: str | None = None) -> MoEModel:
    """Find each MoE layer's router and check it returns (logits, weights, indices)."""
    import torch
    config = model.config
    origin = name or getattr(config, "name_or_path", "") or type(model).__name__
    arch = arch_for(config, origin)
    total = sum(p.numel() for p in model.parameters())
    spec = config_to_spec(config, name=name, total_params=total)
    layers = decoder_layers_of(model)
    moe_layers = arch.moe_layers(config)
    with_experts = [i for i, layer in enumerate(layers) if hasattr(getattr(layer, "mlp", None), "experts")]
    if with_experts != moe_layers:
        raise UnsupportedRouterError(f"config says MoE layers {moe_layers}, the model has experts in {with_experts}",
                                     source=origin, fix="check the checkpoint's config.json against its weights")
    routers = [getattr(layers[i].mlp, arch.router_attr, None) for i in moe_layers]
    for i, router in zip(moe_layers, routers):
        weight = getattr(router, "weight", None)
        if weight is None or tuple(weight.shape) != (spec.num_experts, spec.hidden_size):
            raise UnsupportedRouterError(f"layer {i}: {type(router).__name__} has no ({spec.num_experts}, "
                                         f"{spec.hidden_size}) router weight", source=origin,
                                         field=f"mlp.{arch.router_attr}", fix="use transformers>=5 for this model")
    probe = torch.zeros(2, spec.hidden_size, dtype=routers[0].weight.dtype, device=routers[0].weight.device)
    with torch.no_grad():
        out = routers[0].forward(probe)
    shapes_ok = (isinstance(out, tuple) and len(out) == 3
                 and tuple(out[0].shape) == (2, spec.num_experts)
                 and tuple(out[1].shape) == (2, spec.top_k) and tuple(out[2].shape) == (2, spec.top_k))
    if not shapes_ok:
        raise UnsupportedRouterError(f"{type(routers[0]).__name__} does not return (logits, weights, indices)",
                                     source=origin, field=f"mlp.{arch.router_attr}",
                                     fix="capture reads the router modules of transformers>=5; upgrade transformers")
    return MoEModel(model=model, spec=spec, arch=arch, routers=routers, decoder_layers=moe_layers)
