"""``graphslot show``: the buffers a spec allocates for a param set, computed. Torch-free."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Sequence

from ..spec.errors import shorten
from ..spec.loading import load_spec
from ..spec.model import RegistrySpec
from ..spec.resolve import ResolvedSlot, resolve_params, resolve_slots
from . import limits
from .common import (Command, add_spec_reading_options, format_table, format_value, hook_import_path, human_bytes,
                     import_hooks_wanted, json_value, param_arg, unchecked_hook_imports)

HELP = """Print the buffers a spec allocates for a param set.

Resolves the spec for the params and capacities as build_registry would and prints
each slot's shape, dtype, axis, padding, device and size (computed: nothing is
allocated, and hooks are not imported unless --import-hooks); disabled slots are
listed with their shape and no bytes. --json prints the same as one JSON object
(notes go to stderr).
"""


def show_json(spec: RegistrySpec, resolved: Sequence[ResolvedSlot], params: Dict[str, Any],
              changed: Sequence[str], args: argparse.Namespace, unchecked: int) -> Dict[str, Any]:
    """What ``show`` prints as a table, as one JSON object."""
    slots = [{
        "name": r.name, "shape": list(r.shape), "dtype": str(r.dtype_name), "axis": r.axis,
        "slice_dim": r.slice_dim, "padding": None if slot.padding is None else str(r.padding),
        "pad_value": json_value(r.pad_value) if r.fills_at_allocation else None,
        "device": "cpu", "host": r.host, "staged": r.staged, "extra_rows": r.extra_rows,
        "reset_to": str(r.reset_to), "index": r.index,
        "bytes": r.nbytes if r.enabled else None, "enabled": r.enabled,
    } for slot, r in zip(spec.slots, resolved)]
    enabled = [r for r in resolved if r.enabled]
    return {"spec": spec.name, "source": spec.path, "max_bs": args.max_bs, "max_num_tokens": args.max_num_tokens,
            "preset": args.preset, "params": {k: json_value(v) for k, v in params.items()},
            "changed_params": {k: json_value(params[k]) for k in changed}, "slots": slots,
            "total_bytes": sum(r.nbytes for r in enabled), "enabled_slots": len(enabled),
            "unchecked_hook_imports": unchecked}


def show_rows(spec: RegistrySpec, resolved: Sequence[ResolvedSlot], device: str = "cpu") -> List[List[str]]:
    rows = []
    for slot, r in zip(spec.slots, resolved):  # resolve_slots keeps spec order
        padding = "-" if slot.padding is None else str(r.padding)  # a str param's: its value
        notes = []
        if r.pad_value is not None and r.fills_at_allocation:
            notes.append(format_value(r.pad_value))
        if r.to_capacity:  # the tail a fill writes runs to the buffer's end
            notes.append("to capacity")
        if notes:
            padding += f" ({', '.join(notes)})"
        axis = r.axis + (f" (dim {r.slice_dim})" if r.slice_dim else "")
        if r.host:
            host = "cpu (host)"
        elif r.staged:
            host = f"{device} (staged)"
        else:
            host = device
        nbytes = str(r.nbytes) if r.enabled else "-"
        rows.append([shorten(r.name, quote=False), str(list(r.shape)), r.dtype_name, axis, padding, host,
                     nbytes, "yes" if r.enabled else "no"])
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="a shipped spec name or a YAML file")
    parser.add_argument("--param", action="append", type=param_arg, default=[], metavar="NAME=VALUE",
                        help="set a param; VALUE is a YAML scalar (4, int32, true); repeatable")
    parser.add_argument("--preset", metavar="NAME", help="start from one of the spec's presets")
    capacity = limits.MAX_CAPACITY
    parser.add_argument("--max-bs", type=capacity.argument(), default=256, metavar="N",
                        help=f"batch capacity (default 256, at most {capacity.most})")
    parser.add_argument("--max-num-tokens", type=capacity.argument(), default=256, metavar="N",
                        help=f"token capacity (default 256, at most {capacity.most})")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    add_spec_reading_options(parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import_hooks = import_hooks_wanted(args, strict=False)
    with hook_import_path(import_hooks):
        spec = load_spec(args.spec, import_hooks=import_hooks, max_bytes=args.max_bytes)
    params = resolve_params(spec, dict(args.param), preset=args.preset, torch_dtypes=False)
    resolved = resolve_slots(spec, params, args.max_bs, args.max_num_tokens)
    defaults = resolve_params(spec, torch_dtypes=False)
    changed_keys = [k for k, v in params.items() if v != defaults[k]]
    unchecked = 0 if import_hooks else unchecked_hook_imports(spec)
    note = f"note: {unchecked} hook import{'s' if unchecked > 1 else ''} not checked: pass --import-hooks"
    if args.json:
        print(json.dumps(show_json(spec, resolved, params, changed_keys, args, unchecked), indent=2,
                         allow_nan=False))
        if unchecked:
            print(note, file=sys.stderr)
        return 0
    changed = [f"{k}={shorten(format_value(params[k]), quote=False)}" for k in changed_keys]
    preset = f" preset={shorten(args.preset, quote=False)}" if args.preset else ""
    print(f"{spec.name} ({spec.path}): max_bs={args.max_bs} max_num_tokens={args.max_num_tokens}{preset}")
    print(f"params: {', '.join(changed) or 'defaults'}")
    print()
    header = ["slot", "shape", "dtype", "axis", "padding", "device", "bytes", "enabled"]
    print(format_table(header, show_rows(spec, resolved), right=(6,)))
    print()
    enabled = [r for r in resolved if r.enabled]
    total = sum(r.nbytes for r in enabled)
    print(f"total: {total} bytes ({human_bytes(total)}) in {len(enabled)} of {len(resolved)} slots enabled")
    if unchecked:
        print(note)
    return 0


COMMAND = Command("show", HELP, add_arguments, run, reads_specs=True)
