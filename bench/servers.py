"""The OpenAI-compatible servers Cadence is tested against and measured beside, each started on a free
loopback port and stopped again: ``cadence serve``, llama.cpp's (llama-cpp-python's ``llama_cpp.server``
over the registry's SmolLM2 Q4_1 GGUF) and vLLM's CPU build (its own virtual environment, .venv-vllm,
made by packaging/vllm-venv.sh; it serves the safetensors folders Cadence converts the GGUF and the
CTranslate2 Whisper into).

    with llama_cpp_server(gguf, threads=2) as server:
        OpenAI(base_url=server.api, api_key="none")...

Used by tests/test_interop.py and bench/serve.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
LOG_TAIL = 3000  # characters of a server's log shown when it fails to start

# Runs a command after asking Linux to SIGTERM it when the process that started it dies, even by SIGKILL (kept
# across exec): a test run or benchmark killed from outside skips its teardown, and its servers went on holding
# gigabytes. ``[sys.executable, "-c", STOPS_WITH_PARENT, *command]``.
STOPS_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                     "if sys.platform.startswith('linux'):\n"
                     "    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
                     "os.execv(sys.argv[1], sys.argv[1:])")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on loopback; ``with`` waits until ``health`` answers 200 and stops it after."""

    def __init__(self, name: str, command: list[str], port: int, health: str = "/health", env: dict | None = None,
                 startup_s: float = 600, api_key: str | None = None):
        self.name, self.command, self.port, self.health = name, command, port, health
        self.env, self.startup_s, self.api_key = env, startup_s, api_key
        self.url = f"http://127.0.0.1:{port}"
        self.api = self.url + "/v1"
        self.process: subprocess.Popen | None = None
        self.log = Path(tempfile.mkstemp(prefix=f"{name.replace(' ', '-')}-", suffix=".log")[1])

    def __enter__(self) -> "Server":
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen([sys.executable, "-c", STOPS_WITH_PARENT, *self.command], stdout=out,
                                            stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(self.env or {})})
        deadline = time.monotonic() + self.startup_s
        while self.status(self.health) != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-LOG_TAIL:]
                self.stop()
                raise RuntimeError(f"{self.name} did not start (exit {self.process.returncode}):\n{tail}")
            time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)

    def status(self, path: str) -> int:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=headers), timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0


def cadence_server(*flags: str, env: dict | None = None, api_key: str | None = None) -> Server:
    port = free_port()
    key = ["--api-key", api_key] if api_key else []
    return Server("cadence serve", [sys.executable, "-m", "app.cli", "serve", "--port", str(port), *key, *flags],
                  port, env=env, api_key=api_key)


def smollm2_gguf() -> Path:
    """The registry's SmolLM2-135M-Instruct Q4_1 GGUF (the file Cadence's default chat model loads)."""
    from engine.models import resolve

    return resolve("smollm2-135m-instruct").weights[0]


def llama_cpp_server(gguf: Path, threads: int, context: int = 4096, alias: str = "smollm2") -> Server:
    port = free_port()
    return Server("llama.cpp server", [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
                                       "--model_alias", alias, "--host", "127.0.0.1", "--port", str(port),
                                       "--n_ctx", str(context), "--n_threads", str(threads), "--verbose", "False",
                                       # (by default a new request interrupts the one being answered)
                                       "--interrupt_requests", "False"],
                  port, health="/v1/models")


def vllm_folder(converted: Path, out: Path) -> Path:
    """A folder vLLM serves in float32: the converted model's files, its config without the
    ``quantization_config`` that names the GGUF it came from."""
    out.mkdir(parents=True, exist_ok=True)
    for item in converted.iterdir():
        if item.is_file() and item.name != "config.json" and not (out / item.name).exists():
            os.symlink(item, out / item.name)
    config = json.loads((converted / "config.json").read_text())
    config.pop("quantization_config", None)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:  # transformers 5.2x nests it; the transformers vLLM pins reads it at the top
        config.setdefault("rope_theta", rope["rope_theta"])
    config["torch_dtype"] = config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def vllm_whisper_folder(converted: Path, out: Path) -> Path:
    """A folder vLLM serves Whisper from, made from Cadence's converted one (weights, config, tokenizer from
    CTranslate2): the config names its architecture, a ``preprocessor_config.json`` gives the log-mel front end
    (Whisper's standard one), and the tokenizer gains the time tokens ``<|0.00|>`` ... ``<|30.00|>`` after
    ``<|notimestamps|>``, as transformers' own Whisper tokenizers list them; CTranslate2's leaves them out and
    vLLM finds its verbose_json segments by them."""
    from transformers import WhisperFeatureExtractor

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "model.safetensors").exists():
        os.symlink(converted / "model.safetensors", out / "model.safetensors")
    config = json.loads((converted / "config.json").read_text())
    config["architectures"] = ["WhisperForConditionalGeneration"]
    config["torch_dtype"] = config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    WhisperFeatureExtractor(feature_size=config["num_mel_bins"]).save_pretrained(out)
    tokenizer = json.loads((converted / "tokenizer.json").read_text())
    added = tokenizer["added_tokens"]
    first = max(t["id"] for t in added) + 1
    added += [{"id": first + i, "content": f"<|{i * 0.02:.2f}|>", "single_word": False, "lstrip": False,
               "rstrip": False, "normalized": True, "special": False}
              for i in range(config["vocab_size"] - first)]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


def vllm_server(folder: Path, name: str, threads: int, context: int = 2048, kv_cache_gb: float = 2,
                extra: tuple[str, ...] = (), engine_in_process: bool = False) -> Server:
    """vLLM's OpenAI-compatible server. ``engine_in_process``: its engine core runs inside the API server's
    process instead of a process of its own (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0), which saves importing
    vLLM and torch once more at start (a server was ready after 36 s instead of 48 s on 2 free AMD EPYC cores,
    one thread) but no longer overlaps the HTTP work with decoding: for the tests, not for a benchmark."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: `bash packaging/vllm-venv.sh` builds it.")
    port = free_port()
    # (the KV cache's size as a flag, in bytes: VLLM_CPU_KVCACHE_SPACE takes whole GiB only and overrides the flag)
    env = {"OMP_NUM_THREADS": str(threads),
           "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if engine_in_process else {})}
    return Server("vLLM", [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                           "--served-model-name", name, "--dtype", "float32", "--host", "127.0.0.1",
                           "--port", str(port), "--max-model-len", str(context),
                           "--kv-cache-memory-bytes", str(int(kv_cache_gb * 2**30)), *extra],
                  port, env=env, startup_s=900)


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
