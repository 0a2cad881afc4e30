"""Check `kvtool export --engine vllm` against vLLM's own argument parser (outside CI: about 9 GB).

    .venv/bin/python scripts/check_vllm_export.py                  # scratch venv in /tmp/kvtool-vllm-check
    .venv/bin/python scripts/check_vllm_export.py --venv DIR PROFILE.yaml ...

Builds (once) a scratch venv with `pip install vllm==0.33.0` (CUDA wheels: check `df -h` first; 30 GB
free is plenty), exports each profile (default: the built-in ones, plus each of them at every kvtool
storage format vLLM has a dtype for), and, in that venv with VLLM_TARGET_DEVICE=cpu, parses each
exported line with `EngineArgs.add_cli_args(FlexibleArgumentParser())`: the flags must parse, the
parsed `hf_overrides`, `kv_cache_dtype_skip_layers` must be what kvtool meant, and the KV dtype must
be one of `typing.get_args(vllm.config.cache.CacheDType)` (vLLM checks it later, not in the parser).
Prints one line per export and exits 1 if any fails. Needs no GPU and loads no model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM = "vllm==0.33.0"

# Run inside the vLLM venv: reads [{"name", "argv", "hf_overrides", "skip"}] on stdin.
CHECK = r'''
import json, sys, typing
from vllm.engine.arg_utils import EngineArgs
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
from vllm.config.cache import CacheDType
dtypes = set(typing.get_args(CacheDType))
failed = 0
for case in json.load(sys.stdin):
    argv = case["argv"]
    assert argv[:2] == ["vllm", "serve"], argv
    try:
        parsed = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", argv[2], *argv[3:]])
        problems = []
        if parsed.kv_cache_dtype not in dtypes:
            problems.append(f"kv_cache_dtype {parsed.kv_cache_dtype!r} not in CacheDType {sorted(dtypes)}")
        if (parsed.hf_overrides or None) != case["hf_overrides"] and case["hf_overrides"] is not None:
            problems.append(f"hf_overrides parsed as {parsed.hf_overrides!r}")
        if [str(s) for s in (parsed.kv_cache_dtype_skip_layers or [])] != case["skip"]:
            problems.append(f"kv_cache_dtype_skip_layers parsed as {parsed.kv_cache_dtype_skip_layers!r}")
    except SystemExit as exc:
        problems = [f"the parser refused it (exit {exc.code})"]
    except Exception as exc:
        problems = [f"{type(exc).__name__}: {exc}"]
    failed += bool(problems)
    print(("FAIL " if problems else "ok   ") + case["name"] + (": " + "; ".join(problems) if problems else ""), flush=True)
sys.exit(1 if failed else 0)
'''


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != VLLM.split("==")[1]:
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", VLLM], check=True)
    return python


def cases(profiles: list[Path]) -> list[dict]:
    """One export per profile, and per built-in profile one at each format vLLM has a dtype for."""
    sys.path.insert(0, str(ROOT))
    from kvtool.calibration.engine import ENGINE_SPACES
    from kvtool.export import export_profile
    from kvtool.runtime import load_profile

    found = []
    for path in profiles:
        profile = load_profile(path)
        variants = {path.name: profile}
        for fmt in ENGINE_SPACES["vllm"].dtypes:
            # Every layer but the first at `fmt`: the first stays native (--kv-cache-dtype-skip-layers).
            layers = tuple(
                dataclasses.replace(layer, keys_format=fmt, values_format=fmt) if i else layer
                for i, layer in enumerate(profile.layers)
            )
            variants[f"{path.name} at {fmt}"] = dataclasses.replace(profile, layers=layers)
        for name, variant in variants.items():
            data = export_profile(variant, "vllm").data
            found.append({"name": name, "argv": data["argv"], "hf_overrides": data["hf_overrides"],
                          "skip": data["kv_cache_dtype_skip_layers"]})
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="*", type=Path)
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "kvtool-vllm-check")
    args = parser.parse_args()
    profiles = args.profiles or sorted((ROOT / "kvtool" / "profiles" / "builtin").glob("*.yaml"))
    exports = cases(profiles)
    python = ensure_venv(args.venv)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    return subprocess.run([str(python), "-c", CHECK], input=json.dumps(exports), text=True, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
