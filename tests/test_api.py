"""The package's face: the public API imports from `kvtool`, and importing it costs no torch."""

from __future__ import annotations

import subprocess
import sys

import kvtool


def test_every_public_name_resolves_to_its_owner() -> None:
    from kvtool.calibration.runner import calibrate
    from kvtool.evaluation import evaluate
    from kvtool.runtime import attach, load_profile, uniform_profile

    for name in kvtool.__all__:
        assert getattr(kvtool, name) is not None, name
    assert kvtool.attach is attach and kvtool.load_profile is load_profile
    assert kvtool.uniform_profile is uniform_profile
    assert kvtool.calibrate is calibrate and kvtool.evaluate is evaluate


def test_the_readme_import_line_works() -> None:
    from kvtool import attach, builtin_profile, calibrate, evaluate, load_model, load_profile, run_bench, uniform_profile

    assert callable(attach) and callable(calibrate) and callable(evaluate) and callable(run_bench)
    assert load_profile(builtin_profile("smollm2", 0.2)).budget == 0.2
    assert callable(load_model) and callable(uniform_profile)


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        kvtool.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("kvtool.no_such_name resolved")


def test_importing_kvtool_loads_no_torch() -> None:
    code = "import sys, kvtool; print('torch' in sys.modules, kvtool.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False" and out[1] == kvtool.__version__
