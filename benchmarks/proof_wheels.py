"""The wheels gpu_proof carries to the GPU machine (docs/benchmarks.md, "GPU proof").

The device image has no package registry and lacks pydantic (and its three helpers),
sglang and msgspec. They travel in ``.whl/`` (git-ignored) and are installed, without
dependencies or a registry, into a folder put on ``PYTHONPATH`` (:func:`install`).

sglang 0.5.23 is not on the package index this project's machine reaches, and its wheel
(222 MB installed) is over what a device call carries (64 MiB). gpu_proof needs five of
its files, the ones tests/sglang_loader.py imports (the buffer registry, its input
buffers, ``ForwardBatch``, the environment flags) and the Triton ``small_copy`` kernel
the registry launches on CUDA: :func:`slim_sglang_wheel` packs exactly those, unchanged,
from the installed sglang 0.5.23 into ``sglang-0.5.23-py3-none-any.whl``.

    python3 benchmarks/proof_wheels.py --sglang-wheel .whl
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Dict, List

#: The sglang files gpu_proof imports (paths inside the package).
SGLANG_FILES = (
    "srt/environ.py",
    "srt/model_executor/cuda_graph_buffer_registry.py",
    "srt/model_executor/input_buffers.py",
    "srt/model_executor/forward_batch_info.py",
    "kernels/ops/memory/small_copy.py",
)


def install(wheels: Path, site: Path) -> Dict[str, Any]:
    """``pip install --no-index --no-deps --upgrade --target site wheels/*.whl``: what was
    installed, or why not (``--upgrade``: a folder left by an earlier run on a warm machine
    is replaced, not kept with a warning)."""
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    if not found:
        return {"installed": [], "reason": f"no wheels in {wheels}"}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site), *found]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"installed": [], "error": f"{' '.join(cmd[:4])} did not finish in 120 s"}
    names = [Path(p).name for p in found]
    if proc.returncode != 0:
        return {"installed": [], "wheels": names, "error": (proc.stderr or proc.stdout)[-2000:]}
    return {"installed": names, "site": str(site)}


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim_sglang_wheel(out: Path) -> Path:
    """A wheel of :data:`SGLANG_FILES` from the installed sglang (which must be 0.5.23)."""
    version = importlib.metadata.version("sglang")
    if version != "0.5.23":
        raise SystemExit(f"proof_wheels: the installed sglang is {version}, not 0.5.23")
    spec = importlib.util.find_spec("sglang")
    root = Path(list(spec.submodule_search_locations)[0])
    dist = f"sglang-{version}.dist-info"
    files: List[tuple] = [(f"sglang/{rel}", (root / rel).read_bytes()) for rel in SGLANG_FILES]
    files.append((f"{dist}/METADATA", (f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\nSummary: five files "
                                       "of sglang 0.5.23 (gpu_proof's slim wheel, benchmarks/proof_wheels.py)\n"
                                       ).encode()))
    files.append((f"{dist}/WHEEL", b"Wheel-Version: 1.0\nGenerator: graphslot proof_wheels\nRoot-Is-Purelib: true\n"
                                   b"Tag: py3-none-any\n"))
    record = "\n".join([_record_line(name, data) for name, data in files] + [f"{dist}/RECORD,,", ""])
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sglang-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files:
            zf.writestr(name, data)
        zf.writestr(f"{dist}/RECORD", record)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sglang-wheel", metavar="DIR", required=True, help="write the slim sglang wheel here")
    args = parser.parse_args(argv)
    print(slim_sglang_wheel(Path(args.sglang_wheel)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
