"""Start-up checks: the mistakes a user can make when starting pdserve, found before anything starts.

Each check raises ValueError with one line that says what is wrong and what to do; `pdserve` prints it and
exits non-zero (cli.py), before any process is started or any "serving" line printed. `pdserve up` runs them
all for the stack it is about to start; each verb runs those that concern it. Torch is imported only to ask
about CUDA, and only when a device names it.
"""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path

from pdserve.checkpoint import BUILTIN_MODELS, SUPPORTED_MODEL_TYPES, resolve_model

# a checkpoint's tokenizer: one of these beside its config (tokenizer_config.json alone cannot tokenize)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")

READY_TIMEOUT_S = 300.0  # how long a launcher waits for what it started (nodes, router, Ray actors) to be ready


def check_port_free(host: str, port: int) -> None:
    """The HTTP port must be free now: another server on it would answer our readiness poll and our users."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"port {port} on {host} is already in use (another server?): stop it, or give --port another port"
                ) from None
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (check --host and --port)") from None


def check_device(device: str, engine: str = "model") -> None:
    """A cuda device must exist: this torch built with CUDA, and a GPU of that index. A mock engine uses no device
    (and imports no torch)."""
    if not device.startswith("cuda") or engine == "mock":
        return
    import torch

    if not torch.cuda.is_available():
        why = "was built without CUDA" if torch.version.cuda is None else "finds no GPU"
        raise ValueError(f"--device {device}: this machine's torch {torch.__version__} {why}; use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s), cuda:0 and up")


def check_checkpoint(model: str, tokenizer: bool = True) -> None:
    """--model names a built-in, or a folder with a config of a supported architecture (and, where text is
    tokenized, the tokenizer's files)."""
    if model in BUILTIN_MODELS:
        return
    folder = resolve_model(model)  # ValueError: neither a built-in nor a folder with a config.json
    config = _read_config(folder)
    kind = config.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        archs = ", ".join(config.get("architectures") or []) or "no architectures listed"
        raise ValueError(
            f"--model {model}: model type {kind!r} ({archs}) is not supported; pdserve serves "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if tokenizer and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(
            f"--model {model} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy the "
            "tokenizer's files into that folder, or give --skip-tokenizer to serve token-id prompts "
            "only"
        )


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {folder / 'config.json'}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{folder / 'config.json'} is not a JSON object")
    return config
