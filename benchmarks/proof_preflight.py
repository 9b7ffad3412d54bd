"""gpu_proof's first check, in seconds: can the pieces run here at all?

    python3 benchmarks/proof_preflight.py [--cuda]

Run with the pieces' environment (the working tree and the installed wheels on
``PYTHONPATH``), it prints one JSON object: the versions the pieces will see, and
``problems``, what would make every piece fail (torch does not import; graphslot does
not import or cannot build a registry: pydantic and its helpers, jinja2, pyyaml;
``--cuda``: torch sees no GPU). gpu_proof stops with those problems instead of spending
the device call on pieces that would each fail the same way. sglang's registry (part 2
only) is reported, never a problem: part 2 records a skip without it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

PACKAGES = ("transformers", "triton", "pydantic", "pydantic-core", "typing-extensions", "sglang", "msgspec",
            "hypothesis", "jinja2", "pyyaml")


def version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def probe(cuda: bool) -> Dict[str, Any]:
    found: Dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    problems: List[str] = []
    try:
        import torch

        found.update(torch=torch.__version__, cuda=torch.version.cuda,
                     gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        if cuda and found["gpu"] is None:
            problems.append(f"torch {torch.__version__} sees no CUDA GPU (run with --smoke on a CPU machine)")
    except Exception as exc:  # noqa: BLE001 -- reported, not raised: that is the probe's answer
        problems.append(f"torch does not import: {why(exc)}")
    found.update({name: version(name) for name in PACKAGES})
    try:
        import graphslot

        graphslot.build_registry("decode", device="cpu", max_bs=4, max_num_tokens=4)
        found["graphslot"] = str(Path(graphslot.__file__).parent)
    except Exception as exc:  # noqa: BLE001
        problems.append(f"graphslot does not import or cannot build the decode registry ({why(exc)}): are the "
                        "wheels of docs/benchmarks.md ('GPU proof') in .whl/ and carried?")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    try:
        import sglang_loader

        found["sglang_registry"] = sglang_loader.load().version
    except Exception as exc:  # noqa: BLE001 -- part 2 records its skip; the other parts need no sglang
        found["sglang_registry"] = f"not loadable ({why(exc)}): part 2 will be skipped"
    found["problems"] = problems
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="a CUDA GPU is required")
    args = parser.parse_args(argv)
    print(json.dumps(probe(args.cuda)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
